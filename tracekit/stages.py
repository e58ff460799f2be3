"""The TRACE stages wired into the pipeline: config -> library calls -> artifact files.

Each stage declares the config keys it reads; see :mod:`tracekit.pipeline` for keys and caching. What the stages
build from a config (clients, suites, agents) is :mod:`tracekit.wiring`; the cached rollouts, trajectory readers and
GRPO runs they share with the methods are :mod:`tracekit.runs`.
"""

from __future__ import annotations

import csv
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from tracekit.analysis.discovery import discover, read_dictionary, write_dictionary
from tracekit.analysis.labeling import LLMLabeler
from tracekit.analysis.select import Thresholds
from tracekit.analysis.settings import discovery_config, discovery_reads, labeling_config, labeling_reads
from tracekit.analysis.stages import import_labels, label, read_labels
from tracekit.analysis.stages import select_stage as run_select
from tracekit.artifacts import Artifact, atomic_write_json, atomic_write_text, file_sha256, read_json
from tracekit.config import imported_run_files, read_pinned_dictionary
from tracekit.evaluate import RESULTS, SCORED_ROWS, paired_table, wandb_rows, write_results
from tracekit.report.ladder import LADDER_PNG, RESULTS_MD, write_ladder_chart
from tracekit.methods import METHODS
from tracekit.methods.consolidate import CONSOLIDATED, STRATEGIES, compose_inputs, compose_reads, write_consolidated
from tracekit.pipeline import Pipeline, Stage, StageContext
from tracekit.report.figure4 import FIGURE4
from tracekit.rl.launch import Factory
from tracekit.runs import (GRPO_RUN_READS, adapters_of, cached_rollout, grpo_run, package_identity, policy_trajectories,
                           ready_capabilities, synthesis_target, train_seeds, trajectories_of)
from tracekit.synthesis.calibrate import make_rollout_fn
from tracekit.synthesis.chain import chain_sampler
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.stage import MANIFEST, SynthesisSettings, synthesize
from tracekit.targets.registry import benchmark_identity, evaluation_config, family_reads, target_of, target_of_trajectories
from tracekit.types import stable_hash
from tracekit.wiring import client_for, llm_agent, plain, rollout_reads

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# the base agent's rollout


def rollout_stage(ctx: StageContext) -> None:
    atomic_write_json(ctx.work_dir / "episodes.json", cached_rollout(ctx).ref())


def rollout_report(art: Artifact, ctx: StageContext) -> None:
    trajs = trajectories_of(art)
    ok = sum(t.success for t in trajs)
    errors = sum(t.termination == "error" for t in trajs)
    target = target_of(ctx.cfg)
    rollout = read_json(art.path / "episodes.json")
    skipped = read_json(art.resolve(rollout).path / "summary.json").get("skipped", {})
    note = "".join(f" Skipped ({why}): {len(names)}." for why, names in skipped.items())
    ctx.record.section("Rollout (base agent)", f"{len(trajs)} episodes, {ok} successful, {errors} errors.{note}\n\n"
                       + target.markdown_table({"Base": target.summarize(trajs)}))


# --------------------------------------------------------------------------------------------
# contrastive capability analysis


def discover_stage(ctx: StageContext) -> None:
    a = ctx.cfg.analysis
    if a.discovery == "reference":  # the fixed dictionary of the target the rollout ran on
        target = target_of_trajectories(trajectories_of(ctx.inputs["rollout"]))
        write_dictionary(target.reference_dictionary(), ctx.work_dir, source="reference")
        return
    pinned = str(Path(a.dictionary_path).expanduser().resolve()) if a.discovery == "pinned" else None
    client = None if pinned else client_for(ctx.cfg, a.endpoint)
    trajectories = [] if pinned else trajectories_of(ctx.inputs["rollout"])  # a pinned file reads no episode
    discover(trajectories, client, discovery_config(a, ctx.seed, pinned), ctx.work_dir)


def pinned_dictionary(cfg: DictConfig) -> list[dict[str, str]] | None:
    """The pinned dictionary's entries, read as discovery reads them (a malformed file: ConfigError naming it):
    editing them invalidates `discover` and what follows."""
    if cfg.analysis.discovery != "pinned":
        return None
    return [c.model_dump() for c in read_pinned_dictionary(cfg)]


def imported_runs(cfg: DictConfig) -> dict[str, str] | None:
    """The imported labeling runs' contents ({file: sha256}; a missing folder: ConfigError naming it): editing a
    run file invalidates `label` and what follows."""
    if cfg.analysis.labeler != "imported":
        return None
    return {p.name: file_sha256(p) for p in imported_run_files(cfg)}


def label_stage(ctx: StageContext) -> None:
    a = ctx.cfg.analysis
    if a.labeler == "imported":  # the official code's labeling runs, as they are
        import_labels(Path(a.labels_from).expanduser(), read_dictionary(ctx.inputs["discover"].path), ctx.work_dir)
        return
    trajectories = trajectories_of(ctx.inputs["rollout"])
    if a.labeler == "reference":  # the heuristic labeler of the target the rollout ran on
        labeler: Any = target_of_trajectories(trajectories).reference_labeler(a.label_noise)
    else:
        labeler = LLMLabeler(client_for(ctx.cfg, a.endpoint), labeling_config(a))
    label(trajectories, read_dictionary(ctx.inputs["discover"].path), labeler,
          runs=ctx.cfg.thresholds.n, seed=ctx.seed, out_dir=ctx.work_dir)


def label_report(art: Artifact, ctx: StageContext) -> None:
    rep = read_json(art.path / "labeling_report.json")
    source = f" from {rep['imported']['source']}" if "imported" in rep else ""
    ctx.record.section("Labeling", f"{rep.get('labels', '?')} labels, {rep.get('missing', '?')} missing "
                       f"(labeler: {ctx.cfg.analysis.labeler}{source}, runs: {ctx.cfg.thresholds.n}).")


def select_stage(ctx: StageContext) -> None:
    run_select(read_labels(ctx.inputs["label"].path), read_dictionary(ctx.inputs["discover"].path),
               Thresholds(**plain(ctx.cfg.thresholds)), ctx.work_dir, examples=ctx.cfg.analysis.examples_per_capability)


def select_report(art: Artifact, ctx: StageContext) -> None:
    sel = read_json(art.path / "selected.json")
    rows = ["| capability | selected in runs | mean Delta | mean Cov | kept |", "|---|---|---|---|---|"]
    kept = {c["name"] for c in sel["selected"]}
    for c in sel["candidates"]:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {c['name']} | {c['selection_count']}/{sel['thresholds']['n']} | {fmt(c.get('mean_delta'))} "
                    f"| {fmt(c.get('mean_cov'))} | {'yes' if c['name'] in kept else 'no'} |")
    ctx.record.section("Capability selection", "\n".join(rows))
    log_ = ctx.record.logger
    for png in ("selection_frequency.png", "failure_coverage.png"):
        if (art.path / png).exists():
            log_.image(f"analysis/{png[:-4]}", art.path / png)
    log_.table("analysis/capabilities", ["capability", "selection_count", "mean_delta", "mean_cov", "kept"],
               [[c["name"], c["selection_count"], c.get("mean_delta"), c.get("mean_cov"), c["name"] in kept]
                for c in sel["candidates"]])


# --------------------------------------------------------------------------------------------
# synthetic environments, GRPO adapters, MoE composition


def synthesize_stage(ctx: StageContext) -> None:
    cfg, sy = ctx.cfg, ctx.cfg.synthesis
    selected = read_json(ctx.inputs["select"].path / "selected.json")["selected"]
    settings = SynthesisSettings.of(SynthesisConfig(**plain(sy)), ctx.stage_seed)  # seed: read by source=generate
    official = sy.acceptance == "official"
    rollout_fn = acceptance_fn = chain_fn = None
    if sy.calibrate or official or sy.chains:  # against the current (base) policy, sampled as GRPO samples
        agent = llm_agent(cfg, temperature=cfg.grpo.temperature)

        def sampler(folder: str) -> Any:
            return make_rollout_fn(agent, ctx.work_dir / folder, max_steps=cfg.grpo.max_steps,
                                   batch_size=cfg.agent.batch_size, progress=False)

        rollout_fn = sampler("calibration_rollouts") if sy.calibrate else None
        acceptance_fn = sampler("acceptance_rollouts") if official else None  # its own resumable folder
        chain_fn = chain_sampler(agent, max_steps=cfg.grpo.max_steps, batch_size=cfg.agent.batch_size,
                                 progress=False) if sy.chains else None
    trajectories = {t.uid: t for t in trajectories_of(ctx.inputs["rollout"])} if sy.source == "generate" else None
    client = client_for(cfg, sy.endpoint) if sy.source == "generate" else None
    synthesize(selected, synthesis_target(cfg), ctx.work_dir, settings, trajectories, client, rollout_fn,
               acceptance_fn, chain_fn)


def synthesize_report(art: Artifact, ctx: StageContext) -> None:
    man = read_json(art.path / "environments.json")
    rows = ["| capability | status | environment | difficulty / reason |", "|---|---|---|---|"]
    for e in man["environments"]:
        gate = (f" (official gate: mean reward {e['acceptance']['mean_reward']:.2f}, success "
                f"{e['acceptance']['success_rate']:.2f}, informative {e['acceptance']['informative_rate']:.2f})"
                if e["status"] == "ready" and "acceptance" in e else "")
        rows.append(f"| {e['capability']} | {e['status']} | {e.get('env', e.get('kind', ''))} | "
                    f"{str(e.get('difficulty')) + gate if e['status'] == 'ready' else e.get('reason', '')} |")
    for c in man.get("chains", []):  # beyond the paper (issue 53): chained environments, sampled by the base
        rows.append(f"| {c['chain']} (chained) | {c['status']} | | " + (
            f"{c['successes']} of {c['episodes']} base-policy episodes succeed" if c["status"] == "ready"
            else c["reason"]) + " |")
    ctx.record.section("Synthetic environments", f"{man['ready']} ready, {man['skipped']} skipped "
                       f"(source: {man['source']}, target: {man['target']}).\n\n" + "\n".join(rows))


def train_stage(ctx: StageContext) -> None:
    """One GRPO adapter per ready environment, each its own cache entry (keyed on the env's content)."""
    cfg = ctx.cfg
    syn = ctx.inputs["synthesize"]
    ready = ready_capabilities(syn)
    runs = cfg.launcher.concurrent_runs
    # capabilities whose environment packages are identical share one run (one cache key): train each content once,
    # so that two concurrent runs never compute the same key
    first_of: dict[str, str] = {}
    for cap in ready:
        first_of.setdefault(stable_hash(package_identity(syn.path / cap)), cap)
    distinct = list(first_of.values())
    if runs > 1 and len(distinct) > 1:  # each capability's run in its own process, `runs` at a time
        log.info("train: %d capability GRPO runs, %d at a time", len(distinct), runs)
        with ThreadPoolExecutor(max_workers=runs) as pool:
            trained = dict(zip(distinct, pool.map(lambda cap: train_adapter(ctx, cap, syn.path / cap, isolate=True),
                                                  distinct)))
    else:
        trained = {cap: train_adapter(ctx, cap, syn.path / cap) for cap in distinct}
    arts = [trained[first_of[stable_hash(package_identity(syn.path / cap))]] for cap in ready]
    adapters = {cap: {**art.ref(), "content_key": art.content_key} for cap, art in zip(ready, arts)}
    if not adapters:  # each capability's reason: the official gate's refusal carries the rates it measured
        why = "; ".join(f"{e['capability']}: {e.get('reason', e['status'])}"
                        for e in read_json(syn.path / MANIFEST)["environments"])
        raise RuntimeError(f"train: no ready synthetic environment in {syn.path / MANIFEST}, every capability skipped: "
                           f"{why}")
    atomic_write_json(ctx.work_dir / "adapters.json", adapters)


def train_adapter(ctx: StageContext, capability: str, pkg: Path, isolate: bool = False) -> Artifact:
    env = Factory("tracekit.synthesis.stage:open_package", {"pkg_dir": str(pkg), "seeds": train_seeds(ctx.cfg)})
    return grpo_run(ctx, capability, env, {"env": package_identity(pkg)}, isolate=isolate)


def train_report(art: Artifact, ctx: StageContext) -> None:
    rows = ["| capability | iterations | first reward | last reward | discarded groups (last) |", "|---|---|---|---|---|"]
    for cap, a in adapters_of(art).items():
        metrics = list(csv.DictReader(open(a.path / "metrics.csv")))
        first, last = metrics[0], metrics[-1]
        rows.append(f"| {cap} | {len(metrics)} | {float(first['reward_mean']):.3f} | {float(last['reward_mean']):.3f} "
                    f"| {float(last['frac_groups_dropped']):.2f} |")
    ctx.record.section("GRPO adapters", "\n".join(rows))


def compose_stage(ctx: StageContext) -> None:
    """The configured consolidation strategy over the capability adapters (paper Table 4)."""
    strategy = STRATEGIES[ctx.cfg.consolidation.method]
    write_consolidated(ctx.work_dir, strategy, strategy.consolidate(ctx, adapters_of(ctx.inputs["train"])), ctx.cfg)


def compose_report(art: Artifact, ctx: StageContext) -> None:
    STRATEGIES[read_json(art.path / CONSOLIDATED)["strategy"]].report(art, ctx)


# --------------------------------------------------------------------------------------------
# evaluation


def evaluate_stage(ctx: StageContext) -> None:
    """One loop over every method's policy rows; each method keeps the rows its table shows."""
    target = target_of(evaluation_config(ctx.cfg))  # the evaluation target's metric (pass rate; similarity)
    summarize = target.summarize
    results: dict[str, Any] = {}
    every: dict[str, Any] = {}  # every scored row, kept or not (each single adapter on its own environment)
    for name in ctx.cfg.eval.methods:
        method = METHODS[name]
        rows = method.rows(ctx)
        scored = {row.label: summarize(policy_trajectories(ctx, row.policy)) for row in rows}
        kept = method.keep(scored)
        for row in rows:
            entry = {**scored[row.label], "method": name, "budget": row.budget.to_dict(), "notes": list(row.notes)}
            every[row.label] = {**entry, "kept": row.label in kept}
            if row.label in kept:
                results[row.label] = entry
    write_results(ctx.work_dir, results, table=target.markdown_table(results))
    atomic_write_json(ctx.work_dir / SCORED_ROWS, every, sort_keys=False)


def evaluate_report(art: Artifact, ctx: StageContext) -> None:
    results = read_json(art.path / RESULTS)
    notes = [f"- {label}: {n}" for label, r in results.items() for n in r.get("notes", ())]
    on = evaluation_config(ctx.cfg)
    paired = paired_table({label: r["paired_vs_base"] for label, r in results.items() if "paired_vs_base" in r})
    protocol = target_of(on).protocol(on)  # a versioned benchmark's task set and user simulator, above its table
    table = ((f"{protocol}\n\n" if protocol else "") + target_of(on).markdown_table(results) + paired
             + ("\n" + "\n".join(notes) + "\n" if notes else ""))
    trained = f" (trained on {ctx.cfg.benchmark.name})" if on is not ctx.cfg else ""
    print(f"\n{on.benchmark.name}{trained} ({ctx.cfg.backbone.name}, eval={ctx.cfg.eval.mode}):\n{table}\n", flush=True)
    atomic_write_json(ctx.record.run_dir / RESULTS, results, sort_keys=False)  # the run's own copy (a multirun's table reads it)
    atomic_write_text(ctx.record.run_dir / RESULTS_MD, table)
    write_ladder_chart(results, ctx.record.run_dir / LADDER_PNG,
                       f"{on.benchmark.name}{trained}, {ctx.cfg.backbone.name}: {ctx.cfg.name}")
    ctx.record.section("Evaluation", f"{table}\n![the ladder: each row's success and its paired difference against "
                                     f"Base]({LADDER_PNG}) (`{LADDER_PNG}`; the table: `{RESULTS_MD}`)\n")
    cols, rows = wandb_rows(results)
    ctx.record.logger.table("eval/results", cols, rows)


def evaluate_inputs(cfg: DictConfig) -> tuple[str, ...]:
    # rollout always: the base and zero-update policies read its episodes
    return tuple(dict.fromkeys(["rollout", *(s for m in cfg.eval.methods for s in METHODS[m].inputs(cfg))]))


def discover_inputs(cfg: DictConfig) -> tuple[str, ...]:
    # imported labels need no episode: their pinned candidates stand alone (other pinned runs keep the rollout as
    # an input, so that their keys stay as they were)
    a = cfg.analysis
    return () if a.labeler == "imported" and a.discovery == "pinned" else ("rollout",)


def label_inputs(cfg: DictConfig) -> tuple[str, ...]:
    return ("discover",) if cfg.analysis.labeler == "imported" else ("rollout", "discover")


# the official acceptance gate's own settings (issue 39): while it is off they change nothing, and keys stay as they
# were before the gate existed
ACCEPTANCE_SETTINGS = ("synthesis.acceptance", "synthesis.acceptance_group_size", "synthesis.min_reward_std",
                       "synthesis.max_all_success", "synthesis.max_all_zero")


# synthesis chaining's settings (issue 53): while no chain is asked for they change nothing, keys as before
CHAIN_SETTINGS = ("synthesis.chains", "synthesis.chain_seeds", "synthesis.chain_samples")


def acceptance_off(cfg: DictConfig) -> tuple[str, ...]:
    return ((ACCEPTANCE_SETTINGS if cfg.synthesis.acceptance == "none" else ())
            + (() if cfg.synthesis.chains else CHAIN_SETTINGS))


def synthesize_reads(cfg: DictConfig) -> tuple[str, ...]:
    sy = cfg.synthesis
    reads = ["synthesis", *family_reads(cfg)]
    if sy.calibrate or sy.acceptance == "official" or sy.chains:  # they sample the base agent as GRPO does
        reads += ["backbone", "agent", "grpo.temperature", "grpo.max_steps"]
    if sy.source == "generate":
        reads += [f"llm.endpoints.{sy.endpoint}", "backbone", "agent", "seed"]
    return tuple(dict.fromkeys(reads))


def evaluate_reads(cfg: DictConfig) -> tuple[str, ...]:
    # each policy's rollout reads what the base rollout reads (and, evaluated on another target, its name)
    other = ["eval.benchmark"] if cfg.eval.benchmark is not None else []  # unset: not read (keys as before)
    return tuple(dict.fromkeys(["eval.methods", *other, *rollout_reads(cfg), *(r for m in cfg.eval.methods
                                                                                for r in METHODS[m].reads(cfg))]))


def evaluation_benchmark(cfg: DictConfig) -> Any:
    """The evaluate key's extra: the contents of the benchmark ``eval.benchmark`` names (None when unset)."""
    return None if cfg.eval.benchmark is None else benchmark_identity(evaluation_config(cfg).benchmark)


def build_pipeline() -> Pipeline:
    return Pipeline([
        Stage("rollout", reads=rollout_reads, inputs=(), compute=rollout_stage, report=rollout_report),
        Stage("discover", reads=discovery_reads, inputs=discover_inputs, compute=discover_stage,
              key_extra=pinned_dictionary),
        Stage("label", reads=labeling_reads, inputs=label_inputs, compute=label_stage, report=label_report,
              key_extra=imported_runs),
        Stage("select", reads=("thresholds", "analysis.examples_per_capability"), inputs=("label", "discover"),
              compute=select_stage, report=select_report, identity_files=("selected_names.json",)),
        Stage("synthesize", reads=synthesize_reads, inputs=("select", "rollout"), compute=synthesize_stage,
              report=synthesize_report, key_neutral=acceptance_off),
        Stage("train", reads=GRPO_RUN_READS, inputs=("synthesize",),
              compute=train_stage, report=train_report),
        Stage("compose", reads=compose_reads, inputs=compose_inputs, compute=compose_stage, report=compose_report,
              version="3"),  # 2: the moe gate holds out a fixed share of its examples (CE before/after on them); 3: per-example routes
        Stage("evaluate", reads=evaluate_reads, inputs=evaluate_inputs, compute=evaluate_stage,
              report=evaluate_report, key_extra=evaluation_benchmark,
              version="3"),  # 2: each row keeps its per-episode outcomes and its paired comparison with Base;
    # 3: scored_rows.json holds every scored row, also those a method does not keep
        *(stage for method in METHODS.values() for stage in method.stages),
        FIGURE4,  # paper Figure 4: TRACE, GEPA, GRPO on target and prompt only along k and the rollouts
    ])
