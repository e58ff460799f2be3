"""Child processes for tests, with what they depend on set here rather than inherited from however pytest started.

pytest started in the background by a script (``bash .ci/run &``) runs with SIGINT and SIGQUIT ignored and often
no usable stdin. An ignored signal stays ignored across exec, and the CLI rightly keeps an ignored SIGINT ignored,
so a child started plainly would ignore the SIGINT a test sends (it exits 0, not 130). A child that reads stdin
would block on a terminal or get SIGTTIN in a background job. :func:`run` and :func:`popen` are
``subprocess.run``/``subprocess.Popen`` with these defaults:

- ``preexec_fn`` sets SIGINT, SIGTERM, SIGQUIT and SIGHUP back to their default actions in the child before exec
  (a Python child then installs its own SIGINT handler, as it does when started from a terminal);
- stdin is ``/dev/null`` unless the test passes ``stdin=`` or ``input=``.

A test that passes its own ``preexec_fn`` gets the reset too, before its function runs.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)


def default_signals() -> None:
    """In the child between fork and exec: the signals a test may send act as they do from a terminal."""
    for sig in RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def _kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    own: Callable[[], None] | None = kw.pop("preexec_fn", None)
    if own is None:
        kw["preexec_fn"] = default_signals
    else:
        def both() -> None:
            default_signals()
            own()

        kw["preexec_fn"] = both
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    return kw


def run(args, **kw: Any) -> subprocess.CompletedProcess:
    """``subprocess.run`` with default signal actions and stdin from /dev/null in the child."""
    return subprocess.run(args, **_kwargs(kw))


def popen(args, **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen`` with default signal actions and stdin from /dev/null in the child."""
    return subprocess.Popen(args, **_kwargs(kw))


def catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``sig`` (Linux: ``SigCgt`` in ``/proc/<pid>/status``)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (int(sig) - 1) & 1)
    return False


def wait_for(ready: Callable[[], Any], what: str, timeout: float = 600.0,
             proc: subprocess.Popen | None = None, poll: float = 0.05) -> Any:
    """Wait for an event (``ready()`` true), not for a clock: return its value as soon as it holds.

    ``timeout`` is only a bound against a hang (generous: the machine may be loaded); on it, or when ``proc`` exits
    before the event, fail naming ``what`` was awaited.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = ready()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = ready()  # it may have happened just before the exit
            if value:
                return value
            raise AssertionError(f"the process exited with {proc.returncode} before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}")
        time.sleep(poll)


def wait_for_path(path: Path, timeout: float = 600.0, proc: subprocess.Popen | None = None) -> Path:
    """Wait until ``path`` exists (see :func:`wait_for`)."""
    wait_for(path.exists, f"{path} to appear", timeout, proc)
    return path
