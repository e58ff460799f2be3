"""The Python environment a jailed command sees, and what it must never see (standard library only; used by
:mod:`tracekit.coding.sandbox`).

**The task runtime** (:func:`runtime_dir`). Coding tasks are made from an installed package (``toolz``): its
pristine source sits in the interpreter's site-packages, which a command must not see (``cp -r <site>/toolz .``
would solve every task). So no site directory of the interpreter is shown as it is: each one (``site-packages`` of
the prefix, of a venv and its base, the ``dist-packages`` of a Debian system Python) is covered by the *task runtime*,
a directory tracekit builds and owns with only what a task's test run needs: the distributions of
:data:`RUNTIME_DISTS` (pytest) and their requirements (this interpreter's markers, no extras), copied file by file
from their ``RECORD`` (with their ``__pycache__``), minus every hidden distribution. It is built once per
interpreter and distribution set under ``<work root>/runtime/<key>/`` (key: :data:`FORMAT`, the interpreter, each
copied distribution's name, version and RECORD hash), atomically; nothing of the real site directories is bound.

**The interpreter's image** (:func:`interpreter_image`). The jail binds no directory of the interpreter's prefix as
it is (a prefix under $HOME or /usr/local holds whatever was saved there: a wheel, an unpacked copy under another
name, a ``__pycache__`` of the pristine module). It binds over the prefix a copy, made once per interpreter under
``<work root>/runtime/python-<key>/``, of what the interpreter needs, each entry named: the executable and its
links, the shared libraries of ``<prefix>/lib``, the runtime's commands (``pytest``), and of the standard library
only its own top-level entries (:func:`stdlib_entry`: ``sys.stdlib_module_names``, ``lib-dynload``,
``_sysconfigdata``; their ``__pycache__`` files). Something saved in the prefix later is never shown.

**Hidden distributions** (``hide``: a task's package, e.g. ``("toolz",)``). Kept as a second line behind the
allow-list, over the directories still bound whole (the system's, the image, a caller's). Besides being left out of
the runtime,
every copy of a hidden distribution that a bound directory holds anywhere (``/usr``, the prefix, a bound extra) is
found by :func:`scan` and covered (a directory by an empty read-only tmpfs, a file by an empty read-only file):
its ``.dist-info`` / ``.egg-info``, its wheels and source archives (by name), a directory named as one of its
top-level packages holding at least half of that package's file names, a module file of its name, and any file of
at least :data:`MIN_HASHED` bytes whose content equals one of the installed distribution's files (sources, tests,
``__pycache__``, metadata; smaller files say nothing: an empty ``__init__.py``).

**Stray caches.** The same walk reports every ``coding_tasks`` directory (a task cache: gold patches, hidden tests,
the pristine tree) and every stage artifact (a ``COMPLETE.json`` manifest of :mod:`tracekit.artifacts`) it meets;
the sandbox refuses to start a command while one lies in a bound directory.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata as md
import json
import os
import re
import shutil
import site
import stat
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FORMAT = 1  # bump when what a runtime holds changes (its key changes with it)
RUNTIME_DISTS = ("pytest",)  # what a task's test run needs; their requirements come with them
MIN_HASHED = 128  # a file this small equal to a hidden one is not masked (it tells nothing: blank __init__.py)
SCAN_TTL_S = 600.0  # a bound tree is walked again after this long (a cache left there since is found)
CACHE_DIR_NAMES = ("coding_tasks",)  # tracekit.targets.coding.tasks.load_or_generate's cache directory
ARTIFACT_MARKER = "COMPLETE.json"  # tracekit.artifacts.COMPLETE: a stage artifact (trajectories hold gold patches)


def normalize(name: str) -> str:
    """A distribution name as in wheel file names and ``.dist-info`` directories (PEP 503 + PEP 427)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def task_hide(repo: str | None) -> tuple[str, ...]:
    """The distribution a task was made from, from its ``repo`` (``toolz==1.2.0``), as a ``hide`` tuple; () for a
    repository name (SWE-bench's ``owner/name``: nothing installed to hide)."""
    if repo and "==" in repo and "/" not in repo:
        return (repo.split("==", 1)[0].strip(),)
    return ()


def site_dirs() -> list[str]:
    """Every site directory of this interpreter (and of its base, for a venv), real paths, existing only."""
    out: list[str] = []
    try:
        out += site.getsitepackages()
        out += site.getsitepackages(list(dict.fromkeys([sys.prefix, sys.exec_prefix, sys.base_prefix,
                                                         sys.base_exec_prefix])))
    except AttributeError:  # an old virtualenv's site module
        pass
    for base in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        for key in ("purelib", "platlib"):
            try:
                out.append(sysconfig.get_path(key, vars=base or None))
            except KeyError:
                pass
    return [p for p in dict.fromkeys(os.path.realpath(p) for p in out if p) if os.path.isdir(p)]


def _find(name: str) -> md.Distribution | None:
    for d in md.distributions(name=name, path=site_dirs()):
        return d
    return None


def _requirements(dist: md.Distribution) -> list[str]:
    """Names of ``dist``'s requirements that apply to this interpreter (no extras)."""
    out = []
    for line in dist.requires or []:
        try:
            from packaging.requirements import Requirement

            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            out.append(req.name)
        except ImportError:  # no packaging: the name, and no requirement that needs an extra
            if "extra ==" not in line and "extra==" not in line:
                out.append(re.split(r"[\s;<>=!~\[(]", line.strip(), 1)[0])
        except Exception:  # noqa: BLE001 - an unparseable requirement line is skipped
            continue
    return out


def closure(roots: tuple[str, ...], hide: tuple[str, ...]) -> list[md.Distribution]:
    """The installed distributions ``roots`` need (with their requirements), none of ``hide``; name order."""
    hidden = {normalize(h) for h in hide}
    seen: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        n = normalize(todo.pop())
        if n in seen or n in hidden:
            continue
        d = _find(n)
        if d is None:
            continue
        seen[n] = d
        todo += _requirements(d)
    return [seen[k] for k in sorted(seen)]


def _record_hash(dist: md.Distribution) -> str:
    text = dist.read_text("RECORD") or dist.read_text("installed-files.txt") or ""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _files(dist: md.Distribution) -> list[tuple[Path, str]]:
    """(installed file, path relative to its site directory) of ``dist`` (scripts outside it left out), with the
    ``__pycache__`` of each of its modules (so a command does not compile them on every run)."""
    out = []
    tag = sys.implementation.cache_tag
    for f in dist.files or []:
        rel = os.path.normpath(str(f))
        if rel.startswith("..") or os.path.isabs(rel):
            continue
        src = Path(dist.locate_file(f))
        if not src.is_file():
            continue
        out.append((src, rel))
        if rel.endswith(".py") and tag:
            stem = os.path.basename(rel)[:-3]
            cache = src.parent / "__pycache__"
            for pyc in (f"{stem}.{tag}.pyc", f"{stem}.{tag}.opt-1.pyc", f"{stem}.{tag}.opt-2.pyc"):
                if (cache / pyc).is_file():
                    out.append((cache / pyc, os.path.join(os.path.dirname(rel), "__pycache__", pyc)))
    return list(dict(((r, (s, r)) for s, r in out)).values())


def runtime_key(dists: list[md.Distribution]) -> str:
    return hashlib.sha256(json.dumps({
        "format": FORMAT, "python": os.path.realpath(sys.executable), "version": sys.version,
        "dists": [[normalize(d.metadata["Name"] or ""), d.version, _record_hash(d)] for d in dists]},
        sort_keys=True).encode()).hexdigest()[:20]


def empty_file(base: Path) -> Path:
    """``<base>/runtime/empty``: the empty read-only file bound over a masked file."""
    root = base / "runtime"
    root.mkdir(mode=0o755, exist_ok=True)
    p = root / "empty"
    if not p.is_file() or p.stat().st_size:
        fd, tmp = tempfile.mkstemp(dir=root)
        os.close(fd)
        os.chmod(tmp, 0o444)
        os.replace(tmp, p)
    return p


def runtime_dir(base: Path, hide: tuple[str, ...] = ()) -> Path:
    """The task runtime's site directory (built once under ``<base>/runtime/<key>/site-packages``)."""
    return _runtime_dir(str(base), tuple(sorted({normalize(h) for h in hide})))


@functools.lru_cache(maxsize=16)
def _runtime_key(hide: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    dists = closure(RUNTIME_DISTS, hide)
    return runtime_key(dists), tuple(d.metadata["Name"] for d in dists)


def _runtime_dir(base: str, hide: tuple[str, ...]) -> Path:
    key, names = _runtime_key(hide)
    root = Path(base) / "runtime"
    final = root / key
    if (final / "site-packages").is_dir() and (final / "COMPLETE").is_file():
        return final / "site-packages"
    root.mkdir(mode=0o755, exist_ok=True)
    os.chmod(root, 0o755)
    work = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        sp = work / "site-packages"
        sp.mkdir()
        dists = [d for d in closure(RUNTIME_DISTS, hide) if d.metadata["Name"] in names]
        for d in dists:
            for src, rel in _files(d):
                dst = sp / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)  # the mtime kept: the copied __pycache__ stays valid
        for dirpath, dirnames, filenames in os.walk(work):
            os.chmod(dirpath, 0o755)
            for n in filenames:
                os.chmod(os.path.join(dirpath, n), 0o644)
        (work / "COMPLETE").write_text(json.dumps({"dists": [f"{d.metadata['Name']}=={d.version}" for d in dists],
                                                   "hide": list(hide), "python": sys.executable}) + "\n")
        try:
            os.rename(work, final)
        except OSError:  # another process made it first
            if not (final / "COMPLETE").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final / "site-packages"


# ---------------------------------------------------------------- what a hidden distribution looks like


@dataclass(frozen=True)
class Fingerprint:
    names: frozenset[str] = frozenset()  # normalized distribution names
    modules: frozenset[str] = frozenset()  # top-level single-file modules ("six.py")
    packages: tuple[tuple[str, frozenset[str]], ...] = ()  # top-level package name -> its entries
    hashes: dict[int, frozenset[str]] = field(default_factory=dict)  # size -> sha256 of its files that size

    def __hash__(self) -> int:
        return hash((self.names, self.modules, self.packages, tuple(sorted(self.hashes))))

    def empty(self) -> bool:
        return not self.names


def _sha(path: str) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


@functools.lru_cache(maxsize=16)
def fingerprint(hide: tuple[str, ...]) -> Fingerprint:
    """What copies of the ``hide`` distributions look like: their names, their top-level packages and modules, and
    the content of every file of their installed copy (RECORD, plus whatever their package directories hold)."""
    names = frozenset(normalize(h) for h in hide)
    if not names:
        return Fingerprint()
    modules, packages, paths = set(), {}, set()
    for h in hide:
        d = _find(h)
        if d is None:
            continue
        top = set()
        for f in d.files or []:
            rel = os.path.normpath(str(f))
            if rel.startswith("..") or os.path.isabs(rel):
                paths.add(os.path.realpath(d.locate_file(f)))
                continue
            first = rel.split(os.sep, 1)[0]
            paths.add(str(d.locate_file(f)))
            if first.endswith((".dist-info", ".egg-info")) or first == "__pycache__":
                continue
            if os.sep in rel:
                top.add(first)
            elif rel.endswith(".py"):
                modules.add(rel)
        base = Path(d.locate_file(""))
        for name in top:
            for dirpath, _, filenames in os.walk(base / name):
                paths.update(os.path.join(dirpath, n) for n in filenames)
            try:
                packages[name] = frozenset(n for n in os.listdir(base / name) if n != "__pycache__")
            except OSError:
                pass
        for line in (d.read_text("top_level.txt") or "").split():
            if (base / f"{line}.py").is_file():
                modules.add(f"{line}.py")
    hashes: dict[int, set[str]] = {}
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_size >= MIN_HASHED:
            digest = _sha(p)
            if digest:
                hashes.setdefault(st.st_size, set()).add(digest)
    return Fingerprint(names, frozenset(modules), tuple(sorted(packages.items())),
                       {k: frozenset(v) for k, v in hashes.items()})


# ---------------------------------------------------------------- the walk of a bound tree


@dataclass(frozen=True)
class Found:
    """Relative paths under a scanned tree: directories and files to cover, task caches met."""

    dirs: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    caches: tuple[str, ...] = ()


_ARCHIVES = (".whl", ".tar.gz", ".tgz", ".tar.bz2", ".zip", ".egg")


def _named(name: str, fp: Fingerprint, is_dir: bool) -> bool:
    """A ``.dist-info`` / ``.egg-info`` / ``.egg`` of a hidden distribution, one of its archives (wheel, sdist),
    or a file of one of its top-level module names."""
    low = name.lower()

    def versioned(stem: str) -> bool:  # <name>_<version...> once normalized
        return any(re.match(rf"{re.escape(n)}_\d", stem) for n in fp.names)

    for suffix in (".dist-info", ".egg-info", ".egg"):
        if low.endswith(suffix):
            stem = normalize(low[:-len(suffix)])
            return stem in fp.names or versioned(stem)
    if not is_dir and low.endswith(_ARCHIVES):
        return versioned(normalize(low))
    return not is_dir and name in fp.modules


def _like(path: str, own: frozenset[str]) -> bool:
    """A directory named as a hidden top-level package holds (a version of) it: ``__init__.py`` and at least half
    of the package's other entries."""
    try:
        have = set(os.listdir(path))
    except OSError:
        return False
    rest = own - {"__init__.py"}
    if not rest:
        return "__init__.py" in have
    return len(have & rest) * 2 >= len(rest) and ("__init__.py" in have or "__init__.py" not in own)


_SCANS: dict[tuple, tuple[float, Found]] = {}


def scan(src: str, prune: tuple[str, ...], fp: Fingerprint) -> Found:
    """Walk ``src`` (a bound file or directory, not following links, not into ``prune``: absolute paths covered by
    other mounts or not carried by the bind) for copies of ``fp``'s distributions and for task caches; cached per
    process for :data:`SCAN_TTL_S`."""
    if not os.path.isdir(src):  # a bound file (a patch): not worth keeping
        return _scan(src, set(prune), fp)
    key = (src, prune, fp)
    hit = _SCANS.get(key)
    if hit and time.monotonic() - hit[0] < SCAN_TTL_S:
        return hit[1]
    found = _scan(src, set(prune), fp)
    if len(_SCANS) > 256:
        _SCANS.clear()
    _SCANS[key] = (time.monotonic(), found)
    return found


def _is_artifact(path: str, st: os.stat_result) -> bool:
    """A tracekit stage artifact's manifest (``{"manifest": .., "files": {..}, ...}``), not any COMPLETE.json."""
    if st.st_size > 16 << 20:
        return False
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "manifest" in meta and isinstance(meta.get("files"), dict)


def _scan(src: str, prune: set[str], fp: Fingerprint) -> Found:
    dirs, files, caches = [], [], []
    packages = dict(fp.packages)

    def check_file(path: str, name: str, st: os.stat_result) -> None:
        if _named(name, fp, False):
            files.append(path)
        elif st.st_size in fp.hashes and _sha(path) in fp.hashes[st.st_size]:
            files.append(path)

    try:
        st = os.lstat(src)
    except OSError:
        return Found()
    if not stat.S_ISDIR(st.st_mode):
        if stat.S_ISREG(st.st_mode) and not fp.empty():
            check_file(src, os.path.basename(src), st)
        return Found((), tuple(os.path.relpath(p, src) for p in files), ())
    stack = [src]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            entries = list(it)
        for e in entries:
            if e.path in prune:
                continue
            try:
                est = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(est.st_mode):
                if e.name in CACHE_DIR_NAMES:
                    caches.append(e.path)
                if not fp.empty():
                    if _named(e.name, fp, True):
                        dirs.append(e.path)
                        continue
                    if e.name in packages and _like(e.path, packages[e.name]):
                        dirs.append(e.path)
                        continue
                stack.append(e.path)
            elif stat.S_ISREG(est.st_mode):
                if e.name == ARTIFACT_MARKER and _is_artifact(e.path, est):
                    caches.append(d)
                if not fp.empty():
                    check_file(e.path, e.name, est)
    rel = functools.partial(os.path.relpath, start=src)
    return Found(tuple(map(rel, dirs)), tuple(map(rel, files)), tuple(map(rel, caches)))


# ---------------------------------------------------------------- the interpreter's image

IMAGE_FORMAT = 1  # bump when what an interpreter image holds changes (its key changes with it)
STDLIB_EXTRA = ("lib-dynload", "LICENSE.txt")  # stdlib entries that are no module name
RUNTIME_SCRIPTS = ("pytest", "py.test")  # the task runtime's commands, beside the executable


def stdlib_dir() -> str:
    """The interpreter's standard library directory (real path: where ``os`` comes from)."""
    return os.path.dirname(os.path.realpath(os.__file__))


def stdlib_entry(name: str) -> bool:
    """A top-level entry of the standard library directory the jail shows: a module or package of
    ``sys.stdlib_module_names`` (never ``site-packages``, ``test``, ``config-*``), ``lib-dynload``, the
    ``_sysconfigdata`` module. Anything else there (a copy of a package saved beside the standard library) is not
    shown."""
    names = getattr(sys, "stdlib_module_names", None)
    if names is None:  # Python < 3.10: the modules of the standard library as this interpreter was built
        names = frozenset(sys.builtin_module_names)
    stem = name[:-3] if name.endswith(".py") else name
    if name in STDLIB_EXTRA or (stem.startswith("_sysconfigdata_") and name.endswith(".py")):
        return True
    return stem in names and stem not in ("test", "site-packages") and (name.endswith(".py") or "." not in name)


def _stdlib_pyc(name: str) -> bool:
    """A ``__pycache__`` file of a shown top-level module (``<module>.<tag>[.opt-N].pyc``)."""
    return name.endswith(".pyc") and stdlib_entry(name.split(".", 1)[0] + ".py")


def interpreter_prefix() -> str | None:
    """The base prefix of this interpreter when it is not a system directory the jail binds anyway (/usr): the
    prefix the jail shows as an image (:func:`interpreter_image`); None for a system interpreter."""
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = stdlib_dir()
    if prefix in ("/usr", "/") or not stdlib.startswith(prefix + os.sep):
        return None
    return prefix


def _image_listing(prefix: str) -> list[tuple[str, str]]:
    """(source, path relative to the image) of everything the image copies: the executable and the links to it
    in its directory, the shared libraries of ``<prefix>/lib``, and the shown standard library."""
    out: list[tuple[str, str]] = []
    exe = os.path.realpath(sys.executable)
    if exe.startswith(prefix + os.sep):
        out.append((exe, os.path.relpath(exe, prefix)))
        bindir = os.path.dirname(exe)
        for n in sorted(os.listdir(bindir)):
            p = os.path.join(bindir, n)
            if (os.path.islink(p) and os.path.realpath(p) == exe) or (n in RUNTIME_SCRIPTS and os.path.isfile(p)):
                out.append((p, os.path.relpath(p, prefix)))
    libdir = os.path.join(prefix, "lib")
    if os.path.isdir(libdir):
        for n in sorted(os.listdir(libdir)):
            p = os.path.join(libdir, n)
            if ".so" in n and (os.path.isfile(p) or os.path.islink(p)):
                out.append((p, os.path.relpath(p, prefix)))
    stdlib = stdlib_dir()
    for n in sorted(os.listdir(stdlib)):
        p = os.path.join(stdlib, n)
        if n == "__pycache__":
            out += [(os.path.join(p, f), os.path.relpath(os.path.join(p, f), prefix)) for f in sorted(os.listdir(p))
                    if _stdlib_pyc(f) and os.path.isfile(os.path.join(p, f))]
        elif stdlib_entry(n) and not os.path.islink(p):
            out.append((p, os.path.relpath(p, prefix)))
    return out


def interpreter_image(base: Path) -> Path:
    """The interpreter's image (:func:`_interpreter_image`), made or found once per process."""
    return _interpreter_image(str(base), os.path.realpath(sys.executable))


@functools.lru_cache(maxsize=4)
def _interpreter_image(base: str, executable: str) -> Path:
    """``<base>/runtime/python-<key>``: a copy of what the interpreter needs of its prefix (:func:`_image_listing`),
    with an empty directory at each of its site directories (where the task runtime is bound); built once,
    atomically, like the runtime. The jail binds it over the prefix, so the prefix shows nothing else however late
    something is saved there (the copy is made once; its key changes with the interpreter and the standard
    library's top-level entries)."""
    prefix = interpreter_prefix()
    if prefix is None:
        raise RuntimeError("interpreter_image: this interpreter's prefix is a system directory")
    listing = _image_listing(prefix)
    sig = [[rel, int(os.lstat(src).st_mtime), os.lstat(src).st_size] for src, rel in listing]
    key = hashlib.sha256(json.dumps({"format": IMAGE_FORMAT, "python": os.path.realpath(sys.executable),
                                     "version": sys.version, "prefix": prefix, "listing": sig},
                                    sort_keys=True).encode()).hexdigest()[:20]
    root = Path(base) / "runtime"
    final = root / f"python-{key}"
    done = root / f"python-{key}.complete"
    if done.is_file():
        return final
    root.mkdir(mode=0o755, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".python-{key}-", dir=root))
    try:
        for src, rel in listing:
            dst = work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns("site-packages"))
            else:
                shutil.copy2(src, dst)  # the mtime kept: the copied __pycache__ stays valid
        for s in site_dirs():
            if s.startswith(prefix + os.sep):
                (work / os.path.relpath(s, prefix)).mkdir(parents=True, exist_ok=True)
        for dirpath, dirnames, filenames in os.walk(work):
            os.chmod(dirpath, 0o755)
            for n in filenames:
                p = os.path.join(dirpath, n)
                if not os.path.islink(p):
                    os.chmod(p, 0o755 if os.access(p, os.X_OK) else 0o644)
        os.chmod(work, 0o755)
        try:
            os.rename(work, final)
        except OSError:  # another process made it first
            if not done.is_file():
                raise
        else:
            done.write_text(json.dumps({"prefix": prefix, "entries": len(listing)}) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
