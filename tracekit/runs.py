"""What the stages and the methods run and read: cached rollouts of a policy, the trajectories behind them, the GRPO
run (one adapter, a cache entry keyed on its settings, engine, backbone and environment), its training seeds and
matched budgets, and the readers of the ``train`` stage's adapters.
"""

from __future__ import annotations

import math
from dataclasses import fields
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open

from tracekit.artifacts import Artifact, CorruptArtifact, StageCache, atomic_write_json, read_json
from tracekit.config import GrpoConfig, eval_benchmark
from tracekit.envs.pool import pooled
from tracekit.pipeline import RunRecord, StageContext
from tracekit.policy import Policy
from tracekit.rl.launch import Factory, TrainSpec, train
from tracekit.rl.settings import LauncherSettings
from tracekit.synthesis.stage import MANIFEST
from tracekit.rollout import TRAJECTORIES, is_infra_record, read_trajectories, run_rollouts
from tracekit.targets.registry import evaluation_config, target_of
from tracekit.types import stable_hash
from tracekit.wiring import (AGENT_ENGINE_READS, backbone_dict, build_agent, build_suite, device, dtype, engine_spec,
                             env_reply_timeout, env_workers, infra_retries, plain, rollout_reads, select, suite_spec,
                             user_kind)


# --------------------------------------------------------------------------------------------
# cached rollouts and their trajectories


def cached_rollout(ctx: StageContext, policy: Any = None, cfg: DictConfig | None = None,
                   split: str | None = None) -> Artifact:
    """Roll the agent under ``policy`` (a :class:`tracekit.policy.Policy`; None: the base agent) out on the
    benchmark (``cfg``'s, by default the stage's), cached under ``episodes/<key>``: keyed on the policy's content, so
    methods that produce the same weights share one rollout. ``split``: the target's tasks other than the evaluated
    ones (a library target's ``validation`` instances: the planted bands); None, the evaluated tasks."""
    policy = policy or Policy()
    cfg = ctx.cfg if cfg is None else cfg
    identity = {"reads": select(cfg, rollout_reads(cfg)), "policy": policy.identity()}
    if split is not None:  # absent for the evaluated tasks: every stage's rollout keeps its key
        identity["split"] = split
    key = stable_hash(identity, length=20)

    def compute(work: Path) -> None:
        suite = build_suite(cfg, split)
        try:
            weights = {} if policy.weights is None else {policy.kind: str(policy.weights.path / policy.subdir)}
            agent = build_agent(cfg, **weights, system_prompt_suffix=policy.system_prompt_suffix)
            greedy = cfg.eval.temperature == 0
            with pooled(suite, lambda: suite_spec(cfg, split), env_workers(cfg),
                        reply_timeout=env_reply_timeout(cfg)) as stepped:
                summary = run_rollouts(
                    stepped, agent, work, samples=1 if greedy else len(cfg.eval.seeds),
                    seed=cfg.eval.seeds[0] if greedy else cfg.seed, max_steps=cfg.eval.max_steps,
                    context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size,
                    infra_retries=infra_retries(cfg))
            # the file by name: the work dir's path (a .partial) is not where the artifact will live; scenarios the
            # suite skipped (ToolSandbox's RapidAPI ones without a key) are counted beside the episodes
            atomic_write_json(work / "summary.json", {"policy": policy.identity(), **summary.to_dict(),
                                                      "path": TRAJECTORIES,
                                                      **({"skipped": suite.skipped} if getattr(suite, "skipped", None) else {})})
        finally:
            getattr(suite, "close", lambda: None)()  # an environment server (ToolSandbox) stops with its rollout

    t0 = time.time()
    art = ctx.cache.get_or_compute("episodes", key, compute, meta={"policy": policy.identity()})
    ctx.use(art, time.time() - t0)
    return art


def tool_rollout(cfg: DictConfig, policy: Policy, cache: StageCache, record: RunRecord,
                 split: str | None = None) -> Artifact:
    """:func:`cached_rollout` outside a pipeline run (the planted experiment tools: rung a, the bands): the same
    ``episodes/<key>`` entry of ``cache`` a stage reads or makes, recorded in ``record`` (its ``artifacts.json``)."""
    record.run_dir.mkdir(parents=True, exist_ok=True)
    return cached_rollout(StageContext(cfg, "episodes", record.run_dir, {}, cache, record), policy, cfg, split)


def read_trajectories_dir(art: Artifact) -> list[Any]:
    """A rollout artifact's trajectories. One that holds an infrastructure failure recorded as an outcome (made
    before those were retried: tracekit.episodes) is refused in one line naming the ``rm -r`` that recomputes it."""
    trajs = read_trajectories(art.path)
    if infra := [t for t in trajs if is_infra_record(t)]:
        raise CorruptArtifact(
            f"{art.path}: {len(infra)} of its {len(trajs)} episodes ended on an infrastructure failure recorded as an "
            f"outcome (e.g. {infra[0].task_id}: {' '.join(infra[0].error.split())[:200]}), made before those were "
            f"run again; recompute: rm -r {art.path}")
    return trajs


def trajectories_of(art: Artifact) -> list[Any]:
    """The base agent's trajectories behind a ``rollout`` stage artifact."""
    return read_trajectories_dir(art.resolve(read_json(art.path / "episodes.json")))


# --------------------------------------------------------------------------------------------
# GRPO runs: seeds, budgets, adapters


TRAIN_SEED_OFFSET = 100_000  # training instances never reuse the validation seeds 0..n


def adapters_of(train: Artifact) -> dict[str, Artifact]:
    """The per-capability adapter artifacts behind a ``train`` artifact (verified)."""
    return {cap: train.resolve(ref) for cap, ref in read_json(train.path / "adapters.json").items()}


def ready_capabilities(syn: Artifact) -> list[str]:
    """The capabilities whose environment package a ``synthesize`` artifact holds ready, in its manifest's order."""
    return [e["capability"] for e in read_json(syn.path / MANIFEST)["environments"] if e["status"] == "ready"]


def package_identity(pkg: Path) -> dict[str, str]:
    """What an environment package runs (env.json + generated source), not the reports beside it (timings)."""
    return {f.name: f.read_text() for f in sorted(pkg.iterdir()) if f.name == "env.json" or f.suffix == ".py"}


def train_seeds(cfg: DictConfig, iterations: int | None = None) -> list[int]:
    """Environment seeds GRPO draws its groups from (never the validation seeds)."""
    n = cfg.grpo.groups * (iterations or cfg.grpo.iterations)
    return list(range(TRAIN_SEED_OFFSET, TRAIN_SEED_OFFSET + n))


def matched_iterations(cfg: DictConfig, episodes: int) -> int:
    """GRPO iterations of ``grpo.groups x grpo.group_size`` episodes that spend ``episodes`` (rounded up)."""
    return max(1, math.ceil(episodes / (cfg.grpo.groups * cfg.grpo.group_size)))


def synthesis_target(cfg: DictConfig) -> str:
    """The environment family synthesized environments must keep the interface of (the target's)."""
    return target_of(cfg).synthesis_family(cfg)


# what a GRPO run (:func:`grpo_run`) reads: the recipe, the engine, the backbone (the stages that train one read these)
GRPO_RUN_READS = ("grpo", "backbone", "launcher.kind", *AGENT_ENGINE_READS)
# the grpo group's checkpoint knobs; a run on the target's training tasks (grpo_target, swe_rl) keeps its checkpoints
# by its own setting (baselines.<method>.checkpoint_iterations), so it does not read these
CHECKPOINT_KNOBS = ("checkpoint_every", "keep_checkpoints")
GRPO_RUN_READS_OWN_CHECKPOINTS = (*(f"grpo.{f.name}" for f in fields(GrpoConfig) if f.name not in CHECKPOINT_KNOBS),
                                  *GRPO_RUN_READS[1:])

_LOG_LOCK = threading.Lock()  # concurrent runs replay their metrics to the one run logger


def grpo_run(ctx: StageContext, label: str, env: Any, identity: dict[str, Any], iterations: int | None = None,
             isolate: bool = False) -> Artifact:
    """One GRPO adapter (the ``grpo`` settings; ``iterations`` overrides theirs) on the environment ``env``
    (a :class:`tracekit.rl.launch.Factory` of an EnvSuite) whose content is ``identity``: a cache entry
    ``adapters/<key>`` keyed on the settings, engine, backbone and that content. ``isolate`` trains in a
    subprocess (concurrent runs); the key does not depend on it: the adapter is the same."""
    cfg = ctx.cfg
    grpo = {**plain(cfg.grpo), **({"iterations": iterations} if iterations else {})}
    key = stable_hash({"grpo": grpo, "engine": engine_spec(cfg), "backbone": backbone_dict(cfg), **identity},
                      length=20)

    def compute(work: Path) -> None:
        # every rollout kept with its tokens: the successful ones are the MoE gate's and SFT's data
        settings = OmegaConf.to_object(cfg.grpo).settings(save_rollouts="full")
        settings.iterations = grpo["iterations"]
        spec = TrainSpec(
            model=Factory("tracekit.llm.backbones:load_backbone",
                          {"spec": backbone_dict(cfg), "device": device(cfg), "dtype": dtype(cfg)}),
            env=env, out_dir=str(work), grpo=settings, chat_format=cfg.backbone.chat_format, engine=engine_spec(cfg),
            # execution only (in no key); an LLM user's replies are batched in the trainer's process
            env_workers=0 if user_kind(cfg) == "llm" else env_workers(cfg), env_reply_timeout=env_reply_timeout(cfg),
            env_infra_retries=infra_retries(cfg))
        launcher = LauncherSettings(**plain(cfg.launcher))
        logger = ctx.record.logger

        def log_row(row: dict[str, Any]) -> None:
            with _LOG_LOCK:
                logger.scalars({f"train/{label}/{k}": v for k, v in row.items()})

        train(spec, launcher, callbacks=[log_row], isolate=isolate)

    t0 = time.time()
    art = ctx.cache.get_or_compute("adapters", key, compute, meta={"capability": label})
    ctx.use(art, time.time() - t0)
    return art


# --------------------------------------------------------------------------------------------
# evaluation: a policy's trajectories


def is_zero_update(adapter_dir: Path) -> bool:
    """Whether a saved LoRA adapter adds nothing: every ``lora_B`` is zero (its initialization, kept when every
    GRPO group of the run had zero reward variance), so W + s B A = W exactly."""
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if "lora_B" in n]
        return bool(names) and all(not f.get_tensor(n).any() for n in names)


def policy_trajectories(ctx: StageContext, policy: Any) -> list[Any]:
    """The policy's trajectories on the target's test tasks: one cached rollout per distinct policy. The
    base policy, and an adapter that is the zero update (B = 0: the base model's outputs bit for bit), read
    the base rollout. With ``eval.benchmark`` (another target, Table 8) every policy, the base included, is rolled
    out there."""
    base = policy.kind == "base" or (policy.kind == "adapter" and is_zero_update(policy.weights.path / policy.subdir))
    if eval_benchmark(ctx.cfg) is not None:
        return read_trajectories_dir(cached_rollout(ctx, Policy() if base else policy, evaluation_config(ctx.cfg)))
    if base:
        return trajectories_of(ctx.inputs["rollout"])
    return read_trajectories_dir(cached_rollout(ctx, policy))
