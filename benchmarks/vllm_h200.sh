#!/usr/bin/env bash
# Issue 52 on a lent GPU (H100 or H200), run by gpu_run.sh after `carry_parts.sh unpack` put the vLLM carry in
# /root/vllm-stash: vLLM installed once into /tmp/vsite, then, each where asked:
#   TESTS=1            python -m pytest -m gpu over the whole suite (as a user runs it), summary in $OUT/pytest_gpu.txt
#   SECTIONS="micro:checks ..."   benchmarks/vllm_server.py with those sections, resumed from /root/vwork/vllm.json
#                      (the machine's disk: a cut call's sections stay), the JSON copied to $OUT/vllm_side_by_side.json
#   ROLLOUT=1          the gain target's 300 episodes, base policy (rollout_arms.py, batched arm), to $OUT
#   bash benchmarks/gpu_run.sh run 570 env TESTS=1 SECTIONS="micro:checks" bash benchmarks/vllm_h200.sh [vllm_server.py args]
set -u
OUTDIR=${OUT:-/tmp/out}
if [ ! -f /tmp/vsite/.ok ]; then
  bash benchmarks/vllm_stash.sh install || exit 5
fi
# vLLM's default sampler imports flashinfer (not carried) with no guard on CUDA: the PyTorch sampler instead
export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} PATH=/tmp/vsite/bin:$PATH VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 6
rc=0
if [ "${TESTS:-0}" = 1 ]; then
  t0=$(date +%s)
  timeout "${TESTS_S:-420}" python3 -m pytest -m gpu -q -rfEs -p no:cacheprovider --durations=15 tests 2>&1 \
    | tee "$OUTDIR/pytest_gpu.txt" | tail -40
  echo "pytest -m gpu: exit ${PIPESTATUS[0]} after $(( $(date +%s) - t0 )) s on $(nvidia-smi --query-gpu=name --format=csv,noheader)" \
    | tee -a "$OUTDIR/pytest_gpu.txt"
fi
if [ -n "${SECTIONS:-}" ]; then
  # shellcheck disable=SC2086
  python3 benchmarks/vllm_server.py --work /root/vwork --json /root/vwork/vllm.json --resume --sections $SECTIONS "$@"
  rc=$?
  cp /root/vwork/vllm.json "$OUTDIR/vllm_side_by_side.json" 2>/dev/null
  for f in $(find /root/vwork -name vllm_server.log -newer /tmp/vsite/.ok 2>/dev/null); do echo "== $f"; grep -v "INFO" "$f" | tail -15; done
fi
if [ "${ROLLOUT:-0}" = 1 ]; then
  ROLLOUT_ARMS=batched python3 benchmarks/rollout_arms.py --targets gain --gain-limit 100 --repeats "${ROLLOUT_REPEATS:-3}" \
    --warmup turn --host-rows 0 --json "$OUTDIR/rollout_throughput_gain300.json" 2>&1 | tail -40
fi
exit $rc
