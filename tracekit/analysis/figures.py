"""Figures of the selection (paper Figure 3) as PNG files, drawn from the selection dict.

- ``selection_frequency.png`` (Fig. 3a): per candidate, in how many of the N runs it passed the
  thresholds; kept capabilities (>= K runs) highlighted, a dashed line at K.
- ``failure_coverage.png`` (Fig. 3b): per candidate, the median over runs of Cov(c) with IQR
  (25th-75th percentile) error bars; kept capabilities highlighted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

KEPT, DROPPED = "#2e7d32", "#9e9e9e"


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only; never a display), imported when a figure is drawn
    (importing it takes about a second: the stages module imports this one)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path) -> Path:
    """Save via a temp name + rename (atomic, like every artifact)."""
    plt = _pyplot()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=150, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)
    return path


def selection_frequency_figure(selection: dict[str, Any], path: Path) -> Path:
    cands = sorted(selection["candidates"], key=lambda c: (-c["selection_count"], c["name"]))
    n, k = len(selection["runs"]), selection["thresholds"]["k"]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(cands) + 1.5), 3.6))
    ax.bar(
        range(len(cands)),
        [c["selection_count"] for c in cands],
        color=[KEPT if c["selected"] else DROPPED for c in cands],
    )
    ax.axhline(k, ls="--", lw=1, color="k", label=f"K = {k}")
    ax.set_xticks(range(len(cands)), [c["name"] for c in cands], rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, n + 0.5)
    ax.set_ylabel(f"runs selected (of {n})")
    t = selection["thresholds"]
    ax.set_title(f"Capability selection frequency (delta={t['delta']:g}, rho={t['rho']:g})", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def failure_coverage_figure(selection: dict[str, Any], path: Path) -> Path:
    cands = [c for c in selection["candidates"] if c["median_cov"] is not None]
    cands.sort(key=lambda c: (-c["median_cov"], c["name"]))
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 0.9 * len(cands) + 1.5), 3.6))
    med = [c["median_cov"] for c in cands]
    lo = [c["median_cov"] - c["cov_iqr"][0] for c in cands]
    hi = [c["cov_iqr"][1] - c["median_cov"] for c in cands]
    ax.bar(range(len(cands)), med, color=[KEPT if c["selected"] else DROPPED for c in cands])
    ax.errorbar(range(len(cands)), med, yerr=[lo, hi], fmt="none", ecolor="k", capsize=3, lw=1)
    rho = selection["thresholds"]["rho"]
    ax.axhline(rho, ls="--", lw=1, color="k", label=f"rho = {rho:g}")
    ax.set_xticks(range(len(cands)), [c["name"] for c in cands], rotation=35, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("failure coverage (median, IQR)")
    ax.set_title("Failed trajectories lacking each capability", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def write_figures(selection: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Both figures into ``out_dir``; returns {figure name: path} for logging (e.g. to W&B)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "selection_frequency": selection_frequency_figure(selection, out / "selection_frequency.png"),
        "failure_coverage": failure_coverage_figure(selection, out / "failure_coverage.png"),
    }
