"""The ladder chart: every evaluated row's success with its interval, and its paired difference against Base
(issue 50). Every run that evaluates writes one beside its ``results.json`` (``ladder.png``, linked from
``summary.md``); a multirun's side-by-side table writes one over all its jobs' rows.

Left panel: each row's overall success (%) with a 95% Wilson score interval on its solved / total episodes (an
interval on the row alone). Right panel: each non-Base row's paired difference against Base on the same episodes
with its 95% percentile-bootstrap interval over tasks (:func:`tracekit.paired.summary_of_outcomes`, the paired
lines of the table): the comparison the ladder is about. A difference whose interval lies above 0 is drawn filled.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from tracekit.paired import base_label, summary_of_outcomes

LADDER_PNG = "ladder.png"
RESULTS_MD = "results.md"  # the run's table, as printed
Z95 = 1.959963984540054


def wilson_interval(solved: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion (stays inside [0, 1]; sensible at 0 and ``total`` successes)."""
    if total <= 0:
        raise ValueError(f"wilson_interval: total must be >= 1, got {total}")
    p = solved / total
    denom = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / denom
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def ladder_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One entry per row, in table order: label, success rate and its Wilson interval, and (rows other than Base,
    where the rows kept their outcomes) the paired difference against Base and its interval."""
    base = base_label(results)
    out = []
    for label, r in results.items():
        o = r["overall"]
        lo, hi = wilson_interval(int(o["solved"]), int(o["total"]))
        row = {"label": label, "rate": float(o["pass_rate"]), "ci": [lo, hi], "paired": None}
        if base is not None and label != base:
            paired = r.get("paired_vs_base")
            if paired is None and "outcomes" in r and "outcomes" in results[base]:
                paired = summary_of_outcomes(results[base]["outcomes"], r["outcomes"])
            if paired is not None:
                row["paired"] = {"diff": float(paired["diff"]), "ci": [float(x) for x in paired["ci"]]}
        out.append(row)
    return out


def write_ladder_chart(results: dict[str, Any], out: Path, title: str) -> Path:
    """Draw the ladder of ``results`` (a results.json mapping) into ``out`` (PNG, written atomically)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = ladder_rows(results)
    if not rows:
        raise ValueError("write_ladder_chart: no rows to draw")
    n = len(rows)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.55 * n), sharey=True,
                                      gridspec_kw={"width_ratios": [1.1, 1]})
    ys = list(range(n))[::-1]
    for y, r in zip(ys, rows, strict=True):
        rate, (lo, hi) = 100 * r["rate"], r["ci"]
        left.barh(y, rate, color="#9ecae1" if r["paired"] is None else "#3182bd", height=0.6)
        left.errorbar(rate, y, xerr=[[rate - 100 * lo], [100 * hi - rate]], fmt="none", ecolor="black", capsize=3)
        left.text(100 * hi + 1, y, f"{rate:.1f}", va="center", fontsize=9)
        p = r["paired"]
        if p is not None:
            d, (plo, phi) = 100 * p["diff"], p["ci"]
            above = plo > 0
            right.errorbar(d, y, xerr=[[d - 100 * plo], [100 * phi - d]], fmt="o", capsize=3,
                           color="#31a354" if above else "#636363", mfc="#31a354" if above else "white")
            right.text(100 * phi + 0.8, y, f"{d:+.1f} [{100 * plo:+.1f}, {100 * phi:+.1f}]", va="center", fontsize=9)
    left.set_yticks(ys, [r["label"] for r in rows])
    left.set_xlim(0, 105)
    left.set_xlabel("success (%), 95% Wilson interval")
    right.axvline(0, color="black", lw=0.8)
    spans = [100 * x for r in rows if r["paired"] for x in r["paired"]["ci"]]
    if spans:
        right.set_xlim(min(0.0, min(spans)) - 3, max(0.0, max(spans)) + 14)
    right.set_xlabel("paired difference vs Base (points), 95% bootstrap CI")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    return out
