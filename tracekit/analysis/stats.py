"""Per-run contrastive statistics of paper section 3.3 (pure functions).

For one labeling run and capability c, with y_i the success label and l_i the label of trajectory i:

    ER+(c)  = #{l_i = LACKING, y_i = 1} / #{l_i != NA, y_i = 1}
    ER-(c)  = #{l_i = LACKING, y_i = 0} / #{l_i != NA, y_i = 0}
    Delta(c) = ER-(c) - ER+(c)
    Cov(c)  = #{l_i = LACKING, y_i = 0} / |D-|

Missing labels (``Label.value is None``) are excluded from every numerator and denominator
(|D-| counts the failed trajectories whose label for c was obtained) and are counted.

Empty denominators:
- ER+ undefined (no success with an applicable label, e.g. no successes at all): by default
  treated as 0 (no evidence that c is lacking among successes, so Delta = ER-) and flagged in
  ``er_pos_defined``; with ``undefined_er_pos="unselectable"`` Delta is undefined instead.
- ER- undefined (no failure with an applicable label): Delta undefined.
- Cov undefined (no failed trajectory with a label for c): undefined.
- c NA everywhere: ER+ and ER- undefined, hence Delta undefined.
An undefined Delta or Cov makes c not selectable in that run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Literal

from tracekit.types import Label, LabelValue

UndefinedErPos = Literal["zero", "unselectable"]
# Thresholds compare with this slack so that exact fractions (e.g. 1/1 - 4/5 = 0.2) are not
# lost to float rounding (1.0 - 0.8 = 0.19999999999999996 in binary floating point).
TOLERANCE = 1e-9


def error_rate(lacking: int, applicable: int) -> float | None:
    """lacking / applicable; None when nothing is applicable (an empty denominator)."""
    return lacking / applicable if applicable > 0 else None


def contrastive_gap(er_neg: float | None, er_pos: float | None, undefined_er_pos: UndefinedErPos = "zero") -> float | None:
    """Delta = ER- - ER+; None when ER- is undefined, or ER+ is undefined and not treated as 0."""
    if er_neg is None:
        return None
    if er_pos is None:
        return er_neg if undefined_er_pos == "zero" else None
    return er_neg - er_pos


def coverage(lacking_failed: int, n_failed: int) -> float | None:
    """Cov = lacking-in-failed / |D-|; None when there is no failed trajectory."""
    return lacking_failed / n_failed if n_failed > 0 else None


def passes(delta: float | None, cov: float | None, delta_min: float, rho: float) -> bool:
    """Selection in one run: Delta >= delta and Cov >= rho (both defined)."""
    return delta is not None and cov is not None and delta >= delta_min - TOLERANCE and cov >= rho - TOLERANCE


@dataclass(frozen=True)
class RunStats:
    """Counts and statistics of one capability in one run (None = undefined)."""

    run: int
    capability: str
    n_success: int  # successful trajectories with an obtained label for c
    n_failed: int  # failed trajectories with an obtained label for c (|D-| of Cov)
    applicable_success: int  # ... whose label is not NA (denominator of ER+)
    applicable_failed: int  # (denominator of ER-)
    lacking_success: int
    lacking_failed: int
    missing: int  # labels not obtained (excluded everywhere)
    er_pos: float | None
    er_neg: float | None
    delta: float | None
    cov: float | None
    er_pos_defined: bool

    def as_row(self) -> dict:
        return asdict(self)


def capability_run_stats(
    run: int,
    capability: str,
    values: list[tuple[LabelValue | None, bool]],
    undefined_er_pos: UndefinedErPos = "zero",
) -> RunStats:
    """Stats of one capability in one run from its (label value, success) pairs, one per trajectory."""
    c: dict[str, int] = defaultdict(int)
    for value, success in values:
        side = "success" if success else "failed"
        if value is None:
            c["missing"] += 1
            continue
        c[f"n_{side}"] += 1
        if value != LabelValue.NA:
            c[f"applicable_{side}"] += 1
        if value == LabelValue.LACKING:
            c[f"lacking_{side}"] += 1
    er_pos = error_rate(c["lacking_success"], c["applicable_success"])
    er_neg = error_rate(c["lacking_failed"], c["applicable_failed"])
    return RunStats(
        run=run,
        capability=capability,
        n_success=c["n_success"],
        n_failed=c["n_failed"],
        applicable_success=c["applicable_success"],
        applicable_failed=c["applicable_failed"],
        lacking_success=c["lacking_success"],
        lacking_failed=c["lacking_failed"],
        missing=c["missing"],
        er_pos=er_pos,
        er_neg=er_neg,
        delta=contrastive_gap(er_neg, er_pos, undefined_er_pos),
        cov=coverage(c["lacking_failed"], c["n_failed"]),
        er_pos_defined=er_pos is not None,
    )


def label_grid(labels: list[Label], capabilities: list[str]) -> tuple[list[int], dict[str, bool], dict]:
    """Index labels as {(run, trajectory, capability): value} over the full grid.

    The grid is (runs present) x (trajectories present in any run) x ``capabilities``; a cell with
    no label is missing (value None), exactly like a label recorded as missing. Returns
    (runs, {trajectory: success}, grid). Raises ``ValueError`` on a capability outside the
    dictionary, a duplicated cell, or a trajectory whose success label differs between labels.
    """
    known = set(capabilities)
    success: dict[str, bool] = {}
    cells: dict[tuple[int, str, str], LabelValue | None] = {}
    for lab in labels:
        if lab.capability not in known:
            raise ValueError(f"label for capability {lab.capability!r} which is not in the dictionary")
        if success.setdefault(lab.trajectory, lab.success) != lab.success:
            raise ValueError(f"trajectory {lab.trajectory} has conflicting success labels")
        key = (lab.run, lab.trajectory, lab.capability)
        if key in cells:
            raise ValueError(f"duplicate label for run {lab.run}, {lab.trajectory}, {lab.capability}")
        cells[key] = lab.value
    runs = sorted({lab.run for lab in labels})
    grid = {(r, t, c): cells.get((r, t, c)) for r in runs for t in success for c in capabilities}
    return runs, success, grid


def stats_table(
    labels: list[Label], capabilities: list[str], undefined_er_pos: UndefinedErPos = "zero"
) -> list[RunStats]:
    """RunStats for every (run, capability), runs ascending, capabilities in dictionary order."""
    runs, success, grid = label_grid(labels, capabilities)
    return [
        capability_run_stats(r, c, [(grid[(r, t, c)], success[t]) for t in success], undefined_er_pos)
        for r in runs
        for c in capabilities
    ]
