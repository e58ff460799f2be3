"""K-of-N capability selection (paper section 3.3): a pure function of labels and thresholds.

In each run r, c is selected when Delta_r(c) >= delta and Cov_r(c) >= rho (both defined, see
:mod:`tracekit.analysis.stats`); c is kept when selected in at least K of the N runs. Kept
capabilities are ranked by mean Delta over the runs where Delta is defined (ties by name).
Because selection reads only labels, a threshold sweep re-runs nothing but this function.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, get_args

import numpy as np

from tracekit.analysis.stats import UndefinedErPos, label_grid, passes, stats_table
from tracekit.ranges import Choice, check_declared
from tracekit.types import Capability, Label, LabelValue


@dataclass
class Thresholds:
    """delta (Delta >= delta), rho (Cov >= rho), K of N runs; paper defaults 0.20, 0.10, 8 of 10. Also the schema of
    the ``thresholds`` config group: its rules are declared here once, checked here and by ``validate``.

    ``undefined_er_pos``: ``zero`` treats an undefined ER+ (no applicable success) as 0 and flags
    it; ``unselectable`` makes Delta undefined in that run instead.
    """

    delta: float = 0.20
    rho: float = 0.10
    k: int = 8
    n: int = 10
    undefined_er_pos: str = "zero"  # an UndefinedErPos (typed str: the config schema holds no Literal)

    # a gap ER- - ER+ below 0 would select what successes lack more
    RANGES: ClassVar[dict[str, str]] = {"delta": "[0, 1]", "rho": "[0, 1]", "k": ">= 1", "n": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"undefined_er_pos": get_args(UndefinedErPos)}

    def __post_init__(self) -> None:
        check_declared("thresholds", self)
        if self.k > self.n:
            raise ValueError(f"thresholds.k={self.k!r} is invalid: must be in [1, thresholds.n={self.n}]")


def _mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(np.mean(vals)) if vals else None


def _quartiles(xs: list[float | None]) -> tuple[float, float, float] | None:
    vals = [x for x in xs if x is not None]
    if not vals:
        return None
    q25, q50, q75 = np.percentile(vals, [25, 50, 75])
    return float(q25), float(q50), float(q75)


def select(
    labels: list[Label], dictionary: list[Capability], thresholds: Thresholds, examples: int = 5
) -> dict[str, Any]:
    """The selection (the content of ``selected.json``) from a label table.

    Raises ``ValueError`` when the labels hold a number of runs other than ``thresholds.n`` or
    are inconsistent (see :func:`~tracekit.analysis.stats.label_grid`).
    """
    names = [c.name for c in dictionary]
    if not labels:
        raise ValueError("selection needs labels, got none")
    rows = stats_table(labels, names, thresholds.undefined_er_pos)
    runs, success, grid = label_grid(labels, names)
    if len(runs) != thresholds.n:
        raise ValueError(f"labels hold {len(runs)} runs {runs} but thresholds.n={thresholds.n}")
    by_cap = {c: [s for s in rows if s.capability == c] for c in names}

    candidates = []
    flags = []
    for cap in dictionary:
        st = by_cap[cap.name]
        picked = [passes(s.delta, s.cov, thresholds.delta, thresholds.rho) for s in st]
        covs = [s.cov for s in st]
        q = _quartiles(covs)
        lacking_runs = Counter(
            t for r in runs for t, ok in success.items() if not ok and grid[(r, t, cap.name)] == LabelValue.LACKING
        )
        undefined_pos = [s.run for s in st if not s.er_pos_defined]
        if undefined_pos:
            how = "treated as 0" if thresholds.undefined_er_pos == "zero" else "Delta undefined"
            flags.append(f"{cap.name}: ER+ undefined (no applicable success) in runs {undefined_pos}, {how}")
        if all(s.delta is None for s in st):
            flags.append(f"{cap.name}: Delta undefined in every run (NA or missing everywhere on one side)")
        candidates.append(
            {
                "name": cap.name,
                "description": cap.description,
                "selection_count": sum(picked),
                "selected": sum(picked) >= thresholds.k,
                "selected_runs": [s.run for s, p in zip(st, picked) if p],
                "mean_delta": _mean([s.delta for s in st]),
                "deltas": [s.delta for s in st],
                "mean_cov": _mean(covs),
                "covs": covs,
                "median_cov": q[1] if q else None,
                "cov_iqr": [q[0], q[2]] if q else None,
                "er_pos": [s.er_pos for s in st],
                "er_neg": [s.er_neg for s in st],
                "mean_er_pos": _mean([s.er_pos for s in st]),
                "mean_er_neg": _mean([s.er_neg for s in st]),
                "missing_labels": sum(s.missing for s in st),
                "example_failed_trajectories": [
                    t for t, _ in sorted(lacking_runs.items(), key=lambda kv: (-kv[1], kv[0]))[:examples]
                ],
            }
        )
    candidates.sort(key=lambda c: (c["mean_delta"] is None, -(c["mean_delta"] or 0.0), c["name"]))
    n_failed = sum(not ok for ok in success.values())
    return {
        "thresholds": asdict(thresholds),
        "runs": runs,
        "n_trajectories": len(success),
        "n_success": len(success) - n_failed,
        "n_failed": n_failed,
        "selected": [c for c in candidates if c["selected"]],
        "candidates": candidates,
        "stats": [s.as_row() for s in rows],
        "missing_labels": {
            "total": sum(v is None for v in grid.values()),
            "by_capability": {c: sum(s.missing for s in by_cap[c]) for c in names},
        },
        "flags": flags,
    }


def selected_names(selection: dict[str, Any]) -> list[dict[str, str]]:
    """The identity of a selection (downstream cache key): sorted names and descriptions only."""
    return sorted(({"name": c["name"], "description": c["description"]} for c in selection["selected"]), key=lambda c: c["name"])
