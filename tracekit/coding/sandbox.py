"""Run one untrusted shell command (an agent's bash call, a test suite on a patched tree) in a task's private copy.

Every command is a fresh process tree; nothing persists between commands but the files of the copy.

What is enforced (``isolation()`` says which applies on this machine, and every result records it):

- CPU time: ``RLIMIT_CPU`` (soft = limit, hard = limit + 1 s: SIGXCPU, then SIGKILL).
- Wall time: a deadline; past it the whole process tree is SIGKILLed (with namespaces: the command's PID
  namespace dies with its init, so background processes such as ``sleep 1000 &`` die too).
- Memory: ``RLIMIT_AS``; file size: ``RLIMIT_FSIZE`` (also bounds the captured output: output goes to a file).
- Processes: ``RLIMIT_NPROC`` (a fork bomb stops at the limit; the kernel exempts uid 0, which is why the
  command runs as ``nobody``).
- As root with ``unshare`` and ``setpriv`` (``mode="namespaces"``): a fresh network namespace (no network, loopback
  down), mount namespace (private tmpfs over ``/tmp``, ``/var/tmp``, ``/dev/shm``: writes there vanish with the
  command) and PID namespace; the command runs as ``nobody``, owner of the copy only, so a write anywhere else is
  refused by the kernel. Task copies live under :func:`work_root` (not in a world-writable directory).
- Otherwise (``mode="rlimits"``): only the rlimits, the deadline and a scrubbed environment; network and writes
  outside the copy are NOT contained (said in ``isolation()`` and in every result).

A command that hits a limit is never an exception: :class:`CommandResult` says what happened (``events``:
``wall_time``, ``cpu_time``, ``killed``, ``memory``, ``processes``, ``file_size``, ``network_blocked``, ``write_denied``,
``output_truncated``) and the caller (the episode, the test runner) records and counts it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

NOBODY = 65534
JAIL = Path(__file__).with_name("_jail.py")


@dataclass(frozen=True)
class CommandLimits:
    cpu_seconds: int = 30
    wall_seconds: float = 60.0
    memory_bytes: int = 2 << 30
    file_bytes: int = 64 << 20
    processes: int = 128
    output_chars: int = 8000  # what the agent sees: head and tail of the combined stdout/stderr

    def __post_init__(self) -> None:
        for name in ("cpu_seconds", "wall_seconds", "memory_bytes", "file_bytes", "processes", "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CommandLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass
class CommandResult:
    command: str
    returncode: int | None  # None: killed at the wall-time limit
    output: str  # combined stdout + stderr, truncated to the limit (head and tail kept)
    wall_s: float
    events: list[str] = field(default_factory=list)
    mode: str = "rlimits"

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


@functools.cache
def namespaces_available() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    if shutil.which("unshare") is None:
        return False
    try:
        r = subprocess.run(["unshare", "--mount", "--net", "--pid", "--fork", "--mount-proc", "--", "true"],
                           capture_output=True, timeout=20)
        return r.returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def mode() -> str:
    return "namespaces" if namespaces_available() else "rlimits"


def isolation() -> dict[str, str]:
    """What this machine enforces for agent commands (recorded in reports)."""
    ns = namespaces_available()
    return {
        "mode": mode(),
        "cpu": "RLIMIT_CPU", "wall": "deadline + SIGKILL of the process tree" + (" (PID namespace)" if ns else ""),
        "memory": "RLIMIT_AS", "processes": "RLIMIT_NPROC" + (" as nobody" if ns else " (not enforced for uid 0)"),
        "files": ("runs as nobody, owner of the task copy only; private tmpfs over /tmp, /var/tmp, /dev/shm"
                  if ns else "NOT contained: only RLIMIT_FSIZE"),
        "network": "network namespace (unshare --net)" if ns else "NOT contained",
    }


def work_root() -> Path:
    """Where task copies live: ``$TRACEKIT_CODING_WORKDIR``, else (namespaces) ``/var/lib/tracekit-coding`` (a
    private tmpfs covers the world-writable temp directories inside a command), else the temp directory."""
    env = os.environ.get("TRACEKIT_CODING_WORKDIR")
    if env:
        root = Path(env)
    elif namespaces_available():
        root = Path("/var/lib/tracekit-coding")
    else:
        root = Path(tempfile.gettempdir()) / f"tracekit-coding-{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o711)
    return root


def new_workdir(prefix: str) -> Path:
    """A fresh directory under :func:`work_root`, traversable (not listable) by the sandbox user."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=work_root()))
    os.chmod(path, 0o711)
    return path


def give_to_sandbox(path: Path) -> None:
    """Make ``path`` (a task copy, a results directory) the sandbox user's, so commands may write there only."""
    if not namespaces_available():
        return
    os.chown(path, NOBODY, NOBODY)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), NOBODY, NOBODY)


def scrubbed_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]))
    env = {"PATH": path, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "GIT_CONFIG_NOSYSTEM": "1",
           # pytest without the host's installed plugins (they are not the package's and take seconds to load)
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.update(extra or {})
    return env


_PATTERNS = {
    "network_blocked": re.compile(r"Network is unreachable|Temporary failure in name resolution|"
                                  r"Name or service not known|Cannot assign requested address|Connection refused"),
    "write_denied": re.compile(r"Permission denied|Read-only file system|Operation not permitted"),
    "processes": re.compile(r"Resource temporarily unavailable|fork: retry|Cannot fork|can't fork"),
    "memory": re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|memory exhausted"),
}


def _truncate(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    head, tail = limit * 2 // 3, limit // 3
    return f"{text[:head]}\n[... {len(text) - head - tail} characters cut ...]\n{text[-tail:]}", True


def run(command: str | list[str], cwd: Path, limits: CommandLimits = CommandLimits(),
        env: dict[str, str] | None = None, read_only: tuple[Path, ...] = ()) -> CommandResult:
    """Run ``command`` (a bash command line, or an argv) in ``cwd`` under ``limits``; never raises for what the
    command does (only for a missing ``cwd``). ``read_only``: directories the command must see even where a
    private tmpfs covers them (a checkout of tracekit under /tmp); they stay read-only."""
    cwd = Path(cwd)
    if not cwd.is_dir():
        raise FileNotFoundError(f"no working directory {cwd}")
    argv = ["bash", "--noprofile", "--norc", "-c", command] if isinstance(command, str) else list(command)
    ns = namespaces_available()
    lim = [str(limits.cpu_seconds), str(limits.memory_bytes), str(limits.file_bytes), str(limits.processes)]
    if ns:
        full = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
                sys.executable, "-I", "-S", "-B", str(JAIL), str(cwd), *lim, *map(str, read_only), "--",
                *argv]
        preexec = None
    else:
        full = argv

        def preexec() -> None:  # rlimits only (no namespaces, not root)
            import resource

            resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_seconds, limits.cpu_seconds + 1))
            resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
            if os.getuid() != 0:
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

    events: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(full, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=scrubbed_env(env), start_new_session=True, preexec_fn=preexec)
        try:
            rc: int | None = proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = None
            events.append("wall_time")
        wall = time.monotonic() - t0
        if not ns:  # background children may still hold the group: one SIGKILL for the group
            _kill_group(proc.pid)
        out.seek(0)
        raw = out.read(limits.file_bytes + 1)
    text = raw.decode("utf-8", "replace")
    if rc is not None:
        sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
        if sig == signal.SIGXCPU:
            events.append("cpu_time")
        elif sig == signal.SIGKILL:  # not ours (ours is the wall deadline): the CPU hard limit or the kernel
            events.append("killed")
        elif sig == signal.SIGXFSZ:
            events.append("file_size")
        if rc < 0:  # report a signal death as a shell would
            rc = 128 - rc
    for name, pattern in _PATTERNS.items():
        if pattern.search(text) and name not in events:
            events.append(name)
    text, cut = _truncate(text, limits.output_chars)
    if cut:
        events.append("output_truncated")
    return CommandResult(command if isinstance(command, str) else " ".join(command), rc, text, round(wall, 3),
                         events, "namespaces" if ns else "rlimits")


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_tree(proc: subprocess.Popen) -> None:
    _kill_group(proc.pid)
    try:
        proc.kill()
    except ProcessLookupError:
        pass
    proc.wait()
