"""``prompt_only``: the selected capabilities' names and descriptions appended to the agent's system prompt,
no training and no optimization (paper Figure 4a's comparator at zero optimization; GEPA's seed candidate)."""

from __future__ import annotations

from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.target_train import capabilities_block, ranked_capabilities
from tracekit.policy import Budget, Policy

LABEL = "Prompt only (capabilities in the system prompt)"


def prompt_policy(capabilities: list[dict[str, str]]) -> Policy:
    return Policy("prompt", system_prompt_suffix=capabilities_block([(c["name"], c["description"])
                                                                     for c in capabilities]))


class PromptOnly(Method):
    name = "prompt_only"
    summary = "the selected capabilities' names and descriptions in the system prompt, no training"

    def inputs(self, cfg):
        return ("select",)

    def rows(self, ctx):
        caps = ranked_capabilities(ctx.inputs["select"])
        if not caps:
            raise RuntimeError("prompt_only: the selection is empty (no capability passed the thresholds)")
        return [PolicyRow(LABEL, prompt_policy(caps), Budget(),
                          (f"{len(caps)} capabilities in the system prompt: {', '.join(c['name'] for c in caps)}",))]
