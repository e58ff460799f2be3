"""Scoring TRACE's analysis against the planted set (issue 21): precision and recall of the selected
capabilities, over seeds and a delta/rho grid.

For each master seed (stochastic base rollout and label noise are drawn from it) the pipeline runs up to
``select`` once per (delta, rho) point: the rollout, the dictionary and the labels are computed once per seed
and every other point recomputes ``select`` alone (the run's record shows which stages were computed; a point
that recomputes anything else is refused). With S the selected set and P the planted set:

    precision = |S & P| / |S|   (undefined, shown as n/a, when nothing is selected)
    recall    = |S & P| / |P|

Outputs (``--out``): ``planted_analysis.md`` (per seed and mean over seeds, every grid point, the selected
capabilities), ``planted_analysis.csv`` and ``planted_analysis.png`` (mean precision and recall over the grid).

    python -m tracekit.planted.score --seeds 0 1 2 --out benchmarks/results/planted  experiment=planted
"""

from __future__ import annotations

import argparse
import csv
import io
import logging
import sys
import time
from pathlib import Path
from typing import Any

from tracekit.artifacts import StageCache, atomic_write_json, atomic_write_text, read_json
from tracekit.cli import compose_config
from tracekit.config import ConfigError
from tracekit.pipeline import RunRecord
from tracekit.warmstart.planted import PlantedSpec
from tracekit.report.logging import RunLogger
from tracekit.runs import trajectories_of
from tracekit.stages import build_pipeline

log = logging.getLogger(__name__)

DELTAS = (0.10, 0.20, 0.30)
RHOS = (0.05, 0.10, 0.20)


def precision_recall(selected: list[str], planted: list[str]) -> tuple[float | None, float]:
    """(precision, recall) of ``selected`` against ``planted``; precision is None when nothing is selected."""
    if not planted:
        raise ValueError("the planted set is empty: recall is undefined")
    hit = len(set(selected) & set(planted))
    return (hit / len(set(selected)) if selected else None), hit / len(set(planted))


def run_grid(overrides: list[str], seeds: list[int], deltas: tuple[float, ...] = DELTAS,
             rhos: tuple[float, ...] = RHOS, run_root: Path = Path("outputs/planted/runs")) -> list[dict[str, Any]]:
    """One row per (seed, delta, rho): the selected capabilities, precision, recall and what was computed."""
    rows = []
    for seed in seeds:
        first = True
        for d in deltas:
            for r in rhos:
                extra = [f"seed={seed}", f"thresholds.delta={d}", f"thresholds.rho={r}", "logger=none",
                         f"paths.root_dir={Path.cwd()}", f"paths.run_dir={run_root.resolve()}/seed{seed}_d{d}_r{r}"]
                cfg = compose_config([*overrides, *extra])
                if cfg.backbone.get("planted") is None:
                    raise ValueError("scoring the analysis needs a planted backbone (backbone.planted; experiment=planted)")
                planted = PlantedSpec.from_config(cfg.backbone.planted).planted_set
                record = RunRecord(Path(cfg.paths.run_dir))
                record.run_dir.mkdir(parents=True, exist_ok=True)
                record.logger = RunLogger(cfg, record.run_dir)
                t0 = time.time()
                build_pipeline().run(cfg, ["select"], StageCache(cfg.paths.cache_dir), record)
                computed = sorted({a["stage"] for a in record.artifacts.values() if not a["cache_hit"]})
                if not first and set(computed) - {"select"}:
                    raise RuntimeError(f"seed {seed} delta {d} rho {r}: recomputed {computed}, not select alone")
                if first:
                    by_env = base_success_by_env(StageCache(cfg.paths.cache_dir), record)
                first = False
                sel_art = next(a for a in record.artifacts.values() if a["stage"] == "select")
                selection = read_json(Path(sel_art["path"]) / "selected.json")
                selected = [c["name"] for c in selection["selected"]]
                p, rec = precision_recall(selected, planted)
                rows.append({"seed": seed, "delta": d, "rho": r, "selected": selected, "planted": planted,
                             "precision": p, "recall": rec, "computed": computed,
                             "n_trajectories": selection["n_trajectories"], "n_success": selection["n_success"],
                             "candidates": {c["name"]: {"mean_delta": c["mean_delta"], "mean_cov": c["mean_cov"],
                                                        "selection_count": c["selection_count"]}
                                            for c in selection["candidates"]},
                             "base_success_by_env": by_env, "seconds": round(time.time() - t0, 2)})
                log.info("seed %d delta %.2f rho %.2f: selected %s (P %s, R %.2f), computed %s", seed, d, r, selected,
                         "n/a" if p is None else f"{p:.2f}", rec, computed)
    return rows


def base_success_by_env(cache: Any, record: Any) -> dict[str, list[int]]:
    """{environment: [successes, episodes]} of the run's base rollout: whether the warm start made the strong
    capabilities strong and left the planted ones weak."""
    art = next(a for a in record.artifacts.values() if a["stage"] == "rollout")
    counts: dict[str, list[int]] = {}
    for t in trajectories_of(cache.lookup("rollout", art["key"])):
        c = counts.setdefault(t.env, [0, 0])
        c[0] += int(t.success)
        c[1] += 1
    return dict(sorted(counts.items()))


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean precision (over seeds where defined) and recall per grid point."""
    import numpy as np

    out = []
    for d, r in dict.fromkeys((x["delta"], x["rho"]) for x in rows):
        pts = [x for x in rows if x["delta"] == d and x["rho"] == r]
        ps = [x["precision"] for x in pts if x["precision"] is not None]
        out.append({"delta": d, "rho": r, "seeds": len(pts), "precision": float(np.mean(ps)) if ps else None,
                    "precision_defined": len(ps), "recall": float(np.mean([x["recall"] for x in pts])),
                    "recall_min": min(x["recall"] for x in pts),
                    "exact": sum(set(x["selected"]) == set(x["planted"]) for x in pts)})
    return out


def render(rows: list[dict[str, Any]], out: Path, title: str = "") -> dict[str, Path]:
    """Write the table (md, csv) and the figure (png) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    planted = rows[0]["planted"]
    seeds = sorted({x["seed"] for x in rows})
    md = [f"# Analysis vs the planted set{(': ' + title) if title else ''}", "",
          f"Planted set (the capabilities the warm start left out): {', '.join(planted)}. Seeds: {seeds}. "
          "Precision = |selected & planted| / |selected| (n/a: nothing selected), recall = |selected & planted| / "
          "|planted|; K of N and the labeler as configured.", "",
          "## Mean over seeds", "", "| delta | rho | precision | recall (min) | exact match | seeds |",
          "|---|---|---|---|---|---|"]
    for s in summary:
        md.append(f"| {s['delta']:.2f} | {s['rho']:.2f} | {_fmt(s['precision'])} | {s['recall']:.2f} "
                  f"({s['recall_min']:.2f}) | {s['exact']}/{s['seeds']} | {s['seeds']} |")
    md += ["", "## Per seed", "", "| seed | delta | rho | selected | precision | recall | computed |",
           "|---|---|---|---|---|---|---|"]
    for x in rows:
        md.append(f"| {x['seed']} | {x['delta']:.2f} | {x['rho']:.2f} | {', '.join(x['selected']) or '(none)'} | "
                  f"{_fmt(x['precision'])} | {x['recall']:.2f} | {', '.join(x['computed']) or 'none'} |")
    md += ["", "## Candidates (per seed, first grid point)", "", "| seed | capability | mean Delta | mean Cov |",
           "|---|---|---|---|"]
    for seed in seeds:
        first = next(x for x in rows if x["seed"] == seed)
        for name, c in first["candidates"].items():
            md.append(f"| {seed} | {name}{' (planted)' if name in planted else ''} | {_fmt(c['mean_delta'])} | "
                      f"{_fmt(c['mean_cov'])} |")
        md.append(f"| {seed} | ({first['n_success']}/{first['n_trajectories']} trajectories successful) | | |")
    md += ["", "## The base agent per environment (successful / episodes of each seed's rollout)", "",
           "| seed | " + " | ".join(rows[0]["base_success_by_env"]) + " |",
           "|---|" + "---|" * len(rows[0]["base_success_by_env"])]
    for seed in seeds:
        first = next(x for x in rows if x["seed"] == seed)
        md.append(f"| {seed} | " + " | ".join(f"{a}/{n}" for a, n in first["base_success_by_env"].values()) + " |")
    paths = {"md": out / "planted_analysis.md", "csv": out / "planted_analysis.csv", "png": out / "planted_analysis.png"}
    atomic_write_text(paths["md"], "\n".join(md) + "\n")
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["seed", "delta", "rho", "selected", "planted", "precision", "recall", "computed"])
    for x in rows:
        w.writerow([x["seed"], x["delta"], x["rho"], ";".join(x["selected"]), ";".join(x["planted"]),
                    "" if x["precision"] is None else f"{x['precision']:.4f}", f"{x['recall']:.4f}", ";".join(x["computed"])])
    atomic_write_text(paths["csv"], buf.getvalue())
    _figure(summary, paths["png"], planted)
    return paths


def _figure(summary: list[dict[str, Any]], path: Path, planted: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    deltas = sorted({s["delta"] for s in summary})
    rhos = sorted({s["rho"] for s in summary})
    fig, axes = plt.subplots(1, 2, figsize=(8.6, 3.4), gridspec_kw={"wspace": 0.45})
    for ax, key in zip(axes, ("precision", "recall")):
        grid = np.full((len(deltas), len(rhos)), np.nan)
        for s in summary:
            if s[key] is not None:
                grid[deltas.index(s["delta"]), rhos.index(s["rho"])] = s[key]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="lower")
        for i in range(len(deltas)):
            for j in range(len(rhos)):
                ax.text(j, i, "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.2f}", ha="center", va="center",
                        color="white" if np.isnan(grid[i, j]) or grid[i, j] < 0.6 else "black", fontsize=9)
        ax.set_xticks(range(len(rhos)), [f"{r:.2f}" for r in rhos])
        ax.set_yticks(range(len(deltas)), [f"{d:.2f}" for d in deltas])
        ax.set_xlabel("rho (coverage)")
        ax.set_ylabel("delta (contrast)")
        ax.set_title(f"mean {key} over seeds")
    fig.colorbar(im, ax=axes, shrink=0.8)
    fig.suptitle(f"selected vs planted {{{', '.join(planted)}}}", fontsize=9)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    plt.close(fig)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracekit.planted.score", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--deltas", type=float, nargs="+", default=list(DELTAS))
    p.add_argument("--rhos", type=float, nargs="+", default=list(RHOS))
    p.add_argument("--out", type=Path, default=Path("outputs/planted"))
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. experiment=planted)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")

    try:
        rows = run_grid(a.overrides, a.seeds, tuple(a.deltas), tuple(a.rhos), run_root=a.out / "runs")
    except (ConfigError, ValueError) as e:
        print(f"tracekit.planted.score: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2

    atomic_write_json(a.out / "planted_analysis.json", rows, sort_keys=False)
    paths = render(rows, a.out)
    print(paths["md"].read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
