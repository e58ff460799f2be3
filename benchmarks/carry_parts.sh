#!/usr/bin/env bash
# The device side of scripts/carry_parts.py: one part per call into a stash on the machine's disk (it outlives a
# call while the machine stays warm), then the parts checked against the stream's sha256 and unpacked under /root.
#   bash benchmarks/carry_parts.sh stash     # in each call that carries [.dcarry/N]; prints what the stash holds
#   bash benchmarks/carry_parts.sh unpack    # once every part is there: cat, sha256, untar into /root (idempotent)
set -u
STASH=/root/parts-stash
mkdir -p "$STASH"
for d in .dcarry/*/; do
  [ -f "$d/parts.json" ] || continue
  cp "$d"/part* "$STASH"/ && cp "$d/parts.json" "$STASH/parts.json"
done
case "${1:-stash}" in
  stash)
    echo "stash: $(ls "$STASH" | grep -c '^part') of $(python3 -c "import json; print(json.load(open('$STASH/parts.json'))['parts'])" 2>/dev/null || echo '?') parts"
    ;;
  unpack)
    [ -f /root/.parts-unpacked ] && { echo "unpacked already"; exit 0; }
    python3 - "$STASH" <<'EOF' || exit 3
import hashlib, json, sys, tarfile, pathlib
stash = pathlib.Path(sys.argv[1]); meta = json.loads((stash / "parts.json").read_text())
parts = [stash / f"part{i + 1:02d}" for i in range(meta["parts"])]
missing = [p.name for p in parts if not p.is_file()]
if missing:
    sys.exit(f"carry_parts.sh: the stash lacks {', '.join(missing)}: carry every part (stash) first")
h = hashlib.sha256()
for p in parts:
    h.update(p.read_bytes())
if h.hexdigest() != meta["sha256"]:
    sys.exit(f"carry_parts.sh: the parts' sha256 {h.hexdigest()[:12]} is not the stream's {meta['sha256'][:12]}")
import io
stream = io.BytesIO(b"".join(p.read_bytes() for p in parts))
with tarfile.open(fileobj=stream) as tar:
    tar.extractall("/root", filter="data")
print(f"unpacked {meta['bytes'] / 2**20:.1f} MiB: {', '.join(meta['sources'])}")
EOF
    touch /root/.parts-unpacked
    ;;
  *) echo "carry_parts.sh: unknown phase '$1' (stash | unpack)"; exit 2 ;;
esac
