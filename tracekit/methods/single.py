"""``single_capability``: each capability's GRPO adapter alone; the table keeps the best (paper Table 1)."""

from __future__ import annotations

from tracekit.methods.base import Method, PolicyRow
from tracekit.policy import Policy, grpo_budget
from tracekit.runs import adapters_of

PREFIX = "Single Capability GRPO"


class SingleCapability(Method):
    name = "single_capability"
    summary = "the best of the per-capability GRPO adapters, each evaluated alone"

    def inputs(self, cfg):
        return ("train",)

    def rows(self, ctx):
        return [PolicyRow(f"{PREFIX} ({cap})", Policy("adapter", art, "adapter"), grpo_budget(art))
                for cap, art in adapters_of(ctx.inputs["train"]).items()]

    def keep(self, results):
        best = max(results, key=lambda label: (results[label]["overall"]["pass_rate"], label))
        return [best]
