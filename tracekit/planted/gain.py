"""The measured gain on the planted testbed (issue 21): Base / best Single-capability GRPO / TRACE on the held-out
target tasks, with 95% intervals, the per-capability GRPO learning curves and the gate report.

Each variant (``--variant "grpo.lr=5e-5 grpo.iterations=20"``; none: the preset as it is) is one run of the app
(``python -m tracekit experiment=planted <overrides> <variant>``, every stage cached and shared: variants that
differ only in GRPO settings share the warm start, the base rollout and the analysis). ``--training-seeds 0 1 2``
runs each variant once per training seed (``seed=s backbone.planted.seed=s``, and for a world-tokenizer backbone
trained from random initialization ``backbone.planted.init_seed=s``: the initial weights, the warm start's
demonstrations and SFT order, the labeling noise, GRPO, the gate: the whole pipeline), and adds the seed table: per
row, each seed's overall pass rate and paired difference against Base, their mean and spread. Written to ``--out``:

- ``planted_gain.md`` / ``.json``: per variant and row, the per-seed overall pass rates, their mean +- the Student-t
  95% half-width (evaluate.py's interval: seeds are the replicates), the pooled Wilson 95% interval over every
  (task, seed) episode, per-environment means, the training budget, and whether TRACE's and Base's intervals
  overlap; beside them each row's paired comparison with Base, and with TRACE, on the same episodes
  (``paired_vs_base`` / ``paired_vs_trace``: the difference in points, its task-cluster bootstrap 95% CI,
  fixed / broken episodes, exact McNemar p; see :mod:`tracekit.paired`) and the measured power (the half-width
  the TRACE - Base differences achieve, and the episodes needed for +-5 points);
- ``planted_curves.png`` / ``.csv``: reward and informative-group rate per GRPO iteration, per capability and
  variant;
- ``planted_gate.md``: the compose report (CE on held-out gate examples before/after, routing usage);
- ``planted.json``: the warm start's record (planted set, demonstrations, seed).

    python -m tracekit.planted.gain --out benchmarks/results/planted experiment=planted
    python -m tracekit.planted.gain --out benchmarks/results/micro/final --training-seeds 0 1 2 \\
        -- experiment=micro
"""

from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from tracekit.artifacts import atomic_write_json, atomic_write_text, read_json
from tracekit.cli import compose_config, task
from tracekit.config import ConfigError
from tracekit.llm.backbones import get_spec
from tracekit.methods.consolidate.moe import moe_report
from tracekit.paired import Z95, paired_vs_base, required_n, summary_of_outcomes
from tracekit.planted.curves import adapter_curves, write_curves
from tracekit.warmstart.planted import PlantedSpec, planted_record
from tracekit.targets.registry import target_of
from tracekit.wiring import backbone_dict

log = logging.getLogger(__name__)


def wilson(solved: int, total: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% by default)."""
    if total <= 0:
        raise ValueError("no episodes")
    p = solved / total
    den = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / den
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / den
    return centre - half, centre + half


def row_summary(r: dict[str, Any]) -> dict[str, Any]:
    """One results.json row as the gain table's numbers."""
    ov = r["overall"]
    st = r.get("stochastic") or {}
    per_seed = st.get("overall", {}).get("per_run")
    mean = st.get("overall", {}).get("mean", ov["pass_rate"])
    half = st.get("overall", {}).get("ci")
    lo, hi = wilson(ov["solved"], ov["total"])
    return {"per_seed": per_seed, "mean": mean, "t_ci": half,
            "t_interval": None if half is None else [mean - half, mean + half],
            "solved": ov["solved"], "episodes": ov["total"], "wilson": [lo, hi],
            "domains": {env: (st.get(env) or {}).get("mean", d["pass_rate"]) for env, d in r["domains"].items()},
            "domain_ci": {env: (st.get(env) or {}).get("ci") for env in r["domains"]},
            "budget": r.get("budget", {}), "method": r.get("method")}


def paired_rows(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each non-base row's paired comparison with Base: the one ``write_results`` stored (``paired_vs_base``),
    else recomputed from the rows' ``outcomes``; rows evaluated before outcomes were kept have none."""
    stored = {label: r["paired_vs_base"] for label, r in results.items() if "paired_vs_base" in r}
    return {**paired_vs_base(results), **stored}


POWER_HALF_WIDTH = 0.05  # the +-5-point interval the power line asks the episodes for


def paired_vs_trace(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each row other than TRACE against TRACE on the same episodes (empty without a TRACE row or outcomes)."""
    trace = next((label for label, r in results.items() if r.get("method") == "trace"), None)
    if trace is None or "outcomes" not in results[trace]:
        return {}
    return {label: summary_of_outcomes(results[trace]["outcomes"], r["outcomes"])
            for label, r in results.items() if label != trace and "outcomes" in r}


def seed_rows(table: dict[str, Any], seeds: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The training-seed table: per row method (Single's label names its capability, which may differ by seed),
    each seed's overall pass rate and paired difference against Base (with its CI), and their mean, sd and range.
    ``seeds``: variant name -> training seed."""
    out: dict[str, dict[str, Any]] = {}
    for name, seed in seeds.items():
        for label, s in table[name]["rows"].items():
            row = out.setdefault(s["method"] or label, {"labels": {}, "per_seed": {}})
            row["labels"][seed] = label
            pair = s.get("paired_vs_base")
            row["per_seed"][seed] = {"overall": s["mean"], "vs_base": None if pair is None else pair["diff"],
                                     "vs_base_ci": None if pair is None else pair["ci"],
                                     "excludes_zero": None if pair is None else pair["excludes_zero"]}
    for row in out.values():
        for key in ("overall", "vs_base"):
            xs = [v[key] for v in row["per_seed"].values() if v[key] is not None]
            if xs:
                m = sum(xs) / len(xs)
                sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else None
                row[key] = {"mean": m, "sd": sd, "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


def seed_md(rows: dict[str, dict[str, Any]]) -> list[str]:
    seeds = sorted({s for r in rows.values() for s in r["per_seed"]})
    md = ["## Training seeds", "",
          "Each seed re-runs the whole pipeline with `seed=s backbone.planted.seed=s` (and, for a world-tokenizer "
          "backbone, `backbone.planted.init_seed=s`): its initial weights, the warm start's demonstrations and SFT "
          "order, the labeling noise, GRPO and the gate.", "",
          "| row | " + " | ".join(f"seed {s}: overall / vs Base [paired 95% CI]" for s in seeds)
          + " | overall mean (sd, range) | vs Base mean (sd, range) |",
          "|---|" + "---|" * len(seeds) + "---|---|"]
    for method, r in rows.items():
        cells = []
        for s in seeds:
            v = r["per_seed"].get(s)
            if v is None:
                cells.append("n/a")
            elif v["vs_base"] is None:
                cells.append(f"{100 * v['overall']:.1f}")
            else:
                cells.append(f"{100 * v['overall']:.1f} / {100 * v['vs_base']:+.1f} [{100 * v['vs_base_ci'][0]:+.1f}, "
                             f"{100 * v['vs_base_ci'][1]:+.1f}]")

        def agg(key: str, sign: str = "") -> str:
            a = r.get(key)
            if a is None:
                return "n/a"
            sd = "n/a" if a["sd"] is None else f"{100 * a['sd']:.1f}"
            return (f"{100 * a['mean']:{sign}.1f} ({sd}, {100 * a['min']:{sign}.1f} to {100 * a['max']:{sign}.1f})")

        md.append(f"| {method} | " + " | ".join(cells) + f" | {agg('overall')} | {agg('vs_base', '+')} |")
    return md + [""]


def power(s: dict[str, Any]) -> dict[str, Any] | None:
    """The power of a paired comparison: the 95% half-width its per-episode differences achieve (normal,
    1.96 sd / sqrt(n), and the bootstrap CI's half-width) and ``required_n`` for +-5 points (None when the sd is
    0: no discordant episode, nothing to scale)."""
    sd, n = s["sd_diff"], s["n_episodes"]
    if sd is None:
        return None
    return {"sd_diff": sd, "n_episodes": n, "half_width_normal": Z95 * sd / math.sqrt(n),
            "half_width_bootstrap": (s["ci"][1] - s["ci"][0]) / 2, "target_half_width": POWER_HALF_WIDTH,
            "required_n": required_n(sd, POWER_HALF_WIDTH) if sd > 0 else None}


def overlap(a: list[float] | None, b: list[float] | None) -> bool | None:
    if a is None or b is None:
        return None
    return not (a[1] < b[0] or b[1] < a[0])


def paired_md(rows: dict[str, dict[str, Any]], against: str = "Base") -> list[str]:
    """The paired table of one variant's rows against Base (or TRACE); nothing when no row has that comparison."""
    key = "paired_vs_base" if against == "Base" else "paired_vs_trace"
    paired = {label: s[key] for label, s in rows.items() if s.get(key)}
    if not paired:
        return []
    md = ["", f"| approach | paired vs {against} (points) | paired 95% CI (points) | fixed / broken | McNemar p | "
          "excludes 0 | episodes (tasks) |", "|---|---|---|---|---|---|---|"]
    for label, p in paired.items():
        md.append(f"| {label} | {100 * p['diff']:+.1f} | {100 * p['ci'][0]:+.1f} to {100 * p['ci'][1]:+.1f} | "
                  f"{p['fixed']} / {p['broken']} | {p['mcnemar_p']:.3g} | {'yes' if p['excludes_zero'] else 'no'} | "
                  f"{p['n_episodes']} ({p['n_tasks']}) |")
    return md


def power_md(pw: dict[str, Any] | None) -> list[str]:
    """The measured-power line of TRACE - Base."""
    if pw is None:
        return []
    needed = ("n/a (no discordant episode: the sd of the difference is 0)" if pw["required_n"] is None
              else f"{pw['required_n']} episodes")
    return [f"Power: the {pw['n_episodes']} TRACE - Base per-episode differences (sd {pw['sd_diff']:.3f}) give a 95% "
            f"half-width of ± {100 * pw['half_width_normal']:.1f} points (normal; task-cluster bootstrap "
            f"± {100 * pw['half_width_bootstrap']:.1f}); ± {100 * pw['target_half_width']:.0f} points needs {needed} "
            "(n = (1.96 sd / h)^2, episodes independent)."]


def compose_variant(overrides: list[str], run_dir: Path) -> Any:
    """The validated config of one variant (``tracekit.config.ConfigError`` or Hydra's error when refused)."""
    return compose_config([*overrides, f"paths.root_dir={Path.cwd()}", f"paths.run_dir={run_dir.resolve()}"])


def run_variant(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Run the app to ``evaluate`` on a composed variant; the run's results, artifacts and seconds."""
    t0 = time.time()
    task(cfg)
    arts = read_json(run_dir / "artifacts.json")
    return {"cfg": cfg, "results": read_json(run_dir / "results.json"), "artifacts": arts,
            "seconds": round(time.time() - t0, 1), "run_dir": str(run_dir)}


def _of(arts: dict[str, Any], stage: str) -> Path | None:
    found = [a for a in arts.values() if a["stage"] == stage]
    return Path(found[-1]["path"]) if found else None


def report(variants: dict[str, dict[str, Any]], out: Path,
           training_seeds: dict[str, int] | None = None) -> dict[str, Any]:
    """Write the gain report of ``variants`` to ``out``; ``training_seeds`` (variant name -> training seed) adds
    the seed table."""
    out.mkdir(parents=True, exist_ok=True)
    table: dict[str, Any] = {}
    curves: dict[str, Any] = {}
    gate_md = []
    for name, v in variants.items():
        rows = {label: row_summary(r) for label, r in v["results"].items()}
        for label, pair in paired_rows(v["results"]).items():
            rows[label]["paired_vs_base"] = pair
        for label, pair in paired_vs_trace(v["results"]).items():
            rows[label]["paired_vs_trace"] = pair
        base = next((s for s in rows.values() if s["method"] == "base"), None)
        trace = next((s for s in rows.values() if s["method"] == "trace"), None)
        verdict = None
        if base and trace:
            pair = trace.get("paired_vs_base")
            verdict = {"t_overlap": overlap(base["t_interval"], trace["t_interval"]),
                       "wilson_overlap": overlap(base["wilson"], trace["wilson"]),
                       "gain": trace["mean"] - base["mean"],
                       "paired_excludes_zero": None if pair is None else pair["excludes_zero"],
                       "power": None if pair is None else power(pair)}
        table[name] = {"rows": rows, "verdict": verdict, "seconds": v["seconds"], "run_dir": v["run_dir"]}
        train = _of(v["artifacts"], "train")
        if train is not None:
            refs = read_json(train / "adapters.json")
            dirs = {cap: train.parent.parent / ref["stage"] / ref["key"] for cap, ref in refs.items()}
            for cap, rows_ in adapter_curves(dirs).items():
                curves[f"{cap}" if len(variants) == 1 else f"{cap} [{name}]"] = rows_
        compose = _of(v["artifacts"], "compose")
        if compose is not None and (compose / "compose.json").is_file():
            c = read_json(compose / "compose.json")
            if "heldout" in c:
                gate_md += [f"## {name}", "", moe_report(c), ""]
    first = next(iter(variants.values()))
    cfg = first["cfg"]

    if cfg.backbone.get("planted"):  # the planted testbed's warm start; experiment=gain has none
        spec = PlantedSpec.from_config(cfg.backbone.planted)
        atomic_write_json(out / "planted.json", planted_record(backbone_dict(cfg)))
        agent = (f"{cfg.backbone.name} after the planted warm start (strong: {', '.join(spec.strong)}; planted "
                 f"gaps: {', '.join(spec.weak)}; {spec.demos_strong} / {spec.demos_weak} demonstrations per "
                 f"environment, seed {spec.seed})")
    else:
        agent = f"{cfg.backbone.name} as released (no warm start)"
    world = target_of(cfg).own(cfg.benchmark)  # a library target's envs and difficulty
    md = [f"# TRACE's gain ({cfg.name})", "",
          f"Backbone: {agent}. Target: {cfg.benchmark.name}, {cfg.benchmark.limit} held-out instances of each of "
          f"{', '.join(world.envs)} (difficulty {world.difficulty}; seeds from 10,000,000). "
          f"Decoding: T={cfg.eval.temperature}, seeds {list(cfg.eval.seeds)}, at most {cfg.eval.max_steps} steps.", "",
          "Intervals: t = Student-t 95% on the per-seed overall pass rates (mean +- t_{0.975,n-1} sd/sqrt(n)); "
          "Wilson = 95% score interval on all (task, seed) episodes pooled (treats episodes as independent). "
          "Paired = each row against Base on the same (task, seed) episodes: mean of the per-episode success "
          "differences, 95% percentile bootstrap resampling tasks with their seeds, fixed (row solved, Base not) / "
          "broken (Base solved, row not), exact two-sided McNemar p on those.", ""]
    for name, t in table.items():
        md += [f"## {name} ({t['seconds']:.0f} s)", "",
               "| approach | overall mean (%) | t 95% CI | per seed (%) | Wilson 95% (%) | "
               + " | ".join(e.removeprefix("tau2_") for e in next(iter(t["rows"].values()))["domains"])
               + " | episodes | gen. tokens | opt. steps |",
               "|---|---|---|---|---|" + "---|" * len(next(iter(t["rows"].values()))["domains"]) + "---|---|---|"]
        for label, s in t["rows"].items():
            ci = "n/a" if s["t_ci"] is None else f"± {100 * s['t_ci']:.1f}"
            seeds = "n/a" if s["per_seed"] is None else " / ".join(f"{100 * p:.1f}" for p in s["per_seed"])
            b = s["budget"]
            md.append(f"| {label} | {100 * s['mean']:.1f} | {ci} | {seeds} | {100 * s['wilson'][0]:.1f}-"
                      f"{100 * s['wilson'][1]:.1f} | " + " | ".join(f"{100 * x:.1f}" for x in s["domains"].values())
                      + f" | {b.get('episodes', 0)} | {b.get('generated_tokens', 0)} | {b.get('optimizer_steps', 0)} |")
        md += paired_md(t["rows"])
        md += paired_md(t["rows"], "TRACE")
        v = t["verdict"]
        if v is not None:
            said = {True: "overlap", False: "do not overlap", None: "n/a"}
            paired_said = {True: "excludes 0", False: "includes 0", None: "n/a (no per-episode outcomes)"}
            md += ["", f"TRACE - Base: {100 * v['gain']:+.1f} points; t intervals {said[v['t_overlap']]}; "
                   f"Wilson intervals {said[v['wilson_overlap']]}; paired 95% CI "
                   f"{paired_said[v['paired_excludes_zero']]}."]
            md += power_md(v["power"])
        md.append("")
    done = {name: seed for name, seed in (training_seeds or {}).items() if name in table}  # a search in progress
    if len(done) > 1:
        table_seeds = seed_rows(table, done)
        md += seed_md(table_seeds)
        table = {**table, "training_seeds": table_seeds}
    atomic_write_text(out / "planted_gain.md", "\n".join(md) + "\n")
    atomic_write_json(out / "planted_gain.json", table, sort_keys=False)
    if curves:
        write_curves(curves, out / "planted_curves.png", out / "planted_curves.csv",
                     title=f"per-capability GRPO ({cfg.name}, {cfg.backbone.name})")
    if gate_md:
        atomic_write_text(out / "planted_gate.md", "# Gate report (compose)\n\n" + "\n".join(gate_md))
    return table


def init_seed(overrides: list[str], seed: int) -> list[str]:
    """``+backbone.planted.init_seed=s`` where the backbone is trained from random initialization by the warm start
    (a world tokenizer): its initial weights are part of the training seed. Left unset at seed 0, whose weights are
    ``backbone.seed`` 0's either way, so seed 0 keeps the keys and caches of every earlier run."""
    if seed == 0:
        return []
    cfg = compose_config(overrides)
    planted = cfg.backbone.get("planted")
    world = planted is not None and get_spec(backbone_dict(cfg)).tokenizer == "world"
    return [f"+backbone.planted.init_seed={seed}"] if world else []


def plan_variants(overrides: list[str], variants: list[str], training_seeds: list[int],
                  out: Path) -> tuple[dict[str, tuple[Any, Path]], dict[str, int]]:
    """Every run of the search, composed and validated before any runs (a refused one costs no GPU time spent on
    the others): ({name: (config, run directory)}, {name: training seed} for the seed table, only with one
    variant). Raises ``ValueError`` naming the variant that is refused."""
    planned: dict[str, tuple[Any, Path]] = {}
    seeds: dict[str, int] = {}
    for i, v in enumerate(variants or [""]):
        for seed in training_seeds or [None]:
            reseed = ([] if seed is None else
                      [f"seed={seed}", f"backbone.planted.seed={seed}", *init_seed(overrides, seed)])
            name = " ".join([v or "preset", *reseed]) if seed is not None else v or "preset"
            run_dir = out / "runs" / (f"variant{i}" + ("" if seed is None else f"-seed{seed}"))
            try:
                planned[name] = (compose_variant([*overrides, *shlex.split(v), *reseed], run_dir), run_dir)
            except (ConfigError, HydraException, OmegaConfBaseException) as e:
                raise ValueError(f"variant {name!r}: {' '.join(str(e).split())}") from None
            if seed is not None and len(variants) <= 1:
                seeds[name] = seed
    return planned, seeds


def run_search(planned: dict[str, tuple[Any, Path]], out: Path, seeds: dict[str, int]) -> dict[str, Any]:
    """Run each planned variant through the app (every stage cached), the report rewritten after each: a killed
    search keeps what it measured. The last report's table."""
    variants: dict[str, Any] = {}
    table: dict[str, Any] = {}
    for name, (cfg, run_dir) in planned.items():
        variants[name] = run_variant(cfg, run_dir)
        table = report(variants, out, seeds)
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracekit.planted.gain", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/planted"))
    p.add_argument("--variant", action="append", default=[], help="extra overrides of one variant (repeatable)")
    p.add_argument("--training-seeds", type=int, nargs="*", default=[],
                   help="run each variant once per training seed (seed=s backbone.planted.seed=s)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. experiment=planted)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    try:
        planned, seeds = plan_variants(a.overrides, a.variant, a.training_seeds, a.out)
    except ValueError as e:
        print(f"tracekit.planted.gain: error: {e}", file=sys.stderr)
        return 2
    run_search(planned, a.out, seeds)
    print((a.out / "planted_gain.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
