"""The TRACE stages wired into the pipeline: config -> library calls -> artifact files.

Each stage declares the config keys it reads; see :mod:`tracekit.pipeline` for keys and caching.
Heavy objects (models, clients) are built once per process and shared by the stages of a run.
"""

from __future__ import annotations

import logging
import time
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, StageCache, atomic_write_json, read_json
from tracekit.pipeline import Pipeline, Stage, StageContext
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

# Config keys a rollout's result depends on (the agent's adapters/method are added per call).
ROLLOUT_READS = ("benchmark", "backbone", "agent", "user", "eval.temperature", "eval.seeds",
                 "eval.max_steps", "eval.context_budget", "llm.endpoints.user")


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _select(cfg: DictConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: _plain(OmegaConf.select(cfg, k)) for k in keys}


# --------------------------------------------------------------------------------------------
# models and clients (one per process and configuration)

_CLIENTS: dict[str, Any] = {}


def backbone_dict(cfg: DictConfig) -> dict[str, Any]:
    b = _plain(cfg.backbone)
    return {k: b[k] for k in ("name", "source", "hf_id", "chat_format", "arch") if b.get(k) is not None}


def device(cfg: DictConfig) -> str:
    import torch

    want = cfg.backbone.device
    return ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want


def dtype(cfg: DictConfig) -> str | None:
    want = cfg.backbone.dtype
    if want != "auto":
        return want
    return "bfloat16" if device(cfg) == "cuda" else "float32"


def client_for(cfg: DictConfig, role: str, adapter: str | None = None) -> Any:
    """The chat client of an LLM role (``agent`` or a key of ``llm.endpoints``), built once."""
    from tracekit.llm import make_client

    if role == "agent":
        ep: dict[str, Any] = {"kind": "hf"}
    else:
        if role not in cfg.llm.endpoints:
            raise KeyError(f"llm.endpoints has no '{role}' endpoint (have: {', '.join(cfg.llm.endpoints)})")
        ep = {k: v for k, v in _plain(cfg.llm.endpoints[role]).items() if v is not None}
    if ep["kind"] == "hf":
        spec = {"kind": "hf", "backbone": backbone_dict(cfg), "device": device(cfg), "dtype": dtype(cfg),
                "adapter": adapter, "max_batch_size": cfg.agent.batch_size,
                "constrained_tool_calls": cfg.agent.constrained_tool_calls if role == "agent" else False}
    else:
        key_env = ep.pop("api_key_env", None)
        spec = {"kind": "openai", "base_url": ep["base_url"], "model": ep["model"], "timeout_s": ep["timeout_s"],
                "max_retries": ep["max_retries"], "max_concurrency": ep["concurrency"]}
        if key_env:
            spec["api_key_env"] = key_env
    key = stable_hash(spec)
    if key not in _CLIENTS:
        _CLIENTS[key] = make_client(spec)
    return _CLIENTS[key]


# --------------------------------------------------------------------------------------------
# environments, agents, rollouts


def build_user(cfg: DictConfig) -> Any:
    from tracekit.envs.users import LLMUser, ScriptedUser

    u = cfg.user
    if u.kind == "scripted":
        return ScriptedUser(max_turns=u.max_turns)
    return LLMUser(client_for(cfg, u.endpoint), temperature=u.temperature, max_new_tokens=u.max_new_tokens,
                   max_turns=u.max_turns)


def build_suite(cfg: DictConfig, split: str | None = None) -> Any:
    b = cfg.benchmark
    if b.kind == "tau2":
        from tracekit.envs.tau2 import Tau2Suite

        if b.policy != "full":
            raise ValueError(f"benchmark.policy={b.policy!r}: only 'full' (tau^2's own policy) is built")
        return Tau2Suite(name=b.name, domains=list(b.domains), split=split or b.split,
                         task_ids=list(b.task_ids) if b.task_ids else None, limit=b.limit,
                         user=build_user(cfg), max_errors=b.max_errors, agent_can_stop=b.agent_can_stop)
    raise NotImplementedError(f"benchmark.kind={b.kind!r}: no adapter is built yet (built: tau2)")


def build_agent(cfg: DictConfig, adapter: str | None = None) -> Any:
    from tracekit.agents import GoldAgent, LLMAgent

    if cfg.agent.kind == "gold":
        return GoldAgent()
    return LLMAgent(client_for(cfg, "agent", adapter), temperature=cfg.eval.temperature, top_p=cfg.agent.top_p,
                    max_new_tokens=cfg.agent.max_new_tokens)


def cached_rollout(ctx: StageContext, method: str, adapter: Artifact | None = None) -> Artifact:
    """Roll the agent (+ ``adapter``) out on the benchmark, cached under ``episodes/<key>``.

    The base agent's rollout is shared by the ``rollout`` stage (analysis input) and the
    ``evaluate`` stage's Base row.
    """
    from tracekit.rollout import run_rollouts

    cfg = ctx.cfg
    key = stable_hash({"reads": _select(cfg, ROLLOUT_READS), "method": method,
                       "adapter": adapter.content_key if adapter else None}, length=20)

    def compute(work: Path) -> None:
        suite = build_suite(cfg)
        agent = build_agent(cfg, str(adapter.path / "adapter") if adapter else None)
        greedy = cfg.eval.temperature == 0
        summary = run_rollouts(
            suite, agent, work, samples=1 if greedy else len(cfg.eval.seeds),
            seed=cfg.eval.seeds[0] if greedy else cfg.seed, max_steps=cfg.eval.max_steps,
            context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size)
        atomic_write_json(work / "summary.json", {"method": method, **summary.to_dict()})

    t0 = time.time()
    art = ctx.cache.get_or_compute("episodes", key, compute, meta={"method": method})
    ctx.record.used(art, time.time() - t0)
    return art


def trajectories_of(art: Artifact) -> list[Any]:
    from tracekit.rollout import read_trajectories

    return read_trajectories(Path(read_json(art.path / "episodes.json")["path"]))


def rollout_stage(ctx: StageContext) -> None:
    art = cached_rollout(ctx, "base")
    atomic_write_json(ctx.work_dir / "episodes.json", {"path": str(art.path), "key": art.key})


def rollout_report(art: Artifact, ctx: StageContext) -> None:
    from tracekit.evaluate import markdown_table, summarize

    trajs = trajectories_of(art)
    ok = sum(t.success for t in trajs)
    errors = sum(t.termination == "error" for t in trajs)
    ctx.record.section("Rollout (base agent)", f"{len(trajs)} episodes, {ok} successful, {errors} errors.\n\n"
                       + markdown_table({"Base": summarize(trajs)}))


# --------------------------------------------------------------------------------------------
# contrastive capability analysis


def discover_stage(ctx: StageContext) -> None:
    from tracekit.analysis.compact import CompactConfig
    from tracekit.analysis.discovery import DiscoveryConfig, discover, write_dictionary
    from tracekit.analysis.reference import reference_dictionary

    a = ctx.cfg.analysis
    if a.discovery == "reference":
        write_dictionary(reference_dictionary(), ctx.work_dir, source="reference")
        return
    pinned = str(Path(a.dictionary_path).expanduser().resolve()) if a.discovery == "pinned" else None
    client = None if pinned else client_for(ctx.cfg, a.endpoint)
    discover(trajectories_of(ctx.inputs["rollout"]), client, DiscoveryConfig(
        min_capabilities=a.min_capabilities, max_capabilities=a.max_capabilities, max_attempts=a.max_retries + 1,
        max_new_tokens=a.max_new_tokens, seed=ctx.seed, compact=CompactConfig(max_chars=a.compact_chars),
        use_response_format=a.use_response_format, pinned=pinned), ctx.work_dir)


def label_stage(ctx: StageContext) -> None:
    from tracekit.analysis.compact import CompactConfig
    from tracekit.analysis.discovery import read_dictionary
    from tracekit.analysis.labeling import LabelingConfig, LLMLabeler
    from tracekit.analysis.reference import ReferenceLabeler
    from tracekit.analysis.stages import label

    a = ctx.cfg.analysis
    if a.labeler == "reference":
        labeler: Any = ReferenceLabeler(noise=a.label_noise)
    else:
        labeler = LLMLabeler(client_for(ctx.cfg, a.endpoint), LabelingConfig(
            temperature=a.temperature, capabilities_per_call=a.capabilities_per_call,
            max_attempts=a.max_retries + 1, max_new_tokens=a.max_new_tokens, chunk_size=a.chunk_size,
            on_missing=a.on_missing, show_outcome=a.show_outcome, compact=CompactConfig(max_chars=a.compact_chars),
            use_response_format=a.use_response_format))
    label(trajectories_of(ctx.inputs["rollout"]), read_dictionary(ctx.inputs["discover"].path), labeler,
          runs=ctx.cfg.thresholds.n, seed=ctx.seed, out_dir=ctx.work_dir)


def label_report(art: Artifact, ctx: StageContext) -> None:
    rep = read_json(art.path / "labeling_report.json")
    ctx.record.section("Labeling", f"{rep.get('labels', '?')} labels, {rep.get('missing', '?')} missing "
                       f"(labeler: {ctx.cfg.analysis.labeler}, runs: {ctx.cfg.thresholds.n}).")


def select_stage(ctx: StageContext) -> None:
    from tracekit.analysis.discovery import read_dictionary
    from tracekit.analysis.select import Thresholds
    from tracekit.analysis.stages import read_labels, select_stage as run_select

    t = ctx.cfg.thresholds
    run_select(read_labels(ctx.inputs["label"].path), read_dictionary(ctx.inputs["discover"].path),
               Thresholds(delta=t.delta, rho=t.rho, k=t.k, n=t.n, undefined_er_pos=t.undefined_er_pos),
               ctx.work_dir, examples=ctx.cfg.analysis.examples_per_capability)


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
# evaluation


def evaluate_stage(ctx: StageContext) -> None:
    from tracekit.evaluate import summarize, write_results

    results: dict[str, Any] = {}
    for method in ctx.cfg.eval.methods:
        if method == "base":
            art = ctx.inputs["rollout"]
            trajs = trajectories_of(art)
        else:
            raise NotImplementedError(f"eval.methods: {method!r} is not built yet (built: base)")
        results[method] = summarize(trajs)
    write_results(ctx.work_dir, {_LABELS.get(m, m): r for m, r in results.items()})


_LABELS = {"base": "Base", "single_capability": "Single Capability GRPO", "trace": "TRACE"}


def evaluate_report(art: Artifact, ctx: StageContext) -> None:
    from tracekit.evaluate import markdown_table, wandb_rows

    results = read_json(art.path / "results.json")
    table = markdown_table(results)
    print(f"\n{ctx.cfg.benchmark.name} ({ctx.cfg.backbone.name}, eval={ctx.cfg.eval.mode}):\n{table}\n", flush=True)
    ctx.record.section("Evaluation", table)
    cols, rows = wandb_rows(results)
    ctx.record.logger.table("eval/results", cols, rows)


def build_pipeline() -> Pipeline:
    return Pipeline([
        Stage("rollout", reads=ROLLOUT_READS, inputs=(), compute=rollout_stage, report=rollout_report),
        Stage("discover", reads=("analysis.discovery", "analysis.dictionary_path", "analysis.endpoint",
                                 "analysis.max_retries", "analysis.min_capabilities", "analysis.max_capabilities",
                                 "analysis.max_new_tokens", "analysis.compact_chars", "analysis.use_response_format",
                                 "llm.endpoints.analysis"),
              inputs=("rollout",), compute=discover_stage),
        Stage("label", reads=("analysis.labeler", "analysis.label_noise", "analysis.temperature",
                              "analysis.capabilities_per_call", "analysis.max_retries", "analysis.on_missing",
                              "analysis.max_new_tokens", "analysis.chunk_size", "analysis.show_outcome",
                              "analysis.compact_chars", "analysis.use_response_format", "analysis.endpoint",
                              "llm.endpoints.analysis", "thresholds.n"),
              inputs=("rollout", "discover"), compute=label_stage, report=label_report),
        Stage("select", reads=("thresholds", "analysis.examples_per_capability"), inputs=("label", "discover"),
              compute=select_stage,
              report=select_report, identity_files=("selected_names.json",)),
        Stage("evaluate", reads=("eval.methods",), inputs=("rollout",), compute=evaluate_stage,
              report=evaluate_report),
    ])
