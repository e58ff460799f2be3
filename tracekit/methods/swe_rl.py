"""``swe_rl``: the SWE-RL baseline (Wei et al., 2025; paper Table 2): the GRPO recipe on the coding target's
training tasks with SWE-RL's rule-based reward instead of the tests.

SWE-RL's reward (:func:`tracekit.targets.coding.reward.swe_rl_reward`, written from its definition) scores the patch
against the oracle's per-file diffs; the coding suite computes it (built with ``reward="swe_rl"``). The oracle
is the task's gold patch (the bug's reverse). Training tasks, budget (matched to TRACE's per-capability GRPO episodes
unless ``baselines.swe_rl.episodes`` is set), engine and LoRA are ``grpo_target``'s.
"""

from __future__ import annotations

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.config import ConfigError
from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.grpo_target import GrpoTargetSettings, train_on_target
from tracekit.methods.grpo_target import stage_reads as grpo_reads
from tracekit.methods.target_train import refuse_without_training_split, train_suite_spec
from tracekit.pipeline import Stage
from tracekit.policy import Policy, grpo_budget
from tracekit.targets.registry import kinds, target, target_of

LABEL = "SWE-RL"
RESULT = "swe_rl.json"


# --------------------------------------------------------------------------------------------
# the method: GRPO on the coding target's training split with the SWE-RL reward


def stage_reads(cfg):
    return tuple(r if r != "baselines.grpo_target" else "baselines.swe_rl" for r in grpo_reads(cfg))


def stage_inputs(cfg):
    return ("train",) if cfg.baselines.swe_rl.episodes is None else ()


def swe_rl_stage(ctx) -> None:
    cfg, s = ctx.cfg, ctx.cfg.baselines.swe_rl
    record = train_on_target(ctx, "swe_rl", s, lambda _: {**train_suite_spec(cfg, limit=s.train_limit), "reward": "swe_rl"},
                             cache_dir=str(cfg.paths.cache_dir))
    atomic_write_json(ctx.work_dir / RESULT, record)


def swe_rl_report(art: Artifact, ctx) -> None:
    r = read_json(art.path / RESULT)
    b = r["budget"]
    ctx.record.section("SWE-RL", (
        f"{r['iterations']} GRPO iterations on the coding target's training tasks with SWE-RL's patch-similarity "
        f"reward: {b['episodes']:,} episodes, {b['generated_tokens']:,} generated tokens, "
        f"{b['optimizer_steps']:,} optimizer steps."))


class SweRl(Method):
    name = "swe_rl"
    settings = GrpoTargetSettings  # grpo_target's knobs, its own values
    summary = "GRPO on the coding target's training tasks with SWE-RL's reward (patch similarity to the oracle)"
    stages = (Stage("swe_rl", reads=stage_reads, inputs=stage_inputs, compute=swe_rl_stage, report=swe_rl_report),)

    def inputs(self, cfg):
        return ("swe_rl",)

    def validate(self, cfg):
        if not target_of(cfg).patch_reward:
            with_patches = " or ".join(k for k in kinds() if target(k).patch_reward)
            raise ConfigError(f"swe_rl trains with SWE-RL's patch-similarity reward on the coding target's training "
                              f"split (gold patches): benchmark.kind={with_patches} (got {cfg.benchmark.kind}, "
                              f"{cfg.benchmark.name})")
        refuse_without_training_split(cfg, self.name)

    def rows(self, ctx):
        art = ctx.inputs["swe_rl"]
        r = read_json(art.path / RESULT)
        adapter = art.resolve(r["adapter"])
        budget = grpo_budget(adapter)
        note = (f"{r['iterations']} GRPO iterations on the coding training split, SWE-RL reward: "
                f"{budget.episodes:,} episodes")
        return [PolicyRow(LABEL, Policy("adapter", adapter, "adapter"), budget, (note,))]
