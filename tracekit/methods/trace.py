"""``trace``: the capability adapters consolidated by ``consolidation.method`` (TRACE itself: ``moe``)."""

from __future__ import annotations

from tracekit.methods.base import Method
from tracekit.methods.consolidate import read_consolidated


class Trace(Method):
    name = "trace"
    summary = "the capability adapters consolidated by consolidation.method (moe: TRACE's LoRA-MoE)"

    def inputs(self, cfg):
        return ("compose",)

    def rows(self, ctx):
        return [read_consolidated(ctx.inputs["compose"])]
