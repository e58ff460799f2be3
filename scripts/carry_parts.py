"""Pack folders for the lent GPU machine into equal parts that each fit one device call beside the working tree.

A device call carries the working tree plus its carried paths, 64 MiB in all; the tree alone is ~14 MiB now (the
micro fixture, the committed results), so a call has room for ~48 MiB of carry. The per-file bundles of
``scripts/build_device_carry.py`` (up to 60 MiB) no longer fit. This packs whole folders (those bundles, the vLLM
carry of ``scripts/build_vllm_carry.py``) into one tar stream cut into parts of ``--part-mib``, each in its own
folder ``OUT/1``, ``OUT/2``, ... with the stream's sha256 and part count; ``benchmarks/carry_parts.sh`` stashes
one part per call on the machine's disk and, once all are there, checks and unpacks them.

    python scripts/carry_parts.py --out .dcarry --part-mib 47 tk-stash=.carry/1 tk-stash=.carry/2 vllm-stash=.carry_vllm
    # there: bash benchmarks/carry_parts.sh stash (once per part, carry [.dcarry/N]); bash benchmarks/carry_parts.sh unpack
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pack(sources: list[tuple[str, Path]]) -> bytes:
    """One uncompressed tar of every source folder's files under its destination name (wheels and GGUF parts are
    compressed already), files in sorted order so that the same inputs give the same stream."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for dest, src in sources:
            if not src.is_dir():
                raise SystemExit(f"carry_parts: {src} is not a folder")
            for f in sorted(p for p in src.rglob("*") if p.is_file()):
                info = tar.gettarinfo(str(f), arcname=f"{dest}/{f.relative_to(src)}")
                info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
                with open(f, "rb") as fh:
                    tar.addfile(info, fh)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".dcarry")
    ap.add_argument("--part-mib", type=float, default=47.0)
    ap.add_argument("sources", nargs="+", help="DEST=FOLDER: FOLDER's files unpack under /root/DEST there")
    args = ap.parse_args()
    sources = []
    for s in args.sources:
        dest, _, src = s.partition("=")
        if not src or "/" in dest or dest in ("", ".", ".."):
            raise SystemExit(f"carry_parts: {s!r} is not DEST=FOLDER with a plain DEST name")
        sources.append((dest, (ROOT / src).resolve()))
    stream = pack(sources)
    size = int(args.part_mib * 2**20)
    n = -(-len(stream) // size)
    out = ROOT / args.out
    shutil.rmtree(out, ignore_errors=True)
    digest = hashlib.sha256(stream).hexdigest()
    for i in range(n):
        d = out / str(i + 1)
        d.mkdir(parents=True)
        (d / f"part{i + 1:02d}").write_bytes(stream[i * size : (i + 1) * size])
        (d / "parts.json").write_text(json.dumps({"parts": n, "sha256": digest, "bytes": len(stream),
                                                  "sources": [f"{a}={b}" for a, b in sources]}))
    print(f"{len(stream) / 2**20:.1f} MiB in {n} parts of at most {args.part_mib} MiB under {out}: carry [{args.out}/1] .. [{args.out}/{n}]")


if __name__ == "__main__":
    main()
