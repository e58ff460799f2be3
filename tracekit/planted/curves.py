"""Per-capability GRPO learning curves and run health per iteration (issue 21).

An informative group is one with reward variance (GRPO drops the others: their advantages are all zero), so
the informative-group rate is ``1 - frac_groups_dropped`` of the trainer's ``metrics.csv``. The health panel
plots the trainer's health columns beside it (``tracekit.rl.trainer.METRIC_COLUMNS``): reward mean +- std,
informative-group rate, policy entropy, k3 KL to the frozen base (only when some run measured it), clip
fraction, pre-clip gradient norm and the rollout-minus-trainer log-prob gap (mean, and mean |gap|), one line
per capability. A column a run did not record (an older ``metrics.csv``, an empty cell) is NaN: a gap in its
line, an empty cell in the CSV.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_text

# metrics.csv columns read as they are (NaN when the file lacks them or the cell is empty)
HEALTH = ("reward_std", "success_rate", "entropy", "kl_ref", "clip_frac", "grad_norm", "logprob_gap_mean",
          "logprob_gap_abs")
CSV_COLUMNS = ["iteration", "reward", "reward_std", "success_rate", "informative", "groups", "entropy", "kl_ref",
               "clip_frac", "grad_norm", "logprob_gap_mean", "logprob_gap_abs"]


def _cell(r: dict[str, str], column: str) -> float:
    v = r.get(column)
    return float(v) if v not in (None, "") else float("nan")


def read_curve(metrics_csv: str | Path) -> list[dict[str, float]]:
    """One row per GRPO iteration: iteration, reward, informative-group rate, groups, and the health columns
    of :data:`HEALTH` (NaN where the file has none)."""
    rows = []
    with open(metrics_csv, newline="") as f:
        for r in csv.DictReader(f):
            rows.append({"iteration": int(float(r["iteration"])), "reward": float(r["reward_mean"]),
                         "informative": 1.0 - float(r["frac_groups_dropped"]), "groups": int(float(r["groups"])),
                         **{col: _cell(r, col) for col in HEALTH}})
    if not rows:
        raise ValueError(f"{metrics_csv}: no GRPO iterations")
    return rows


def _measured(curves: dict[str, list[dict[str, float]]], key: str) -> bool:
    return any(not math.isnan(r.get(key, float("nan"))) for rows in curves.values() for r in rows)


def panels(curves: dict[str, list[dict[str, float]]]) -> list[tuple[str, str]]:
    """(curve key, title) of each health subplot, in order; KL to the base only when some run measured it."""
    out = [("reward", "mean reward (+- std over the rollouts)"), ("informative", "informative-group rate"),
           ("entropy", "policy entropy (nats / token)")]
    if _measured(curves, "kl_ref"):
        out.append(("kl_ref", "KL to the base (k3, per token)"))
    out += [("clip_frac", "clip fraction"), ("grad_norm", "grad norm (pre-clip)"),
            ("logprob_gap_mean", "log-prob gap rollout - trainer"), ("logprob_gap_abs", "mean |log-prob gap|")]
    return out


def write_curves(curves: dict[str, list[dict[str, float]]], png: Path, csv_path: Path | None = None,
                 title: str = "") -> None:
    """The curves of every run (label -> rows) as one PNG (a grid of the :func:`panels` subplots, one line per
    run) and a long CSV (:data:`CSV_COLUMNS`, one row per run and iteration; NaN as an empty cell)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    which = panels(curves)
    ncols = 4
    nrows = math.ceil(len(which) / ncols)
    fig, grid = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False, layout="constrained")
    axes = grid.ravel()
    for ax, (key, name) in zip(axes, which):
        for n, (label, rows) in enumerate(curves.items()):
            color = f"C{n % 10}"
            it = [r["iteration"] for r in rows]
            ys = [r.get(key, float("nan")) for r in rows]
            ax.plot(it, ys, marker="o", ms=3, color=color, label=label)
            if key == "reward":
                std = [r.get("reward_std", float("nan")) for r in rows]
                ax.fill_between(it, [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)],
                                color=color, alpha=0.15, linewidth=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("GRPO iteration", fontsize=8)
        if key in ("informative", "clip_frac"):
            ax.set_ylim(-0.05, 1.05)
        if key == "logprob_gap_mean":
            ax.axhline(0.0, color="0.5", lw=0.6)
        ax.grid(alpha=0.3)
    for ax in axes[len(which):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    png.parent.mkdir(parents=True, exist_ok=True)
    tmp = png.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(png)
    if csv_path is not None:
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["run", *CSV_COLUMNS])
        for label, rows in curves.items():
            for r in rows:
                w.writerow([label, *(_fmt(r.get(k, float("nan"))) for k in CSV_COLUMNS)])
        atomic_write_text(csv_path, buf.getvalue())


def _fmt(v: float | int) -> str:
    if isinstance(v, int):
        return str(v)
    return "" if math.isnan(v) else f"{v:.6g}"


def adapter_curves(adapter_dirs: dict[str, Path]) -> dict[str, list[dict[str, Any]]]:
    return {label: read_curve(Path(d) / "metrics.csv") for label, d in adapter_dirs.items()}


def cache_curves(cache_dir: str | Path) -> dict[str, list[dict[str, Any]]]:
    """Curves of every GRPO run in a stage cache, finished (``adapters/<key>``) or cut off (``<key>.partial``,
    its iterations so far), labelled by its environment's capability."""
    import json

    out = {}
    for d in sorted(Path(cache_dir, "adapters").iterdir()):
        metrics, first = d / "metrics.csv", d / "rollouts" / "iter_00000.jsonl"
        if not (metrics.is_file() and first.is_file()):
            continue
        with open(first) as f:
            env = json.loads(f.readline())["env"]
        label = env.removeprefix("tau2_") + (" (cut off)" if d.name.endswith(".partial") else "")
        try:
            out[label] = read_curve(metrics)
        except ValueError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tracekit.planted.curves", description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=Path("outputs/cache"))
    p.add_argument("--out", type=Path, default=Path("outputs/planted"))
    a = p.parse_args(argv)
    curves = cache_curves(a.cache)
    if not curves:
        print("no GRPO runs with metrics in", a.cache)
        return 1
    write_curves(curves, a.out / "planted_curves.png", a.out / "planted_curves.csv",
                 title=f"per-capability GRPO (stage cache {a.cache})")
    for label, rows in curves.items():
        print(label, " ".join(f"it{r['iteration']}: R {r['reward']:.2f} inf {r['informative']:.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
