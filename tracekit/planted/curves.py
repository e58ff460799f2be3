"""Per-capability GRPO learning curves: mean reward and informative-group rate per iteration (issue 21).

An informative group is one with reward variance (GRPO drops the others: their advantages are all zero), so
the informative-group rate is ``1 - frac_groups_dropped`` of the trainer's ``metrics.csv``.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_text


def read_curve(metrics_csv: str | Path) -> list[dict[str, float]]:
    """One row per GRPO iteration: iteration, reward, success rate, informative-group rate, groups."""
    rows = []
    for r in csv.DictReader(open(metrics_csv)):
        rows.append({"iteration": int(float(r["iteration"])), "reward": float(r["reward_mean"]),
                     "success_rate": float(r["success_rate"]) if r.get("success_rate") not in (None, "") else float("nan"),
                     "informative": 1.0 - float(r["frac_groups_dropped"]), "groups": int(float(r["groups"]))})
    if not rows:
        raise ValueError(f"{metrics_csv}: no GRPO iterations")
    return rows


def write_curves(curves: dict[str, list[dict[str, float]]], png: Path, csv_path: Path | None = None,
                 title: str = "") -> None:
    """The curves of every run (label -> rows) as one PNG (reward, informative-group rate) and a long CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for label, rows in curves.items():
        it = [r["iteration"] for r in rows]
        axes[0].plot(it, [r["reward"] for r in rows], marker="o", ms=3, label=label)
        axes[1].plot(it, [r["informative"] for r in rows], marker="o", ms=3, label=label)
    axes[0].set_ylabel("mean reward (rollouts of the iteration)")
    axes[1].set_ylabel("informative-group rate")
    for ax in axes:
        ax.set_xlabel("GRPO iteration")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
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
        w.writerow(["run", "iteration", "reward", "success_rate", "informative", "groups"])
        for label, rows in curves.items():
            for r in rows:
                w.writerow([label, r["iteration"], f"{r['reward']:.4f}", f"{r['success_rate']:.4f}",
                            f"{r['informative']:.4f}", r["groups"]])
        atomic_write_text(csv_path, buf.getvalue())


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
                 title="per-capability GRPO on the planted agent")
    for label, rows in curves.items():
        print(label, " ".join(f"it{r['iteration']}: R {r['reward']:.2f} inf {r['informative']:.2f}" for r in rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
