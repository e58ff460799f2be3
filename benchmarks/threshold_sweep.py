"""Cost of a 3x3 (delta, rho) threshold sweep against one run, in one process (issue 4; target <= 1.3x).

A run here is the analysis pipeline up to `select` (rollout -> discover -> label -> select) on a
fresh cache. The sweep runs the 9 threshold settings one after another on another fresh cache:
the first computes everything, the other 8 re-use the cached rollout and labels and recompute only
`select`. A warm-up run first pays the one-time process costs (imports, model load, DB parse). Offline: the tiny random backbone (or any backbone=...) and the reference labeler.

    python benchmarks/threshold_sweep.py                       # tiny model, 4 retail tasks
    python benchmarks/threshold_sweep.py backbone=smollm2_135m benchmark.limit=2
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tracekit.artifacts import StageCache
from tracekit.cli import compose_config
from tracekit.pipeline import RunRecord
from tracekit.report.logging import RunLogger
from tracekit.stages import build_pipeline

DELTAS = (0.10, 0.20, 0.30)
RHOS = (0.05, 0.10, 0.20)
BASE = ["experiment=smoke", "benchmark.limit=4", "thresholds.n=10", "thresholds.k=8", "analysis.label_noise=0.1"]


def run_once(root: Path, overrides: list[str]) -> tuple[float, list[str]]:
    cfg = compose_config([f"paths.root_dir={root}", f"paths.cache_dir={root}/cache", f"paths.run_dir={root}/run",
                          *BASE, *overrides])
    record = RunRecord(Path(cfg.paths.run_dir))
    record.run_dir.mkdir(parents=True, exist_ok=True)
    record.logger = RunLogger(cfg, record.run_dir)
    t0 = time.perf_counter()
    build_pipeline().run(cfg, ["select"], StageCache(cfg.paths.cache_dir), record)
    computed = [a["stage"] for a in record.artifacts.values() if not a["cache_hit"]]
    return time.perf_counter() - t0, computed


def main(extra: list[str]) -> None:
    with tempfile.TemporaryDirectory() as warm_root, tempfile.TemporaryDirectory() as single_root, \
            tempfile.TemporaryDirectory() as sweep_root:
        run_once(Path(warm_root), extra)  # imports, model load, tau2 DB parse: paid once, by neither side
        single, _ = run_once(Path(single_root), extra)
        sweep, recomputed = 0.0, []
        for d in DELTAS:
            for r in RHOS:
                seconds, computed = run_once(Path(sweep_root), [*extra, f"thresholds.delta={d}", f"thresholds.rho={r}"])
                sweep += seconds
                recomputed.append(f"delta={d} rho={r}: {seconds:.2f}s, computed {computed}")
    print("\n".join(recomputed))
    print(f"\nsingle run: {single:.2f}s   9-point sweep: {sweep:.2f}s   ratio: {sweep / single:.3f}x (target <= 1.3x)")


if __name__ == "__main__":
    main(sys.argv[1:])
