#!/usr/bin/env bash
# The micro warm start's calibration sweep on the lent GPU (issue 42): demonstration mixes x SFT epochs, the bands
# of each at T=1 and T=0.7. Run through benchmarks/gpu_run.sh (the stage cache and warm starts on the machine's disk).
set -u
for T in 1.0 0.7; do
  python -m tracekit.planted.bands --device cuda --out "$OUT/bands_T$T" --seeds 16 --k 8 --temperature "$T" \
    --demos-weak ${DEMOS:-24 48 96} --epochs ${EPOCHS:-8 16} -- experiment=micro
done
