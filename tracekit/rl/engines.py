"""Rollout engines for GRPO: the policy as a batched chat client that returns exact tokens.

Both engines share one chat layer (:class:`PolicyChat`): messages are rendered with the tokenizer's
chat template into prompt ids *here*, the engine samples completion ids and their log-probs, and the
completion text is parsed into an assistant message. Prompt ids are therefore identical whichever
engine generates, and the trainer sees exactly the ids the engine consumed and produced.

- ``hf``: :class:`HFEngine` samples from the live (peft) model in-process: KV-cached batched decode
  with per-row stopping, log-probs of the sampled tokens taken from the same logits that were
  sampled (no second forward pass), seeded ``torch.Generator`` (same seed on CPU -> same tokens).
  By default through :class:`tracekit.llm.decoding.FastDecoder` (adapter merged into a working
  copy, re-merged at each ``sync``; static KV cache; CUDA-graph decode steps on GPU).
- :class:`ClientEngine` wraps any token-returning chat client on the live model (e.g. the llm
  package's ``HFChatClient`` with constrained tool calls, to train with the agent's own decoding).
- ``vllm``: :class:`VLLMEngine` (:mod:`tracekit.rl.vllm_client`) manages a ``vllm serve --enable-lora``
  subprocess (or uses a running server); each iteration the adapter is saved and loaded at runtime
  through ``/v1/load_lora_adapter`` (adapter-only sync), completions are requested with prompt token
  ids and ``return_tokens_as_token_ids`` / ``return_token_ids``, the server can be stopped for the
  update and restarted between iterations, and lost servers or adapters are recovered. vllm and the
  server are only touched when this engine is used.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.llm.decoding import FAST_MODES, Completion, FastDecoder, generate, unsupported_reason
from tracekit.llm.hf import padding_id, stop_token_ids
from tracekit.llm.tools import check_chat_format, encode_prompt, parse_assistant_text
from tracekit.ranges import check_choice
from tracekit.types import Message, stable_hash

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# In-process sampling


# The engines' sampler is the one decoding core's (batched, per-row stopping, log-probs from the sampling
# logits; a peft model takes the plain path, a FastDecoder the merged one): see decoding.generate.
sample_completions = generate


# --------------------------------------------------------------------------------------------
# The chat layer shared by the engines

Generate = Callable[[list[list[int]], float, float, int, int], list[Completion]]


class PolicyChat(ChatClient):
    """A :class:`ChatClient` over a token-level generator, returning exact prompt/completion ids.

    ``generate(prompts, temperature, top_p, max_new_tokens, seed)`` does the sampling; prompts are
    rendered and replies parsed with ``tracekit.llm.tools`` in ``chat_format`` (the same code the
    evaluated agent uses). A request whose prompt exceeds ``max_prompt_tokens`` gets
    ``finish_reason='error'`` (the episode runner ends that episode as out of context) instead of
    being truncated silently.
    """

    name = "policy"

    def __init__(
        self,
        tokenizer: Any,
        generate: Generate,
        stop_ids: Sequence[int],
        *,
        chat_format: str = "qwen3",
        max_prompt_tokens: int = 32000,
        batch_size: int = 64,
    ):
        self.tokenizer = tokenizer
        self.generate = generate
        self.stop_ids = sorted(set(stop_ids))
        self.chat_format = check_chat_format(chat_format)
        self.max_prompt_tokens = max_prompt_tokens
        self.batch_size = batch_size

    def prompt_ids(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        """The chat template's generation prompt for ``messages`` as token ids (what the model receives)."""
        return encode_prompt(self.tokenizer, messages, tools)

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        return len(self.prompt_ids(messages, tools))

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        prompts = [self.prompt_ids(r.messages, r.tools) for r in requests]
        out: list[ChatResponse | None] = [None] * len(requests)
        ok = [i for i, p in enumerate(prompts) if len(p) <= self.max_prompt_tokens]
        for i in set(range(len(requests))) - set(ok):
            out[i] = ChatResponse(
                message=Message(role="assistant", content=None, parse_error="prompt exceeds the context budget"),
                text="",
                finish_reason="error",
                prompt_token_ids=prompts[i],
                usage={"prompt_tokens": len(prompts[i]), "completion_tokens": 0},
            )
        # Requests with equal sampling settings are batched together; one seed per batch, derived
        # from the requests' seeds so that the same requests give the same samples.
        groups: dict[tuple[float, float, int], list[int]] = {}
        for i in ok:
            r = requests[i]
            groups.setdefault((r.temperature, r.top_p, r.max_new_tokens), []).append(i)
        for (temp, top_p, max_new), idx in groups.items():
            for s in range(0, len(idx), self.batch_size):
                chunk = idx[s : s + self.batch_size]
                seed = int(stable_hash([requests[i].seed for i in chunk], 15), 16)
                comps = self.generate([prompts[i] for i in chunk], temp, top_p, max_new, seed)
                for i, c in zip(chunk, comps):
                    out[i] = self._response(requests[i], prompts[i], c)
        return [o for o in out if o is not None]

    def _response(self, req: ChatRequest, prompt: list[int], c: Completion) -> ChatResponse:
        body = c.ids[:-1] if c.ids and c.ids[-1] in self.stop_ids else c.ids
        text = self.tokenizer.decode(body, skip_special_tokens=False)
        if req.tools:
            message = parse_assistant_text(text, self.chat_format, turn=len(req.messages), tools=req.tools)
        else:
            message = Message(role="assistant", content=text.strip() or None)
        want = req.return_tokens
        return ChatResponse(
            message=message,
            text=text,
            finish_reason=c.finish_reason,
            prompt_token_ids=prompt if want else None,
            completion_token_ids=c.ids if want else None,
            completion_logprobs=c.logprobs if want else None,
            usage={"prompt_tokens": len(prompt), "completion_tokens": len(c.ids)},
        )


# --------------------------------------------------------------------------------------------
# Engines


class HFEngine:
    """Rollouts from the model being trained, in-process (CPU or GPU), sampled on the device.

    ``fast``: ``auto`` decodes through a :class:`FastDecoder` when the architecture is supported
    (else the plain peft forward, logged once), ``on`` requires it, ``off`` never uses it.
    ``cuda_graphs``: passed to the decoder (None: on for CUDA models with dense MLPs).
    ``compile_layers``: decode steps through the compiled layer with ``bmm`` attention (the fastest
    compiled decode on an H200, ``benchmarks/grpo_step.py``).
    """

    kind = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        chat_format: str = "qwen3",
        max_prompt_tokens: int = 32000,
        batch_size: int = 64,
        fast: str = "auto",
        cuda_graphs: bool | None = None,
        compile_layers: bool = False,
    ):
        check_choice("fast", fast, FAST_MODES)
        self.model = model
        stops = stop_token_ids(model, tokenizer)
        self.client = PolicyChat(
            tokenizer, self._generate, stops, chat_format=chat_format, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size
        )
        self._pad = padding_id(tokenizer)
        reason = unsupported_reason(model) if fast != "off" else "fast=off"
        if reason is not None and fast == "on":
            raise NotImplementedError(f"grpo.rollout_fast=on but fast decoding does not support this model: {reason}")
        if reason is not None and fast == "auto":
            log.info("hf engine: plain peft decoding (%s)", reason)
        if reason is not None and compile_layers:
            raise NotImplementedError(f"grpo.rollout_compile needs fast decoding, which is off for this model: {reason}")

        def make_decoder() -> FastDecoder:
            return FastDecoder(model, cuda_graphs=cuda_graphs, compile_layers=compile_layers, attention="bmm" if compile_layers else "sdpa")

        self._make_decoder = make_decoder if reason is None else None
        self.decoder = make_decoder() if reason is None else None

    def _generate(self, prompts: list[list[int]], temperature: float, top_p: float, max_new: int, seed: int) -> list[Completion]:
        if self.decoder is None and self._make_decoder is not None:  # released after the last rollouts
            self.decoder = self._make_decoder()
        was_training = self.model.training
        self.model.eval()  # no dropout while sampling: the rollout policy is the eval-mode policy
        try:
            return sample_completions(
                self.decoder if self.decoder is not None else self.model,
                prompts,
                max_new_tokens=max_new,
                temperature=temperature,
                top_p=top_p,
                stop_ids=self.client.stop_ids,
                pad_id=self._pad,
                seed=seed,
            )
        finally:
            self.model.train(was_training)

    def sync(self, iteration: int, save_adapter: Callable[[Path], None]) -> None:
        """Re-merge the adapter into the fast decoder's working copy (plain decoding: nothing to do)."""
        if self.decoder is not None:
            self.decoder.refresh()

    def release(self) -> None:
        """Drop the fast decoder (merged working copy, static KV cache, CUDA graphs) until the next
        rollouts, which build it again from the current weights (``grpo.release_rollout_memory``)."""
        self.decoder = None

    def close(self) -> None:
        self.decoder = None
        self._make_decoder = None


class ClientEngine:
    """Any in-process :class:`ChatClient` on the live model that honours ``return_tokens``.

    E.g. ``tracekit.llm.hf.HFChatClient(trainer_model, tok, chat_format=..., constrained_tool_calls=True)``
    to roll out with exactly the evaluated agent's decoding. Log-probs a constrained client reports
    are those of the masked distribution: use ``old_logprobs='recompute'`` with it.
    """

    kind = "client"

    def __init__(self, client: ChatClient):
        self.client = client

    def sync(self, iteration: int, save_adapter: Callable[[Path], None]) -> None:
        """Re-merge a fast-decoding client's working copy (a plain client wraps the live weights)."""
        refresh = getattr(self.client, "refresh", None)
        if refresh is not None:
            refresh()

    def release(self) -> None:
        """Let the client drop what it keeps between chats (``HFChatClient``: its fast decoder's working
        copy and KV cache); clients without such state keep nothing (``grpo.release_rollout_memory``)."""
        release = getattr(self.client, "release", None)
        if release is not None:
            release()

    def close(self) -> None:
        self.client.close()
