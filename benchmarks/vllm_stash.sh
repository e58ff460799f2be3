#!/usr/bin/env bash
# The device side of scripts/build_vllm_carry.py: vllm 0.26.0 and what it needs beyond the GPU image, carried in
# bundles (.carry_vllm/1 .. N, one per call) into a stash on the machine's disk that outlives a call while the
# machine stays warm, then checked and installed into /tmp/vsite (apart from tracekit's /tmp/site).
#
#   bash benchmarks/vllm_stash.sh stash      # in each call that carries ['.carry_vllm/N']: copies it into the stash
#   bash benchmarks/vllm_stash.sh install    # once all are stashed: sha256 of every file, the wheel rebuilt from
#                                            # its parts, the xz'd kernels put back, pip install into /tmp/vsite
#                                            # (idempotent: a second call with the same manifest does nothing)
#   bash benchmarks/vllm_stash.sh check      # imports the serve path on the GPU, prints FA3 / platform / glibc
#   eval "$(bash benchmarks/vllm_stash.sh env)"   # the environment a vllm serve needs (PYTHONPATH=/tmp/vsite, ...)
#
# The stash may also be filled by benchmarks/carry_parts.sh (vllm-stash=.carry_vllm unpacks to /root/vllm-stash/N/).
# Serve with:  python3 -m vllm.entrypoints.cli.main serve MODEL_DIR --enable-lora ...   (pip --target puts the
# `vllm` script in /tmp/vsite/bin; the module form needs no PATH).
set -u
STASH=${VLLM_STASH_DIR:-/root/vllm-stash}
SITE=${VLLM_SITE:-/tmp/vsite}
ENV_LINE="export PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1"
mkdir -p "$STASH"
for b in .carry_vllm/*/; do
  [ -f "$b/manifest.json" ] || continue
  n=$(basename "$b"); mkdir -p "$STASH/$n"; cp -r "$b". "$STASH/$n/"
done
phase=${1:-stash}
case "$phase" in
stash)
  man=$(ls "$STASH"/*/manifest.json 2>/dev/null | head -1)
  echo "stash: bundles $(ls -d "$STASH"/*/ 2>/dev/null | xargs -n1 basename 2>/dev/null | tr '\n' ' ')of" \
    "$([ -n "$man" ] && python3 -c "import json; print(json.load(open('$man'))['bundles'])" || echo '?')"
  ;;
install)
  env -u PYTHONPATH python3 - "$STASH" "$SITE" <<'EOF' || exit 3
import hashlib, importlib.metadata as md, json, lzma, re, subprocess, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.version import Version

stash, site = Path(sys.argv[1]), Path(sys.argv[2])
mans = sorted(stash.glob("*/manifest.json")) + sorted(stash.glob("manifest.json"))
if not mans:
    sys.exit("vllm_stash.sh: no manifest in the stash: carry .carry_vllm/1 (stash phase) first")
raw_man = mans[0].read_bytes(); man = json.loads(raw_man)
stamp = hashlib.sha256(raw_man).hexdigest()
if (site / ".ok").is_file() and (site / ".ok").read_text().strip() == stamp:
    print("installed already"); sys.exit(0)

def locate(name, bundle):
    for c in [stash / str(bundle) / name, stash / name, *stash.glob(f"*/{name}")]:
        if c.is_file():
            return c

def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()

where, missing, bad = {}, set(), []
for name, meta in man["files"].items():
    p = locate(name, meta["bundle"])
    if p is None:
        missing.add(meta["bundle"])
    elif p.stat().st_size != meta["bytes"] or sha(p) != meta["sha256"]:
        bad.append(name)
    else:
        where[name] = p
if missing or bad:
    sys.exit(f"vllm_stash.sh: carry bundle(s) {sorted(missing)} (stash phase) first" if missing else
             f"vllm_stash.sh: sha256 mismatch: {', '.join(bad)}: carry their bundles again")

work = stash / "assembled"; work.mkdir(exist_ok=True)
vw = man["vllm_wheel"]; wheel = work / vw["name"]
with open(wheel, "wb") as out:
    for part in vw["parts"]:
        out.write(where[part].read_bytes())
if sha(wheel) != vw["sha256"]:
    sys.exit("vllm_stash.sh: the vllm wheel rebuilt from its parts fails its sha256")

# [fallback] wheels: only where the image's version misses a requirement of what is installed with it
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
reqs = {}
for w in [wheel, *(where[f] for f in man["carry"])]:
    with zipfile.ZipFile(w) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in meta.splitlines():
        if line.startswith("Requires-Dist:"):
            r = Requirement(line.split(":", 1)[1].strip())
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                reqs.setdefault(norm(r.name), []).append((w.name.split("-")[0], r.specifier))
fallback = []
for f, pin in man["fallback"].items():
    name = norm(pin.split("==")[0])
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    unmet = [f"{who} {spec}" for who, spec in reqs.get(name, [])
             if have is None or not spec.contains(Version(have), prereleases=True)]
    if unmet:
        fallback.append(where[f])
    print(f"fallback {pin}: image has {have or 'none'}; "
          f"{'INSTALLED for ' + '; '.join(unmet) if unmet else 'not needed'}")

wheels = [str(wheel)] + [str(where[f]) for f in man["carry"]] + [str(p) for p in fallback]
subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                "--no-cache-dir", "--upgrade", "--target", str(site), *wheels], check=True)
record = next(site.glob("vllm-*.dist-info")) / "RECORD"
for name, meta in man["xz"].items():
    dest = site / meta["dest"]
    dest.write_bytes(lzma.decompress(where[name].read_bytes()))
    if sha(dest) != meta["sha256"]:
        sys.exit(f"vllm_stash.sh: {meta['dest']} from {name} fails its sha256")
    with open(record, "a") as r:
        r.write(meta["record"] + "\n")
(site / ".ok").write_text(stamp)
print(f"installed {len(wheels)} wheels and {len(man['xz'])} xz members into {site}")
EOF
  PYTHONPATH=$SITE python3 -c "import importlib.metadata as m, vllm; print('vllm', vllm.__version__, m.version('vllm'))"
  ;;
check)
  eval "$ENV_LINE"
  ldd --version | head -1
  python3 - <<'EOF'
import importlib, time
t = time.time()
for m in ["vllm.entrypoints.openai.api_server", "vllm.entrypoints.cli.serve", "vllm.v1.engine.core",
          "vllm.v1.worker.gpu_model_runner", "vllm.model_executor.models.llama", "vllm.lora.worker_manager",
          "vllm.lora.punica_wrapper.punica_gpu", "vllm.v1.attention.backends.flash_attn", "vllm.v1.sample.sampler"]:
    importlib.import_module(m)
from vllm.platforms import current_platform
from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE, FA3_AVAILABLE, is_fa_version_supported
from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
print(f"imports {time.time() - t:.1f} s; platform {type(current_platform).__name__} "
      f"{current_platform.get_device_capability()}; FA2 {FA2_AVAILABLE} FA3 {FA3_AVAILABLE} "
      f"(supported: {is_fa_version_supported(3)}); FA version {get_flash_attn_version()}")
EOF
  ;;
env) echo "$ENV_LINE" ;;
*) echo "vllm_stash.sh: unknown phase '$phase' (stash | install | check | env)"; exit 2 ;;
esac
