"""A policy (the backbone, alone or with one set of weights, or with a prompt suffix) and what producing it
consumed (its budget): what a method hands to evaluation, what a cached rollout is keyed on.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from typing import Any, Literal

from tracekit.artifacts import COMPLETE, Artifact, read_json

PolicyKind = Literal["base", "adapter", "moe", "prompt"]
_NO_WEIGHTS = ("base", "prompt")


@dataclass(frozen=True)
class Policy:
    """The backbone, alone or with the peft adapter / LoRA-MoE saved at ``weights.path / subdir``.

    ``prompt``: the backbone alone with ``system_prompt_suffix`` appended to the system prompt of every
    episode (prompt-only and GEPA rows: no weights change). ``base`` is the untouched base agent (it reads the
    base rollout), so a suffix makes a policy of kind ``prompt``, never ``base``.
    """

    kind: PolicyKind = "base"
    weights: Artifact | None = None
    subdir: str = ""
    system_prompt_suffix: str | None = None

    def __post_init__(self) -> None:
        if (self.kind in _NO_WEIGHTS) != (self.weights is None):
            raise ValueError(f"policy kind {self.kind!r} {'takes no' if self.kind in _NO_WEIGHTS else 'needs'} weights")
        if (self.kind == "prompt") != bool(self.system_prompt_suffix):
            raise ValueError("a system_prompt_suffix makes a policy of kind 'prompt' (and kind 'prompt' needs one)")

    def identity(self) -> dict[str, Any]:
        """What the policy's rollout depends on (content, not location): part of its cache key."""
        out = {"kind": self.kind, "weights": self.weights.content_key if self.weights else None, "subdir": self.subdir}
        if self.system_prompt_suffix is not None:  # absent otherwise: existing rollouts keep their keys
            out["system_prompt_suffix"] = self.system_prompt_suffix
        return out


@dataclass(frozen=True)
class Budget:
    """What producing a policy consumed (paper: consolidations compared at matched budgets)."""

    episodes: int = 0  # environment episodes rolled out for training (evaluation not counted)
    generated_tokens: int = 0  # tokens sampled during training
    optimizer_steps: int = 0

    def __add__(self, other: Budget) -> Budget:
        return Budget(self.episodes + other.episodes, self.generated_tokens + other.generated_tokens,
                      self.optimizer_steps + other.optimizer_steps)

    def to_dict(self) -> dict[str, int]:
        return {"episodes": self.episodes, "generated_tokens": self.generated_tokens,
                "optimizer_steps": self.optimizer_steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Budget:
        return cls(int(d["episodes"]), int(d["generated_tokens"]), int(d["optimizer_steps"]))


@dataclass(frozen=True)
class PolicyRow:
    """One row of a results table: its label, the policy evaluated and the budget that produced it."""

    label: str
    policy: Policy
    budget: Budget
    notes: tuple[str, ...] = ()


def budget_sum(budgets: Any) -> Budget:
    total = Budget()
    for b in budgets:
        total = total + b
    return total


def grpo_budget(adapter: Artifact) -> Budget:
    """A GRPO run's budget from its artifact: episodes = rollout rows (counted by the verified manifest),
    tokens and optimizer steps summed over ``metrics.csv``."""
    files = read_json(adapter.path / COMPLETE)["files"]
    episodes = sum(f.get("rows", 0) for rel, f in files.items() if rel.startswith("rollouts/"))
    with open(adapter.path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return Budget(episodes, sum(int(float(r["tokens_generated"] or 0)) for r in rows),
                  sum(int(float(r["optimizer_steps"] or 0)) for r in rows))
