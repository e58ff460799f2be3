"""The routing table at outcome-deciding tokens of a finished micro run (issue 53; :mod:`tracekit.report.routing`):
which expert each block's gate picks at the first token of the turns where an episode's outcome is decided.

    python -m tracekit.planted.routing --run outputs/runs/<time>_<name> [--out <dir>] [--device cpu]

It lives beside the micro ladder's other post-hoc analyses (``rung_a``) because a micro run's backbone is the planted
warm start, whose source this package registers on import (:mod:`tracekit.warmstart.planted`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import tracekit.warmstart.planted  # noqa: F401 - registers the planted backbone source the composed model loads on
from tracekit.artifacts import CorruptArtifact
from tracekit.report.routing import RoutingTableError, routing_table

PROG = "python -m tracekit.planted.routing"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished run directory (its artifacts.json)")
    p.add_argument("--out", type=Path, default=None, help="where the tables go (default: <run>/routing)")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    try:
        written = routing_table(a.run, a.out, a.device)
    except (RoutingTableError, CorruptArtifact, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path.read_text())
        print(f"written: {path} (and the CSVs beside it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
