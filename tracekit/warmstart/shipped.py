"""Shipped warm starts: a planted warm start committed with the code, so a run skips training it (issue 50).

The micro backbone's warm start trains for ~6 minutes on 2 cores, the longest stage of the micro world's ladder. The
default experiment (``experiment=micro_ladder``) names a shipped copy instead (``warm_start=micro``): the folder
``tracekit/warmstart/warmstarts/<name>/`` holds the planted folder's files (``model/``: float32 weights, the world
tokenizer, the config; ``planted.json``: the warm start's record) and ``identity.json``: the planted key it is (the
cache key of :func:`tracekit.warmstart.planted.planted_dir`, over the planted spec, the base backbone and the world
tokenizer's inputs) and the sha256 of every file. ``scripts/build_warmstart.py <name>`` trains the warm start from
scratch in an empty cache and writes the folder; ``--check`` trains it again and compares every file's sha256 with
the shipped one (bit for bit on the same torch build and thread count, which the script pins; SFT on another CPU
kind may round apart). Like the trained folder's key, the shipped one's holds the recipe, not the rounding: the micro
copy is a 1-thread build, and micro's committed tables came from a 2-thread one that rounds apart.

Refused in one line (``ShippedWarmStartError``, a ``ConfigError``: the CLI exits 2 before any work): a name with no
folder, a config whose ``backbone.planted`` key is not the shipped one (the preset or an override changed the warm
start: drop ``warm_start`` to train it, or rebuild the artifact), a file whose sha256 is not the recorded one.

Installing copies the verified files into the planted cache folder (``<cache_root>/planted/<backbone>-<key>/``),
through the same atomic ``cached_folder`` the trained warm start goes through: from there every stage (and every
training subprocess) loads it as it would the trained one. A folder already there (trained or installed) is kept.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from tracekit.artifacts import file_sha256, read_json
from tracekit.config import ConfigError
from tracekit.llm.backbones import cache_root, cached_folder, get_spec
from tracekit.warmstart.planted import PlantedSpec, planted_key

WARMSTARTS = Path(__file__).resolve().parent / "warmstarts"
IDENTITY = "identity.json"
REBUILD = "python scripts/build_warmstart.py"


class ShippedWarmStartError(ConfigError):
    """A shipped warm start that is missing, of another key, or whose files differ from their recorded sha256."""


def shipped_names() -> list[str]:
    return sorted(p.name for p in WARMSTARTS.iterdir() if (p / IDENTITY).is_file()) if WARMSTARTS.is_dir() else []


def shipped_dir(name: str) -> Path:
    return WARMSTARTS / name


SPEC_KEYS = ("name", "source", "hf_id", "chat_format", "arch", "planted")  # a config node's fields that are the spec's


def config_planted_key(backbone: Any) -> tuple[Any, str]:
    """(backbone spec, planted key) of a config's ``backbone`` node (its spec fields; device and dtype are where it
    runs, not what it is), or of a spec or a dict."""
    if OmegaConf.is_config(backbone):
        node = OmegaConf.to_container(backbone, resolve=True)
        backbone = {k: node[k] for k in SPEC_KEYS if node.get(k) is not None}
    spec = get_spec(backbone)
    if not spec.planted:
        raise ShippedWarmStartError(f"warm_start: backbone={spec.name} has no planted warm start (backbone.planted "
                                    "is unset), so there is nothing to ship: drop warm_start")
    return spec, planted_key(PlantedSpec.from_config(spec.planted), dataclasses.replace(spec, planted=None))


_VERIFIED: dict[tuple[str, str], tuple[tuple[str, int, int], ...]] = {}  # (name, key) -> files' (path, size, mtime)


def _stat(folder: Path, files: dict[str, str]) -> tuple[tuple[str, int, int], ...]:
    out = []
    for rel in sorted(files):
        st = (folder / rel).stat()
        out.append((rel, st.st_size, st.st_mtime_ns))
    return tuple(out)


def verify_shipped(name: str, backbone: Any) -> dict[str, Any]:
    """The identity of the shipped warm start ``name`` after checking it stands for ``backbone``'s warm start and
    that every file is the recorded one; ``ShippedWarmStartError`` (one line) otherwise. A folder verified once in
    this process is not hashed again while its files' sizes and mtimes stay the same."""
    folder = shipped_dir(name)
    if not (folder / IDENTITY).is_file():
        raise ShippedWarmStartError(f"warm_start={name}: no shipped warm start of that name under {WARMSTARTS} "
                                    f"(shipped: {', '.join(shipped_names()) or 'none'}; null trains the warm start)")
    ident = read_json(folder / IDENTITY)
    spec, key = config_planted_key(backbone)
    if ident["planted_key"] != key or ident["backbone"] != spec.name:
        raise ShippedWarmStartError(
            f"warm_start={name}: the shipped warm start is {ident['backbone']}-{ident['planted_key']}, this config's "
            f"backbone.planted is {spec.name}-{key} (the preset or an override changed the warm start): set "
            f"warm_start=null to train it (~6 min on 2 cores), or rebuild the artifact: {REBUILD} {name}")
    files = ident["files"]
    missing = [rel for rel in files if not (folder / rel).is_file()]
    if missing:
        raise ShippedWarmStartError(f"warm_start={name}: {folder} lacks {', '.join(missing)}: restore it from git, or "
                                    f"rebuild it: {REBUILD} {name}")
    stat = _stat(folder, files)
    if _VERIFIED.get((name, key)) != stat:
        bad = [rel for rel, sha in sorted(files.items()) if file_sha256(folder / rel) != sha]
        if bad:
            raise ShippedWarmStartError(
                f"warm_start={name}: {', '.join(bad)} under {folder} differ from the sha256 in its {IDENTITY}: "
                f"restore them from git, or rebuild the artifact: {REBUILD} {name}")
        _VERIFIED[(name, key)] = stat
    return ident


def install_shipped(name: str, backbone: Any, cache_dir: str | Path | None = None) -> tuple[Path, bool]:
    """Verify the shipped warm start ``name`` and copy it into the planted cache folder of ``backbone``'s warm start
    (the folder :func:`tracekit.warmstart.planted.planted_dir` returns); (that folder, whether it was copied now)."""
    ident = verify_shipped(name, backbone)
    spec, key = config_planted_key(backbone)
    final = cache_root(cache_dir) / "planted" / f"{spec.name}-{key}"
    copied = []

    def copy(tmp: Path) -> dict[str, Any]:
        t0 = time.time()
        for rel, sha in ident["files"].items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shipped_dir(name) / rel, tmp / rel)
            if file_sha256(tmp / rel) != sha:  # a copy torn by the disk: never installed
                raise OSError(f"warm_start={name}: the copy of {rel} in {tmp} differs from its sha256")
        copied.append(True)
        record = read_json(tmp / "planted.json")
        return {"planted_set": record["planted_set"], "shipped": name, "seconds": round(time.time() - t0, 1)}

    return cached_folder(final, copy), bool(copied)
