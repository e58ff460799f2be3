"""``multi_grpo``: one adapter trained with GRPO on a uniform mixture of all selected capability environments
(paper Table 4; official ``train_mixed_grpo_cmd.sh``). Each group is K rollouts of one task, hence of one
environment; tasks are drawn uniformly (seeded by ``grpo.seed``) from equal numbers per environment.

Budget: by default the episodes the per-capability runs spent in all (``consolidation.budget.episodes: null``;
``iterations x T`` iterations when every run ran its plan): the same ``grpo`` settings for as many iterations as
spend them. It does not reuse the capability adapters.
"""

from __future__ import annotations

from tracekit.artifacts import Artifact
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.policy import grpo_budget
from tracekit.rl.launch import Factory
from tracekit.runs import GRPO_RUN_READS, grpo_run, ready_capabilities, matched_iterations, package_identity, train_seeds


class MultiGRPO(Strategy):
    name = "multi_grpo"
    label = "Multi Capability GRPO"
    inputs = ("synthesize",)

    def reads(self, cfg):
        return (*GRPO_RUN_READS, "consolidation.budget")  # a GRPO run's reads (the backbone: compose's own too)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        syn = ctx.inputs["synthesize"]
        ready = ready_capabilities(syn)
        pkgs = {cap: syn.path / cap for cap in sorted(ready)}
        target = adapters_budget(adapters)
        # the episodes the capability runs actually spent (an early stop or dynamic resampling changes the plan)
        iterations = matched_iterations(ctx.cfg, ctx.cfg.consolidation.budget.episodes or target.episodes)
        env = Factory("tracekit.synthesis.mixture:open_mixture",
                      {"pkg_dirs": [str(p) for p in pkgs.values()], "seeds": train_seeds(ctx.cfg, iterations)})
        art = grpo_run(ctx, "multi_grpo", env, {"mixture": {c: package_identity(p) for c, p in pkgs.items()}},
                       iterations=iterations)
        return Consolidated("adapter", "adapter", grpo_budget(art), weights=art, notes=(
            f"GRPO on the uniform mixture of {len(pkgs)} environments for {iterations} iterations "
            f"(per-capability runs: {target.episodes:,} episodes in all)",))
