"""``on_policy_distill``: one student adapter sampling in the uniform mixture of the capability environments,
trained toward the teacher of each episode's environment (that capability's GRPO adapter) with the per-token
reverse KL as the advantage and an importance-sampled loss (paper Table 4; Thinking Machines 2025).

The student samples with the plain hf engine, whose log-probs are the policy's (a grammar-constrained
sampler's are masked): under constrained evaluation decoding it is trained off the evaluated decoding.
Budget: by default the capability runs' summed episodes (``consolidation.budget.episodes``), on top of them.
"""

from __future__ import annotations

import math

from tracekit.artifacts import Artifact
from tracekit.config import _check
from tracekit.llm.backbones import load_backbone
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.policy import Budget
from tracekit.rl.distill import DistillSettings, train_distill
from tracekit.runs import ready_capabilities, train_seeds
from tracekit.synthesis.mixture import MixtureSuite
from tracekit.synthesis.stage import open_package
from tracekit.wiring import backbone_dict, device, dtype


class OnPolicyDistill(Strategy):
    name = "on_policy_distill"
    settings, mount = DistillSettings, "distill"  # iterations: from consolidation.budget
    label = "On Policy Distillation"
    inputs = ("synthesize",)

    def reads(self, cfg):
        return ("consolidation.distill", "consolidation.budget", "grpo.groups", "grpo.iterations")

    def validate(self, cfg) -> None:
        """The iterations follow from the matched budget: a value set by hand is refused."""
        super().validate(cfg)
        _check(cfg.consolidation.distill.iterations == DistillSettings.iterations, "consolidation.distill.iterations",
               cfg.consolidation.distill.iterations, "left unset: set consolidation.budget.episodes (matched budgets)")

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        from omegaconf import OmegaConf


        cfg = ctx.cfg
        syn = ctx.inputs["synthesize"]
        ready = set(ready_capabilities(syn))
        seeds = train_seeds(cfg)
        suites = {cap: open_package(syn.path / cap, seeds) for cap in sorted(ready & set(adapters))}
        suite = MixtureSuite(list(suites.values()))
        teachers = {suites[cap].name: str(adapters[cap].path / "adapter") for cap in suites}
        target = adapters_budget({c: adapters[c] for c in suites})
        values = OmegaConf.to_container(cfg.consolidation.distill, resolve=True)
        per_iteration = values["groups"] * values["samples_per_task"]
        episodes = cfg.consolidation.budget.episodes or target.episodes
        values["iterations"] = max(1, math.ceil(episodes / per_iteration))
        model, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        logger = ctx.record.logger
        summary = train_distill(model, tokenizer, suite, teachers, DistillSettings(**values), ctx.work_dir / "distill",
                                chat_format=cfg.backbone.chat_format, device=device(cfg),
                                callbacks=[lambda row: logger.scalars({f"distill/{k}": v for k, v in row.items()})])
        own = Budget(summary["episodes"], summary["tokens_generated"], summary["optimizer_steps"])
        return Consolidated("adapter", "distill/adapter", target + own, notes=(
            f"{values['iterations']} iterations x {per_iteration} episodes in the mixture of {len(suites)} "
            f"environments; reverse KL {summary['reverse_kl_first']:.3f} -> {summary['reverse_kl_last']:.3f}",))
