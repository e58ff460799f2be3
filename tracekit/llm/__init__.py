"""Chat clients behind one interface (:class:`~tracekit.llm.base.ChatClient`), built from a config dict.

``make_client(cfg)`` reads ``cfg["kind"]`` and these keys (anything else is an error):

kind ``hf`` (in-process transformers model, :class:`~tracekit.llm.hf.HFChatClient`):
    backbone (str name or dict, see :func:`~tracekit.llm.backbones.get_spec`; required),
    device ("cpu"), dtype (null = the backbone's), cache_dir (null = $TRACEKIT_CACHE or ~/.cache/tracekit),
    adapter (null or a peft adapter directory), moe (null or a composed LoRA-MoE directory saved by
    :meth:`tracekit.moe.model.LoRAMoEModel.save`), chat_format (null = the backbone's),
    max_batch_size (8), constrained_tool_calls (false), tool_choice ("auto" | "required"), copy_ids (false),
    fast ("auto" | "on" | "off"),
    stop_at_tool_call_end (true), seed (0), prefill_chunk (1024), max_context_tokens (null),
    max_whitespace (1), torch_threads (null).

kind ``openai`` (OpenAI-compatible endpoint, :class:`~tracekit.llm.openai.OpenAIChatClient`):
    base_url, model (required), api_key (null), api_key_env ("OPENAI_API_KEY"),
    require_api_key (null = unless the host is local), timeout_s (120), connect_timeout_s (5),
    max_retries (3), backoff_s (1), max_backoff_s (30), max_concurrency (8), chat_format ("qwen3"),
    vllm (false), extra_body ({}), check (false: true probes the endpoint now instead of at the first chat).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tracekit.llm.backbones import get_spec, load_backbone
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.llm.hf import HFChatClient
from tracekit.llm.openai import OpenAIChatClient
from tracekit.llm.tools import encode_prompt
from tracekit.moe.model import LoRAMoEModel
from tracekit.moe.routed import routed_client
from tracekit.pipeline import plain

__all__ = ["ChatClient", "ChatRequest", "ChatResponse", "EndpointError", "make_client"]

_HF_KEYS = {
    "max_batch_size",
    "constrained_tool_calls",
    "tool_choice",
    "copy_ids",
    "fast",
    "stop_at_tool_call_end",
    "seed",
    "prefill_chunk",
    "max_context_tokens",
    "max_whitespace",
    "torch_threads",
    "prefix_cache_mib",
}
_OPENAI_KEYS = {
    "base_url",
    "model",
    "api_key",
    "api_key_env",
    "require_api_key",
    "timeout_s",
    "connect_timeout_s",
    "max_retries",
    "backoff_s",
    "max_backoff_s",
    "max_concurrency",
    "chat_format",
    "vllm",
    "extra_body",
}


def _mapping(cfg: Any) -> dict[str, Any]:
    cfg = plain(cfg)
    if not isinstance(cfg, Mapping):
        raise TypeError(f"client config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


def _check_keys(kind: str, cfg: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(cfg) - allowed - {"kind"})
    if unknown:
        raise KeyError(f"llm client kind={kind}: unknown keys {unknown}; allowed: {sorted(allowed)}")


def make_client(cfg: Mapping[str, Any] | Any) -> ChatClient:
    """Build a chat client from a config dict (or OmegaConf node); see the module docstring for keys."""
    cfg = _mapping(cfg)
    kind = cfg.get("kind")
    if kind == "hf":
        return _make_hf(cfg)
    if kind == "openai":
        _check_keys(kind, {k: v for k, v in cfg.items() if k != "check"}, _OPENAI_KEYS)
        for key in ("base_url", "model"):
            if not cfg.get(key):
                raise KeyError(f"llm client kind=openai: '{key}' is required")

        client = OpenAIChatClient(**{k: v for k, v in cfg.items() if k in _OPENAI_KEYS})
        if cfg.get("check"):
            client.check()
        return client
    raise ValueError(f"llm client kind must be 'hf' or 'openai', got {kind!r}")


def _make_hf(cfg: dict[str, Any]) -> ChatClient:
    model_keys = {"backbone", "device", "dtype", "cache_dir", "adapter", "moe", "chat_format"}
    _check_keys("hf", cfg, _HF_KEYS | model_keys)
    if not cfg.get("backbone"):
        raise KeyError("llm client kind=hf: 'backbone' is required")

    spec = get_spec(cfg["backbone"])
    model, tokenizer = load_backbone(spec, cfg.get("device") or "cpu", cfg.get("dtype"), cfg.get("cache_dir"))
    if cfg.get("adapter") and cfg.get("moe"):
        raise ValueError("llm client kind=hf: give 'adapter' (one peft adapter) or 'moe' (a composed model), not both")
    if cfg.get("adapter"):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg["adapter"]).eval()
    if cfg.get("moe"):
        model = LoRAMoEModel.load(cfg["moe"], backbone=model).eval()
    client = HFChatClient(
        model,
        tokenizer,
        chat_format=cfg.get("chat_format") or spec.chat_format,
        **{k: v for k, v in cfg.items() if k in _HF_KEYS},
    )
    if cfg.get("moe"):  # a LoRA-MoE routed per turn or per episode decides before each turn (issue 53)
        return routed_client(client, model, cfg["moe"], lambda m, t: encode_prompt(tokenizer, m, t), client.pad_id)
    return client
