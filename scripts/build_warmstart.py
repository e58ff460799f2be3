"""Build (or check) a shipped warm start: ``tracekit/warmstart/warmstarts/<name>/`` (issue 50).

The warm start is trained from scratch by the planted warm-start stage (``tracekit.warmstart.planted.planted_dir``)
in an empty cache, for the backbone of ``experiment=<preset>`` (the preset defaults to the name), and its planted
folder is copied whole but for the demonstrations and the SFT log: ``model/`` (float32 weights, the world
tokenizer, the config) and ``planted.json``, with ``identity.json``: the planted key, the backbone, the preset, the
sha256 of every file, and how it was built (torch, threads, seconds). A run with ``warm_start=<name>`` refuses
a folder whose key is not its config's planted key, or whose files differ from their sha256
(``tracekit.warmstart.shipped``).

    python scripts/build_warmstart.py micro            # train it (~6 min on 2 idle cores) and write the folder
    python scripts/build_warmstart.py micro --check    # train it again; exit 1 unless every file is the same, bit for bit
    python scripts/build_warmstart.py micro --cache ~/.cache/tracekit   # build (or take) it in that cache instead

The build runs on the CPU with ``--threads`` torch threads (default 1, recorded in identity.json and pinned by
``--check``): the thread count is part of what the bits depend on. Five full-parameter SFT steps gave the same
weights with 1 and 2 threads, but the whole build did not: the shipped micro warm start (1 thread, final SFT loss
0.00185) rounds apart from the 2-thread build that made the CI fixture and experiment=micro's committed tables (final
loss 0.00194; same demonstrations, rows, steps and first loss). One thread also keeps a loaded machine from collapsing
under thread oversubscription. Another torch build or CPU kind may round apart too, which ``--check`` reports. ``--check`` compares ``planted.json`` but for its build time (``seconds``).

Checked 2026-12-07 on the shared 2-core VM: rebuilt in 1,057 s with 1 thread, every weight, tokenizer and config file
the shipped one bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHIPPED_FILES = ("model", "planted.json")  # of the planted folder: the weights, tokenizer, config and the record


def build(preset: str, cache: Path) -> tuple[Path, str, str, float]:
    """(planted folder, backbone name, planted key, seconds) of ``experiment=<preset>``'s warm start in ``cache``."""
    from tracekit.cli import compose_config
    from tracekit.llm.backbones import get_spec
    from tracekit.warmstart.shipped import config_planted_key
    from tracekit.warmstart.planted import planted_dir
    from tracekit.wiring import backbone_dict

    cfg = compose_config([f"experiment={preset}", "warm_start=null"])
    spec, key = config_planted_key(get_spec(backbone_dict(cfg)))
    t0 = time.time()
    folder = planted_dir(spec, "cpu", cache_dir=cache)
    return folder, spec.name, key, time.time() - t0


RECORD = "planted.json"
VOLATILE = ("seconds",)  # the record's build time: the one value of the folder a rebuild cannot repeat


def same_record(built: Path, shipped: Path) -> bool:
    """planted.json of a rebuild against the shipped one: equal but for the build time."""
    import json

    a, b = (json.loads(p.read_text()) for p in (built, shipped))
    return all(a.pop(k, None) is not None and b.pop(k, None) is not None for k in VOLATILE) and a == b


def files_of(folder: Path) -> dict[str, str]:
    from tracekit.artifacts import file_sha256

    out = {}
    for top in SHIPPED_FILES:
        paths = [folder / top] if (folder / top).is_file() else sorted(p for p in (folder / top).rglob("*") if p.is_file())
        for p in paths:
            out[p.relative_to(folder).as_posix()] = file_sha256(p)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("name", help="the shipped warm start (tracekit/warmstart/warmstarts/<name>/)")
    p.add_argument("--preset", help="the experiment preset whose backbone it is (default: the name)")
    p.add_argument("--check", action="store_true", help="train again and compare with the shipped files")
    p.add_argument("--cache", type=Path, help="build (or take) the warm start in this cache root, not an empty one")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the build (default 1)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)

    from tracekit.artifacts import atomic_write_json, read_json
    from tracekit.warmstart.shipped import IDENTITY, shipped_dir

    preset = a.preset or a.name
    with tempfile.TemporaryDirectory(prefix="warmstart-") as tmp:
        cache = a.cache or Path(tmp)
        folder, backbone, key, seconds = build(preset, cache)
        files = files_of(folder)
        out = shipped_dir(a.name)
        if a.check:
            shipped = read_json(out / IDENTITY)
            differ = sorted(rel for rel in set(files) | set(shipped["files"])
                            if files.get(rel) != shipped["files"].get(rel)
                            and not (rel == RECORD and same_record(folder / rel, out / rel)))
            if shipped["planted_key"] != key:
                print(f"{a.name}: the shipped warm start is key {shipped['planted_key']}, experiment={preset}'s is {key}")
                return 1
            if differ:
                print(f"{a.name}: rebuilt in {seconds:.0f} s, {len(differ)} of {len(files)} files differ from the "
                      f"shipped ones: {', '.join(differ)} (torch {torch.__version__}, {torch.get_num_threads()} "
                      f"threads here; shipped: torch {shipped['torch']}, {shipped['threads']} threads)")
                return 1
            print(f"{a.name}: rebuilt in {seconds:.0f} s, every file ({len(files)}) is the shipped one, bit for bit "
                  f"(key {key}; {RECORD} but for its build time)")
            return 0
        stage = out.with_name(out.name + ".tmp")
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        for top in SHIPPED_FILES:
            (shutil.copytree if (folder / top).is_dir() else shutil.copy2)(folder / top, stage / top)
        atomic_write_json(stage / IDENTITY, {
            "name": a.name, "preset": preset, "backbone": backbone, "planted_key": key, "files": files,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cache": "an empty temporary one" if a.cache is None else str(a.cache),
            "seconds": round(seconds, 1), "rebuild": f"python scripts/build_warmstart.py {a.name} --check"})
        shutil.rmtree(out, ignore_errors=True)
        stage.rename(out)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"wrote {out} (warm start {backbone}-{key}, {len(files)} files, {size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
