"""Config -> objects: the chat clients (one per process and configuration), the backbone's device and dtype, the
target's suite, the agent, the GRPO rollout engine, and the config keys a rollout reads.

Library code (the stages, the methods, the reports) builds what a config names through these functions, so every
caller gets the same objects and the same cache identities.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from tracekit.agents import LLMAgent
from tracekit.envs.pool import REPLY_TIMEOUT_S, SuiteSpec
from tracekit.episodes import INFRA_RETRIES
from tracekit.llm import make_client
from tracekit.llm.backbones import keeping_cached_models, register_model_cache, release_memory
from tracekit.pipeline import plain
from tracekit.targets.registry import benchmark_reads, target_of
from tracekit.targets.tau2.target import build_user as tau2_user
from tracekit.types import stable_hash


log = logging.getLogger(__name__)


def select(cfg: DictConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    """The plain values of ``keys`` in ``cfg`` (a cache identity)."""
    return {k: plain(OmegaConf.select(cfg, k)) for k in keys}


def rollout_reads(cfg: DictConfig) -> tuple[str, ...]:
    """Config keys a rollout's result depends on (the agent's adapter or MoE is added per rollout)."""
    reads = [*benchmark_reads(cfg), "backbone", "agent", "user", "eval.temperature", "eval.seeds", "eval.max_steps",
             "eval.context_budget"]
    if cfg.user.kind == "llm":
        reads.append(f"llm.endpoints.{cfg.user.endpoint}")
    if cfg.eval.temperature > 0:  # stochastic decoding samples from the master seed
        reads.append("seed")
    return tuple(reads)


# --------------------------------------------------------------------------------------------
# models and clients (one per process and configuration)

# In-process (hf) clients leave this cache when a stage loads a backbone of its own (GRPO training,
# composition: ``llm.backbones.load_backbone``), so the run holds one model at a time.
_CLIENTS: dict[str, Any] = {}


def backbone_dict(cfg: DictConfig) -> dict[str, Any]:
    b = plain(cfg.backbone)
    return {k: b[k] for k in ("name", "source", "hf_id", "chat_format", "arch", "planted") if b.get(k) is not None}


def device(cfg: DictConfig) -> str:
    want = cfg.backbone.device
    return ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want


def dtype(cfg: DictConfig) -> str | None:
    want = cfg.backbone.dtype
    if want != "auto":
        return want
    return "bfloat16" if device(cfg) == "cuda" else "float32"


def _client_spec(cfg: DictConfig, role: str, adapter: str | None, moe: str | None) -> dict[str, Any]:
    """The :func:`tracekit.llm.make_client` spec of an LLM role (its identity in the client cache)."""
    if role == "agent":
        ep: dict[str, Any] = {"kind": "hf"}
    else:
        if role not in cfg.llm.endpoints:
            raise KeyError(f"llm.endpoints has no '{role}' endpoint (have: {', '.join(cfg.llm.endpoints)})")
        ep = {k: v for k, v in plain(cfg.llm.endpoints[role]).items() if v is not None}
    if ep["kind"] == "hf":
        spec = {"kind": "hf", "backbone": backbone_dict(cfg), "device": device(cfg), "dtype": dtype(cfg),
                "adapter": adapter, "moe": moe, "max_batch_size": cfg.agent.batch_size,
                "constrained_tool_calls": cfg.agent.constrained_tool_calls if role == "agent" else False}
        if role == "agent":  # prefixes: only the agent's, which each rollout clears (the other roles' would carry over)
            spec.update(tool_choice=cfg.agent.tool_choice, copy_ids=cfg.agent.copy_ids,
                        prefix_cache_mib=cfg.agent.prefix_cache_mib)
        return spec
    key_env = ep.pop("api_key_env", None)
    spec = {"kind": "openai", "base_url": ep["base_url"], "model": ep["model"], "timeout_s": ep["timeout_s"],
            "max_retries": ep["max_retries"], "max_concurrency": ep["concurrency"]}
    if key_env:
        spec["api_key_env"] = key_env
    return spec


def client_for(cfg: DictConfig, role: str, adapter: str | None = None, moe: str | None = None) -> Any:
    """The chat client of an LLM role (``agent`` or a key of ``llm.endpoints``), built once per process.

    ``adapter``: a peft adapter directory; ``moe``: a composed LoRA-MoE directory (agent only).
    """
    spec = _client_spec(cfg, role, adapter, moe)

    if adapter or moe:  # used for one rollout: not kept, so a run over many adapters holds one model at a time
        with keeping_cached_models():  # the cached user client serves the same rollout
            return make_client(spec)
    key = stable_hash(spec)
    if key not in _CLIENTS:
        with keeping_cached_models():  # building one role's client keeps the others' (agent and user)
            _CLIENTS[key] = make_client(spec)
        if spec["kind"] == "hf":  # a model in this process: dropped when a stage loads its own backbone

            def drop_in_process() -> int:
                local = [k for k, c in _CLIENTS.items() if getattr(c, "name", None) == "hf"]
                for k in local:
                    del _CLIENTS[k]
                return len(local)

            register_model_cache("tracekit.wiring._CLIENTS", drop_in_process)
    return _CLIENTS[key]


def release_client(cfg: DictConfig, role: str) -> None:
    """Drop ``role``'s cached client and, for an in-process one, free its model: a stage done with a role (GEPA's
    reflection LM) leaves the memory to the next (the agent's evaluation)."""
    client = _CLIENTS.pop(stable_hash(_client_spec(cfg, role, None, None)), None)
    if client is not None:
        client.close()
        del client
        release_memory()


# --------------------------------------------------------------------------------------------
# environments, agents, rollouts


def build_user(cfg: DictConfig) -> Any:
    """tau^2's simulated user (:func:`tracekit.targets.tau2.target.build_user`)."""
    return tau2_user(cfg, client_for)


def build_suite(cfg: DictConfig, split: str | None = None) -> Any:
    """The target's suite (:mod:`tracekit.targets`, by ``benchmark.kind``)."""
    return target_of(cfg).build_suite(cfg, split, client_for)


def user_kind(cfg: DictConfig) -> str | None:
    """``user.kind``, or None where the stage's read view masks the user group (the stage does not read it)."""
    user = cfg.get("user")
    return user.get("kind") if isinstance(user, DictConfig) else None


def suite_from_config(cfg: dict, split: str | None = None) -> Any:
    """An environment worker's suite (:mod:`tracekit.envs.pool`) from a plain config dict."""
    return build_suite(OmegaConf.create(cfg), split)


def suite_spec(cfg: DictConfig, split: str | None = None) -> SuiteSpec | None:
    """The picklable spec env workers build ``cfg``'s suite from, or None when its steps call a model in the
    driver (an LLM user)."""
    if user_kind(cfg) == "llm":
        log.info("rollout.env_workers: in-process (the LLM user's replies are batched in the driver)")
        return None
    plain_cfg: dict[str, Any] = {}
    for k in cfg:  # each top-level group that resolves (a stage's read view masks the ones it does not read)
        try:
            plain_cfg[k] = plain(cfg[k])
        except Exception:  # noqa: BLE001
            continue
    return SuiteSpec(suite_from_config, (plain_cfg, split))  # the forkserver preloads the factory's module


def env_workers(cfg: DictConfig) -> Any:
    """``rollout.env_workers`` (execution only: in no cache key)."""
    return OmegaConf.select(cfg, "rollout.env_workers", default="auto")


def env_reply_timeout(cfg: DictConfig) -> float | None:
    """``rollout.env_reply_timeout_s``: how long an env worker may stay silent on one turn (execution only)."""
    return OmegaConf.select(cfg, "rollout.env_reply_timeout_s", default=REPLY_TIMEOUT_S)


def infra_retries(cfg: DictConfig) -> int:
    """``rollout.infra_retries``: runs of an episode again after an infrastructure failure (execution only)."""
    return OmegaConf.select(cfg, "rollout.infra_retries", default=INFRA_RETRIES)


def build_agent(cfg: DictConfig, adapter: str | None = None, moe: str | None = None,
                system_prompt_suffix: str | None = None) -> Any:
    if cfg.agent.kind == "gold":  # the target's own wiring check (tau^2: gold actions; ToolSandbox: its milestones)
        return target_of(cfg).gold_agent()
    return llm_agent(cfg, cfg.eval.temperature, adapter, moe, system_prompt_suffix)


def llm_agent(cfg: DictConfig, temperature: float, adapter: str | None = None,
                moe: str | None = None, system_prompt_suffix: str | None = None) -> Any:
    return LLMAgent(client_for(cfg, "agent", adapter, moe), temperature=temperature, top_p=cfg.agent.top_p,
                    max_new_tokens=cfg.agent.max_new_tokens, system_prompt_suffix=system_prompt_suffix)


# --------------------------------------------------------------------------------------------
# the GRPO rollout engine


# grpo.engine=agent: the HFChatClient options it takes from the agent config (client option: agent key)
_AGENT_ENGINE_KEYS = {"constrained_tool_calls": "constrained_tool_calls", "tool_choice": "tool_choice",
                      "copy_ids": "copy_ids", "max_batch_size": "batch_size", "prefix_cache_mib": "prefix_cache_mib"}
AGENT_ENGINE_READS = tuple(f"agent.{k}" for k in _AGENT_ENGINE_KEYS.values())


def engine_spec(cfg: DictConfig) -> dict[str, Any]:
    """The GRPO rollout engine: ``agent`` samples with the evaluated agent's client settings."""
    g = cfg.grpo
    if g.engine == "vllm":
        return {"kind": "vllm", **plain(g.vllm)}
    if g.engine == "agent":
        return {"kind": "agent", **{option: cfg.agent[key] for option, key in _AGENT_ENGINE_KEYS.items()}}
    return {"kind": g.engine}
