"""The data model shared by every stage: messages, tool calls, trajectories, tasks, capabilities, labels.

All types are pydantic models so that every artifact round-trips through JSON/JSONL exactly
(``model_dump_json`` / ``model_validate_json``) and malformed files fail with a precise error.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ToolCall(_Model):
    """One function call emitted by the agent (OpenAI function-call shape)."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Message(_Model):
    """One chat message.

    ``tool_calls`` is set on assistant messages that call tools; ``tool_call_id``/``name`` on tool
    results. ``parse_error`` records why the raw model text could not be parsed into tool calls
    (the text is then kept as ``content`` and the agent sees the error, never a crash).
    ``error`` marks a tool result that is an error (unknown tool, bad arguments, policy raise).
    """

    role: Role
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None
    parse_error: str | None = None
    error: bool = False

    def to_chat(self) -> dict[str, Any]:
        """The message as a chat-template / OpenAI dict (no tracekit-only fields)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id
            if self.name:
                out["name"] = self.name
        return out


class TokenRecord(_Model):
    """Exact tokens of one trajectory as the policy saw and produced them (for RL).

    ``token_ids`` is the full token sequence (prompt, context and generated tokens, in order);
    ``loss_mask[i] == 1`` iff token i was sampled by the policy; ``logprobs[i]`` is the rollout
    policy's log-prob of token i where the mask is 1 and 0.0 elsewhere.
    """

    token_ids: list[int]
    logprobs: list[float]
    loss_mask: list[int]


class Trajectory(_Model):
    """One episode: the messages exchanged, the outcome and where it came from."""

    task_id: str
    env: str
    seed: int = 0
    sample: int = 0
    messages: list[Message] = Field(default_factory=list)
    reward: float = 0.0
    success: bool = False
    termination: str = ""
    error: str | None = None
    info: dict[str, Any] = Field(default_factory=dict)
    tokens: TokenRecord | None = None

    @property
    def uid(self) -> str:
        """Stable id of the episode within a rollout: env/task/sample."""
        return f"{self.env}/{self.task_id}/{self.sample}"


class Task(_Model):
    """One task instance of a target environment (a benchmark task or a synthetic seed)."""

    id: str
    env: str
    instruction: str = ""
    data: dict[str, Any] = Field(default_factory=dict)


class Capability(_Model):
    """An entry of the capability dictionary: a fixed snake_case name and a description."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    description: str


class LabelValue(str, enum.Enum):
    NA = "NA"
    PRESENT = "PRESENT"
    LACKING = "LACKING"


class Label(_Model):
    """The analysis agent's verdict on one (trajectory, capability) in one labeling run.

    ``value is None`` means the label could not be obtained (recorded as missing, never guessed).
    """

    trajectory: str
    capability: str
    run: int
    value: LabelValue | None
    rationale: str = ""
    success: bool


def stable_hash(obj: Any, length: int = 16) -> str:
    """Hex digest of a JSON-serialisable object, independent of dict order."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]
