#!/usr/bin/env bash
# Issue 41 on the lent H200, run by gpu_run.sh after `carry_parts.sh unpack` put the vLLM carry in /root/vllm-stash:
# vLLM installed once into /tmp/vsite, the -m gpu test, then benchmarks/vllm_server.py (checks + throughput).
#   bash benchmarks/gpu_run.sh run 560 bash benchmarks/vllm_h200.sh [vllm_server.py arguments]
set -u
OUTDIR=${OUT:-/tmp/out}
if [ ! -f /tmp/vsite/.ok ]; then
  bash benchmarks/vllm_stash.sh install || exit 5
  touch /tmp/vsite/.ok
fi
# vLLM's default sampler imports flashinfer (not carried) with no guard on CUDA: the PyTorch sampler instead
export PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} PATH=/tmp/vsite/bin:$PATH VLLM_ALLOW_RUNTIME_LORA_UPDATING=True \
  VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
python3 -c "import vllm; print('vllm', vllm.__version__)" || exit 6
[ "${CHECK:-1}" = 1 ] && bash benchmarks/vllm_stash.sh check 2>&1 | tail -8
if [ "${SKIP_TEST:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m gpu tests/test_vllm_server_gpu.py -x -rs -p no:cacheprovider 2>&1 | tail -15
fi
python3 benchmarks/vllm_server.py --work /root/vwork --json "$OUTDIR/vllm_h200.json" "$@"
rc=$?
for f in $(find /root/vwork /tmp -name vllm_server.log 2>/dev/null); do echo "== $f"; grep -v "INFO" "$f" | tail -25; done
tar czf "$OUTDIR/vllm_logs.tgz" $(find /root/vwork /tmp -name vllm_server.log 2>/dev/null) 2>/dev/null
exit $rc
