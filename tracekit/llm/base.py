"""One chat interface for every model backend (transformers in-process, OpenAI-compatible endpoints).

Messages and tool schemas go in, assistant messages with parsed tool calls come out, in batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tracekit.types import Message


class EndpointError(RuntimeError):
    """A model endpoint is unreachable, misconfigured or keeps failing (one clear line)."""


@dataclass
class ChatRequest:
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 512
    seed: int | None = None
    return_tokens: bool = False  # ask for token ids / log-probs (RL)
    response_format: dict[str, Any] | None = None  # e.g. a JSON schema, where the backend supports it


@dataclass
class ChatResponse:
    message: Message  # role="assistant"; tool_calls parsed; parse_error set when parsing failed
    text: str  # the raw generated text
    finish_reason: str = "stop"  # stop | length | error
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    completion_logprobs: list[float] | None = None
    usage: dict[str, int] = field(default_factory=dict)


class ChatClient(ABC):
    """A batched chat model."""

    name: str = "chat"

    @abstractmethod
    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        """Answer every request; the i-th response belongs to the i-th request."""

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        """Prompt length in tokens (for context budgets); backends without a tokenizer estimate."""
        text = "".join((m.content or "") + str([c.arguments for c in m.tool_calls]) for m in messages)
        return len(text) // 4 + (len(str(tools)) // 4 if tools else 0)

    def clear_prefix_cache(self) -> dict[str, int]:
        """Forget prompt prefixes kept between calls; -> prompt tokens decoded and tokens prefilled since the last
        clear (empty: this client keeps none)."""
        return {}

    def close(self) -> None:
        """Release resources (servers, sessions)."""
