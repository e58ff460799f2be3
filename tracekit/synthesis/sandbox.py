"""Run untrusted (LLM-generated) environment code only in a limited subprocess.

What is enforced, per worker process:

- CPU time: ``RLIMIT_CPU`` (hard = total budget; soft re-armed per request to used + per-request budget;
  past it the kernel sends SIGXCPU and the process dies).
- Wall time: every request has a deadline; past it the whole process group is SIGKILLed.
- Memory: ``RLIMIT_AS`` (allocations past it raise MemoryError or kill the process); files: ``RLIMIT_FSIZE``.
- Files: a private temporary working directory (cwd, HOME and TMPDIR point there); an audit hook installed
  before the module is imported denies and records any write, rename, removal, chmod, ... outside it
  (``python -B``: no bytecode caches are written either). The directory is deleted afterwards.
- Environment: scrubbed; only PATH/HOME/TMPDIR/LANG/LC_ALL/TZ and thread-count variables are passed, so no
  tokens or keys are inherited; ``python -I`` ignores PYTHON* variables and the user site.
- Network: a fresh network namespace (``unshare -n``, loopback only, down) when running as root with
  ``unshare`` available; otherwise NOT enforced by the kernel, only by the audit hook (``socket.connect``/
  ``bind``/``sendto`` denied), which native code could bypass. ``isolation()`` says which applies.
- Also denied by the audit hook: starting processes, loading native libraries through ctypes, signalling.

Audit hooks are a tripwire against accidents and sloppy code, not a security boundary against an adversary
with native code execution; the kernel limits (CPU, wall, memory, file size, netns) are the hard ones.

Any crash, hang, memory blow-up, exception or violation ends in :class:`SandboxError` with a precise reason;
the caller (validation) records it as a failed check and the pipeline goes on.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.synthesis.protocol import EnvBackend, EnvInfo, Instance, Verdict
from tracekit.synthesis.targets import sandbox_preload
from tracekit.types import Message, ToolCall

log = logging.getLogger(__name__)

RUNNER = Path(__file__).with_name("_sandbox_runner.py")
REPO_ROOT = Path(__file__).resolve().parents[2]


class SandboxError(RuntimeError):
    """Untrusted code failed, hung, blew a limit or broke a sandbox rule; ``str(e)`` is the precise reason."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 30.0  # per request
    cpu_seconds_total: int = 3600  # per worker process
    wall_seconds: float = 60.0  # per request
    memory_bytes: int = 4 << 30
    file_bytes: int = 64 << 20
    max_reply_bytes: int = 64 << 20


@functools.lru_cache(maxsize=None)
def _netns_available() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "-n", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def isolation() -> dict[str, str]:
    """What this platform enforces (recorded in validation reports)."""
    return {
        "cpu": "RLIMIT_CPU", "wall": "deadline + SIGKILL of the process group", "memory": "RLIMIT_AS",
        "files": "private workdir + audit hook denying writes outside it + RLIMIT_FSIZE",
        "env": "scrubbed (PATH, HOME, TMPDIR, LANG, LC_ALL, TZ, thread counts)",
        "network": "network namespace (unshare -n)" if _netns_available()
        else "NOT kernel-enforced: audit hook denies socket connect/bind/sendto only",
    }


def _scrubbed_env(workdir: str) -> dict[str, str]:
    path = os.pathsep.join(dict.fromkeys([os.path.dirname(sys.executable), "/usr/local/bin", "/usr/bin", "/bin"]))
    env = {"PATH": path, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TZ": "UTC",
           "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    env.update({k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    return env


def _signal_name(rc: int) -> str:
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


class SandboxWorker:
    """One sandboxed child process serving JSON-line requests for one module."""

    def __init__(self, source: str, limits: SandboxLimits = SandboxLimits()):
        self.limits = limits
        self.workdir = tempfile.mkdtemp(prefix="tracekit-sandbox-")
        Path(self.workdir, "env_module.py").write_text(source, encoding="utf-8")
        self._stderr = open(Path(self.workdir, "stderr.log"), "wb")
        cmd = [sys.executable, "-I", "-B", str(RUNNER), "--root", str(REPO_ROOT), "--workdir", self.workdir,
               "--memory", str(limits.memory_bytes), "--cpu-total", str(limits.cpu_seconds_total),
               "--fsize", str(limits.file_bytes)]
        if _netns_available():
            cmd = ["unshare", "-n", "--", *cmd]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                     cwd=self.workdir, env=_scrubbed_env(self.workdir), start_new_session=True)
        log.debug("sandbox worker pid %d in %s", self.proc.pid, self.workdir)
        self._buf = b""
        self._dead: str | None = None
        self._lock = threading.Lock()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()

    def _stderr_tail(self, n: int = 400) -> str:
        self._stderr.flush()
        try:
            data = Path(self.workdir, "stderr.log").read_bytes()[-n:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace").strip().replace("\n", " | ")

    def _death_reason(self, op: str) -> str:
        rc = self.proc.wait()
        if rc < 0 and -rc == signal.SIGXCPU:
            return f"CPU time limit exceeded ({self.limits.cpu_seconds:g}s per request) during {op}"
        if rc < 0 and -rc in (signal.SIGKILL, signal.SIGSEGV):
            return (f"killed by {_signal_name(rc)} during {op} (memory limit "
                    f"{self.limits.memory_bytes >> 20} MiB?): {self._stderr_tail()}")
        tail = self._stderr_tail()
        how = f"killed by {_signal_name(rc)}" if rc < 0 else f"exited with status {rc}"
        return f"sandbox process {how} during {op}" + (f": {tail}" if tail else "")

    def request(self, op: str, **payload: Any) -> Any:
        """Send one request and return its result; any failure raises SandboxError with the reason."""
        with self._lock:
            if self._dead:
                raise SandboxError(f"sandbox worker is no longer usable ({self._dead})")
            try:
                return self._request(op, payload)
            except SandboxError as e:
                self._dead = str(e)
                self._kill()
                log.info("sandbox worker %d stopped: %s", self.proc.pid, e)
                raise

    def _request(self, op: str, payload: dict[str, Any]) -> Any:
        line = json.dumps({"op": op, "cpu": self.limits.cpu_seconds, **payload}, default=str) + "\n"
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SandboxError(self._death_reason(op)) from None
        reply = self._read_line(op)
        try:
            msg = json.loads(reply)
        except json.JSONDecodeError:
            raise SandboxError(f"malformed reply from the sandbox during {op}: {reply[:200]!r}") from None
        if msg.get("violations"):
            raise SandboxError(f"sandbox rule broken during {op}: {'; '.join(list(dict.fromkeys(msg['violations']))[:3])}")
        if not msg.get("ok"):
            if msg.get("kind") == "memory":
                raise SandboxError(f"memory limit ({self.limits.memory_bytes >> 20} MiB) exceeded during {op}: "
                                   f"{msg.get('error')}")
            raise SandboxError(f"{op} raised {msg.get('error')}")
        return msg.get("result")

    def _read_line(self, op: str) -> bytes:
        deadline = time.monotonic() + self.limits.wall_seconds
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._kill()
                    raise SandboxError(f"wall-time limit exceeded ({self.limits.wall_seconds:g}s) during {op}")
                if not sel.select(timeout=left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise SandboxError(self._death_reason(op))
                self._buf += chunk
                if len(self._buf) > self.limits.max_reply_bytes:
                    raise SandboxError(f"reply larger than {self.limits.max_reply_bytes} bytes during {op}")
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def close(self) -> None:
        self._kill()
        self._stderr.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __del__(self) -> None:  # a forgotten worker must not outlive its owner
        try:
            if getattr(self, "proc", None) is not None and self.proc.poll() is None:
                self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


class SandboxBackend(EnvBackend):
    """An environment module run in a :class:`SandboxWorker` (the only way generated code is executed)."""

    SCORE_CHUNK = 25  # jobs per request, so one request's wall budget stays meaningful

    def __init__(self, source: str, limits: SandboxLimits = SandboxLimits(), difficulty: int | None = None,
                 target: str | None = None):
        """``target``: the interface the module keeps (its family's modules are imported before the sandbox's
        limits apply: :func:`tracekit.synthesis.targets.sandbox_preload`)."""
        self.worker = SandboxWorker(source, limits)
        preload = list(sandbox_preload(target))
        try:
            self.info = EnvInfo.model_validate(self.worker.request("load", difficulty=difficulty, preload=preload))
        except SandboxError:
            self.worker.close()
            raise
        except Exception as e:  # a malformed EnvInfo
            self.worker.close()
            raise SandboxError(f"load returned an invalid description: {str(e).splitlines()[0]}") from None

    @classmethod
    def from_file(cls, path: str | Path, limits: SandboxLimits = SandboxLimits(), difficulty: int | None = None,
                  target: str | None = None) -> SandboxBackend:
        return cls(Path(path).read_text(encoding="utf-8"), limits, difficulty, target)

    def describe(self) -> EnvInfo:
        return self.info

    def _parse(self, model: type, data: Any, what: str) -> Any:
        try:
            return model.model_validate(data)
        except Exception as e:
            raise SandboxError(f"{what} returned invalid data: {str(e).splitlines()[0]}") from None

    def generate(self, seeds: list[int]) -> list[Instance]:
        data = self.worker.request("generate", seeds=[int(z) for z in seeds])
        return [self._parse(Instance, d, "generate") for d in data]

    def open(self, instance: Instance) -> str:
        return self.worker.request("open", instance=instance.model_dump(mode="json"))

    def call(self, handle: str, call: ToolCall) -> Message:
        return self._parse(Message, self.worker.request("call", handle=handle, call=call.model_dump(mode="json")), "call")

    def finish(self, handle: str, messages: list[Message]) -> Verdict:
        data = self.worker.request("finish", handle=handle, messages=[m.model_dump(mode="json") for m in messages])
        return self._parse(Verdict, data, "verify")

    def score(self, jobs: list[tuple[Instance, list[Message]]]) -> list[Verdict]:
        out: list[Verdict] = []
        for i in range(0, len(jobs), self.SCORE_CHUNK):
            chunk = [{"instance": inst.model_dump(mode="json"), "actions": [m.model_dump(mode="json") for m in acts]}
                     for inst, acts in jobs[i:i + self.SCORE_CHUNK]]
            out += [self._parse(Verdict, d, "verify") for d in self.worker.request("score", jobs=chunk)]
        return out

    def close(self) -> None:
        self.worker.close()
