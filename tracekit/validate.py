"""Value checks that run before any work: every key against the schema (:mod:`tracekit.config`), every value
against its range (``RANGES``) or choices (``CHOICES``), the cross-field rules, each target's and each method's
own checks, and the endpoints the stages will call (``needed_endpoints``, ``probe_endpoints``).

A ``+key=value`` override adds keys even in struct mode (Hydra applies it with ``force_add``), so :func:`validate`
walks the composed config against the schema again and raises :class:`~tracekit.config.ConfigError` with one line
naming the key and what is valid. The choices some keys take come from the registries (methods, consolidation
strategies, targets, stages, library environments): this module reads them; the schema does not.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tracekit.analysis.select import Thresholds
from tracekit.coding.config import CHOICES as CODING_CHOICES
from tracekit.coding.config import RANGES as CODING_RANGES
from tracekit.config import (Config, ConfigError, _check, eval_benchmark, evaluation_config, imported_run_files,
                             interpolation_message, read_imported_labels, read_pinned_dictionary)
from tracekit.envs.pool import valid_setting as valid_env_workers
from tracekit.envs.toolsandbox import DOMAINS as TOOLSANDBOX_DOMAINS
from tracekit.envs.toolsandbox import VARIANTS as TOOLSANDBOX_VARIANTS
from tracekit.llm.backbones import BACKBONES
from tracekit.llm.base import EndpointError
from tracekit.llm.decoding import PREFIX_CACHE_MIB
from tracekit.llm.openai import OpenAIChatClient
from tracekit.llm.tools import CHAT_FORMATS
from tracekit.methods import METHODS, validate_methods
from tracekit.methods.consolidate import STRATEGIES
from tracekit.moe.gate import GateTrainConfig
from tracekit.planted.warmstart import PlantedSpec, longest_gold_episode, world_tokenizer
from tracekit.ranges import DTYPES, in_range, what_it_must_be
from tracekit.rl.distill import DistillSettings
from tracekit.rl.settings import KINDS, GRPORecipe, LauncherSettings
from tracekit.rl.sft import SFTSettings
from tracekit.rl.vllm_client import check_recipe, vllm_settings
from tracekit.stages import build_pipeline
from tracekit.targets import env_names
from tracekit.targets import kinds as target_kinds
from tracekit.targets import target_of
from tracekit.targets.tau2 import TAU2_DOMAINS
from tracekit.targets.toolsandbox import TRAIN_SPLITS as TOOLSANDBOX_TRAIN_SPLITS

CONF = Path(__file__).resolve().parent.parent / "conf"


def _group_ranges(group: str, settings: type) -> dict[str, str]:
    """A config group's ranges from the settings class it is built on (its ``RANGES``, checked there too)."""
    return {f"{group}.{k}": v for k, v in settings.RANGES.items()}


# every numeric field's valid range ("[a, b]", "(a, b]", "> a", ">= a"; null passes where the field is
# optional; a list field: each element)
RANGES: dict[str, str] = {
    "benchmark.limit": ">= 1", "benchmark.max_errors": ">= 1", "benchmark.difficulty": ">= 0",
    "benchmark.train_seed": ">= 0",  # kind=toolsandbox: the heldout training split's seed
    "rollout.env_reply_timeout_s": "> 0",  # null: no timeout
    "rollout.infra_retries": ">= 0",
    "agent.max_new_tokens": ">= 1", "agent.top_p": "(0, 1]", "agent.batch_size": ">= 1", "agent.prefix_cache_mib": PREFIX_CACHE_MIB,
    "user.max_turns": ">= 1", "user.temperature": "[0, 2]", "user.max_new_tokens": ">= 1",
    "thresholds.delta": "[0, 1]", "thresholds.rho": "[0, 1]", "thresholds.k": ">= 1", "thresholds.n": ">= 1",
    "analysis.temperature": "[0, 2]", "analysis.capabilities_per_call": ">= 0", "analysis.max_retries": ">= 0",
    "analysis.compact_chars": ">= 200", "analysis.label_noise": "[0, 0.5]", "analysis.examples_per_capability": ">= 0",
    "analysis.chunk_size": ">= 1", "analysis.min_capabilities": ">= 1", "analysis.max_capabilities": ">= 1",
    "analysis.max_new_tokens": ">= 1",
    "synthesis.repair_rounds": ">= 0", "synthesis.mutation_rounds": ">= 0", "synthesis.validation_seeds": ">= 1",
    "synthesis.calibration_seeds": ">= 1", "synthesis.calibration_k": ">= 2", "synthesis.target_low": "[0, 1]",
    "synthesis.target_high": "[0, 1]", "synthesis.min_informative": "[0, 1]", "synthesis.difficulty": ">= 0",
    "synthesis.acceptance_group_size": ">= 2", "synthesis.min_reward_std": "[0, 1]",
    "synthesis.max_all_success": "[0, 1]", "synthesis.max_all_zero": "[0, 1]",
    "synthesis.cpu_seconds": ">= 1", "synthesis.wall_seconds": ">= 1", "synthesis.memory_mb": ">= 256",
    **_group_ranges("grpo", GRPORecipe),  # the recipes' own ranges (one check per knob)
    **_group_ranges("moe", GateTrainConfig),
    "moe.top_k": ">= 1", "moe.train_top_k": ">= 1", "moe.gate_init_std": ">= 0",
    "moe.trajectories_per_capability": ">= 1",
    "llm.endpoints.*.timeout_s": "> 0", "llm.endpoints.*.max_retries": ">= 0", "llm.endpoints.*.concurrency": ">= 1",
    "eval.temperature": ">= 0", "eval.seeds": ">= 0", "eval.max_steps": ">= 1", "eval.context_budget": ">= 256",
    "launcher.nproc": ">= 1", "launcher.master_port": "[1, 65535]", "launcher.concurrent_runs": ">= 1",
    "consolidation.budget.episodes": ">= 1", "consolidation.merge.weights": "[-10, 10]",
    "consolidation.merge.density": "(0, 1]", "consolidation.merge.rank": ">= 1", "consolidation.merge.lam": "> 0",
    "consolidation.core_tsv.lam": "> 0", "consolidation.core_tsv.density": "(0, 1]",
    "consolidation.arrow.top_k": ">= 1", "consolidation.arrow.temperature": "> 0",
    "consolidation.gate.soft_target.temperature": "> 0", "consolidation.gate.soft_target.seeds": ">= 1",
    "consolidation.gate.grpo.iterations": ">= 1", "consolidation.gate.grpo.groups": ">= 1",
    "consolidation.gate.grpo.group_size": ">= 1", "consolidation.gate.grpo.lr": "> 0",
    "consolidation.gate.grpo.clip_eps": "(0, 1)", "consolidation.gate.grpo.temperature": "[0, 2]",
    "consolidation.gate.grpo.hint_fraction": "[0, 1]", "consolidation.gate.grpo.updates": ">= 1",
    "consolidation.gate.grpo.max_grad_norm": ">= 0",
    **_group_ranges("consolidation.sft", SFTSettings), **_group_ranges("consolidation.distill", DistillSettings),
    "baselines.grpo_target.episodes": ">= 1", "baselines.grpo_target.train_limit": ">= 1",
    "baselines.grpo_target.checkpoint_iterations": ">= 1",
    "baselines.swe_rl.episodes": ">= 1", "baselines.swe_rl.train_limit": ">= 1",
    "baselines.swe_rl.checkpoint_iterations": ">= 1",
    **CODING_RANGES,  # benchmark.coding.* (tracekit/coding/config.py)
    "baselines.gepa.max_metric_calls": ">= 1", "baselines.gepa.reflection_minibatch_size": ">= 1",
    "baselines.gepa.valset_size": ">= 1", "baselines.gepa.train_limit": ">= 2",
    "baselines.gepa.reflection_temperature": "[0, 2]", "baselines.gepa.reflection_max_new_tokens": ">= 1",
    "baselines.untargeted_synthetic.episodes": ">= 1",
    **_group_ranges("baselines.adp_sft", SFTSettings),
    "baselines.adp_sft.max_records": ">= 1", "baselines.adp_sft.max_tokens": ">= 16",
    "seed": ">= 0",
}


def _library_names() -> tuple[str, ...]:
    return env_names()


def _benchmark_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CONF / "benchmark").glob("*.yaml")))


def _target_domains() -> tuple[str, ...]:
    # tau^2's domains (tracekit.envs.tau2.DOMAINS: importing it loads tau2, seconds) and ToolSandbox's scenario sets
    return (*TAU2_DOMAINS, *TOOLSANDBOX_DOMAINS)


def _toolsandbox_variants() -> tuple[str, ...]:
    return TOOLSANDBOX_VARIANTS


def _toolsandbox_train_splits() -> tuple[str, ...]:
    return tuple(TOOLSANDBOX_TRAIN_SPLITS)


def _stage_names() -> tuple[str, ...]:
    return tuple(build_pipeline().stages)


def _method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def _strategy_names() -> tuple[str, ...]:
    return tuple(STRATEGIES)


def _scale_names() -> tuple[str, ...]:
    return ("none", *sorted(p.stem for p in (CONF / "scale").glob("*.yaml")))


def _backbone_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (CONF / "backbone").glob("*.yaml")))


def _chat_formats() -> tuple[str, ...]:
    return CHAT_FORMATS


# every string field with a fixed set of values: a tuple, a function giving one (computed when used), or a
# regular expression; the other strings are names, paths and URLs
CHOICES: dict[str, tuple[str, ...] | Callable[[], tuple[str, ...]] | str] = {
    "benchmark.kind": target_kinds,  # the targets registry (tracekit.targets)
    "benchmark.domains": _target_domains,  # which go with which kind: the target's validate()
    "benchmark.train_domains": _toolsandbox_variants,  # ToolSandbox's variants learned from (the target's validate())
    "benchmark.train_split": _toolsandbox_train_splits,  # ToolSandbox's training split (tracekit/targets/toolsandbox.py)
    "benchmark.split": ("train", "test", "base"),
    "benchmark.policy": ("full",),
    "benchmark.envs": _library_names,
    **CODING_CHOICES,  # benchmark.coding.modifiers: swesmith's Python modifiers
    "backbone.source": ("random", "gguf", "hub"),
    "backbone.chat_format": _chat_formats,
    "backbone.dtype": (*DTYPES, "float16"),
    "backbone.device": r"auto|cpu|mps|cuda(:\d+)?",
    "agent.kind": ("llm", "gold"),
    "agent.tool_choice": ("auto", "required"),
    "user.kind": ("scripted", "llm"),
    "thresholds.undefined_er_pos": ("zero", "unselectable"),
    "analysis.discovery": ("reference", "llm", "pinned"),
    "analysis.labeler": ("reference", "llm", "imported"),
    "analysis.on_missing": ("skip", "fail"),
    "synthesis.source": ("library", "generate"),
    "synthesis.acceptance": ("none", "official"),
    "grpo.old_logprobs": ("rollout", "recompute"),
    "grpo.checkpoint_policy": ("full", "selective"),
    "grpo.rollout_fast": ("auto", "on", "off"),
    "grpo.dtype": DTYPES,
    "grpo.engine": ("hf", "agent", "vllm"),
    "moe.impl": ("grouped", "grouped_mm", "masked_dense"),
    "moe.gate_data": ("successes", "all"),
    "consolidation.method": _strategy_names,
    "consolidation.merge.majority_sign": ("total", "frequency"),
    "consolidation.core_tsv.majority_sign": ("total", "frequency"),
    "consolidation.core_tsv.rank_policy": ("full", "truncate"),
    "consolidation.sft.data": ("successes", "all"),
    "consolidation.gate.objective": ("ce_lb", "soft_target", "grpo"),
    "consolidation.gate.grpo.warm_start": ("ce_lb", "soft_target"),
    "consolidation.sft.schedule": ("linear", "constant"),
    "consolidation.sft.dtype": DTYPES,
    "consolidation.distill.rollout_fast": ("auto", "on", "off"),
    "consolidation.distill.dtype": DTYPES,
    "consolidation.distill.save_rollouts": ("none", "messages", "full"),
    "llm.endpoints.*.kind": ("hf", "openai"),
    "eval.mode": ("greedy", "stochastic"),
    "eval.benchmark": _benchmark_names,  # a conf/benchmark name (evaluation on another target, Table 8)
    "scale.name": _scale_names,
    "scale.backbone": _backbone_names,
    "eval.methods": _method_names,
    "logger.kind": ("wandb", "none"),
    "logger.mode": ("offline", "online", "disabled"),
    "launcher.kind": KINDS,
    "launcher.command": ("torchrun", "deepspeed"),
    "stages": _stage_names,
    "baselines.gepa.endpoint": r"[A-Za-z_][\w\-]*",  # a key of llm.endpoints (checked in validate())
    "baselines.gepa.candidate_selection": ("pareto", "current_best", "epsilon_greedy", "top_k_pareto"),
    "baselines.gepa.module_selector": ("round_robin", "all"),
    "baselines.untargeted_synthetic.envs_dir": r".+",  # a folder of environment packages (checked in validate())
    "baselines.adp_sft.data": r"(hf://[\w.\-]+/[\w.\-]+(/[\w.\-/]+)?|[^:]+|[A-Za-z]:.+)",  # paths or hub ids
    "baselines.adp_sft.schedule": ("linear", "constant"),
    "baselines.adp_sft.dtype": DTYPES,
    "baselines.adp_sft.lora.target_modules": r"[\w.\-*]+",
    "baselines.adp_sft.lora.target_parameters": r"[\w.\-*]+",
}

def _check_leaf(key: str, pattern: str, value: Any) -> None:
    for item in value if isinstance(value, ListConfig) else [value]:
        if item is None:
            continue
        if pattern in RANGES:
            spec = RANGES[pattern]
            _check(in_range(item, spec), key, item, what_it_must_be(spec))
        elif isinstance(rule := CHOICES[pattern], str):
            _check(re.fullmatch(rule, item) is not None, key, item, f"of the form {rule}")
        else:
            options = rule() if callable(rule) else rule
            _check(item in options, key, item, "one of " + ", ".join(options))


def _leaves(node: DictConfig, schema: type, key: str = "",
            pattern: str = "") -> Iterator[tuple[str, str, DictConfig, str]]:
    """(key, its pattern in RANGES/CHOICES, parent node, name) of every leaf of ``node``; a key the schema lacks
    (Hydra's ``+key=value`` adds keys even in struct mode) raises ConfigError. ``dict[str, Any]`` fields are
    open; a ``dict[str, <dataclass>]`` field takes any name, each entry checked against the dataclass."""
    fields = get_type_hints(schema)
    for name in node:
        k, p = f"{key}{name}", f"{pattern}{name}"
        if name not in fields:
            raise ConfigError(f"unknown key {k} (valid: {', '.join(fields)})")
        hint = fields[name]
        if is_dataclass(hint):
            yield from _leaves(node[name], hint, f"{k}.", f"{p}.")
        elif get_origin(hint) is dict and is_dataclass(entry := get_args(hint)[1]):
            for entry_name in node[name]:
                yield from _leaves(node[name][entry_name], entry, f"{k}.{entry_name}.", f"{p}.*.")
        else:
            yield k, p, node, name


ENDPOINT_KEYS = ("user.endpoint", "analysis.endpoint", "synthesis.endpoint",
                 "baselines.gepa.endpoint")  # the keys naming an endpoint


def needed_endpoints(cfg: DictConfig, stage: str) -> list[str]:
    """The names of the ``llm.endpoints`` entries ``stage`` calls when it computes: those its reads name."""
    prefix = "llm.endpoints."
    return [r[len(prefix):] for r in build_pipeline().reads(cfg, stage) if r.startswith(prefix)]


PROBE_TIMEOUT_S = 3.0


def probe_endpoints(cfg: DictConfig, roles: Iterable[str]) -> None:
    """Ask each openai endpoint among ``roles`` for ``<base_url>/models`` with a short timeout (hf endpoints run
    in process: nothing to ask); ConfigError naming the endpoint, its URL and the error on the first that fails."""
    for role in dict.fromkeys(roles):
        ep = cfg.llm.endpoints[role]
        if ep.kind != "openai":
            continue
        try:
            client = OpenAIChatClient(ep.base_url, ep.model, connect_timeout_s=PROBE_TIMEOUT_S,
                                      **({"api_key_env": ep.api_key_env} if ep.api_key_env else {}))
            try:
                client.check()
            finally:
                client.close()
        except EndpointError as e:
            raise ConfigError(f"llm.endpoints.{role}: {e}") from None


def _check_backbone_name(bb: DictConfig) -> None:
    """``backbone.name`` names a registered backbone, or a custom one with its own source: ``backbone.source=hub``
    and a ``backbone.hf_id`` that is no registered backbone's. Any other unknown name (a typo: ``tinyy``) would run
    the group's model under a new name, so every stage would recompute for nothing: refused, listing the names."""
    if bb.name in BACKBONES:
        return
    own_source = bb.source == "hub" and bool(bb.hf_id) and bb.hf_id not in {s.hf_id for s in BACKBONES.values()}
    _check(own_source, "backbone.name", bb.name,
           f"a known backbone ({', '.join(sorted(BACKBONES))}; backbone=<name> picks one), or a custom one with its own "
           "source: backbone.source=hub and backbone.hf_id=<a hub model no known backbone names>")


def validate(cfg: DictConfig) -> None:
    """Check every key against the schema, every value's range or choices and the cross-field rules; raise
    ConfigError (one line) on the first problem, a value whose interpolation cannot be resolved included."""
    try:
        _validate(cfg)
    except InterpolationResolutionError as e:
        raise ConfigError(interpolation_message(e, cfg)) from None


def _check_world_backbone(cfg: DictConfig, planted: PlantedSpec) -> None:
    """A backbone trained from random init on one world (tokenizer=world: the micro backbone) runs on that world's
    target only: anywhere else it has never seen a token of the task."""
    spec = BACKBONES.get(cfg.backbone.name)
    if spec is None or spec.tokenizer != "world":
        return
    family = target_of(cfg).synthesis_family(cfg) if cfg.benchmark.kind in target_kinds() else None
    if family != planted.family:
        raise ConfigError(f"backbone={cfg.backbone.name} was warm-started for the {planted.family} world "
                          f"(backbone.planted.family); benchmark={cfg.benchmark.name} is a {family} target: use "
                          f"benchmark=micro, or another backbone")
    # the world's episodes must fit the context the agent is given (eval.context_budget; GRPO's max_prompt_tokens)
    tokenizer = world_tokenizer(planted.family, spec.chat_format, int(spec.arch["vocab_size"]))
    suite = target_of(cfg).build_suite(cfg, None, lambda *_: None)
    try:
        tokens, task = longest_gold_episode(suite, tokenizer)
    finally:
        suite.close()
    for key in ("eval.context_budget", "grpo.max_prompt_tokens"):
        budget = OmegaConf.select(cfg, key)
        _check(tokens <= budget, key, budget, f">= {tokens}: the gold episode of {task} (benchmark.difficulty="
               f"{cfg.benchmark.difficulty}) is {tokens} tokens of the {planted.family} tokenizer")


def _check_vllm(g: DictConfig) -> None:
    """``grpo.vllm``: with engine=vllm, the fields of :class:`~tracekit.rl.vllm_client.VLLMSettings` and the
    engine's rules on the recipe (the trainer checks them again); under another engine, empty (nothing reads it)."""
    options = OmegaConf.to_container(g.vllm, resolve=True)
    if g.engine != "vllm":
        _check(not options, "grpo.vllm", options, f"empty with grpo.engine={g.engine} (only the vllm engine reads it)")
        return
    try:
        check_recipe(vllm_settings(options), g.lora.rank, g.temperature, g.old_logprobs)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def _validate(cfg: DictConfig) -> None:
    if "seed" not in cfg:  # Hydra's ~seed deletes it; every stage derives its seeds from it
        raise ConfigError("seed is not in the config (an override like ~seed removes it): every stage derives its "
                          "seeds from it; drop the override, or give it a value: seed=<int>")
    for key, pattern, node, name in _leaves(cfg, Config):
        if not key.startswith("paths.") and not OmegaConf.is_missing(node, name):
            node[name]  # resolved: a broken ${...} is named here (paths resolve only in Hydra's app)
        if pattern in RANGES or pattern in CHOICES:
            _check_leaf(key, pattern, node[name])
    if "rollout" in cfg:
        _check(valid_env_workers(cfg.rollout.env_workers), "rollout.env_workers", cfg.rollout.env_workers,
               "auto, 0 (in-process) or a positive integer (worker processes)")
    _check_backbone_name(cfg.backbone)
    t = cfg.thresholds
    _check(t.k <= t.n, "thresholds.k", t.k, f"in [1, thresholds.n={t.n}]")
    if cfg.backbone.get("planted") is not None:  # a planted set naming a capability the library lacks: one line
        try:
            planted = PlantedSpec.from_config(cfg.backbone.planted)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
        _check_world_backbone(cfg, planted)
    for key in ("tool_choice", "copy_ids"):
        if cfg.agent[key] not in ("auto", False):
            _check(cfg.agent.constrained_tool_calls, "agent.constrained_tool_calls", False,
                   f"true when agent.{key}={cfg.agent[key]} (both are grammar constraints)")
    _check(cfg.user.kind != "scripted" or cfg.user.max_turns is not None, "user.max_turns", None,
           ">= 1 with user.kind=scripted (the scripted user needs a last turn)")
    a = cfg.analysis
    _check(a.min_capabilities <= a.max_capabilities, "analysis.min_capabilities", a.min_capabilities,
           f"<= analysis.max_capabilities={a.max_capabilities}")
    if a.labeler == "imported":  # its folder first: analysis=imported's dictionary_path lies in it
        runs = imported_run_files(cfg)
        _check(a.discovery == "pinned", "analysis.discovery", a.discovery,
               "pinned with analysis.labeler=imported (the runs label a fixed candidate list: their "
               "candidate_capabilities.json as analysis.dictionary_path; analysis=imported sets both)")
    if a.discovery == "pinned":
        read_pinned_dictionary(cfg)
    if a.labeler == "imported":
        read_imported_labels(cfg)
        _check(t.n == len(runs), "thresholds.n", t.n,
               f"{len(runs)} with analysis.labeler=imported: the number of run files in {a.labels_from}")
    sy = cfg.synthesis
    _check(sy.target_low <= sy.target_high, "synthesis.target_low", sy.target_low,
           f"<= synthesis.target_high={sy.target_high}")
    for group, schema in (("grpo", GRPORecipe), ("launcher", LauncherSettings), ("thresholds", Thresholds),
                          ("consolidation.sft", SFTSettings), ("consolidation.distill", DistillSettings)):
        values = OmegaConf.to_container(OmegaConf.select(cfg, group), resolve=True)
        try:  # the settings dataclasses' own cross-field checks (tis_cap needs old_logprobs=recompute)
            schema(**{k: v for k, v in values.items() if k in {f.name for f in fields(schema)}})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.consolidation.method == "moe" and cfg.consolidation.gate.objective == "grpo":
        gr = cfg.consolidation.gate.grpo
        # GRPO learns only from groups whose rewards differ: a group of one never does, whatever else varies
        _check(gr.group_size >= 2, "consolidation.gate.grpo.group_size", gr.group_size,
               ">= 2 with consolidation.gate.objective=grpo (a group of one rollout has no reward variance: "
               "GRPO's advantage is 0)")
        _check(not cfg.moe.base_slot, "moe.base_slot", True,
               "false with consolidation.gate.objective=grpo (each trajectory's expert is a capability adapter; the "
               "base slot has none to roll out)")
    _check(cfg.consolidation.distill.iterations == DistillSettings.iterations, "consolidation.distill.iterations",
           cfg.consolidation.distill.iterations, "left unset: set consolidation.budget.episodes (matched budgets)")
    if cfg.grpo.engine == "agent" and cfg.agent.constrained_tool_calls:
        _check(cfg.grpo.old_logprobs == "recompute", "grpo.old_logprobs", cfg.grpo.old_logprobs,
               "recompute with grpo.engine=agent and constrained tool calls (the sampler's log-probs are masked)")
    _check_vllm(cfg.grpo)
    if cfg.launcher.kind == "deepspeed_zero3" and cfg.launcher.nproc > 1:  # as tracekit.rl.launch.check_supported
        _check(cfg.grpo.engine != "hf", "grpo.engine", "hf",
               "agent or vllm with launcher=deepspeed_zero3 and nproc > 1 (hf rollouts are not rank-synchronized)")
    target_of(cfg).validate(cfg)  # the target's own checks (tracekit/targets/<kind>.py: domains, environments, ...)
    if eval_benchmark(cfg) is not None:  # evaluation on another target (Table 8): that target's checks too
        target_of(evaluation_config(cfg)).validate(evaluation_config(cfg))
    _check(len(cfg.eval.seeds) >= 1, "eval.seeds", list(cfg.eval.seeds), "a non-empty list")
    _check(len(cfg.eval.methods) >= 1, "eval.methods", list(cfg.eval.methods),
           "a non-empty list (the rows of the results table: " + ", ".join(_method_names()) + ")")
    validate_methods(cfg)  # each method's own checks (a target without a training split, missing data, ...)
    for name, ep in cfg.llm.endpoints.items():
        if ep.kind == "openai":
            _check(bool(ep.base_url) and ep.base_url.startswith(("http://", "https://")),
                   f"llm.endpoints.{name}.base_url", ep.base_url, "an http(s) URL with kind=openai")
            _check(bool(ep.model), f"llm.endpoints.{name}.model", ep.model, "set with kind=openai")
    for role in dict.fromkeys(r for stage in _stage_names() for r in needed_endpoints(cfg, stage)):
        if role not in cfg.llm.endpoints:
            key = next(k for k in ENDPOINT_KEYS if OmegaConf.select(cfg, k) == role)
            _check(False, key, role, "a key of llm.endpoints (" + ", ".join(cfg.llm.endpoints) + ")")
