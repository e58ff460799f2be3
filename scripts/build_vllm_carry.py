"""Build the carry that lets the lent GPU machine import vllm 0.26.0 and serve a small dense model with LoRA.

The GPU machine (Python 3.12, torch 2.11 / CUDA 13, an H200, no network) takes at most 64 MiB of carried files
per call. vllm's wheel is 290 MiB, most of it kernels this serve never loads, and vllm declares some 60
dependencies, most of them either in the GPU image or imported only by features this serve does not use.
This script carries the rest, in bundles of at most ``--bundle-mib`` each, one bundle per call, into a stash on
the machine's disk that outlives the call while the machine stays warm (``benchmarks/vllm_stash.sh``):

- a stripped vllm wheel: the members in ``DROP`` removed (and their RECORD lines), the ones in ``XZ`` moved out
  as .xz files (FA3's kernels shrink from 37 MiB deflated to 10 MiB) that the install phase puts back; the wheel
  is larger than a bundle, so it travels in parts with its sha256;
- the wheels pinned in ``scripts/vllm_carry.txt`` ([carry]: always installed; [fallback]: installed only where
  the image's own version misses a requirement), cp312 manylinux, cached in ``.vllm_wheels/`` (git-ignored).

Each bundle holds a ``manifest.json`` (the same in all): every file with its bytes, sha256 and bundle.

    python scripts/build_vllm_carry.py --dry-run     # the plan and sizes (from the cache where it has them)
    python scripts/build_vllm_carry.py               # writes .carry_vllm/1, .carry_vllm/2, ... (git-ignored)
    python scripts/build_vllm_carry.py --verify      # also pip-installs the result here into a temp dir

There: carry ['.carry_vllm/1'] with `bash benchmarks/vllm_stash.sh stash`, then ['.carry_vllm/2'] and so on;
then `bash benchmarks/vllm_stash.sh install`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import lzma
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PINS = ROOT / "scripts" / "vllm_carry.txt"
VLLM = "vllm==0.26.0"
VLLM_WHEEL = "vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"
# Where a copy may already lie (the brief's download); else it is fetched into the cache.
VLLM_WHEEL_ELSEWHERE = [Path("/tmp/vw") / VLLM_WHEEL]
# Members of the vllm wheel that do not travel (path prefixes), with why (see benchmarks/results/vllm_carry.md).
DROP = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FA2 kernels, 124 MiB: sm_90 runs FA3 (fa_utils.get_flash_attn_version)"
                                                "; flash_attn_interface.py:13 imports it in try/except ImportError",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels, 39 MiB: platforms/cuda.py:228 imports it under contextlib."
                                           "suppress(ImportError); only fused-MoE layers call torch.ops._moe_C",
    "vllm/vllm-rs": "Rust frontend binary, 15 MiB: used only with VLLM_USE_RUST_FRONTEND=1 (envs.py:557)",
    "vllm/third_party/deep_gemm/": "vendored DeepGEMM (FP8 GEMMs; .so for five Pythons, CUTLASS headers for its JIT): "
                                   "without it has_deep_gemm() is False and DeepGEMM paths/warmup are skipped",
    "vllm/third_party/fmha_sm100/": "Blackwell (SM100) FMHA and its CUTLASS headers: MiniMax-M3 indexer only",
    "vllm/_flashmla_C.abi3.so": "FlashMLA: MLA models only; v1/attention/ops/flashmla.py:14 try/except",
    "vllm/_flashmla_extension_C.abi3.so": "FlashMLA: MLA models only; v1/attention/ops/flashmla.py:24 try/except",
    "vllm/_qutlass_C.abi3.so": "QuTLASS FP4 kernels: platforms/cuda.py:26 and :230, under "
                               "contextlib.suppress(ImportError)",
}
# Members that travel xz-compressed beside the wheel and are put back into the install by vllm_stash.sh.
XZ = ["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]
XZ_PRESET = 6
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64"]
MIB = 1 << 20


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path = PINS) -> dict[str, dict[str, str]]:
    """``{"carry": {name: version}, "fallback": {name: version}}`` from the pins file's sections."""
    out: dict[str, dict[str, str]] = {"carry": {}, "fallback": {}}
    section = None
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        if section not in out or "==" not in line:
            raise SystemExit(f"build_vllm_carry: {path.name}: unexpected line {raw!r}")
        name, version = line.split("==", 1)
        out[section][name.strip()] = version.strip()
    return out


def wheel_name_matches(filename: str, name: str, version: str) -> bool:
    dist, ver = filename.split("-")[:2]
    return norm(dist) == norm(name) and ver == version


def find_cached(cache: Path, name: str, version: str) -> Path | None:
    return next((p for p in sorted(cache.glob("*.whl")) if wheel_name_matches(p.name, name, version)), None)


def pip_download(cache: Path, reqs: list[str]) -> None:
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
            "3.12", "--implementation", "cp", "-d", str(cache)]
    for p in PLATFORMS:
        args += ["--platform", p]
    out = subprocess.run(args + reqs, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"build_vllm_carry: pip download {' '.join(reqs)} failed:\n{out.stderr.strip()[-1500:]}")


def fetch_wheels(pins: dict[str, str], cache: Path) -> dict[str, Path]:
    """The cached wheel of each pin, downloading the ones the cache lacks."""
    cache.mkdir(parents=True, exist_ok=True)
    missing = [f"{n}=={v}" for n, v in pins.items() if find_cached(cache, n, v) is None]
    if missing:
        print(f"downloading {len(missing)} wheels into {cache}")
        pip_download(cache, missing)
    found = {n: find_cached(cache, n, v) for n, v in pins.items()}
    lost = [n for n, p in found.items() if p is None]
    if lost:
        raise SystemExit(f"build_vllm_carry: no cp312 wheel found for {', '.join(lost)}")
    return found  # type: ignore[return-value]


def vllm_source(cache: Path, download: bool) -> Path | None:
    for p in [cache / VLLM_WHEEL, *VLLM_WHEEL_ELSEWHERE]:
        if p.is_file():
            return p
    if not download:
        return None
    cache.mkdir(parents=True, exist_ok=True)
    print(f"downloading {VLLM} (290 MiB)")
    pip_download(cache, [VLLM])
    return cache / VLLM_WHEEL


def dropped(member: str) -> bool:
    return any(member == d or (d.endswith("/") and member.startswith(d)) for d in DROP)


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def strip_plan(src: Path) -> dict:
    """Sizes of what the stripped wheel keeps, drops and moves out (compressed sizes in the source wheel)."""
    keep = drop = xz = 0
    with zipfile.ZipFile(src) as z:
        for i in z.infolist():
            if dropped(i.filename):
                drop += i.compress_size
            elif i.filename in XZ:
                xz += i.compress_size
            else:
                keep += i.compress_size
    return {"keep": keep, "drop": drop, "xz_deflated": xz}


def strip_wheel(src: Path, out_dir: Path) -> tuple[Path, dict[str, dict]]:
    """Write the stripped wheel (same name) and the .xz members into ``out_dir``; reuse them when the stamp matches."""
    stamp = {"src": src.name, "src_bytes": src.stat().st_size, "drop": sorted(DROP), "xz": XZ, "preset": XZ_PRESET}
    stamp_file = out_dir / "stamp.json"
    whl = out_dir / src.name
    if stamp_file.is_file() and json.loads(stamp_file.read_text()).get("stamp") == stamp and whl.is_file():
        return whl, json.loads(stamp_file.read_text())["xz_files"]
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    xz_files: dict[str, dict] = {}
    removed: set[str] = set()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as zout:
        record_name = next(n for n in zin.namelist() if n.endswith(".dist-info/RECORD"))
        for info in zin.infolist():
            name = info.filename
            if name == record_name:
                continue
            if dropped(name):
                removed.add(name)
                continue
            data = zin.read(name)
            if name in XZ:
                removed.add(name)
                packed = f"{Path(name).name}.xz"
                print(f"  xz -{XZ_PRESET} {name} ({len(data) / MIB:.1f} MiB raw) ...", flush=True)
                comp = lzma.compress(data, preset=XZ_PRESET)
                (out_dir / packed).write_bytes(comp)
                xz_files[packed] = {"dest": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                    "record": f"{name},{record_hash(data)},{len(data)}"}
                continue
            zout.writestr(info, data, compress_type=info.compress_type)
        record = zin.read(record_name).decode()
        kept = [ln for ln in record.splitlines() if ln and ln.split(",", 1)[0] not in removed]
        zout.writestr(zin.getinfo(record_name), "\n".join(kept) + "\n")
    stamp_file.write_text(json.dumps({"stamp": stamp, "xz_files": xz_files}, indent=1))
    return whl, xz_files


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def pack(items: list[tuple[str, int]], limit: int) -> list[list[tuple[str, int]]]:
    """First-fit of (name, bytes), largest first, into bundles of at most ``limit`` bytes."""
    bundles: list[list[tuple[str, int]]] = []
    for name, size in sorted(items, key=lambda x: -x[1]):
        if size > limit:
            raise SystemExit(f"build_vllm_carry: {name} ({size / MIB:.1f} MiB) exceeds a bundle "
                             f"({limit / MIB:.0f} MiB)")
        for b in bundles:
            if sum(s for _, s in b) + size <= limit:
                b.append((name, size))
                break
        else:
            bundles.append([(name, size)])
    return bundles


def plan_bundles(wheel_bytes: int, files: list[tuple[str, int]], limit: int) -> tuple[int, list]:
    """Parts of the vllm wheel and the bundles: the fewest bundles of at most ``limit``, then evened out (the
    smallest cap that still gives that many), so that each call carries as little as it can."""
    def attempt(cap: int) -> tuple[int, list] | None:
        best = None
        first = max(1, -(-wheel_bytes // cap))
        for parts in range(first, first + 4):
            step = -(-wheel_bytes // parts)
            items = [(f"parts/{VLLM_WHEEL}.part{i + 1}", min(step, wheel_bytes - i * step)) for i in range(parts)]
            try:
                bundles = pack(items + files, cap)
            except SystemExit:
                continue
            if best is None or len(bundles) < len(best[1]):
                best = (parts, bundles)
        return best

    best = attempt(limit)
    if best is None:
        raise SystemExit(f"build_vllm_carry: a file exceeds a bundle ({limit / MIB:.0f} MiB)")
    total = wheel_bytes + sum(s for _, s in files)
    for cap in range(-(-total // len(best[1])), limit, MIB // 4):
        even = attempt(cap)
        if even is not None and len(even[1]) == len(best[1]):
            return even
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / ".carry_vllm", help="bundles go to OUT/1, OUT/2, ...")
    p.add_argument("--cache", type=Path, default=ROOT / ".vllm_wheels", help="downloaded and stripped wheels")
    p.add_argument("--bundle-mib", type=int, default=60, help="at most this much per bundle (a call carries 64 MiB)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and sizes; download and write nothing")
    p.add_argument("--verify", action="store_true", help="after writing, pip-install every wheel into a temp dir here")
    a = p.parse_args(argv)
    limit = a.bundle_mib * MIB - 64 * 1024  # room for manifest.json
    pins = read_pins()
    everything = {**pins["carry"], **pins["fallback"]}

    src = vllm_source(a.cache, download=not a.dry_run)
    if a.dry_run:
        print(f"vllm: {VLLM_WHEEL} ({'at ' + str(src) if src else 'not downloaded yet'})")
        if src:
            sp = strip_plan(src)
            print(f"  stripped wheel keeps {sp['keep'] / MIB:.1f} MiB, drops {sp['drop'] / MIB:.1f} MiB; "
                  f"moves out as xz "
                  f"{', '.join(XZ)} ({sp['xz_deflated'] / MIB:.1f} MiB deflated; about a quarter of that as xz)")
        for d, why in DROP.items():
            print(f"  drop {d}: {why}")
        items: list[tuple[str, int]] = []
        for section in ("carry", "fallback"):
            print(f"[{section}]")
            for n, v in pins[section].items():
                w = find_cached(a.cache, n, v)
                if w:
                    items.append((w.name, w.stat().st_size))
                print(f"  {n}=={v}: {f'{w.stat().st_size / MIB:.2f} MiB' if w else 'not downloaded yet'}")
        stripped = a.cache / "stripped" / VLLM_WHEEL
        if stripped.is_file():
            items += [(f.name, f.stat().st_size) for f in (a.cache / "stripped").glob("*.xz")]
            w = stripped.stat().st_size
            parts, bundles = plan_bundles(w, items, limit)
            print(f"from the cache (last build): stripped wheel {w / MIB:.1f} MiB in {parts} parts, other files "
                  f"{sum(s for _, s in items) / MIB:.1f} MiB: {(w + sum(s for _, s in items)) / MIB:.1f} MiB in "
                  f"{len(bundles)} bundles")
            for i, b in enumerate(bundles, 1):
                print(f"  bundle {i}: {sum(s for _, s in b) / MIB:.1f} MiB, {len(b)} files")
        return 0

    assert src is not None
    wheels = fetch_wheels(everything, a.cache)
    print(f"stripping {src.name} ...", flush=True)
    stripped, xz_files = strip_wheel(src, a.cache / "stripped")
    wbytes = stripped.stat().st_size
    raw = stripped.read_bytes()

    files: list[tuple[str, int]] = [(f"wheels/{w.name}", w.stat().st_size) for w in wheels.values()]
    files += [(f"xz/{n}", (a.cache / "stripped" / n).stat().st_size) for n in xz_files]
    parts, bundles = plan_bundles(wbytes, files, limit)
    step = -(-wbytes // parts)
    part_names = [f"parts/{VLLM_WHEEL}.part{i + 1}" for i in range(parts)]
    data_of = {name: (lambda i=i: raw[i * step:(i + 1) * step]) for i, name in enumerate(part_names)}
    for n, w in wheels.items():
        data_of[f"wheels/{w.name}"] = w.read_bytes
    for n in xz_files:
        data_of[f"xz/{n}"] = (a.cache / "stripped" / n).read_bytes

    manifest = {
        "vllm": VLLM, "bundles": len(bundles), "files": {},
        "vllm_wheel": {"name": VLLM_WHEEL, "bytes": wbytes, "sha256": hashlib.sha256(raw).hexdigest(),
                       "parts": part_names},
        "xz": {f"xz/{n}": meta for n, meta in xz_files.items()},
        "carry": {f"wheels/{wheels[n].name}": f"{n}=={v}" for n, v in pins["carry"].items()},
        "fallback": {f"wheels/{wheels[n].name}": f"{n}=={v}" for n, v in pins["fallback"].items()},
    }
    for i, b in enumerate(bundles, 1):
        for name, _ in b:
            data = data_of[name]()
            manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "bundle": i}

    for old in a.out.glob("[0-9]*"):
        shutil.rmtree(old)
    for i, b in enumerate(bundles, 1):
        for name, _ in b:
            path = a.out / str(i) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data_of[name]())
        (a.out / str(i) / "manifest.json").write_text(json.dumps(manifest, indent=1))
        print(f"bundle {i}: {sum(s for _, s in b) / MIB:.1f} MiB: {', '.join(Path(n).name for n, _ in b)}")
    total = sum(m["bytes"] for m in manifest["files"].values())
    print(f"total {total / MIB:.1f} MiB in {len(bundles)} bundles (stripped vllm wheel {wbytes / MIB:.1f} MiB in "
          f"{parts} parts, {len(xz_files)} xz members, {len(wheels)} wheels)")
    print(f"carry one bundle per call: carry=['.carry_vllm/1'] with `bash benchmarks/vllm_stash.sh stash`, ... "
          f"({len(bundles)} calls), then `bash benchmarks/vllm_stash.sh install`")
    if a.verify:
        verify(stripped, list(wheels.values()))
    return 0


def verify(stripped: Path, wheels: list[Path]) -> None:
    """pip accepts the stripped wheel (this Python) and the cp312 wheels (as for Python 3.12) into temp dirs."""
    with tempfile.TemporaryDirectory() as t:
        base = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        out = subprocess.run([*base, "--target", f"{t}/v", str(stripped)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"build_vllm_carry: pip rejects the stripped wheel:\n{out.stderr[-1500:]}")
        plat = [x for p in PLATFORMS for x in ("--platform", p)]
        out = subprocess.run([*base, "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", *plat,
                              "--target", f"{t}/w", *map(str, wheels)], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"build_vllm_carry: pip rejects a carried wheel:\n{out.stderr[-1500:]}")
        print(f"verify: pip installs the stripped wheel ({sum(1 for _ in Path(t, 'v').rglob('*.py'))} .py files) "
              f"and the {len(wheels)} cp312 wheels")


if __name__ == "__main__":
    sys.exit(main())
