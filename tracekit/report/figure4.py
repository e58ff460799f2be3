"""Paper Figure 4 (method scaling): ``stages=[figure4]`` writes ``figure4a.png``, ``figure4b.png`` and the data
behind them, ``figure4.json``, into its artifact (and logs both images to W&B).

(a) Pass rate against the number of trained capabilities k = 1..|C*|, top-ranked first (by mean failure
    coverage): TRACE = the configured consolidation (``consolidation.method``; TRACE: the LoRA-MoE) over the
    top-k capability adapters (k = |C*| is the ``compose`` artifact itself; smaller k are composed here as
    ``compositions/<key>`` sub-artifacts); GEPA = a GEPA run seeded with the top-k capabilities at the budget
    of their k adapters' episodes (k = |C*| is the ``gepa`` stage's run); prompt only = the top-k block
    without optimization (GEPA's seed).
(b) Pass rate against training rollouts (episodes): TRACE at the episodes of its top-k adapters for each k
    (the paper's x-grid: multiples of one capability run); GRPO on target at each kept checkpoint (every
    ``baselines.grpo_target.checkpoint_iterations``); GEPA's best candidate so far (by its valset score) at
    the episodes spent when each candidate was found, and at the end. Every curve starts at the base agent
    (0 rollouts). TRACE's rollouts are in its synthetic environments, GRPO's and GEPA's in the target's
    training tasks; evaluation episodes are never counted.

Every point is one cached evaluation rollout of a policy on the target's test tasks (``episodes/<key>``), so
the points shared with the results table (TRACE, GEPA, GRPO on target, prompt only) cost nothing twice.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.evaluate import summarize
from tracekit.methods.consolidate import (STRATEGIES, adapters_budget, compose_inputs, compose_reads, read_consolidated,
                                          write_consolidated)
from tracekit.methods.gepa import RUN_RESULT, _values, gepa_run, run_reads
from tracekit.methods.gepa import RESULT as GEPA_RESULT
from tracekit.methods.grpo_target import read_result
from tracekit.methods.prompt_only import prompt_policy
from tracekit.methods.target_train import capabilities_block, ranked_capabilities
from tracekit.pipeline import Stage
from tracekit.policy import Policy
from tracekit.runs import adapters_of, policy_trajectories
from tracekit.types import stable_hash
from tracekit.wiring import rollout_reads

DATA = "figure4.json"


def figure4_reads(cfg) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*rollout_reads(cfg), *compose_reads(cfg), *run_reads(cfg), "baselines.gepa"]))


def figure4_inputs(cfg) -> tuple[str, ...]:
    return tuple(dict.fromkeys(["rollout", "select", "train", "compose", "gepa", "grpo_target", *compose_inputs(cfg)]))


def _pass_rate(ctx, policy) -> float:
    return float(summarize(policy_trajectories(ctx, policy))["overall"]["pass_rate"])


def top_k_composition(ctx, adapters: dict[str, Artifact]):
    """The configured consolidation over ``adapters`` as the sub-artifact ``compositions/<key>``; its policy."""
    cfg = ctx.cfg
    strategy = STRATEGIES[cfg.consolidation.method]
    key = stable_hash({"reads": _values(cfg, compose_reads(cfg)), "seed": ctx.seed,
                       "adapters": {c: a.content_key for c, a in sorted(adapters.items())}}, length=20)

    def compute(work) -> None:
        write_consolidated(work, strategy, strategy.consolidate(dataclasses.replace(ctx, work_dir=work), adapters), ctx.cfg)

    t0 = time.time()
    art = ctx.cache.get_or_compute("compositions", key, compute, meta={"capabilities": sorted(adapters)})
    ctx.use(art, time.time() - t0)
    return read_consolidated(art)


def figure4_stage(ctx) -> None:
    cfg = ctx.cfg
    adapters = adapters_of(ctx.inputs["train"])
    ranked = ranked_capabilities(ctx.inputs["select"], only=set(adapters))
    if not ranked:
        raise RuntimeError("figure4: no selected capability has a trained adapter")
    base = _pass_rate(ctx, Policy())
    n = len(ranked)
    gepa_stage = read_json(ctx.inputs["gepa"].path / GEPA_RESULT)
    per_k = []
    for k in range(1, n + 1):
        top = ranked[:k]
        subset = {c["name"]: adapters[c["name"]] for c in top}
        trace = read_consolidated(ctx.inputs["compose"]) if k == n else top_k_composition(ctx, subset)
        episodes = adapters_budget(subset).episodes
        total = adapters_budget(adapters).episodes
        budget = (episodes if cfg.baselines.gepa.max_metric_calls is None
                  else max(1, round(cfg.baselines.gepa.max_metric_calls * episodes / total)))
        run = read_json(gepa_run(ctx, top, budget).path / RUN_RESULT)
        per_k.append({
            "k": k, "capabilities": [c["name"] for c in top], "trace_episodes": episodes,
            "trace": _pass_rate(ctx, trace.policy), "trace_label": trace.label,
            "gepa": _pass_rate(ctx, Policy("prompt", system_prompt_suffix=run["system_prompt_suffix"])),
            "gepa_episodes": run["episodes"], "gepa_budget": budget,
            "prompt_only": _pass_rate(ctx, prompt_policy(top))})

    # (b): GRPO on target along its checkpoints; GEPA's best-so-far candidate along its run
    grpo, grpo_adapter = read_result(ctx.inputs["grpo_target"])
    grpo_points = [{"episodes": 0, "pass_rate": base}] + [
        {"episodes": c["episodes"], "iteration": c["iteration"],
         "pass_rate": _pass_rate(ctx, Policy("adapter", grpo_adapter, c["subdir"]))} for c in grpo["checkpoints"]]
    main = read_json(ctx.inputs["gepa"].resolve(gepa_stage["run"]).path / RUN_RESULT)
    gepa_points, best, best_score = [], None, -1.0
    for c in sorted((c for c in main["candidates"] if c["episodes"] is not None), key=lambda c: c["episodes"]):
        if c["val_score"] > best_score:
            best, best_score = c, c["val_score"]
            suffix = _suffix(main, best["candidate"])
            gepa_points.append({"episodes": c["episodes"], "candidate": c["idx"],
                                "pass_rate": _pass_rate(ctx, Policy("prompt", system_prompt_suffix=suffix))})
    gepa_points = [{"episodes": 0, "pass_rate": base}] + [p for p in gepa_points if p["episodes"] > 0]
    final = _pass_rate(ctx, Policy("prompt", system_prompt_suffix=main["system_prompt_suffix"]))
    gepa_points.append({"episodes": main["episodes"], "candidate": main["best_idx"], "pass_rate": final})
    trace_points = [{"episodes": 0, "pass_rate": base}] + [
        {"episodes": p["trace_episodes"], "k": p["k"], "pass_rate": p["trace"]} for p in per_k]
    data = {"benchmark": cfg.benchmark.name, "backbone": cfg.backbone.name, "base": base,
            "ranking": [c["name"] for c in ranked], "a": per_k,
            "b": {"TRACE": trace_points, "GRPO on Target": grpo_points, "GEPA": gepa_points}}
    atomic_write_json(ctx.work_dir / DATA, data)
    plot(data, ctx.work_dir)


def _suffix(run: dict[str, Any], candidate: dict[str, str]) -> str:
    return capabilities_block([(name, candidate[name]) for name in run["capabilities"]])


def plot(data: dict[str, Any], out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = [p["k"] for p in data["a"]]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for key, label, marker in (("trace", data["a"][-1]["trace_label"], "o"), ("gepa", "GEPA", "s"),
                               ("prompt_only", "Prompt only", "^")):
        ax.plot(ks, [100 * p[key] for p in data["a"]], marker=marker, label=label)
    ax.axhline(100 * data["base"], color="gray", linestyle="--", linewidth=1, label="Base")
    ax.set_xlabel("number of trained capabilities (top-ranked first)")
    ax.set_ylabel("pass rate (%)")
    ax.set_xticks(ks)
    ax.set_ylim(0, _top(data))
    ax.set_title(f"(a) Scaling the number of capabilities ({data['benchmark']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "figure4a.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for (label, points), marker in zip(data["b"].items(), ("o", "D", "s"), strict=False):
        ax.plot([p["episodes"] for p in points], [100 * p["pass_rate"] for p in points], marker=marker, label=label)
    ax.set_ylim(0, _top(data))
    ax.set_xlabel("training rollouts (episodes)")
    ax.set_ylabel("pass rate (%)")
    ax.set_title(f"(b) Scaling the number of rollouts ({data['benchmark']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "figure4b.png", dpi=120)
    plt.close(fig)


def _top(data: dict[str, Any]) -> float:
    """The y-axis top (percent): the highest point plus a margin, at least 10."""
    values = [data["base"]] + [p[k] for p in data["a"] for k in ("trace", "gepa", "prompt_only")] + [
        p["pass_rate"] for pts in data["b"].values() for p in pts]
    return max(10.0, min(100.0, 100 * max(values) + 10))


def figure4_report(art: Artifact, ctx) -> None:
    data = read_json(art.path / DATA)
    rows = ["| k | capabilities | TRACE | GEPA | prompt only | TRACE episodes | GEPA episodes |", "|---|---|---|---|---|---|---|"]
    for p in data["a"]:
        rows.append(f"| {p['k']} | {', '.join(p['capabilities'])} | {100 * p['trace']:.1f} | {100 * p['gepa']:.1f} | "
                    f"{100 * p['prompt_only']:.1f} | {p['trace_episodes']:,} | {p['gepa_episodes']:,} |")
    curves = "\n".join(f"- {name}: " + ", ".join(f"{p['episodes']:,} -> {100 * p['pass_rate']:.1f}%" for p in pts)
                       for name, pts in data["b"].items())
    ctx.record.section("Figure 4", "\n".join(rows) + f"\n\n(b) pass rate by training rollouts:\n{curves}\n\n"
                       f"Images: {art.path / 'figure4a.png'}, {art.path / 'figure4b.png'}")
    for name in ("figure4a", "figure4b"):
        ctx.record.logger.image(f"figure4/{name}", art.path / f"{name}.png")
    ctx.record.logger.table("figure4/a", ["k", "trace", "gepa", "prompt_only", "trace_episodes", "gepa_episodes"],
                            [[p["k"], p["trace"], p["gepa"], p["prompt_only"], p["trace_episodes"], p["gepa_episodes"]]
                             for p in data["a"]])
    print(f"\nFigure 4 ({data['benchmark']}, {data['backbone']}):\n" + "\n".join(rows) + "\n" + curves + "\n"
          f"images: {art.path / 'figure4a.png'} {art.path / 'figure4b.png'}\n", flush=True)


FIGURE4 = Stage("figure4", reads=figure4_reads, inputs=figure4_inputs, compute=figure4_stage, report=figure4_report)
