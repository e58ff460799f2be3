"""``python -m tracekit``. SIGINT and SIGTERM are caught before anything else is imported: the app's imports take
seconds, and a signal in them ends the command in one line (exit 130 / 143), not a traceback or a silent exit. The
app replaces these handlers with its own (:func:`tracekit.cli.catch_signals`) before it writes anything."""

import os
import signal
import sys


def _starting(signum: int, frame: object) -> None:
    try:
        sys.stderr.write(f"tracekit: interrupted by {signal.Signals(signum).name} while starting: nothing was run or "
                         "written\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


_starting.tracekit_early = True  # type: ignore[attr-defined]  # catch_signals replaces it

for _sig, _default in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL)):
    if signal.getsignal(_sig) is _default:  # one the parent set to ignore stays ignored
        signal.signal(_sig, _starting)

from tracekit.cli import main  # noqa: E402 - after the handlers: this import is the slow part

if __name__ == "__main__":
    main()
