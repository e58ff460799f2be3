"""Agents the rollout runner drives: batched ``act(states) -> responses``.

- :class:`LLMAgent` (``agent=llm``): a :class:`~tracekit.llm.base.ChatClient` (the backbone,
  optionally with adapters) answering the episode's messages with its tool schemas.
- :class:`GoldAgent` (``agent=gold``): replays the task's gold actions as tool calls, then sends one
  text message containing every communicate-info string, then ``###STOP###`` if the user keeps
  talking. Like tau^2's ground-truth agent it checks the environment + evaluator wiring: it must
  score 1.0 on every airline/retail task.

``act`` answers all live episodes at once so model calls are batched across episodes; a response
is a :class:`~tracekit.llm.base.ChatResponse` (message + token ids / log-probs when the client
returns them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.types import Message, Task, ToolCall, stable_hash

STOP_TOKEN = "###STOP###"


@dataclass
class AgentState:
    """What an agent sees of one live episode."""

    task: Task
    messages: list[Message]  # the full conversation so far (system prompt first)
    tools: list[dict[str, Any]]
    seed: int  # the episode's seed
    turn: int  # number of actions this agent already took in the episode


class Agent(ABC):
    name: str = "agent"
    max_new_tokens: int = 0  # tokens an action may add to the context (for the context budget)

    @abstractmethod
    def act(self, states: list[AgentState]) -> list[ChatResponse]:
        """One action per state; the i-th response belongs to the i-th state."""

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> int | None:
        """Prompt length in the agent's tokens; None = the agent has no context limit (no model)."""
        return None

    def clear_prefix_cache(self) -> dict[str, int]:
        """Forget prompt prefixes the agent's model keeps between calls (:meth:`ChatClient.clear_prefix_cache`)."""
        return {}

    def close(self) -> None:
        """Release resources."""


def turn_seed(episode_seed: int, turn: int) -> int:
    """Seed of one model call: ``int(sha256([episode_seed, turn])[:16], 16) mod 2^31``."""
    return int(stable_hash([episode_seed, "agent", turn]), 16) % 2**31


class LLMAgent(Agent):
    """A chat model as the agent: the request is the episode's messages + tools + decoding params.

    With ``temperature == 0`` decoding is greedy; otherwise each call is seeded with
    :func:`turn_seed` of (episode seed, turn), so a rerun reproduces the same samples on backends
    that honour seeds.

    ``system_prompt_suffix`` (prompt-only and GEPA policies) is appended to the episode's system
    message (separated by a blank line; a system message is added when the episode has none) in every
    request and in the context-budget count; the episode's own messages, and so its trajectory, are
    unchanged.
    """

    name = "llm"

    def __init__(
        self,
        client: ChatClient,
        temperature: float = 0.0,
        top_p: float = 1.0,
        max_new_tokens: int = 256,
        return_tokens: bool = False,
        system_prompt_suffix: str | None = None,
    ):
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.client = client
        self.temperature = temperature
        self.top_p = top_p
        self.max_new_tokens = max_new_tokens
        self.return_tokens = return_tokens
        self.system_prompt_suffix = system_prompt_suffix or None

    def with_suffix(self, messages: list[Message]) -> list[Message]:
        """``messages`` as the model sees them: the system prompt extended by ``system_prompt_suffix``."""
        if not self.system_prompt_suffix:
            return list(messages)
        if messages and messages[0].role == "system":
            head = messages[0]
            text = f"{head.content}\n\n{self.system_prompt_suffix}" if head.content else self.system_prompt_suffix
            return [head.model_copy(update={"content": text}), *messages[1:]]
        return [Message(role="system", content=self.system_prompt_suffix), *messages]

    def request(self, state: AgentState) -> ChatRequest:
        return ChatRequest(
            messages=self.with_suffix(state.messages),
            tools=state.tools or None,
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=turn_seed(state.seed, state.turn),
            return_tokens=self.return_tokens,
        )

    def act(self, states: list[AgentState]) -> list[ChatResponse]:
        if not states:
            return []
        responses = self.client.chat([self.request(s) for s in states])
        if len(responses) != len(states):
            raise RuntimeError(f"{type(self.client).__name__} answered {len(responses)} of {len(states)} requests")
        return responses

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> int:
        return self.client.count_tokens(self.with_suffix(messages), tools)

    def clear_prefix_cache(self) -> dict[str, int]:
        return self.client.clear_prefix_cache()

    def close(self) -> None:
        self.client.close()


class GoldAgent(Agent):
    """Replays ``task.data['actions']`` (tau^2 gold actions), then reports ``communicate_info``.

    Turn ``i < n`` calls gold action ``i`` (its ``action_id`` as the call id); turn ``n`` sends
    ``"Your request has been processed. <info 1> <info 2> ..."``; later turns send ``###STOP###``.
    """

    name = "gold"

    def actions(self, task: Task) -> list[dict[str, Any]]:
        """The calls to replay (override to perturb them in checks)."""
        actions = task.data.get("actions")
        if actions is None:
            raise ValueError(f"task {task.id} has no gold actions (task.data['actions']): the gold agent needs them")
        for a in actions:
            if a.get("requestor", "assistant") != "assistant":
                raise ValueError(f"task {task.id}: gold action {a.get('name')} is a user action; the gold agent replays agent actions only")
        return actions

    def final_message(self, task: Task) -> str:
        info = [str(x) for x in task.data.get("communicate_info", [])]
        return " ".join(["Your request has been processed.", *info])

    def act(self, states: list[AgentState]) -> list[ChatResponse]:
        out = []
        for s in states:
            actions = self.actions(s.task)
            if s.turn < len(actions):
                a = actions[s.turn]
                msg = Message(role="assistant", tool_calls=[
                    ToolCall(id=a.get("action_id") or f"gold_{s.turn}", name=a["name"], arguments=dict(a["arguments"]))
                ])
                text = ""
            else:
                text = self.final_message(s.task) if s.turn == len(actions) else STOP_TOKEN
                msg = Message(role="assistant", content=text)
            out.append(ChatResponse(message=msg, text=text))
        return out
