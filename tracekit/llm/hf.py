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

import itertools
import logging
from typing import Any

import numpy as np
import torch

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.llm.constrained import TOOL_CHOICES, ToolCallGrammar
from tracekit.llm.decoding import FastSession, causal_lm_of
from tracekit.llm.tools import TOOL_CALL_CLOSE, check_chat_format, encode_prompt, parse_assistant_text
from tracekit.types import Message

log = logging.getLogger(__name__)

_TAIL_TOKENS = 16  # stop strings are matched in the decoded last tokens; longer strings need more


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
    """

    name = "hf"

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
        if prefix_cache_mib < 0:
            raise ValueError(f"prefix_cache_mib must be >= 0, got {prefix_cache_mib}")
        if fast not in ("auto", "on", "off"):
            raise ValueError(f"fast must be auto, on or off, got {fast!r}")
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
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.stop_ids[0]
        self._counter = itertools.count()
        self._vocab = int(text_config.vocab_size)
        self.fast = fast
        self.prefix_cache_mib = prefix_cache_mib
        self._decoder: Any = None  # tracekit.llm.decoding.FastDecoder, built at the first chat
        self.max_whitespace = max_whitespace
        self._grammar: ToolCallGrammar | None = None

    # -- public API ---------------------------------------------------------------------------

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        """Exact prompt length: the chat template rendered and tokenized (with the generation prompt)."""
        return len(encode_prompt(self.tokenizer, messages, tools))

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        rows = []
        for i, req in enumerate(requests):
            if req.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
            seed = req.seed if req.seed is not None else self.seed + next(self._counter)
            prompt = encode_prompt(self.tokenizer, req.messages, req.tools)
            matcher = None
            if req.response_format:
                matcher = self._grammars().json_matcher(req.response_format)
            elif self.constrained_tool_calls and req.tools:
                matcher = self._grammars().matcher(req.tools, self.chat_format, self.tool_choice,
                                                   req.messages if self.copy_ids else None)
            row = _Row(req, prompt, seed, matcher)
            if self.max_context_tokens is not None and len(prompt) >= self.max_context_tokens:
                row.finish = "length"  # no room left to generate
            rows.append(row)
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
        from tracekit.llm.decoding import FastDecoder, open_session, unsupported_reason

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
        r.tokens.append(token)
        r.logprobs.append(logprob)
        if r.matcher is not None and not r.matcher.accept_token(token):
            raise RuntimeError(f"xgrammar rejected token {token} that its own mask allowed")
        if token in self.stop_ids:
            r.finish = "stop"
        elif r.req.tools and self.stop_at_tool_call_end and self._ends_tool_call(r.tokens):
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
