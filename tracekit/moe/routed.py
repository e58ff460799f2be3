"""Coarse routing of a LoRA-MoE at inference (issue 53): one decision per assistant turn or per episode.

:class:`PromptRoutedClient` wraps the chat client of a :class:`~tracekit.moe.model.LoRAMoEModel` whose
``granularity`` is ``turn`` or ``trajectory`` (or whose ``decider`` is ``task``). For each request (one assistant
turn of one episode) it decides the slot weights, groups the requests by decision, and generates each group with
every gate pinned to its weights (:meth:`LoRAMoEModel.pinned`): every token of the turn, the prompt's included,
goes through ``W + sum_c w_c B_c A_c``. Hard routing puts the whole weight on one adapter, so the turn runs that
adapter alone; soft top-k mixes k adapters with weights summing to 1, which is the linear merge of their updates.

- ``turn``: the decision is made from the turn's prompt: the gates' probabilities (token-level inference routing)
  averaged over the prompt tokens after the agent's last message (what the user or the environment said since;
  the whole prompt at the first turn), read in the context of the whole conversation, then over the blocks.
- ``trajectory``: from the episode's opening, every message before the first assistant message (the system
  prompt, the task, the tools): the same for every turn of the episode, so the client keeps no per-episode state.
- ``decider="task"`` (``consolidation=route``): the opening is handed to a task router
  (:class:`tracekit.moe.task_router.TaskRouter`) instead of the gates.

The decisions are counted per slot (:attr:`PromptRoutedClient.decisions`). A switch of the pinned weights moves
the gates' version counters, so a fast decoder re-copies them and drops its stored prompt prefixes (their K/V
were computed under other weights): correct, and slower than token routing when a batch mixes decisions.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tracekit.moe.gate import prompt_decisions
from tracekit.moe.model import LoRAMoEModel
from tracekit.moe.task_router import load_task_router

log = logging.getLogger(__name__)

Encode = Callable[[list[Any], Any], list[int]]  # (messages, tools) -> prompt ids (the chat template, generation prompt)
_DECISION_CACHE = 4096  # episode openings whose decision is kept (trajectory granularity)


def opening(messages: Sequence[Any]) -> list[Any]:
    """The messages before the first assistant message: what an episode's decision is made from."""
    for i, m in enumerate(messages):
        if m.role == "assistant":
            return list(messages[:i])
    return list(messages)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def turn_start(encode: Encode, messages: Sequence[Any], tools: Any, ids: Sequence[int]) -> int:
    """The first token of a turn's prompt ``ids`` that is new since the agent's last message (0 at the first turn;
    never past the last token, so every turn has at least one token to decide from)."""
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        return 0
    return min(common_prefix_length(encode(list(messages[: last + 1]), tools), ids), len(ids) - 1)


class GateDecider:
    """Decisions from the LoRA-MoE's own gates (:func:`tracekit.moe.gate.prompt_decisions`, then
    :meth:`LoRAMoEModel.decide`)."""

    def __init__(self, model: LoRAMoEModel, encode: Encode, pad_id: int):
        self.model, self.encode, self.pad_id = model, encode, pad_id

    def __call__(self, prompts: list[tuple[list[Any], Any]], turn: bool) -> torch.Tensor:
        ids = [self.encode(m, t) for m, t in prompts]
        starts = [turn_start(self.encode, m, t, i) if turn else 0 for (m, t), i in zip(prompts, ids)]
        return self.model.decide(prompt_decisions(self.model, ids, starts, self.pad_id))


class PromptRoutedClient:
    """A chat client whose LoRA-MoE routes once per turn or per episode (module docstring). Every attribute but
    :meth:`chat` is the wrapped client's."""

    def __init__(self, inner: Any, model: LoRAMoEModel, decide: Callable[[list[tuple[list[Any], Any]], bool], torch.Tensor]):
        granularity = model.moe_config.granularity
        if granularity == "token":
            raise ValueError("token granularity routes inside the model: no PromptRoutedClient")
        self.inner, self.model, self.decide = inner, model, decide
        self.turn = granularity == "turn"
        self.decisions: Counter[str] = Counter()  # chosen slot (hard) or the slots mixed (soft) -> turns
        self._episode: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def clear_prefix_cache(self) -> dict[str, int]:
        """The wrapped client's (a rollout clears it when it starts and ends), logging the decisions so far."""
        if self.decisions:
            log.info("routed per %s: %s (turns per decision)", "turn" if self.turn else "episode",
                     ", ".join(f"{k}: {n}" for k, n in self.decisions.most_common()))
        return self.inner.clear_prefix_cache()

    def _weights(self, requests: list[Any]) -> list[torch.Tensor]:
        if self.turn:
            return list(self.decide([(list(r.messages), r.tools) for r in requests], True))
        keys = [_opening_key(r) for r in requests]
        todo = {k: r for k, r in zip(keys, requests) if k not in self._episode}
        if todo:
            for k, w in zip(todo, self.decide([(opening(r.messages), r.tools) for r in todo.values()], False)):
                self._episode[k] = w
            while len(self._episode) > _DECISION_CACHE:
                self._episode.popitem(last=False)
        return [self._episode[k] for k in keys]

    def chat(self, requests: list[Any]) -> list[Any]:
        weights = self._weights(requests)
        groups: dict[tuple[float, ...], list[int]] = {}
        for i, w in enumerate(weights):
            groups.setdefault(tuple(float(x) for x in w), []).append(i)
        out: list[Any] = [None] * len(requests)
        for w, rows in groups.items():
            chosen = "+".join(s for s, x in zip(self.model.slot_names, w) if x > 0)
            self.decisions[chosen] += len(rows)
            with self.model.pinned(torch.tensor(w)):
                for i, response in zip(rows, self.inner.chat([requests[i] for i in rows])):
                    out[i] = response
        return out


def _opening_key(request: Any) -> str:
    return "\x00".join(m.model_dump_json() for m in opening(request.messages)) + "\x00" + repr(request.tools)


def routed_client(inner: Any, model: LoRAMoEModel, directory: Any, encode: Encode, pad_id: int) -> Any:
    """``inner`` itself for a token-routed model, else a :class:`PromptRoutedClient` deciding by the gates or, for
    ``decider="task"``, by the task router saved in ``directory`` (:func:`tracekit.moe.task_router.load_task_router`)."""
    c = model.moe_config
    if c.granularity == "token" and c.decider == "gate":
        return inner
    if c.decider == "task":
        router = load_task_router(directory, model, encode, inner.tokenizer, pad_id)
        return PromptRoutedClient(inner, model, lambda prompts, turn: router.decide(prompts))
    return PromptRoutedClient(inner, model, GateDecider(model, encode, pad_id))
