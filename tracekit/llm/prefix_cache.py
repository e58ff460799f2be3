"""Prompt-prefix reuse for :class:`~tracekit.llm.decoding.FastDecoder`: K/V of token sequences already
prefilled, kept so that a later prompt starting with the same tokens skips their prefill.

Agentic rollouts prefill the same tokens again and again: every turn of an episode re-sends the whole
conversation (the previous prompt plus the answer plus the tool result), the episodes of one environment
share its system prompt and tool schemas, and a GRPO group sends one prompt G times. The K/V of a token
at RoPE position p depends only on the tokens at positions <= p, so the K/V of any common prefix can be
copied into a new row's cache slots (positions start at 0 in every row, whatever its left padding) and
only the rest of the prompt is computed: the same idea as vLLM's automatic prefix caching and SGLang's
RadixAttention, at whole-sequence rather than block granularity.

:class:`PrefixStore` is the host-side bookkeeping (longest-common-prefix lookup, LRU eviction under a
byte budget, entries that another entry extends dropped); the decoder owns the tensors' layout. Reused
K/V equal recomputed ones up to float rounding (a different chunking of the same GEMMs), like the
batch-composition effects the decoder already has.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D integer arrays."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


def batch_shared_prefixes(prompts: Sequence[Sequence[int]], have: Sequence[int], min_gain: int) -> list[list[int]]:
    """Prefixes worth prefilling once before a batch: for each prompt, the longest prefix it shares with
    another prompt of the batch, where that beats the ``have[i]`` tokens already reusable by at least
    ``min_gain``; prefixes that another kept prefix extends are dropped (lookup finds them inside it).

    In lexicographic order a prompt's longest common prefix with any other is the longer of those with its
    two neighbours, so this is a sort plus one comparison per neighbour pair."""
    arrays = [np.asarray(p, dtype=np.int64) for p in prompts]
    order = sorted(range(len(arrays)), key=lambda i: list(prompts[i]))
    shared = [0] * len(arrays)
    for a, b in zip(order, order[1:]):
        n = common_prefix(arrays[a], arrays[b])
        shared[a], shared[b] = max(shared[a], n), max(shared[b], n)
    wanted = {tuple(prompts[i][: shared[i]]) for i in range(len(arrays)) if shared[i] - have[i] >= min_gain}
    longest_first = sorted(wanted, key=len, reverse=True)
    kept: list[tuple[int, ...]] = []
    for p in longest_first:
        if not any(k[: len(p)] == p for k in kept):
            kept.append(p)
    return [list(p) for p in kept]


@dataclass
class PrefixEntry:
    """One stored sequence: its tokens and, per layer, K and V of shape [H_kv, len, D]."""

    tokens: np.ndarray
    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))


class PrefixStore:
    """Stored sequences under a byte budget, least recently used evicted first.

    ``lookup(prompt, limit)`` -> (entry, n): the entry sharing the longest prefix with ``prompt`` and that
    length, at most ``limit`` (a prompt's last token is always computed: its logits start the decode).
    ``add(tokens, kv)`` stores ``kv()`` (called only when the sequence is new): a sequence that an entry
    already extends is not stored again; entries the new one extends are dropped.
    Counters: ``prompt_tokens`` of the batches decoded and ``prefilled_tokens`` actually computed (shared
    prefixes' own pass included), so ``1 - prefilled / prompt`` is the prefill saved.
    """

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._ids = 0
        self.nbytes = 0
        self.prompt_tokens = 0
        self.prefilled_tokens = 0

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        """Forget every entry (the weights changed); the counters stay."""
        self.entries.clear()
        self.nbytes = 0

    def reset(self) -> dict[str, int]:
        """Forget every entry and restart the counters (a rollout begins or ends); -> the counters until now."""
        counts = {"prompt_tokens": self.prompt_tokens, "prefilled_tokens": self.prefilled_tokens}
        self.clear()
        self.prompt_tokens = self.prefilled_tokens = 0
        return counts

    def longest(self, prompt: Sequence[int], limit: int | None = None) -> tuple[int | None, int]:
        """(key of the entry sharing the longest prefix with ``prompt``, that length capped at ``limit``)."""
        p = np.asarray(prompt, dtype=np.int64)
        best, best_n = None, 0
        for key, e in self.entries.items():
            n = common_prefix(p, e.tokens)
            if n > best_n:
                best, best_n = key, n
        cap = best_n if limit is None else min(best_n, max(limit, 0))
        return (best, cap) if cap > 0 else (None, 0)

    def lookup(self, prompt: Sequence[int], limit: int | None = None) -> tuple[PrefixEntry | None, int]:
        key, n = self.longest(prompt, limit)
        if key is None:
            return None, 0
        self.entries.move_to_end(key)
        return self.entries[key], n

    def add(self, tokens: Sequence[int], kv: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]]) -> bool:
        """Store ``tokens`` with K/V from ``kv()``; False when it was already covered or cannot fit."""
        t = np.asarray(tokens, dtype=np.int64)
        if t.size == 0:
            return False
        extends = []
        for key, e in self.entries.items():
            n = common_prefix(t, e.tokens)
            if n == t.size:  # an entry already holds this sequence (or extends it)
                self.entries.move_to_end(key)
                return False
            if n == e.tokens.size:
                extends.append(key)
        k, v = kv()
        entry = PrefixEntry(t, k, v)
        if entry.nbytes > self.budget_bytes:
            return False
        for key in extends:
            self._drop(key)
        while self.entries and self.nbytes + entry.nbytes > self.budget_bytes:
            self._drop(next(iter(self.entries)))
        self._ids += 1
        self.entries[self._ids] = entry
        self.nbytes += entry.nbytes
        return True

    def _drop(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key).nbytes
