"""``HFChatClient``: a transformers causal LM (optionally a peft model) behind the chat interface.

Generation is our own batched loop over the decoding sessions of ``tracekit.llm.decoding`` (the
same core as the GRPO rollout engine: merged-weight fast path or the plain forward; left padding,
chunked prefill) because ``generate`` cannot give each row its own random generator. Each
request samples with its own numpy ``PCG64`` generator seeded by ``request.seed`` and draws exactly
one uniform per generated token (inverse-CDF sampling in float64), so the same request and seed give
the same tokens however requests are batched (up to float ties in the forward pass: rows of
different batches see bitwise-different but ulp-close logits).

Returned log-probs are those of the distribution each token was actually drawn from:
``log softmax(masked_logits / T)`` renormalised over the top-p nucleus when ``top_p < 1``, where
``masked`` applies the tool-call grammar when constrained decoding is on. At ``T = 1, top_p = 1``
without constraints (GRPO rollouts) this is exactly log pi_theta(token | context). Greedy requests
(``T = 0``) report the raw model log-probs at temperature 1 (restricted to the grammar when on).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.llm.constrained import TOOL_CHOICES, ToolCallGrammar
from tracekit.llm.decoding import (FAST_MODES, PREFIX_CACHE_MIB, FastDecoder, FastSession, causal_lm_of, open_session,
                                   unsupported_reason)
from tracekit.llm.picks import batch_pick
from tracekit.llm.tools import TOOL_CALL_CLOSE, check_chat_format, encode_prompt, parse_assistant_text, render_prompt
from tracekit.ranges import check_choice, check_value
from tracekit.types import Message

log = logging.getLogger(__name__)

_TAIL_TOKENS = 16  # stop strings are matched in the decoded last tokens; longer strings need more


def padding_id(tokenizer: Any) -> int:
    """The token id padding rows (the one rule: the tokenizer's pad token, else its end-of-sequence token, else 0).
    Padded positions are masked everywhere, so the id only has to be a valid one."""
    for tok in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tok is not None:
            return int(tok)
    return 0


def stop_token_ids(model: Any, tokenizer: Any) -> list[int]:
    """EOS ids from the tokenizer, ``<|im_end|>`` and the model's generation config."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        ids.add(im_end)
    gen_eos = getattr(getattr(causal_lm_of(model), "generation_config", None), "eos_token_id", None)
    for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if i is not None:
            ids.add(int(i))
    if not ids:
        raise ValueError("no EOS token: neither the tokenizer nor the generation config names one")
    return sorted(ids)


def pick_token(
    logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator
) -> tuple[int, float]:
    """Choose the next token from one row of float64 logits; return ``(token, log-prob under the used distribution)``.

    Greedy (``temperature <= 0``): ``argmax`` (first on ties), log-prob from ``log_softmax(logits)``.
    Sampling: ``logp = log_softmax(logits / T)``; with ``top_p < 1`` keep the smallest prefix of
    tokens sorted by probability whose mass reaches ``top_p`` and renormalise; then the token is
    ``searchsorted(cumsum(p), u * sum(p), side="right")`` with one ``u ~ U[0, 1)`` from ``rng``.
    Pure numpy: single-threaded and deterministic, and free of thread-pool overhead on busy CPUs.
    """
    if temperature <= 0:
        token = int(np.argmax(logits))
        return token, float(_log_softmax(logits)[token])
    logp = _log_softmax(logits / temperature)
    if top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        p_sorted = np.exp(logp[order])
        mass_before = np.cumsum(p_sorted) - p_sorted
        logp[order[mass_before >= top_p]] = -np.inf  # the most likely token always stays (mass_before = 0)
        logp = _log_softmax(logp)
    cdf = np.cumsum(np.exp(logp))
    token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)
    return token, float(logp[token])


def _log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x)
    return x - (m + np.log(np.sum(np.exp(x - m))))


_EXP_LANES: list[bool] = []  # whether numpy's exp of a lane is the same in place, alone and with where= (checked once)


def _exp_lanes_independent() -> bool:
    """Whether this numpy computes ``exp`` of a float64 lane the same whatever its neighbours (-inf ones included),
    in place, on a short array of the finite lanes and under ``where=``: what lets :func:`greedy_pick` and :func:`sample_pick`
    skip the -inf lanes of a masked row (their exp is exactly 0, and numpy takes a slow path for them) and reuse
    buffers while giving :func:`pick_token`'s bits. Checked once on seeded random rows; False: the reference ops."""
    if not _EXP_LANES:
        rng = np.random.default_rng(0)
        x = rng.standard_normal(8192) * 20 - 10
        x[rng.random(8192) < 0.7] = -np.inf
        ref = np.exp(x)
        lanes = x != -np.inf
        inplace = x.copy()
        np.exp(inplace, out=inplace)
        where = np.zeros_like(x)
        np.exp(x, out=where, where=lanes)
        alone = np.array([np.exp(x[i : i + 1])[0] for i in np.flatnonzero(lanes)[:64]])
        compact = [np.array_equal(np.exp(x[lanes][:n]), ref[lanes][:n]) for n in (1, 3, 7, 8, 9, 33, 200)]
        _EXP_LANES.append(bool(np.array_equal(ref, inplace) and np.array_equal(ref, where) and all(compact)
                               and np.array_equal(alone, ref[np.flatnonzero(lanes)[:64]])))
    return _EXP_LANES[0]


def _exp_into(x: np.ndarray, out: np.ndarray, sparse: bool) -> np.ndarray:
    """``out[:] = exp(x)``; with ``sparse`` (a masked row, ``out`` not ``x``) and -inf in most lanes, only the
    others are computed (the rest set to exp(-inf) = 0 exactly)."""
    if sparse and out is not x:
        lanes = x != -np.inf
        if 4 * np.count_nonzero(lanes) < x.size:
            out.fill(0.0)
            return np.exp(x, out=out, where=lanes)
    return np.exp(x, out=out)


def greedy_pick(logits: np.ndarray, token: int | None = None, scratch: np.ndarray | None = None,
                sparse: bool = False) -> tuple[int, float]:
    """``pick_token(logits, 0, ...)`` bit for bit, in place (``logits``, float64, is overwritten; ``scratch``: a
    buffer of its size, needed for ``sparse``, see :func:`_exp_into`); ``token``: its argmax, where known. Needs
    :func:`_exp_lanes_independent`. The argmax's value is the maximum (first on ties, NaN included; a signed zero
    changes nothing: ``exp(x - 0.0) == exp(x + 0.0)``), and ``log_softmax(x)[t]`` is
    ``x[t] - (m + log(sum(exp(x - m))))``: the same float64 operations on the same operands."""
    token = int(np.argmax(logits)) if token is None else token
    m = logits[token]
    np.subtract(logits, m, out=logits)
    e = _exp_into(logits, logits if scratch is None else scratch, sparse)
    return token, float(m - (m + np.log(np.sum(e))))


def sample_pick(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator,
                scratch: np.ndarray, scratch2: np.ndarray | None = None, sparse: bool = False) -> tuple[int, float]:
    """``pick_token(logits, temperature > 0, top_p, rng)`` bit for bit (the same float64 operations on the same
    operands, one draw from ``rng``), in place: ``logits`` is overwritten and ``scratch`` (``scratch2`` for
    ``sparse``: see :func:`_exp_into`) used, so that a row allocates nothing (fresh arrays of a vocabulary's size
    cost page faults). Needs :func:`_exp_lanes_independent`."""
    y = np.divide(logits, temperature, out=logits)
    m = np.max(y)
    np.subtract(y, m, out=scratch)
    e = _exp_into(scratch, scratch if scratch2 is None else scratch2, sparse)
    logp = np.subtract(y, m + np.log(np.sum(e)), out=y)
    if top_p < 1.0:
        order = np.argsort(-logp, kind="stable")
        p_sorted = np.exp(logp[order])
        mass_before = np.cumsum(p_sorted) - p_sorted
        logp[order[mass_before >= top_p]] = -np.inf
        logp = _log_softmax(logp)
    p = _exp_into(logp, scratch, sparse)
    cdf = np.cumsum(p, out=p)
    token = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), cdf.size - 1)
    return token, float(logp[token])


def sparse_pick(x: np.ndarray, lanes: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator,
                scratch: np.ndarray) -> tuple[int, float] | None:
    """``pick_token(x, ...)`` bit for bit for a row whose logits are -inf outside ``lanes`` (sorted indices; a
    grammar that allows a few tokens), touching the other lanes only to sum zeros: their exp is exactly 0, which
    adds nothing to numpy's pairwise sum (``scratch``, float64 like ``x``, holds the zeros) nor to its sequential
    cumsum, whose steps then sit at ``lanes`` (the first step above ``u * total`` is the token). None: no token can
    be picked (no lane), or a case for the dense ops (nucleus sampling, NaN). Needs :func:`_exp_lanes_independent`."""
    if not lanes.size or (temperature > 0 and top_p < 1.0):
        return None
    xs = x[lanes]
    if temperature <= 0:
        k = int(np.argmax(xs))  # the first maximum among the lanes: the row's first maximum
        m = xs[k]
        scratch.fill(0.0)
        scratch[lanes] = np.exp(xs - m)
        total = np.sum(scratch)
        return None if np.isnan(total) else (int(lanes[k]), float(m - (m + np.log(total))))
    ys = xs / temperature
    m = np.max(ys)
    scratch.fill(0.0)
    scratch[lanes] = np.exp(ys - m)
    total = np.sum(scratch)
    if np.isnan(total):
        return None
    c = m + np.log(total)
    logp = ys - c
    cdf = np.cumsum(np.exp(logp))
    k = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if k < lanes.size:
        return int(lanes[k]), float(logp[k])
    return x.size - 1, float(x[-1] / temperature - c)  # u * total rounded up to the total: pick_token's last token


def _pick_row(x: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator, constrained: bool,
              scratch: np.ndarray, scratch2: np.ndarray, lanes: np.ndarray | None = None,
              dense: bool = False) -> tuple[int, float] | None:
    """One row's ``(token, log-prob)`` from its float64 logits ``x`` (any grammar mask applied; overwritten), as
    :meth:`HFChatClient._step` picks it; None where a grammar allows no token (every logit -inf). ``lanes``: the
    indices of the finite logits where known to be few; ``dense``: known to be many
    (:meth:`ToolCallGrammar.masked_row_` tells which)."""
    exact = _exp_lanes_independent()
    sparse = constrained and not dense
    if sparse and exact:
        if lanes is None:
            lanes = np.flatnonzero(x != -np.inf)
            lanes = lanes if 4 * lanes.size < x.size else None
        if lanes is not None:
            if not lanes.size:
                return None
            picked = sparse_pick(x, lanes, temperature, top_p, rng, scratch)
            if picked is not None:
                return picked
    if temperature <= 0:
        token = int(np.argmax(x))
        if constrained and x[token] == -np.inf:
            return None
        if not exact:
            return pick_token(x, temperature, top_p, rng)
        return greedy_pick(x, token, scratch, sparse=sparse)
    if constrained and np.max(x) == -np.inf:
        return None
    if not exact:
        return pick_token(x, temperature, top_p, rng)
    return sample_pick(x, temperature, top_p, rng, scratch, scratch2, sparse=sparse)


_CLOSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> ids whose text has TOOL_CALL_CLOSE's last char


def _closers(tokenizer: Any) -> np.ndarray:
    """Per token id: whether its decoded text holds ``>`` (the last character of ``TOOL_CALL_CLOSE``).

    A row whose newest token has none cannot have just completed ``</tool_call>`` in its decoded tail: the
    occurrence would end in the earlier tokens, whose decoded text (ASCII survives any byte boundary) the
    previous step's tail already held, and that step would have stopped the row."""
    table = _CLOSERS.get(tokenizer)
    if table is None:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False)
        table = _CLOSERS[tokenizer] = np.array([TOOL_CALL_CLOSE[-1] in t for t in texts], dtype=bool)
    return table


class _Row:
    """Generation state of one request."""

    def __init__(self, req: ChatRequest, prompt: list[int], seed: int, matcher: Any):
        self.req = req
        self.prompt = prompt
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self.matcher = matcher
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.finish: str | None = None


class HFChatClient(ChatClient):
    """Batched chat over an in-process transformers model.

    ``chat_format``: tool-call syntax of the model (``qwen3``, ``smollm2``, ``qwen3_xml``).
    ``max_batch_size``: requests generated together (sorted by prompt length to limit padding).
    ``constrained_tool_calls``: when tools are offered, force the output to be text or one
    schema-valid call (``tool_choice="required"``: a call); ``copy_ids``: also narrow identifier arguments to the
    ids seen in the conversation and documented value lists to enums (``tracekit.llm.constrained.tighten_tools``,
    for small models). ``stop_at_tool_call_end``: stop a row
    at ``</tool_call>`` (one call block per turn). ``seed``: seeds requests with ``seed=None``
    (``seed + running request number``, deterministic for a fixed call sequence).
    ``max_context_tokens``: prompt + completion cap (finish_reason ``length``; default: the model's
    ``max_position_embeddings``). ``torch_threads``:
    torch's intra-op threads while generating (restored after; 1 is fastest for tiny models and on
    oversubscribed CPUs). ``max_whitespace``: whitespace run allowed inside constrained JSON.
    A request's ``response_format`` (``json_object`` / ``json_schema``) constrains its whole output
    to JSON with the same grammar machinery (needs xgrammar); tools are then not parsed.
    ``fast``: ``auto`` decodes through ``tracekit.llm.decoding.FastDecoder`` (adapter merged into a
    working copy, re-merged when the weights' version counters move; static KV cache; CUDA graphs)
    when the architecture is supported, ``on`` requires it, ``off`` uses the model's own forward
    (with finished rows pruned from the cache). ``prefix_cache_mib``: the fast decoder's prompt-prefix store
    (:mod:`tracekit.llm.prefix_cache`; 0: off): each finished batch's rows are stored, so an episode's next turn
    and prompts sharing a system prompt skip the prefill of what they share; :meth:`clear_prefix_cache`
    empties it (a rollout starts and ends with it empty).

    Each decode step's host work is batched (issue 30): the grammars' bitmasks filled in one xgrammar call and
    applied where the logits are. On an accelerator every row's pick is made there too
    (:func:`tracekit.llm.picks.batch_pick`: the reference's tokens, its log-probs to ~1e-15; ``pick_on_device``).
    Otherwise, and with ``pick_on_device=False``, only unfinished rows are copied to the host, and each row's
    float64 pick runs in place (a masked row's -inf lanes skipped) on ``host_threads`` threads (half the cores, at
    most 8), giving the row-by-row reference :meth:`_step`'s tokens and log-probs bit for bit. A batch's new
    grammars compile on ``compile_threads`` (the cores, at most 8), and a prompt counted for the context budget is
    not rendered again when it is sent.
    """

    name = "hf"
    batched_host_step = True  # False: the row-by-row reference (_step) that the batched step reproduces (tests, benchmark)
    mask_on_device: bool | None = None  # grammar masks applied where the logits are; None: unless they are on the CPU
    # picks made where the logits are (tracekit.llm.picks; masks there too); None: unless they are on the CPU.
    # False on an accelerator: the host's bit-exact float64 picks (the reference's log-probs to the last bit)
    pick_on_device: bool | None = None

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        chat_format: str = "qwen3",
        max_batch_size: int = 8,
        constrained_tool_calls: bool = False,
        tool_choice: str = "auto",
        copy_ids: bool = False,
        stop_at_tool_call_end: bool = True,
        seed: int = 0,
        prefill_chunk: int = 1024,
        max_context_tokens: int | None = None,
        max_whitespace: int | None = 1,
        torch_threads: int | None = None,
        fast: str = "auto",
        prefix_cache_mib: float = 0,
    ):
        if max_batch_size < 1 or prefill_chunk < 1:
            raise ValueError("max_batch_size and prefill_chunk must be >= 1")
        check_value("prefix_cache_mib", prefix_cache_mib, PREFIX_CACHE_MIB)
        check_choice("fast", fast, FAST_MODES)
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICES}, got {tool_choice!r}")
        self.model = model
        self.tokenizer = tokenizer
        self.chat_format = check_chat_format(chat_format)
        self.max_batch_size = max_batch_size
        self.constrained_tool_calls = constrained_tool_calls
        self.tool_choice = tool_choice
        self.copy_ids = copy_ids
        self.stop_at_tool_call_end = stop_at_tool_call_end
        self.seed = seed
        self.prefill_chunk = prefill_chunk
        base = causal_lm_of(model)
        text_config = base.config.get_text_config()
        self.max_context_tokens = max_context_tokens or getattr(text_config, "max_position_embeddings", None)
        self.torch_threads = torch_threads
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = padding_id(tokenizer)
        self._counter = itertools.count()
        self._vocab = int(text_config.vocab_size)
        self.fast = fast
        self.prefix_cache_mib = prefix_cache_mib
        self._decoder: Any = None  # tracekit.llm.decoding.FastDecoder, built at the first chat
        self.max_whitespace = max_whitespace
        self._grammar: ToolCallGrammar | None = None
        # a step's picks on half the machine's cores (the rest: torch's, the environments', concurrent runs'), at
        # most 8 (2 cores: 1, a second thread bought nothing there); a batch's grammar compiles (milliseconds each,
        # without the GIL) on all of them, at most 8 (benchmarks/rollout_throughput.py)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.host_threads = max(1, min(8, cores // 2))
        self.compile_threads = max(1, min(8, cores))
        self._pool: ThreadPoolExecutor | None = None
        # prompt ids by content: a rollout counts an episode's prompt (context budget), then sends it
        self._prompts: OrderedDict[bytes, np.ndarray] = OrderedDict()

    # -- public API ---------------------------------------------------------------------------

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        """Exact prompt length: the chat template rendered and tokenized (with the generation prompt)."""
        if not self.batched_host_step:
            return len(encode_prompt(self.tokenizer, messages, tools))
        return len(self._prompt_ids([(messages, tools)])[0])

    def _prompt_ids(self, prompts: list[tuple[list[Message], list[dict[str, Any]] | None]]) -> list[list[int]]:
        """``encode_prompt`` of each ``(messages, tools)``: the same ids, with the prompts met in the last
        calls (keyed by their content's hash) not rendered again, and the new ones tokenized in one batch."""
        keys: list[bytes | None] = []
        for messages, tools in prompts:
            try:
                payload = "\x00".join([m.model_dump_json() for m in messages] + [json.dumps(tools)])
                keys.append(hashlib.blake2b(payload.encode(), digest_size=16).digest())
            except (TypeError, ValueError):  # content that does not serialise: not cached
                keys.append(None)
        out: list[list[int] | None] = [None] * len(prompts)
        todo = []
        for i, key in enumerate(keys):
            hit = None if key is None else self._prompts.get(key)
            if hit is None:
                todo.append(i)
            else:
                self._prompts.move_to_end(key)
                out[i] = hit.tolist()
        if todo:
            texts = [render_prompt(self.tokenizer, *prompts[i]) for i in todo]
            for i, ids in zip(todo, self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
                out[i] = list(ids)
                if keys[i] is not None:
                    self._prompts[keys[i]] = np.asarray(ids, dtype=np.int64)
            while len(self._prompts) > max(1024, 2 * self.max_batch_size):
                self._prompts.popitem(last=False)
        return out

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        rows = []
        for i, req in enumerate(requests):
            if req.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
        prompts = self._prompt_ids([(req.messages, req.tools) for req in requests]) if self.batched_host_step else None
        for i, req in enumerate(requests):
            seed = req.seed if req.seed is not None else self.seed + next(self._counter)
            prompt = encode_prompt(self.tokenizer, req.messages, req.tools) if prompts is None else prompts[i]
            matcher = None
            if req.response_format:
                matcher = self._grammars().json_matcher(req.response_format)
            row = _Row(req, prompt, seed, matcher)
            if self.max_context_tokens is not None and len(prompt) >= self.max_context_tokens:
                row.finish = "length"  # no room left to generate
            rows.append(row)
        calls = [r for r in rows if not r.req.response_format and self.constrained_tool_calls and r.req.tools]
        if calls:  # the batch's tool-call grammars at once: the new ones (copy_ids: nearly all) compiled in parallel
            specs = [(r.req.tools, r.req.messages if self.copy_ids else None) for r in calls]
            threads = self.compile_threads if self.batched_host_step else 1
            for r, m in zip(calls, self._grammars().matchers(specs, self.chat_format, self.tool_choice, threads)):
                r.matcher = m
        ordered = sorted((r for r in rows if r.finish is None), key=lambda r: len(r.prompt))
        was_training, threads = self.model.training, torch.get_num_threads()
        self.model.eval()
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        try:
            with torch.inference_mode():
                for start in range(0, len(ordered), self.max_batch_size):
                    self._generate(ordered[start : start + self.max_batch_size])
        finally:
            self.model.train(was_training)
            torch.set_num_threads(threads)
        return [self._response(r) for r in rows]

    def _grammars(self) -> ToolCallGrammar:
        if self._grammar is None:
            self._grammar = ToolCallGrammar(self.tokenizer, self._vocab, self.stop_ids, self.max_whitespace)
        return self._grammar

    # -- generation ---------------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-merge the adapter into the fast decoder's working copy (after the weights changed in a
        way that bypasses version counters, e.g. DeepSpeed's ``p.data`` copies). In inference mode: the
        working copy was built inside :meth:`chat`'s, and an inference tensor takes in-place writes only there."""
        if self._decoder is not None:
            with torch.inference_mode():
                self._decoder.refresh()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def release(self) -> None:
        """Drop the fast decoder: its merged working copy of the weights and its static KV cache (e.g. a
        GRPO trainer's rollout client while the update runs). The next chat builds it again from the
        current weights, as the first chat did."""
        self._decoder = None

    def clear_prefix_cache(self) -> dict[str, int]:
        """Forget the stored prompt prefixes; -> prompt tokens decoded and tokens prefilled since the last clear."""
        store = getattr(self._decoder, "prefixes", None)
        return {} if store is None else store.reset()

    def _session(self, prompts: list[list[int]], max_new: int) -> Any:
        if self._decoder is None and self.fast != "off":
            reason = unsupported_reason(self.model)
            if reason is not None and self.fast == "on":
                raise NotImplementedError(f"fast=on but fast decoding does not support this model: {reason}")
            if reason is None:
                self._decoder = FastDecoder(self.model, prefill_chunk=self.prefill_chunk,
                                            prefix_cache_mib=self.prefix_cache_mib)
            else:
                log.info("HFChatClient: plain decoding (%s)", reason)
                self.fast = "off"
        return open_session(self._decoder or self.model, prompts, self.pad_id, max_new, self.prefill_chunk)

    def _generate(self, rows: list[_Row]) -> None:
        sess = self._session([r.prompt for r in rows], max(r.req.max_new_tokens for r in rows))
        logits = sess.prefill()
        active = list(rows)
        while True:
            if self.batched_host_step:
                self._pick_batch(active, logits)
            else:  # the reference: row by row
                host = logits.cpu().numpy().astype(np.float64)
                for j, r in enumerate(active):
                    self._step(r, host[j])
            keep = [j for j, r in enumerate(active) if r.finish is None]
            if not keep:
                if isinstance(sess, FastSession):  # every token but each row's last was fed: their K/V are cached
                    sess.remember([r.prompt + r.tokens[:-1] for r in rows])
                return
            if len(keep) < len(active) and sess.can_prune:
                sess.keep(torch.tensor(keep))
                active = [active[j] for j in keep]
            tokens = torch.tensor([r.tokens[-1] if r.finish is None else self.pad_id for r in active])
            logits = sess.step(tokens, torch.tensor([r.finish is None for r in active]))

    def _pick_batch(self, active: list[_Row], logits: torch.Tensor) -> None:
        """:meth:`_step` for every unfinished row of ``active`` (``logits`` [len(active), V] float32), in batch: the
        grammars' bitmasks filled in one call, then the picks. On an accelerator the masks are applied there and the
        picks made there (:func:`tracekit.llm.picks.batch_pick`; ``pick_on_device``); with ``pick_on_device=False``
        only the unfinished rows are copied to the host for its float64 picks (the same operations as
        :meth:`_step`, on the host's threads). On the CPU the rows are read in place and masked by their pick's
        thread."""
        live = [j for j, r in enumerate(active) if r.finish is None]
        if not live:
            return
        rows = [active[j] for j in live]
        masked = [k for k, r in enumerate(rows) if r.matcher is not None]
        grammar = self._grammars() if masked else None
        bitmask = grammar.fill([rows[k].matcher for k in masked]) if masked else None
        on_accelerator = logits.device.type != "cpu"
        pick_there = on_accelerator if self.pick_on_device is None else self.pick_on_device
        mask_there = pick_there or (on_accelerator if self.mask_on_device is None else self.mask_on_device)
        if mask_there:
            if len(live) < len(active):
                logits = logits[torch.tensor(live, device=logits.device)]
            if masked:
                grammar.mask_rows_(logits, bitmask, masked)
        if pick_there:
            picks = self._device_picks(rows, logits)
        elif mask_there:
            picks = self._host_picks(rows, logits.cpu().numpy(), range(len(live)), grammar, None, {})
        else:
            word = {k: i for i, k in enumerate(masked)}  # row k -> its bitmask row: masked by its pick's thread
            picks = self._host_picks(rows, logits.numpy(), live, grammar, bitmask, word)
        closers = _closers(self.tokenizer) if self.stop_at_tool_call_end and any(r.req.tools for r in rows) else None
        for r, picked in zip(rows, picks):
            if picked is None:  # the grammar allows no token: nothing valid can follow
                r.finish = "stop"
            else:
                self._take(r, *picked, closers)

    def _device_picks(self, rows: list[_Row], logits: torch.Tensor) -> list[tuple[int, float] | None]:
        """Every row's pick where ``logits`` (masked) are; a sampled row draws its one ``u`` from its own generator,
        as the host pick does (a row that turns out to allow no token finishes, so its extra draw is never seen)."""
        temps = [r.req.temperature for r in rows]
        u = [r.rng.random() if t > 0 else 0.0 for r, t in zip(rows, temps)]
        f64 = torch.float64
        tokens, logprobs, ok = batch_pick(logits, torch.tensor(temps, dtype=f64),
                                          torch.tensor([r.req.top_p for r in rows], dtype=f64), torch.tensor(u, dtype=f64))
        back = torch.stack([tokens.to(f64), logprobs, ok.to(f64)]).cpu().numpy()  # one transfer
        return [(int(t), float(lp)) if k else None for t, lp, k in back.T]

    def _host_picks(self, rows: list[_Row], host: np.ndarray, at: Any, grammar: ToolCallGrammar | None,
                    bitmask: np.ndarray | None, word: dict[int, int]) -> list[tuple[int, float] | None]:
        """Every row's float64 pick on the host (row ``k``'s logits: ``host[at[k]]``; rows in ``word`` are masked
        here by their bitmask row), on up to ``host_threads`` threads."""

        def pick(ks: range) -> list[tuple[int, float] | None]:
            x, scratch, scratch2 = (np.empty(host.shape[1]) for _ in range(3))  # a thread's row buffers
            out = []
            for k in ks:
                r = rows[k]
                lanes = None
                if k in word:  # the row masked on the host
                    lanes = grammar.masked_row_(x, host[at[k]], bitmask[word[k]])
                else:
                    np.copyto(x, host[at[k]])  # float32 -> float64, exact
                out.append(_pick_row(x, r.req.temperature, r.req.top_p, r.rng, r.matcher is not None, scratch, scratch2,
                                     lanes, dense=k in word and lanes is None))
            return out

        n = len(rows)
        threads = min(self.host_threads, n // 8)  # a thread per >= 8 rows (tens of microseconds each)
        if threads <= 1:
            return pick(range(n))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.host_threads, thread_name_prefix="hf-pick")
        parts = [range(i * n // threads, (i + 1) * n // threads) for i in range(threads)]
        return [p for part in self._pool.map(pick, parts) for p in part]

    def _step(self, r: _Row, row: np.ndarray) -> None:
        """Pick one token for an unfinished row (``row``: its float64 logits) and decide whether it stops."""
        if r.finish is not None:
            return
        if r.matcher is not None:
            self._grammars().mask_(r.matcher, row)
            if np.isneginf(row).all():  # the grammar allows no token: nothing valid can follow
                r.finish = "stop"
                return
        token, logprob = pick_token(row, r.req.temperature, r.req.top_p, r.rng)
        self._take(r, token, logprob)

    def _take(self, r: _Row, token: int, logprob: float, closers: np.ndarray | None = None) -> None:
        """Append a picked token to its row and decide whether the row stops (``closers``: see :func:`_closers`;
        None decodes the tail at every token)."""
        r.tokens.append(token)
        r.logprobs.append(logprob)
        if r.matcher is not None and not r.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token} that its own mask allowed")
        if token in self.stop_ids:
            r.finish = "stop"
        elif r.req.tools and self.stop_at_tool_call_end and (closers is None or token >= len(closers) or closers[token]) \
                and self._ends_tool_call(r.tokens):
            r.finish = "stop"
        elif len(r.tokens) >= r.req.max_new_tokens or (
            self.max_context_tokens is not None and len(r.prompt) + len(r.tokens) >= self.max_context_tokens
        ):
            r.finish = "length"

    def _ends_tool_call(self, tokens: list[int]) -> bool:
        return TOOL_CALL_CLOSE in self.tokenizer.decode(tokens[-_TAIL_TOKENS:], skip_special_tokens=False)

    def _response(self, r: _Row) -> ChatResponse:
        body = r.tokens[:-1] if r.tokens and r.tokens[-1] in self.stop_ids else r.tokens
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        if r.req.tools and not r.req.response_format:
            message = parse_assistant_text(text, self.chat_format, turn=len(r.req.messages), tools=r.req.tools)
        else:
            message = Message(role="assistant", content=text.strip() or None)
        want = r.req.return_tokens
        return ChatResponse(
            message=message,
            text=text,
            finish_reason=r.finish or "length",
            prompt_token_ids=list(r.prompt) if want else None,
            completion_token_ids=list(r.tokens) if want else None,
            completion_logprobs=list(r.logprobs) if want else None,
            usage={"prompt_tokens": len(r.prompt), "completion_tokens": len(r.tokens)},
        )
