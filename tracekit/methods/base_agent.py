"""``base``: the untrained backbone (the rollout stage's own episodes are its evaluation)."""

from __future__ import annotations

from tracekit.methods.base import Method, PolicyRow
from tracekit.policy import Budget, Policy


class BaseAgent(Method):
    name = "base"
    summary = "the base agent, no training"

    def inputs(self, cfg):
        return ("rollout",)

    def rows(self, ctx):
        return [PolicyRow("Base", Policy(), Budget())]
