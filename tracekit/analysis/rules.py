"""Labels from rules, the reference analysis's machinery (no LLM): :class:`RuleLabeler`, the base of every target's
reference labeler (each target's rules live in its folder, ``tracekit/targets/<kind>/``), and the agreement of two
label sets (fraction equal, Cohen's kappa)."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tracekit.analysis.labeling import LabelingResult, labeling_report
from tracekit.types import Capability, Label, LabelValue, Trajectory, stable_hash

log = logging.getLogger(__name__)


class RuleLabeler:
    """A labeler from per-trajectory rules (a target's reference labeler): :meth:`rules` gives each trajectory's
    ``{capability: (value, rationale)}``, or None when there is nothing to judge it by (:attr:`unjudged` says why:
    its labels are recorded missing and counted). Every run gives the same labels unless ``noise`` > 0, which flips
    an applicable label with that probability, seeded by (seed, run, trajectory, capability)."""

    name = "reference"
    capabilities: tuple[str, ...] = ()  # the dictionary entries it has rules for
    dictionary_path: Path  # the pinned dictionary (named in the refusal of any other entry)
    unjudged = "nothing to judge the trajectory by"

    def __init__(self, noise: float = 0.0):
        if not 0.0 <= noise <= 0.5:
            raise ValueError(f"reference labeler noise must be in [0, 0.5], got {noise}")
        self.noise = noise

    def rules(self, traj: Trajectory) -> dict[str, tuple[LabelValue, str]] | None:
        raise NotImplementedError(f"{type(self).__name__} gives no labeling rules")

    def _noisy(self, value: LabelValue, seed: int, run: int, uid: str, cap: str) -> LabelValue:
        if self.noise == 0.0 or value == LabelValue.NA:
            return value
        if random.Random(stable_hash([seed, run, uid, cap])).random() >= self.noise:
            return value
        return LabelValue.LACKING if value == LabelValue.PRESENT else LabelValue.PRESENT

    def label_runs(
        self,
        trajectories: list[Trajectory],
        dictionary: list[Capability],
        runs: Sequence[int],
        seed: int,
        work_dir: Path,
    ) -> LabelingResult:
        """Labels for every run. ``work_dir`` is unused: rules need no cache."""
        unknown = [c.name for c in dictionary if c.name not in self.capabilities]
        if unknown:
            raise ValueError(
                f"{type(self).__name__} has rules only for {sorted(self.capabilities)}; dictionary also has {unknown} "
                f"(pin {self.dictionary_path.name})"
            )
        base = {t.uid: self.rules(t) for t in trajectories}
        unjudged = sorted(uid for uid, v in base.items() if v is None)
        labels = []
        for r in runs:
            for t in trajectories:
                got = base[t.uid]
                for c in dictionary:
                    if got is None:
                        value, why = None, self.unjudged
                    else:
                        value, why = self._noisy(got[c.name][0], seed, r, t.uid, c.name), got[c.name][1]
                    labels.append(Label(trajectory=t.uid, capability=c.name, run=r, value=value, rationale=why, success=t.success))
        report = labeling_report(labels, dictionary)
        report.update(labeler=self.name, noise=self.noise, trajectories_without_gold=unjudged)
        if unjudged:
            log.warning("%s: %d trajectories without labels (%s)", type(self).__name__, len(unjudged), self.unjudged)
        return LabelingResult(labels, report)


# ---------------------------------------------------------------- agreement


def cohen_kappa(pairs: Sequence[tuple[LabelValue, LabelValue]]) -> float | None:
    """Cohen's kappa = (p_o - p_e) / (1 - p_e) over 3 classes; None when p_e = 1 (both raters constant and equal) or no pairs."""
    n = len(pairs)
    if n == 0:
        return None
    p_o = sum(a == b for a, b in pairs) / n
    ca, cb = Counter(a for a, _ in pairs), Counter(b for _, b in pairs)
    p_e = sum(ca[v] * cb[v] for v in LabelValue) / (n * n)
    if p_e >= 1.0:
        return None
    return (p_o - p_e) / (1.0 - p_e)


def agreement(labels_a: list[Label], labels_b: list[Label]) -> dict[str, Any]:
    """Per-capability and pooled agreement (fraction equal) and Cohen's kappa between two label sets.

    Labels pair on (trajectory, capability, run); a pair where either label is missing, or a
    label without a partner, is left out and counted (``unpaired``).
    """
    idx_a = {(x.trajectory, x.capability, x.run): x.value for x in labels_a}
    idx_b = {(x.trajectory, x.capability, x.run): x.value for x in labels_b}
    by_cap: dict[str, list[tuple[LabelValue, LabelValue]]] = {}
    for key in sorted(idx_a.keys() & idx_b.keys()):
        a, b = idx_a[key], idx_b[key]
        if a is not None and b is not None:
            by_cap.setdefault(key[1], []).append((a, b))
    unpaired = len(idx_a.keys() | idx_b.keys()) - sum(len(v) for v in by_cap.values())

    def summary(pairs: list[tuple[LabelValue, LabelValue]]) -> dict[str, Any]:
        return {
            "n": len(pairs),
            "agreement": sum(a == b for a, b in pairs) / len(pairs) if pairs else None,
            "kappa": cohen_kappa(pairs),
        }

    pooled = [p for v in by_cap.values() for p in v]
    return {
        "per_capability": {c: summary(v) for c, v in sorted(by_cap.items())},
        "overall": summary(pooled),
        "unpaired": unpaired,
    }
