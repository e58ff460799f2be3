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
- ``vllm``: :class:`VLLMEngine` manages a ``vllm serve --enable-lora`` subprocess; each iteration
  the adapter is saved and loaded at runtime through ``/v1/load_lora_adapter`` (adapter-only sync),
  and completions are requested with prompt token ids and ``return_tokens_as_token_ids``. vllm and
  the server are only touched when this engine is used.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.llm.decoding import Completion, FastDecoder, generate, unsupported_reason
from tracekit.llm.hf import stop_token_ids
from tracekit.llm.tools import check_chat_format, encode_prompt, parse_assistant_text
from tracekit.ports import free_port
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
        if fast not in ("auto", "on", "off"):
            raise ValueError(f"fast must be auto, on or off, got {fast!r}")
        self.model = model
        stops = stop_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
        self.client = PolicyChat(
            tokenizer, self._generate, stops, chat_format=chat_format, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size
        )
        self._pad = int(pad)
        reason = unsupported_reason(model) if fast != "off" else "fast=off"
        if reason is not None and fast == "on":
            raise NotImplementedError(f"grpo.rollout_fast=on but fast decoding does not support this model: {reason}")
        if reason is not None and fast == "auto":
            log.info("hf engine: plain peft decoding (%s)", reason)
        if reason is not None and compile_layers:
            raise NotImplementedError(f"grpo.rollout_compile needs fast decoding, which is off for this model: {reason}")
        self.decoder = (
            FastDecoder(model, cuda_graphs=cuda_graphs, compile_layers=compile_layers, attention="bmm" if compile_layers else "sdpa")
            if reason is None
            else None
        )

    def _generate(self, prompts: list[list[int]], temperature: float, top_p: float, max_new: int, seed: int) -> list[Completion]:
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

    def close(self) -> None:
        self.decoder = None


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

    def close(self) -> None:
        self.client.close()


@dataclass
class VLLMSettings:
    model_path: str  # the backbone as a local HF folder (vLLM loads it itself)
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    max_lora_rank: int = 64
    gpu_memory_utilization: float = 0.5  # the trainer shares the GPU
    dtype: str = "bfloat16"
    max_model_len: int = 32768
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 600.0
    concurrency: int = 64
    extra_args: tuple[str, ...] = ()
    base_url: str | None = None  # an already running server (then nothing is launched)


class VLLMEngine:
    """A managed ``vllm serve`` with runtime LoRA loading (adapter-only sync each iteration)."""

    kind = "vllm"

    def __init__(
        self, settings: VLLMSettings, tokenizer: Any, work_dir: str | Path, *, chat_format: str = "qwen3", max_prompt_tokens: int = 32000
    ):
        import httpx

        self.s = settings
        self.work_dir = Path(work_dir)
        self.proc: subprocess.Popen | None = None
        self.lora_name: str | None = None
        self._lora_path: Path | None = None
        if settings.base_url:
            self.base_url = settings.base_url.rstrip("/")
        else:
            self.base_url = self._launch()
        self.http = httpx.Client(base_url=self.base_url, timeout=settings.request_timeout_s)
        self.client = PolicyChat(
            tokenizer,
            self._generate,
            stop_token_ids(None, tokenizer),
            chat_format=chat_format,
            max_prompt_tokens=max_prompt_tokens,
            batch_size=settings.concurrency,
        )

    def _launch(self) -> str:
        if shutil.which("vllm") is None:
            raise EndpointError("grpo.engine=vllm needs the `vllm` command (pip install the gpu extra); not found on PATH")
        port = self.s.port or free_port()
        cmd = [
            "vllm", "serve", self.s.model_path, "--host", self.s.host, "--port", str(port),
            "--enable-lora", "--max-lora-rank", str(self.s.max_lora_rank), "--max-loras", "2",
            "--dtype", self.s.dtype, "--gpu-memory-utilization", str(self.s.gpu_memory_utilization),
            "--max-model-len", str(self.s.max_model_len), *self.s.extra_args,
        ]  # fmt: skip
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.work_dir / "vllm_server.log", "ab")
        log.info("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env)
        url = f"http://{self.s.host}:{port}"
        self._wait_healthy(url)
        return url

    def _wait_healthy(self, url: str) -> None:
        import httpx

        t0 = time.time()
        while time.time() - t0 < self.s.startup_timeout_s:
            if self.proc is not None and self.proc.poll() is not None:
                raise EndpointError(f"vllm serve exited with code {self.proc.returncode}; see {self.work_dir / 'vllm_server.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        self.close()
        raise EndpointError(f"vllm serve not healthy after {self.s.startup_timeout_s:.0f}s; see {self.work_dir / 'vllm_server.log'}")

    def sync(self, iteration: int, save_adapter: Callable[[Path], None]) -> None:
        """Save the current adapter and load it into the server under a fresh name; unload the old one."""
        path = self.work_dir / "adapters" / f"iter_{iteration:05d}"
        save_adapter(path)
        name = f"policy-it{iteration}-{uuid.uuid4().hex[:6]}"
        r = self.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path.resolve())})
        if r.status_code != 200:
            raise EndpointError(f"vllm load_lora_adapter failed ({r.status_code}): {r.text[:300]}")
        if self.lora_name is not None:
            self.http.post("/v1/unload_lora_adapter", json={"lora_name": self.lora_name})
            if self._lora_path is not None and self._lora_path != path:
                shutil.rmtree(self._lora_path, ignore_errors=True)
        self.lora_name, self._lora_path = name, path

    def _generate(self, prompts: list[list[int]], temperature: float, top_p: float, max_new: int, seed: int) -> list[Completion]:
        if self.lora_name is None:
            raise EndpointError("vllm engine used before sync(): no adapter loaded")
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int) -> Completion:
            body = {
                "model": self.lora_name,
                "prompt": prompts[i],
                "max_tokens": max_new,
                "temperature": temperature,
                "top_p": top_p,
                "seed": (seed + i) % (2**31),
                "logprobs": 1,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "stop_token_ids": self.client.stop_ids,
                "include_stop_str_in_output": True,
            }
            r = self.http.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise EndpointError(f"vllm completion failed ({r.status_code}): {r.text[:300]}")
            return parse_vllm_choice(r.json()["choices"][0], self.client.stop_ids)

        with ThreadPoolExecutor(max_workers=self.s.concurrency) as ex:
            return list(ex.map(one, range(len(prompts))))

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def parse_vllm_choice(choice: dict[str, Any], stop_ids: Sequence[int]) -> Completion:
    """A ``/v1/completions`` choice with ``return_tokens_as_token_ids`` -> ids and log-probs.

    vLLM formats each token as ``"token_id:<id>"``. A completion counts as stopped iff its last id
    is a stop id (the sampled end-of-turn token is trained on like any other generated token).
    """
    lp = choice.get("logprobs") or {}
    toks, lps = lp.get("tokens"), lp.get("token_logprobs")
    if toks is None or lps is None:
        raise EndpointError("vllm response has no token log-probs (was logprobs requested?)")
    ids = []
    for t in toks:
        if not isinstance(t, str) or not t.startswith("token_id:"):
            raise EndpointError(f"vllm token {t!r} is not 'token_id:<id>' (is return_tokens_as_token_ids supported?)")
        ids.append(int(t.split(":", 1)[1]))
    if len(ids) != len(lps):
        raise EndpointError(f"vllm returned {len(ids)} tokens but {len(lps)} log-probs")
    finish = "stop" if ids and ids[-1] in set(stop_ids) else "length"
    return Completion(ids=ids, logprobs=[float(x) for x in lps], finish_reason=finish)
