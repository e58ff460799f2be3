"""Run one untrusted shell command (an agent's bash call, a test suite on a patched tree) in a task's private copy.

Every command is a fresh process tree in a jail (:mod:`tracekit.coding._jail`); nothing persists between commands
but the files of the copy. There is no uncontained fallback: where the jail cannot be set up, :func:`run` raises
:class:`JailUnavailable` with one line naming what is missing (:func:`jail_problem`), and the coding target refuses
to run (``tracekit.targets.coding.config.check``, at validation, before any work).

**What the command sees** (an allow-list: nothing of the host is shown unless named here): an empty tmpfs root
into which are bound, read-only, the system's programs and libraries (``/usr/bin``, ``/usr/sbin``, ``/usr/lib*``,
``/usr/libexec``; ``/bin``, ``/lib*``, ``/sbin``: symlinks into ``/usr`` where the host has them so; never
``/usr/local``, ``/usr/share``, ``/usr/src`` or ``/usr/include``, of which only the files of
:data:`USR_SHARE_KEPT` are bound, file by file), a few loader files of ``/etc`` (``ld.so.cache``,
``alternatives``, ...; ``passwd``, ``group``, ``hosts`` are generated: root and nobody only),
``/dev/{null,zero,full,random,urandom}``, the interpreter (:func:`_interpreter_view`): its base prefix as an
*image* tracekit copied once (the executable and its links, the prefix's shared libraries, the standard library's
own top-level entries: :func:`tracekit.coding.runtime.interpreter_image`), a venv's ``pyvenv.cfg`` and
``bin/python*`` file by file, and at every site directory the *task runtime* (pytest and its requirements, copied
into a directory tracekit owns: :mod:`tracekit.coding.runtime`; nothing else installed shows, so neither does the
package a task was made from), and what the caller names (``read_only``: tracekit's pytest plugin, a patch file;
``protected``: test directories of the copy); writable: its own task copy (and ``writable``: a results directory);
fresh size-limited tmpfs on ``/tmp``, ``/var/tmp``, ``/dev/shm``; a fresh procfs of its own PID namespace. Nothing
else exists for it: not the stage cache (gold patches, hidden tests), not the host checkout, not the host /proc,
not $HOME (the path to a prefix under it holds only the image), not a copy of a package saved anywhere in the
interpreter's prefix or beside the standard library (the image is a copy of named entries: what is saved there
later never shows), not sibling task copies (only its own directory under :func:`work_root` is bound), not a host
unix socket (filesystem sockets are not bound; abstract ones belong to the network namespace). Where the checkout,
$HOME or the work root lies inside a bound directory it is covered by an empty read-only tmpfs
(:func:`secret_paths`), as is a cache inside a directory the caller binds. A tracekit cache or root
(``$TRACEKIT_CACHE``, ``$TRACEKIT_ROOT``, the working directory's ``outputs``, a ``paths.cache_dir`` registered by
the task generator: :func:`register_cache`) inside a directory bound for every command (:func:`system_binds`), or a
task cache (``coding_tasks``) or stage artifact met in any bound directory, is refused: :class:`CacheExposed`, one
line naming the path and the bound directory. ``hide`` (a task's package): the scan stays as a second line over the
directories still bound whole (the system directories, the image, the caller's): every copy of the package it
recognises there (source trees, ``.dist-info``, wheels, files equal to its files) is covered too
(:func:`tracekit.coding.runtime.scan`). Network: a fresh network namespace (no interface up). The root is remounted
read-only and nothing is mounted with suid or device nodes (but /dev's).

**Who runs it** (``isolation()["mode"]``): as root (``root``) the command runs as ``nobody``, owner of its copy
only; otherwise (``userns``) the jail is built in a user namespace where the caller is root, and the command runs
in a second, nested user namespace, so it has no capability over the jail's mounts (it cannot unmount the root or
remount a bind writable) and cannot create setuid files. Either way: no new privileges, no core files.

**Limits.** CPU: ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL). Wall: a deadline; past it the whole PID namespace dies
(background and daemonized processes too). One file: ``RLIMIT_FSIZE`` (it also bounds the captured output). One
allocation: ``RLIMIT_AS`` per process (a clean ``MemoryError``). Per episode (all processes of the command at once;
no process outlives its command, so this bounds everything of the episode that can run at the same time):

- ``accounting() == "cgroup2"``: a cgroup v2 per command under the process's own cgroup, where it is delegated
  (writable, with ``memory`` and ``pids`` in ``cgroup.subtree_control``): ``memory.max`` (swap 0) and ``pids.max``.
- ``"cgroup1"``: where cgroup v2 has no memory/pids controllers for this process but the v1 ``memory`` and ``pids``
  hierarchies are writable (root on a hybrid host, such as the machines this was written on: v2 mounted at
  ``/sys/fs/cgroup/unified`` with ``hugetlb`` only): ``memory.limit_in_bytes`` (+ ``memsw``) and ``pids.max``.
- ``"watchdog"`` (no usable cgroup, e.g. not root without delegation): the jail's PID 1 sums the resident memory
  of every process of the namespace plus its tmpfs usage every 50 ms and kills the namespace over the limit (an
  overshoot of at most one interval of allocation); processes: ``RLIMIT_NPROC`` inside the command's own user
  namespace (counted per namespace since Linux 5.14, so it bounds this command's processes, not the uid's).
  ``TRACEKIT_SANDBOX_ACCOUNTING=cgroup2|cgroup1|watchdog`` forces one (refused in one line where it cannot work).

Disk, per episode: as root a :class:`~tracekit.targets.coding.repo.Workspace`'s copy is a tmpfs of its initial size plus
``disk_bytes`` (:func:`bounded_dir`): writes past it fail with ``No space left on device`` across all the
episode's commands; otherwise the watchdog polls the size of the writable paths and kills the command over it.

A command that hits a limit is never an exception: :class:`CommandResult` says what happened (``events``:
``wall_time``, ``cpu_time``, ``killed``, ``memory``, ``processes``, ``disk``, ``file_size``, ``network_blocked``,
``write_denied``, ``output_truncated``) and the caller (the episode, the test runner) records and counts it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import marshal
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tracekit.coding import runtime

NOBODY = 65534
JAIL = Path(__file__).with_name("_jail.py")
ACCOUNTINGS = ("cgroup2", "cgroup1", "watchdog")
# the system's programs and libraries: of /usr only these (not /usr/local, /usr/share, /usr/src, /usr/include)
SYSTEM_DIRS = ("/usr/bin", "/usr/sbin", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/usr/libexec",
               "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
USR_SHARE_KEPT = ("misc/magic.mgc",)  # of /usr/share only these files (``file``'s database)
ETC_KEPT = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "protocols", "services",
            "mime.types", "magic", "magic.mime")
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_MADE = {
    "passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/tmp:/bin/sh\n",
    "group": "root:x:0:\nnogroup:x:65534:\n",
    "hosts": "127.0.0.1 localhost\n::1 localhost\n",
    "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
}
COPY_INODES = 50_000  # files and directories an episode may add to its copy


@dataclass(frozen=True)
class CommandLimits:
    cpu_seconds: int = 30
    wall_seconds: float = 60.0
    memory_bytes: int = 2 << 30  # all processes of the command together (and each one's address space)
    file_bytes: int = 64 << 20
    processes: int = 128  # all processes of the command together
    output_chars: int = 8000  # what the agent sees: head and tail of the combined stdout/stderr
    disk_bytes: int = 512 << 20  # what an episode may add to its copy (and each private /tmp's size)

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "file_bytes", "processes", "output_chars",
                     "disk_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CommandLimits.{name} must be > 0, got {getattr(self, name)}")


class JailUnavailable(RuntimeError):
    """The jail cannot be set up on this machine (one line naming what is missing); nothing ran."""

    infra = True  # the sandbox's failure, not the agent's command's: tracekit.envs.base.infra_cause (retried)


@dataclass
class CommandResult:
    command: str
    returncode: int | None  # None: killed at the wall-time limit
    output: str  # combined stdout + stderr, truncated to the limit (head and tail kept)
    wall_s: float
    events: list[str] = field(default_factory=list)
    mode: str = "root"

    @property
    def contained(self) -> bool:
        """A limit or a containment rule acted on this command."""
        return any(e != "output_truncated" for e in self.events)

    def to_dict(self) -> dict:
        return asdict(self)

    def for_agent(self) -> str:
        """The tool message text: output, exit status and what the sandbox did."""
        status = "killed: wall-time limit" if self.returncode is None else f"exit code {self.returncode}"
        notes = [e for e in self.events if e != "output_truncated"]
        tail = f" [sandbox: {', '.join(notes)}]" if notes else ""
        return f"{self.output}\n[{status}]{tail}" if self.output else f"[{status}]{tail}"


def mode() -> str:
    """``root`` (the command runs as nobody) or ``userns`` (built in a user namespace of the caller)."""
    return "root" if os.geteuid() == 0 else "userns"


# ---------------------------------------------------------------- accounting (memory and processes per command)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root, mount point, fs type, super options) of every mount of this process."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            a, b = left.split(), right.split()
            if len(a) >= 5 and len(b) >= 3:
                out.append((a[3], a[4].replace("\\040", " "), b[0], b[2]))
    return out


def _own_cgroups() -> dict[str, str]:
    """controller (``""`` for v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _under(mount_root: str, mount_point: str, path: str) -> str | None:
    rel = os.path.relpath(path, mount_root)
    return None if rel.startswith("..") else os.path.normpath(os.path.join(mount_point, rel))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _counter(text: str, key: str) -> int:
    m = re.search(rf"^{key} (\d+)$", text, re.M)
    return int(m.group(1)) if m else 0


_SEQ = itertools.count()


class Accounting:
    """Per-command cgroups (``dirs``: where each is made) or none (``watchdog``)."""

    def __init__(self, name: str, dirs: dict[str, str], why: str):
        self.name, self.dirs, self.why = name, dirs, why

    def describe(self) -> dict[str, str]:
        if self.name == "cgroup2":
            return {"memory": "cgroup v2 memory.max per command (all its processes; swap 0) + RLIMIT_AS per process",
                    "processes": "cgroup v2 pids.max per command"}
        if self.name == "cgroup1":
            return {"memory": "cgroup v1 memory.limit_in_bytes (+memsw) per command (all its processes) + "
                              "RLIMIT_AS per process",
                    "processes": "cgroup v1 pids.max per command"}
        return {"memory": "watchdog: RSS of every process of the command's PID namespace + its tmpfs, polled "
                          "every 50 ms, killed over the limit; + RLIMIT_AS per process",
                "processes": "RLIMIT_NPROC inside the command's own user namespace (per command)"}

    def create(self, limits: CommandLimits) -> list[str]:
        """The command's cgroup directories (limits written), or [] for the watchdog."""
        made = []
        try:
            for kind, base in self.dirs.items():
                d = os.path.join(base, f"tracekit-{os.getpid()}-{next(_SEQ)}")
                os.mkdir(d)
                made.append(d)
                if self.name == "cgroup2":
                    _put(d, "memory.max", limits.memory_bytes)
                    if os.path.exists(os.path.join(d, "memory.swap.max")):
                        _put(d, "memory.swap.max", 0)
                    _put(d, "pids.max", limits.processes)
                elif kind == "memory":
                    _put(d, "memory.limit_in_bytes", limits.memory_bytes)
                    if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                        _put(d, "memory.memsw.limit_in_bytes", limits.memory_bytes)
                else:
                    _put(d, "pids.max", limits.processes)
        except OSError as e:
            self.remove(made)
            raise JailUnavailable(f"coding sandbox: cannot make the command's cgroup under {base} "
                                  f"({self.name}): {e.strerror}") from None
        return made

    def events(self, dirs: list[str]) -> list[str]:
        out = []
        for d in dirs:
            if self.name == "cgroup2":
                if _counter(_read(os.path.join(d, "memory.events")), "oom_kill"):
                    out.append("memory")
                if _counter(_read(os.path.join(d, "pids.events")), "max"):
                    out.append("processes")
            elif os.path.exists(os.path.join(d, "memory.oom_control")):
                if _counter(_read(os.path.join(d, "memory.oom_control")), "oom_kill"):
                    out.append("memory")
            elif _counter(_read(os.path.join(d, "pids.events")), "max"):
                out.append("processes")
        return out

    def kill(self, dirs: list[str]) -> None:
        for d in dirs:
            if os.path.exists(os.path.join(d, "cgroup.kill")):
                try:
                    _put(d, "cgroup.kill", 1)
                    continue
                except OSError:
                    pass
            for pid in _read(os.path.join(d, "cgroup.procs")).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def remove(self, dirs: list[str]) -> None:
        for d in dirs:
            for attempt in range(100):  # the namespace's processes are reaped asynchronously
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if attempt == 20:
                        self.kill([d])
                    time.sleep(0.01)


def _put(d: str, name: str, value: object) -> None:
    with open(os.path.join(d, name), "w") as f:
        f.write(str(value))


def _probe_dirs(name: str, dirs: dict[str, str]) -> str | None:
    """None if a child cgroup can be made (and removed) in each of ``dirs``, else why not."""
    acc = Accounting(name, dirs, "")
    try:
        acc.remove(acc.create(CommandLimits()))
    except JailUnavailable as e:
        return str(e).split(": ", 1)[-1]
    return None


def _find_cgroup2() -> tuple[dict[str, str] | None, str]:
    own = _own_cgroups().get("")
    mounts = [(r, p) for r, p, t, _ in _mounts() if t == "cgroup2"]
    if own is None or not mounts:
        return None, "no cgroup v2 for this process"
    for root, point in mounts:
        base = _under(root, point, own)
        if base is None or not os.path.isdir(base):
            continue
        have = set(_read(os.path.join(base, "cgroup.controllers")).split())
        if not {"memory", "pids"} <= have:
            return None, f"cgroup v2 at {base} has no memory/pids controllers ({' '.join(sorted(have)) or 'none'})"
        enabled = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
        if not {"memory", "pids"} <= enabled:
            try:
                _put(base, "cgroup.subtree_control", "+memory +pids")
            except OSError as e:
                return None, (f"cgroup v2 at {base} does not delegate memory/pids to child cgroups "
                              f"(cgroup.subtree_control: {e.strerror})")
        why = _probe_dirs("cgroup2", {"": base})
        return (None, f"cgroup v2 at {base}: {why}") if why else ({"": base}, f"cgroup v2 delegated at {base}")
    return None, "this process's cgroup v2 directory is not mounted"


def _find_cgroup1() -> tuple[dict[str, str] | None, str]:
    own = _own_cgroups()
    dirs = {}
    for ctrl in ("memory", "pids"):
        for root, point, fstype, opts in _mounts():
            if fstype == "cgroup" and ctrl in opts.split(",") and ctrl in own:
                base = _under(root, point, own[ctrl])
                if base and os.path.isdir(base):
                    dirs[ctrl] = base
                    break
        if ctrl not in dirs:
            return None, f"no cgroup v1 {ctrl} hierarchy for this process"
    why = _probe_dirs("cgroup1", dirs)
    if why:
        return None, f"cgroup v1 memory/pids not writable ({why})"
    return dirs, f"cgroup v1 memory at {dirs['memory']}, pids at {dirs['pids']}"


def accounting() -> Accounting:
    """How memory and processes are bounded per command here (see the module docstring); JailUnavailable when a
    forced ``TRACEKIT_SANDBOX_ACCOUNTING`` cannot work."""
    return _accounting(os.environ.get("TRACEKIT_SANDBOX_ACCOUNTING", "").strip())


@functools.cache
def _accounting(forced: str) -> Accounting:
    if forced and forced not in ACCOUNTINGS:
        raise JailUnavailable(f"coding sandbox: TRACEKIT_SANDBOX_ACCOUNTING={forced!r} is not one of "
                              f"{', '.join(ACCOUNTINGS)}")
    notes = []
    for name, find in (("cgroup2", _find_cgroup2), ("cgroup1", _find_cgroup1)):
        if forced and forced != name:
            continue
        try:
            dirs, why = find()
        except OSError as e:
            dirs, why = None, f"cannot read the cgroups: {e}"
        if dirs:
            return Accounting(name, dirs, "; ".join([*notes, why]))
        if forced:
            raise JailUnavailable(f"coding sandbox: TRACEKIT_SANDBOX_ACCOUNTING={forced}: {why}")
        notes.append(why)
    why = "forced" if forced else "; ".join(notes)
    return Accounting("watchdog", {}, why)


# ---------------------------------------------------------------- the view


def _real(p: str | os.PathLike) -> str:
    return os.path.realpath(os.path.abspath(p))


def _inside(path: str, directory: str) -> bool:
    return directory == "/" or path == directory or path.startswith(directory.rstrip("/") + "/")


def _unreadable_prefix() -> str | None:
    """As root the command runs as nobody: a prefix nobody cannot read (a venv made with umask 077) cannot run."""
    if mode() != "root":
        return None
    for p in interpreter_paths():
        if os.stat(p).st_mode & 0o005 != 0o005:
            return (f"the interpreter's prefix {p} is not readable by the sandbox user nobody "
                    f"(mode {os.stat(p).st_mode & 0o777:o}): chmod o+rx it, or use an interpreter installed elsewhere")
    return None


def interpreter_paths() -> list[str]:
    """The directories the interpreter of ``python`` in a command needs: the prefixes of this interpreter (a venv
    and its base), and the Nix store when it comes from there."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    exe = os.path.realpath(sys.executable)
    paths.append(os.path.dirname(os.path.dirname(exe)))
    if exe.startswith("/nix/store/"):
        paths.append("/nix/store")
    return [p for p in dict.fromkeys(os.path.abspath(p) for p in paths) if p and os.path.isdir(p)]


def checkout_root() -> str | None:
    """tracekit's source checkout (it holds ``outputs/``), or None when tracekit is installed into site-packages."""
    top = Path(__file__).resolve().parents[2]
    return str(top) if (top / "pyproject.toml").exists() or (top / "conf").is_dir() else None


class CacheExposed(JailUnavailable):
    """A tracekit cache or root lies inside a directory the jail binds for every command (one line naming both);
    nothing ran."""


_CACHES: dict[str, str] = {}  # real path -> how it was named (paths.cache_dir of a coding task set)


def register_cache(path: str | os.PathLike, label: str = "paths.cache_dir") -> None:
    """Note a cache directory this process uses (``paths.cache_dir``, passed by the task generator): every command
    refuses to start while it lies inside a directory the jail binds; refused now (:class:`CacheExposed`) if it
    does already (it need not exist yet)."""
    real = _real(path)
    _CACHES[real] = label
    problem = _exposed([(label, real)], system_binds())
    if problem:
        raise CacheExposed(problem)


def known_caches() -> list[tuple[str, str]]:
    """(how it is named, real path) of every tracekit cache or root this process knows: ``$TRACEKIT_CACHE``,
    ``$TRACEKIT_ROOT`` (and its ``outputs``), the working directory's ``outputs`` (the default root), and the
    caches registered by :func:`register_cache`."""
    out = []
    if os.environ.get("TRACEKIT_CACHE"):
        out.append(("TRACEKIT_CACHE", os.environ["TRACEKIT_CACHE"]))
    if os.environ.get("TRACEKIT_ROOT"):
        out += [("TRACEKIT_ROOT", os.environ["TRACEKIT_ROOT"]),
                ("TRACEKIT_ROOT's outputs", os.path.join(os.environ["TRACEKIT_ROOT"], "outputs"))]
    out.append(("the working directory's outputs", os.path.join(os.getcwd(), "outputs")))
    out += [(label, p) for p, label in _CACHES.items()]
    return [(label, _real(p)) for label, p in out]


def secret_paths() -> list[str]:
    """What a command must never see even where a bound directory holds it: the stage cache, tracekit's
    ``outputs``, the checkout, the work root (sibling copies), $HOME. (A cache or root inside a directory the jail
    binds for every command is refused, not covered: :func:`system_binds`.)"""
    out = [p for _, p in known_caches()]
    top = checkout_root()
    if top:
        out.append(top)
    out.append(str(work_root()))
    if os.environ.get("HOME"):
        out.append(os.environ["HOME"])
    return [p for p in dict.fromkeys(_real(p) for p in out) if os.path.isdir(p)]


def system_binds() -> list[str]:
    """What every command's jail binds, whatever the caller asks (real paths): /usr and the library directories,
    the loader files of /etc, the interpreter's prefixes, the task runtime. No tracekit cache or root may lie
    inside one (refused: :class:`CacheExposed`)."""
    out = [_real(d) for d in SYSTEM_DIRS if not os.path.islink(d) and os.path.isdir(d)]
    out += [_real(f"/etc/{n}") for n in _etc_names() if not os.path.islink(f"/etc/{n}") and
            os.path.exists(f"/etc/{n}")]
    out += [_real(p) for p in interpreter_paths() if _real(p) == "/nix/store"]
    out.append(_real(work_root() / "runtime"))  # the task runtime and the interpreter's image
    return list(dict.fromkeys(out))


def _exposed(named: list[tuple[str, str]], bound: list[str]) -> str | None:
    """The refusal line for the first cache or root of ``named`` inside a directory of ``bound``, else None."""
    for label, p in named:
        for b in bound:
            if _inside(p, b):
                return (f"coding sandbox: refused: the tracekit cache or root {p} ({label}) lies inside {b}, which "
                        "the jail binds read-only into every command (an agent could read the gold patches and "
                        f"hidden tests there): move it outside {b}")
    return None


def _etc_names() -> tuple[str, ...]:
    return ETC_KEPT + tuple(sorted(n for n in os.listdir("/etc") if n.startswith("python3")))


def _bind(src: str, dst: str, rw: bool, dev: bool = False) -> dict:
    return {"kind": "bind", "src": src, "dst": dst, "rw": rw, **({"dev": True} if dev else {})}


def _tmpfs(dst: str, size: int, rw: bool = True, mode: str = "1777", inodes: int = 65536) -> dict:
    return {"kind": "tmpfs", "dst": dst, "size": size, "rw": rw, "mode": mode, "inodes": inodes}


def _targets(p: str | os.PathLike) -> list[str]:
    return list(dict.fromkeys([os.path.normpath(os.path.abspath(p)), _real(p)]))


def _at(m: dict, src: str, origin: str | None = None) -> str:
    """Where ``src`` (inside ``origin``: ``m["src"]``, or the host directory an image stands for) appears in the
    jail through bind ``m``."""
    return os.path.normpath(m["dst"] + "/" + os.path.relpath(src, origin or m["src"]))


def _interpreter_view(system_dirs: list[str]) -> list[dict]:
    """The interpreter's binds (nothing of a prefix is bound as a directory): the base prefix as its image
    (:func:`tracekit.coding.runtime.interpreter_image`: the executable, its shared libraries, the standard library;
    ``host``: the prefix it stands for); a venv's ``pyvenv.cfg`` and the ``python*`` of its ``bin``, file by file.
    A prefix inside a system directory (a system Python in /usr) is shown by that directory; the Nix store is bound
    as it is."""
    out: list[dict] = []
    image_prefix = runtime.interpreter_prefix()
    for p in interpreter_paths():
        real = _real(p)
        if any(_inside(real, d) for d in system_dirs):
            continue
        if real == "/nix/store":
            out.append(_bind(real, p, False))
        elif real == image_prefix:
            image = str(runtime.interpreter_image(work_root()))
            out += [{**_bind(image, t, False), "host": real} for t in _targets(p)]
        else:  # a venv (or another prefix): what starts its interpreter
            cfg = os.path.join(p, "pyvenv.cfg")
            files = [cfg] if os.path.isfile(cfg) else []
            bindir = os.path.join(p, "bin")
            if os.path.isdir(bindir):
                files += [os.path.join(bindir, n) for n in sorted(os.listdir(bindir))
                          if n.startswith("python") and os.path.isfile(os.path.join(bindir, n))
                          and os.access(os.path.join(bindir, n), os.X_OK)]
            out += [_bind(_real(f), f, False) for f in files]  # (a link's target, bound as a file: /tmp is a tmpfs)
    return out


def view(cwd: Path, limits: CommandLimits, read_only=(), writable=(), hide: tuple[str, ...] = (),
         probe: bool = False, protected=()) -> tuple[list[dict], list[list[str]]]:
    """(mounts in the order the jail makes them, symlinks) for a command in ``cwd``; ``hide``: distributions whose
    every copy is covered (a task's package, :mod:`tracekit.coding.runtime`). :class:`CacheExposed` when a tracekit
    cache or root lies inside a directory bound for every command (not for ``probe``: tracekit's own command that
    checks the jail starts on this machine, which neither refuses nor scans)."""
    mounts: list[dict] = []
    links: list[list[str]] = []
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            links.append([d, os.readlink(d)])
        elif os.path.isdir(d):
            mounts.append(_bind(_real(d), d, False))
    for name in _etc_names():
        p = f"/etc/{name}"
        if os.path.islink(p):
            links.append([p, os.readlink(p)])
        elif os.path.exists(p):
            mounts.append(_bind(_real(p), p, False))
    for name in USR_SHARE_KEPT:
        p = f"/usr/share/{name}"
        if os.path.isfile(p):
            mounts.append(_bind(_real(p), p, False))
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            mounts.append(_bind(f"/dev/{name}", f"/dev/{name}", True, dev=True))
    links += [["/dev/fd", "/proc/self/fd"], ["/dev/stdin", "/proc/self/fd/0"], ["/dev/stdout", "/proc/self/fd/1"],
              ["/dev/stderr", "/proc/self/fd/2"]]
    if _needs_shim():  # a system python3 with no `python` beside it (a venv's own `python` is never shimmed)
        links.append([f"{SHIM_DIR}/python", sys.executable])
    tmp_size = limits.disk_bytes
    mounts += [_tmpfs("/tmp", tmp_size), _tmpfs("/var/tmp", tmp_size), _tmpfs("/dev/shm", tmp_size)]
    system_dirs = [m["src"] for m in mounts if m["kind"] == "bind" and not m.get("dev")]
    prefixes = _interpreter_view(system_dirs)
    system = [m for m in mounts if m["kind"] == "bind" and not m.get("dev")] + prefixes  # bound for every command
    extra = [_bind(_real(p), t, False) for p in map(str, read_only) for t in _targets(p)]  # the caller's
    mounts += prefixes + extra
    # the interpreter's site directories, wherever a bind shows them or in its prefixes: the task runtime instead
    # (nothing installed but what a test run needs; never the package a task was made from)
    hide = tuple(sorted({runtime.normalize(h) for h in hide}))
    rt = runtime.runtime_dir(work_root(), hide)
    at = set()
    own = [_real(p) for p in interpreter_paths()]
    for s in runtime.site_dirs():
        at |= {_at(m, s, m.get("host", m["src"])) for m in system + extra if _inside(s, m.get("host", m["src"]))}
        if any(_inside(s, p) for p in own):
            at.add(s)
    replaced = [_bind(_real(rt), t, False) for t in sorted(at)]
    mounts += replaced
    for p in [cwd, *writable]:
        for t in _targets(p):
            mounts.append(_bind(_real(p), t, True))
    for p in protected:  # read-only over the writable copy (the task's own files: never scanned, never masked)
        for t in _targets(p):
            mounts.append({**_bind(_real(p), t, False), "own": True})
    binds = [m for m in mounts if m["kind"] == "bind" and not m.get("dev")]
    if not probe:  # a cache or root where every command sees it: refused, not covered (it may be anywhere in it)
        problem = _exposed([(label, p) for label, p in known_caches() if os.path.exists(p)],
                           [m["src"] for m in system])
        if problem:
            raise CacheExposed(problem)
    # masks: a secret inside a bound directory (not one that is itself bound) is covered
    bound = {m["dst"] for m in binds}
    under_runtime = [m["dst"] for m in replaced]
    secrets = secret_paths()
    for s in secrets:
        for m in binds:
            if s != m["src"] and _inside(s, m["src"]):
                dst = _at(m, s)
                if dst not in bound and not any(_inside(dst, r) for r in under_runtime):
                    mounts.append(_tmpfs(dst, 1 << 20, rw=False, mode="0755", inodes=4096))
    masks = [m["dst"] for m in mounts if m["kind"] == "tmpfs" and not m["rw"]] + under_runtime

    def covered(m: dict) -> bool:  # a read-only bind already visible through a shallower one
        if m["kind"] != "bind" or m["rw"] or m.get("dev") or m["src"] != m["dst"]:
            return False
        return any(o is not m and o["kind"] == "bind" and not o["rw"] and o["src"] == o["dst"]
                   and o["dst"] != m["dst"] and _inside(m["dst"], o["dst"])
                   and not any(_inside(k, o["dst"]) and _inside(m["dst"], k) for k in masks) for o in mounts)

    out, seen = [], set()
    for m in mounts:
        if m["dst"] in seen or covered(m):
            continue
        seen.add(m["dst"])
        out.append(m)
    if not probe:
        out += _scan_masks(out, hide, secrets)
    out.sort(key=lambda m: m["dst"].rstrip("/").count("/"))
    return out, links


def _scan_masks(mounts: list[dict], hide: tuple[str, ...], secrets: list[str]) -> list[dict]:
    """Masks over every copy of a hidden distribution in the read-only binds (:func:`tracekit.coding.runtime.scan`);
    :class:`CacheExposed` for a task cache met there (one not covered already)."""
    fp = runtime.fingerprint(hide)
    ro = [m for m in mounts if m["kind"] == "bind" and not m["rw"] and not m.get("dev") and not m.get("own")]
    host_points = [p for _, p, _, _ in _mounts()]
    empty = None
    out: list[dict] = []
    for m in ro:
        src = m["src"]
        # not walked: what other mounts of the jail cover (the runtime over a site directory, masks, deeper binds)
        # and what a bind does not carry (the host's mounts below it: binds are not recursive)
        prune = {src + "/" + os.path.relpath(o["dst"], m["dst"]) for o in mounts
                 if o is not m and o["dst"] != m["dst"] and _inside(o["dst"], m["dst"])}
        prune |= {p for p in host_points if p != src and _inside(p, src)}
        prune |= {s for s in secrets if s != src and _inside(s, src)}
        found = runtime.scan(src, tuple(sorted(prune)), fp)
        if found.caches:
            where = os.path.join(src, found.caches[0])
            raise CacheExposed(f"coding sandbox: refused: a tracekit cache {where} lies inside {src}, which the "
                               "jail binds read-only into commands (an agent could read the gold patches and hidden "
                               f"tests there): move it outside {src}")
        for rel in found.dirs:
            out.append({**_tmpfs(_at(m, os.path.join(src, rel)), 1 << 20, rw=False, mode="0755", inodes=4096),
                        "optional": True})
        for rel in found.files:
            empty = empty or str(runtime.empty_file(work_root()))
            out.append({**_bind(empty, _at(m, os.path.join(src, rel)), False), "optional": True})
    return out


# ---------------------------------------------------------------- work directories and bounded copies


@functools.cache
def _work_root(env: str | None, root_mode: bool) -> Path:
    if env:
        root = Path(env)
    elif root_mode:
        root = Path("/var/lib/tracekit-coding")
    else:
        root = Path(tempfile.gettempdir()) / f"tracekit-coding-{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)
    if root_mode:
        _sweep_stale(root)
    return root


def work_root() -> Path:
    """Where task copies live: ``$TRACEKIT_CODING_WORKDIR``, else (root) ``/var/lib/tracekit-coding``, else the temp
    directory. Commands see only their own directory of it."""
    return _work_root(os.environ.get("TRACEKIT_CODING_WORKDIR"), mode() == "root")


def new_workdir(prefix: str) -> Path:
    """A fresh directory under :func:`work_root` (its name carries this process's pid: a copy left mounted by a
    process that died is swept by the next one)."""
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=work_root()))
    os.chmod(path, 0o711)
    return path


_BOUNDED: dict[str, int] = {}  # real path -> bytes the directory may hold (a tmpfs of that size, as root)
_libc = ctypes.CDLL(None, use_errno=True)


def bounded_dir(path: Path, size_bytes: int, inodes: int) -> bool:
    """Bound what ``path`` (an empty directory) may hold: as root a tmpfs of ``size_bytes`` and ``inodes`` (writes
    past it fail, whoever writes); otherwise the watchdog of every command that may write there. True if a tmpfs."""
    real = _real(path)
    _BOUNDED[real] = size_bytes
    if mode() != "root":
        return False
    opts = f"size={size_bytes},nr_inodes={inodes},mode=0755".encode()
    if _libc.mount(b"tmpfs", real.encode(), b"tmpfs", 2 | 4, opts) != 0:  # MS_NOSUID | MS_NODEV
        n = ctypes.get_errno()
        _BOUNDED.pop(real, None)
        raise JailUnavailable(f"coding sandbox: cannot mount a tmpfs for the task copy at {real}: {os.strerror(n)}")
    return True


def release_dir(path: Path) -> None:
    """Undo :func:`bounded_dir` (unmount the tmpfs; its files are gone)."""
    real = _real(path)
    if _BOUNDED.pop(real, None) is not None and mode() == "root":
        _libc.umount2(real.encode(), 2)  # MNT_DETACH


def _sweep_stale(root: Path) -> None:
    """Unmount and remove copies under ``root`` whose process (the pid in their name) is gone."""
    try:
        points = [p for _, p, t, _ in _mounts() if t == "tmpfs" and _inside(p, str(root)) and p != str(root)]
    except OSError:
        return
    for p in points:
        m = re.match(r"[a-z]+-(\d+)-", Path(p).relative_to(root).parts[0])
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _libc.umount2(p.encode(), 2)
            shutil.rmtree(root / Path(p).relative_to(root).parts[0], ignore_errors=True)


def give_to_sandbox(path: Path) -> None:
    """Make ``path`` (a task copy, a results directory) the sandbox user's, so commands may write there only (as
    root: ``nobody``; in a user namespace the caller's own files are the command's already)."""
    if mode() != "root":
        return
    os.chown(path, NOBODY, NOBODY)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), NOBODY, NOBODY)


SHIM_DIR = "/opt/tracekit/bin"  # in the jail: ``python`` for an interpreter installed as ``python3`` only


def _needs_shim() -> bool:
    return not os.path.exists(os.path.join(os.path.dirname(sys.executable), "python"))


def scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    shim = [SHIM_DIR] if _needs_shim() else []
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable), *shim, "/usr/local/bin", "/usr/bin",
                                          "/bin"]))
    env = {"PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "GIT_CONFIG_NOSYSTEM": "1",
           # pytest without the host's installed plugins (they are not the package's and take seconds to load)
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(extra or {})
    return env


# ---------------------------------------------------------------- running a command

_PATTERNS = {
    "network_blocked": re.compile(r"Network is unreachable|Temporary failure in name resolution|"
                                  r"Name or service not known|Cannot assign requested address|Connection refused"),
    "write_denied": re.compile(r"Permission denied|Read-only file system|Operation not permitted"),
    "processes": re.compile(r"Resource temporarily unavailable|fork: retry|Cannot fork|can't fork"),
    "memory": re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|memory exhausted"),
    "disk": re.compile(r"No space left on device|Disk quota exceeded"),
    "file_size": re.compile(r"File too large"),
}


def _truncate(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}", True


def _spec(cwd: Path, limits: CommandLimits, read_only, writable, acc: Accounting, cgroups: list[str],
          status_fd: int, hide: tuple[str, ...] = (), probe: bool = False, protected=()) -> dict:
    mounts, links = view(cwd, limits, read_only, writable, hide, probe, protected)
    root = mode() == "root"
    watch: dict = {}
    if acc.name == "watchdog":
        watch["memory"] = limits.memory_bytes
    unbounded = [str(p) for p in [cwd, *writable] if not (root and _real(p) in _BOUNDED)]
    if unbounded:  # no tmpfs bounds these: the watchdog does (what a Workspace may hold, else growth from now)
        budget = 0
        for p in unbounded:
            budget += _BOUNDED.get(_real(p)) or (_tree_bytes(Path(p)) + limits.disk_bytes)
        watch.update(disk=budget, disk_paths=unbounded, disk_inodes=COPY_INODES * 4)
    return {"mode": mode(), "cwd": str(cwd), "mounts": mounts, "symlinks": links, "etc": ETC_MADE,
            "cgroup_procs": [os.path.join(d, "cgroup.procs") for d in cgroups],
            "limits": {"cpu": limits.cpu_seconds, "memory": limits.memory_bytes, "file": limits.file_bytes,
                       "nproc": limits.processes if acc.name == "watchdog" else None},
            "command_userns": acc.name == "watchdog" or not root, "watch": watch,
            "deadline_s": limits.wall_seconds + 2.0, "status_fd": status_fd}


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def _read_status(fd: int) -> list[str]:
    chunks, deadline = [], time.monotonic() + 5.0
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        data = os.read(fd, 65536)
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks).decode("utf-8", "replace").splitlines()


def _jail_run(argv: list[str], cwd: Path, limits: CommandLimits, env: dict[str, str] | None, read_only, writable,
              hide: tuple[str, ...] = (), probe: bool = False, protected=(),
              pass_fds: tuple[int, ...] = ()) -> tuple[int | None, bytes, list[str], float]:
    """(exit status or None at the wall limit, raw output, events, wall seconds); JailUnavailable if it cannot
    start (CacheExposed: a cache or root where the command would see it)."""
    acc = accounting()
    spec = _spec(cwd, limits, read_only, writable, acc, [], -1, hide, probe, protected)  # may refuse: nothing made
    cgroups = acc.create(limits) if acc.dirs else []
    r, w = os.pipe()
    spec["cgroup_procs"] = [os.path.join(d, "cgroup.procs") for d in cgroups]
    spec["status_fd"] = w
    events: list[str] = []
    try:
        full = [sys.executable, "-I", "-S", "-B", str(JAIL), marshal.dumps(spec).hex(), "--", *argv]
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(full, cwd="/", stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=scrubbed_env(env), start_new_session=True, pass_fds=(w, *pass_fds))
            os.close(w)
            w = -1
            try:
                rc: int | None = _wait(proc, limits.wall_seconds)
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                acc.kill(cgroups)
                proc.wait()
                rc = None
                events.append("wall_time")
            wall = time.monotonic() - t0
            status = _read_status(r)
            out.seek(0)
            raw = out.read(limits.file_bytes + 1)
        events += [line.split(" ", 1)[1] for line in status if line.startswith("event ")]
        events += [e for e in acc.events(cgroups) if e not in events]
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        acc.remove(cgroups)
    if "ready" not in status:
        errors = [line.split(" ", 1)[1] for line in status if line.startswith("error ")]
        text = raw.decode("utf-8", "replace").strip().splitlines()
        why = errors[0] if errors else (text[-1] if text else f"it exited {rc} before it was ready")
        raise JailUnavailable(f"coding sandbox: the jail cannot start here: {why}")
    return rc, raw, events, wall


@functools.cache
def _problem(forced: str, user: int, cwd: str) -> str | None:
    unreadable = _unreadable_prefix()
    if unreadable:
        return f"coding sandbox: {unreadable}"
    holder = new_workdir("probe-")
    try:
        give_to_sandbox(holder)
        rc, raw, _, _ = _jail_run(["python", "-c", "import sys"], holder, CommandLimits(wall_seconds=20), None, (),
                                  (), probe=True)  # the machine's problem, not where this run keeps its cache
        if rc != 0:
            said = " ".join(raw.decode("utf-8", "replace").split())[-300:]
            return f"coding sandbox: the interpreter does not start in the jail (exit {rc}): {said}"
    except JailUnavailable as e:
        return str(e)
    except OSError as e:
        return f"coding sandbox: the jail cannot start here: {e}"
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return None


def jail_problem() -> str | None:
    """None where the jail works on this machine, else the one line that says what is missing (cached)."""
    try:
        return _problem(os.environ.get("TRACEKIT_SANDBOX_ACCOUNTING", ""), os.geteuid(), os.getcwd())
    except JailUnavailable as e:
        return str(e)


def require_jail() -> None:
    """Raise :class:`JailUnavailable` (one line) unless the jail works here: the coding target refuses to run
    uncontained."""
    problem = jail_problem()
    if problem:
        raise JailUnavailable(problem)


def namespaces_available() -> bool:
    """The jail works here (kept for callers of the earlier API)."""
    return jail_problem() is None


def isolation() -> dict[str, str]:
    """What this machine enforces for agent commands (recorded in reports)."""
    problem = jail_problem()
    if problem:
        return {"mode": "unavailable", "problem": problem}
    acc = accounting()
    root = mode() == "root"
    return {
        "mode": mode(), "accounting": acc.name, "accounting_why": acc.why,
        "view": ("allow-list on an empty tmpfs root: read-only /usr/bin, /usr/sbin, /usr/lib*, /usr/libexec, "
                 "loader files of /etc, the interpreter's image (executable, shared libraries, standard library) at "
                 f"{', '.join(interpreter_paths())} with the task runtime (pytest and its requirements) at its site "
                 "directories, every copy of the task's package the scan recognises covered; writable: the task "
                 "copy; fresh /proc, /tmp; nothing else"),
        "cpu": "RLIMIT_CPU", "wall": "deadline + SIGKILL of the PID namespace", **acc.describe(),
        "disk": ("the task copy is a tmpfs of its size + disk_bytes (per episode)" if root else
                 "watchdog: the writable paths' size polled, killed over the copy's size + disk_bytes"),
        "files": ("runs as nobody, owner of the task copy only" if root else
                  "nested user namespace: no capability over the jail's mounts"),
        "network": "network namespace (no interface up)",
    }


def run(command: str | list[str], cwd: Path, limits: CommandLimits = CommandLimits(),
        env: dict[str, str] | None = None, read_only: tuple[Path, ...] = (),
        writable: tuple[Path, ...] = (), hide: tuple[str, ...] = (), protected: tuple[Path, ...] = (),
        pass_fds: tuple[int, ...] = ()) -> CommandResult:
    """Run ``command`` (a bash command line, or an argv) in ``cwd`` under ``limits``; never raises for what the
    command does (only for a missing ``cwd`` and :class:`JailUnavailable`, :class:`CacheExposed` among them).
    ``read_only``: paths the command must also see (tracekit's pytest plugin); ``writable``: directories it may
    also write (a results directory); ``hide``: distributions no copy of which it may see (the package its task
    was made from: :mod:`tracekit.coding.runtime`); ``protected``: paths inside ``cwd`` the command sees read-only
    (a test run's test directories: they can be neither written nor renamed, being mount points); ``pass_fds``:
    file descriptors of the caller the command inherits at the same numbers (a test run's report channel)."""
    cwd = Path(cwd)
    if not cwd.is_dir():
        raise FileNotFoundError(f"no working directory {cwd}")
    require_jail()
    argv = ["bash", "--noprofile", "--norc", "-c", command] if isinstance(command, str) else list(command)
    rc, raw, events, wall = _jail_run(argv, cwd, limits, env, read_only, writable, tuple(hide),
                                      protected=tuple(protected), pass_fds=tuple(pass_fds))
    text = raw.decode("utf-8", "replace")
    if rc is not None:
        if rc < 0:  # the jail itself died of a signal: report it as a shell would
            rc = 128 - rc
        sig = rc - 128 if rc > 128 else 0
        if sig == signal.SIGXCPU:
            events.append("cpu_time")
        elif sig == signal.SIGKILL and "memory" not in events and "disk" not in events:
            events.append("killed")  # not ours (ours is the wall deadline): the CPU hard limit or the kernel
        elif sig == signal.SIGXFSZ:
            events.append("file_size")
    for name, pattern in _PATTERNS.items():
        if pattern.search(text) and name not in events:
            events.append(name)
    text, cut = _truncate(text, limits.output_chars)
    if cut:
        events.append("output_truncated")
    return CommandResult(command if isinstance(command, str) else " ".join(command), rc, text, round(wall, 3),
                         events, mode())


def _wait(proc: subprocess.Popen, timeout: float) -> int:
    """``proc.wait(timeout)``, woken the moment it exits (Popen's own wait polls at up to 50 ms)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        return proc.wait(timeout=timeout)
    try:
        if not select.select([fd], [], [], timeout)[0]:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        return proc.wait()
    finally:
        os.close(fd)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
