#!/usr/bin/env bash
# Issue 40 part 1 on the lent H200, in one device call (run inside `benchmarks/gpu_run.sh run`; DEADLINE: epoch s).
#  1. rollout throughput on the gain target (300 episodes), medians of 3 interleaved repeats: the base policy
#     (batched arm) and a random 3-adapter LoRA-MoE; plain transformers generate against the client (tau2_mini);
#  2. a GRPO iteration's stages: experiment=gain's train stage (its capability runs concurrent), 2 iterations;
#  3. only if the base misses 20 episodes/s with under 80% of prompt tokens reused and time is left: one decoder
#     variant, a 16 GiB prompt-prefix store (agent.prefix_cache_mib=16384), batched arm, 3 repeats.
set -u
DEADLINE=${DEADLINE:-$(( $(date +%s) + 540 ))}
left() { echo $(( DEADLINE - $(date +%s) )); }
J=$OUT/rollout_throughput_h200_issue40.json
nvidia-smi --query-gpu=name,utilization.gpu,memory.used,clocks.sm --format=csv,noheader; uptime
t=$(date +%s)
ROLLOUT_ARMS=batched timeout -s INT -k 10 $(( $(left) < 300 ? $(left) : 300 )) python3 benchmarks/rollout_arms.py \
  --targets gain --gain-limit 100 --repeats 3 --warmup turn --host-rows 0 --moe --lora-target gain --generate 6 --json "$J"
echo "throughput: rc=$? in $(( $(date +%s) - t )) s, $(left) s left"
t=$(date +%s)
setsid python3 -m tracekit experiment=gain "stages=[train]" grpo.iterations=2 & pg=$!
( sleep $(( $(left) - 5 )); kill -INT -- -$pg; sleep 10; kill -KILL -- -$pg ) 2>/dev/null & w=$!
wait $pg; echo "grpo: rc=$? in $(( $(date +%s) - t )) s, $(left) s left"; kill $w 2>/dev/null
for f in $(find /root/tk-cache/adapters -name metrics.csv); do echo "# $f"; cat "$f"; done > "$OUT/grpo_metrics.txt"
python3 - "$J" <<'PY' && [ "$(left)" -ge 100 ] || exit 0
import json, sys
a = json.load(open(sys.argv[1]))["targets"]["gain"]["arms"]["batched"]
pc = a["prefix_cache"]
sys.exit(0 if a["episodes_per_s"] < 20 and pc["prefilled_tokens"] > 0.2 * pc["prompt_tokens"] else 1)
PY
t=$(date +%s)
ROLLOUT_ARMS=batched timeout -s INT -k 10 $(( $(left) - 5 )) python3 benchmarks/rollout_arms.py agent.prefix_cache_mib=16384 \
  --targets gain --gain-limit 100 --repeats 3 --host-rows 0 --json "$OUT/rollout_throughput_h200_issue40_prefix16g.json"
echo "variant: rc=$? in $(( $(date +%s) - t )) s, $(left) s left"
