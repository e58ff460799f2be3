"""``grpo_target``: the same GRPO recipe (the ``grpo`` settings, LoRA, engine) directly on the target's training
tasks with the target's own reward (paper Tables 1, 3, 6: "GRPO on Target"; Figure 4b's GRPO curve).

Tasks: the target's training split (:mod:`tracekit.methods.target_train`, ``Target.train_suite``: tau^2's ``train``
split, the library environments' training seeds, the coding train split, ToolSandbox's ``train_split``). Budget: by default TRACE's
per-capability GRPO runs' episodes summed, read from the ``train`` stage's adapters (this method then takes
``train`` as an input), spent as ``ceil(episodes / (G x K))`` iterations of the same G x K; with
``baselines.grpo_target.episodes`` set it needs no TRACE run. Checkpoints every
``checkpoint_iterations`` (default ``grpo.iterations``: one capability run's worth) are kept in the adapter
artifact for Figure 4b (each holds the adapter and its optimizer state): these checkpoint settings are the method's
own, so ``grpo.checkpoint_every`` and ``grpo.keep_checkpoints`` (the capability runs') are not among its reads.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
import math
import re
from collections.abc import Callable
from typing import Any, ClassVar

from tracekit.artifacts import COMPLETE, Artifact, atomic_write_json, read_json
from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.target_train import (refuse_without_training_split, trace_episodes, train_suite_reads,
                                           train_suite_spec)
from tracekit.pipeline import Stage
from tracekit.policy import Policy, grpo_budget
from tracekit.rl.launch import Factory
from tracekit.runs import GRPO_RUN_READS_OWN_CHECKPOINTS, grpo_run, matched_iterations, train_seeds
from tracekit.targets.registry import target


@dataclass
class GrpoTargetSettings:
    """grpo_target: the ``grpo`` recipe on the target's own training tasks with the target's reward."""

    episodes: int | None = None  # training episodes; None: TRACE's per-capability GRPO episodes summed (matched)
    # tau2: first n train-split tasks per domain (None: all, split_tasks.json); synthetic: instances per env (None:
    # one per group); coding (swe_rl): None, the whole train split
    train_limit: int | None = None
    # a kept checkpoint every n iterations (Figure 4b's points); None: grpo.iterations (one capability run's worth)
    checkpoint_iterations: int | None = None

    RANGES: ClassVar[dict[str, str]] = {"episodes": ">= 1", "train_limit": ">= 1", "checkpoint_iterations": ">= 1"}


LABEL = "GRPO on Target"
RESULT = "grpo_target.json"


def stage_reads(cfg):
    return (*GRPO_RUN_READS_OWN_CHECKPOINTS, *train_suite_reads(cfg), "baselines.grpo_target")


def stage_inputs(cfg):
    return ("train",) if cfg.baselines.grpo_target.episodes is None else ()


def train_on_target(ctx, name: str, settings: Any, spec_for: Callable[[int], dict[str, Any]],
                    cache_dir: str | None = None) -> dict[str, Any]:
    """GRPO on the target's training tasks at the matched budget (``settings``: a ``baselines.<method>`` group
    with ``episodes`` and ``checkpoint_iterations``; ``spec_for(iterations)``: the training suite's spec). The
    result record: the adapter, the budget and the kept checkpoints."""
    cfg = ctx.cfg
    matched = trace_episodes(ctx.inputs["train"]) if settings.episodes is None else None
    episodes = settings.episodes if settings.episodes is not None else matched
    iterations = matched_iterations(cfg, episodes)
    every = settings.checkpoint_iterations or cfg.grpo.iterations
    run_cfg = copy.deepcopy(cfg)  # keep a checkpoint every `every` iterations, all of them (Figure 4b)
    run_cfg.grpo.checkpoint_every = every
    run_cfg.grpo.keep_checkpoints = math.ceil(iterations / every) + 1
    spec = spec_for(iterations)
    env_args = {"spec": spec} if cache_dir is None else {"spec": spec, "cache_dir": cache_dir}
    env = Factory("tracekit.methods.target_train:open_target_train", env_args)
    art = grpo_run(dataclasses.replace(ctx, cfg=run_cfg), name, env, {"target_train": spec}, iterations=iterations)
    return {"adapter": {**art.ref(), "content_key": art.content_key}, "iterations": iterations,
            "matched_episodes": matched, "requested_episodes": episodes, "budget": grpo_budget(art).to_dict(),
            "checkpoint_every": every, "checkpoints": checkpoint_points(art), "train_suite": spec}


def grpo_target_stage(ctx) -> None:
    cfg, s = ctx.cfg, ctx.cfg.baselines.grpo_target

    def spec_for(iterations: int) -> dict[str, Any]:
        n_per_env = s.train_limit or len(train_seeds(cfg, iterations))  # synthetic: a fresh instance per group
        return train_suite_spec(cfg, n_per_env=n_per_env, limit=s.train_limit)

    atomic_write_json(ctx.work_dir / RESULT, train_on_target(ctx, "grpo_target", s, spec_for))


def grpo_target_report(art: Artifact, ctx) -> None:
    r = read_json(art.path / RESULT)
    b = r["budget"]
    how = (f"matched to TRACE's per-capability GRPO episodes ({r['matched_episodes']:,})"
           if r["matched_episodes"] is not None else f"baselines.grpo_target.episodes={r['requested_episodes']:,}")
    split = target(r["train_suite"]["benchmark"]["kind"]).train_split_label(r["train_suite"])
    ctx.record.section("GRPO on target", (
        f"{r['iterations']} iterations on the {split}, {how}: {b['episodes']:,} episodes, "
        f"{b['generated_tokens']:,} generated tokens, {b['optimizer_steps']:,} optimizer steps; "
        f"{len(r['checkpoints'])} checkpoints kept for Figure 4b."))


def checkpoint_points(adapter: Artifact) -> list[dict]:
    """The GRPO run's kept checkpoints: iteration, episodes rolled out through it, adapter subdir."""
    files = read_json(adapter.path / COMPLETE)["files"]
    rows_by_iter: dict[int, int] = {}
    for rel, f in files.items():
        m = re.fullmatch(r"rollouts/iter_(\d+)(\.rank\d+)?\.jsonl", rel)
        if m:
            rows_by_iter[int(m.group(1))] = rows_by_iter.get(int(m.group(1)), 0) + f.get("rows", 0)
    out = []
    for d in sorted((adapter.path / "checkpoints").glob("iter_*")):
        if (d / "adapter" / "adapter_model.safetensors").exists():
            it = int(d.name.split("_")[1])
            out.append({"iteration": it, "episodes": sum(n for i, n in rows_by_iter.items() if i <= it),
                        "subdir": f"checkpoints/{d.name}/adapter"})
    return out


def read_result(art: Artifact) -> tuple[dict, Artifact]:
    r = read_json(art.path / RESULT)
    return r, art.resolve(r["adapter"])


class GrpoTarget(Method):
    settings = GrpoTargetSettings
    name = "grpo_target"
    summary = "GRPO (the grpo recipe, LoRA) on the target's training tasks with its own reward, at TRACE's episodes"
    stages = (Stage("grpo_target", reads=stage_reads, inputs=stage_inputs, compute=grpo_target_stage,
                    report=grpo_target_report),)

    def inputs(self, cfg):
        return ("grpo_target",)

    def validate(self, cfg):
        refuse_without_training_split(cfg, self.name)

    def rows(self, ctx):
        r, adapter = read_result(ctx.inputs["grpo_target"])
        budget = grpo_budget(adapter)
        matched = (f"TRACE's per-capability GRPO runs: {r['matched_episodes']:,} episodes"
                   if r["matched_episodes"] is not None else "episodes set by baselines.grpo_target.episodes")
        t = target(r["train_suite"]["benchmark"]["kind"])
        split = t.train_split_label(r["train_suite"])
        return [PolicyRow(LABEL, Policy("adapter", adapter, "adapter"), budget, (
            f"{r['iterations']} GRPO iterations on the {split}: {budget.episodes:,} episodes ({matched})",
            *t.train_split_notes(r["train_suite"])))]
