"""Value checks that run before any work: every key against the schema (:mod:`tracekit.schema`), every value
against the range or choices its owner declares (``RANGES`` / ``CHOICES``, collected by walking the schema:
:func:`tracekit.ranges.declared`), the owners' cross-field rules, each target's and each method's own checks, and
the endpoints the stages will call (``needed_endpoints``, ``probe_endpoints``).

A ``+key=value`` override adds keys even in struct mode (Hydra applies it with ``force_add``), so :func:`validate`
walks the composed config against the schema again and raises :class:`~tracekit.config.ConfigError` with one line
naming the key and what is valid. This module holds no table of rules and names no target.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import fields, is_dataclass
from typing import Any, get_args, get_origin

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tracekit.analysis.select import Thresholds
from tracekit.analysis.settings import AnalysisSettings
from tracekit.config import ConfigError, _check, eval_benchmark, imported_run_files, interpolation_message, owner_settings, read_imported_labels, read_pinned_dictionary
from tracekit.envs.pool import valid_setting as valid_env_workers
from tracekit.llm.backbones import BACKBONES
from tracekit.llm.base import EndpointError
from tracekit.llm.openai import OpenAIChatClient
from tracekit.llm.world_tokenizer import MIN_VOCAB as MIN_WORLD_VOCAB
from tracekit.methods import METHODS, validate_methods
from tracekit.methods.consolidate import STRATEGIES
from tracekit.warmstart.shipped import verify_shipped
from tracekit.warmstart.planted import PlantedSpec, longest_gold_episode, world_tokenizer
from tracekit.report.preset import check_built_on
from tracekit.ranges import check_choice, check_value, declared, field_hints
from tracekit.rl.settings import GRPORecipe, LauncherSettings
from tracekit.rl.vllm_client import check_recipe, vllm_settings
from tracekit.schema import config_schema, stage_names
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.stages import build_pipeline
from tracekit.targets.registry import evaluation_config, target_of
from tracekit.targets.registry import kinds as target_kinds

# every rule the groups' owners declare, by the dotted key of its field (ranges: "[a, b]", "(a, b]", "> a", ">= a";
# choices: a tuple, a function giving one, or a regular expression; null passes where a field is optional, a list
# is checked element by element): validate() walks these, and holds no table of its own
RANGES, CHOICES = declared(config_schema())


def _check_leaf(key: str, pattern: str, value: Any) -> None:
    """The owner's rule on one value (a list: on each element, the message naming the one that breaks it)."""
    for item in value if isinstance(value, ListConfig) else [value]:
        try:
            if pattern in RANGES:
                check_value(key, item, RANGES[pattern])
            else:
                check_choice(key, item, CHOICES[pattern])
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _leaves(node: DictConfig, schema: type, key: str = "",
            pattern: str = "") -> Iterator[tuple[str, str, DictConfig, str]]:
    """(key, its pattern in RANGES / CHOICES, parent node, name) of every leaf of ``node``; a key the schema lacks
    (Hydra's ``+key=value`` adds keys even in struct mode) raises ConfigError. ``dict[str, Any]`` fields are
    open; a ``dict[str, <dataclass>]`` field takes any name, each entry checked against the dataclass."""
    fields = field_hints(schema)
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
    # the backbone's vocabulary is the world tokenizer's ceiling (backbone_dict merges backbone.arch over the spec's)
    vocab = OmegaConf.select(cfg, "backbone.arch.vocab_size", default=None) or spec.arch["vocab_size"]
    _check(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= MIN_WORLD_VOCAB,
           "backbone.arch.vocab_size", vocab, f"an integer >= {MIN_WORLD_VOCAB} (backbone={cfg.backbone.name} trains "
           f"its {planted.family} world tokenizer: the 256 bytes and {MIN_WORLD_VOCAB - 256} special tokens, then "
           "merges)")
    # the world's episodes must fit the context the agent is given (eval.context_budget; GRPO's max_prompt_tokens)
    tokenizer = world_tokenizer(planted.family, spec.chat_format, vocab)
    suite = target_of(cfg).build_suite(cfg, None, lambda *_: None)
    try:
        tokens, task = longest_gold_episode(suite, tokenizer)
    finally:
        suite.close()
    for key in ("eval.context_budget", "grpo.max_prompt_tokens"):
        budget = OmegaConf.select(cfg, key)
        _check(tokens <= budget, key, budget, f">= {tokens}: the gold episode of {task} (difficulty "
               f"{target_of(cfg).own(cfg.benchmark).difficulty}) is {tokens} tokens of the {planted.family} tokenizer")


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
    for key, pattern, node, name in _leaves(cfg, config_schema()):
        if not key.startswith("paths.") and not OmegaConf.is_missing(node, name):
            node[name]  # resolved: a broken ${...} is named here (paths resolve only in Hydra's app)
        if pattern in RANGES or pattern in CHOICES:
            _check_leaf(key, pattern, node[name])
    if "rollout" in cfg:
        _check(valid_env_workers(cfg.rollout.env_workers), "rollout.env_workers", cfg.rollout.env_workers,
               "auto, 0 (in-process) or a positive integer (worker processes)")
    _check_backbone_name(cfg.backbone)
    t = cfg.thresholds
    planted = None
    if cfg.backbone.get("planted") is not None:  # a planted set naming a capability the library lacks: one line
        try:
            planted = PlantedSpec.from_config(cfg.backbone.planted)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    if cfg.get("warm_start") is not None:  # a shipped warm start: its key and every file's sha256, one line
        verify_shipped(cfg.warm_start, cfg.backbone)
    check_built_on(cfg)
    for key in ("tool_choice", "copy_ids"):
        if cfg.agent[key] not in ("auto", False):
            _check(cfg.agent.constrained_tool_calls, "agent.constrained_tool_calls", False,
                   f"true when agent.{key}={cfg.agent[key]} (both are grammar constraints)")
    _check(cfg.user.kind != "scripted" or cfg.user.max_turns is not None, "user.max_turns", None,
           ">= 1 with user.kind=scripted (the scripted user needs a last turn)")
    a = cfg.analysis
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
    for group, schema in (("thresholds", Thresholds), ("analysis", AnalysisSettings), ("synthesis", SynthesisConfig),
                          ("grpo", GRPORecipe), ("launcher", LauncherSettings)):
        owner_settings(cfg, group, schema)  # the owners' own cross-field checks (thresholds.k <= n; tis_cap needs ...)
    STRATEGIES[cfg.consolidation.method].validate(cfg)  # the strategy's own refusals, its settings' rules included
    if cfg.grpo.engine == "agent" and cfg.agent.constrained_tool_calls:
        _check(cfg.grpo.old_logprobs == "recompute", "grpo.old_logprobs", cfg.grpo.old_logprobs,
               "recompute with grpo.engine=agent and constrained tool calls (the sampler's log-probs are masked)")
    _check_vllm(cfg.grpo)
    if cfg.launcher.kind == "deepspeed_zero3" and cfg.launcher.nproc > 1:  # as tracekit.rl.launch.check_supported
        _check(cfg.grpo.engine != "hf", "grpo.engine", "hf",
               "agent or vllm with launcher=deepspeed_zero3 and nproc > 1 (hf rollouts are not rank-synchronized)")
    target_of(cfg).validate(cfg)  # the target's own checks (tracekit/targets/<kind>.py: domains, environments, ...)
    if planted is not None:  # after the cheap checks: it tokenizes the world's gold episodes (a world tokenizer)
        _check_world_backbone(cfg, planted)
    if eval_benchmark(cfg) is not None:  # evaluation on another target (Table 8): that target's checks too
        target_of(evaluation_config(cfg)).validate(evaluation_config(cfg))
    _check(len(cfg.eval.seeds) >= 1, "eval.seeds", list(cfg.eval.seeds), "a non-empty list")
    _check(len(cfg.eval.methods) >= 1, "eval.methods", list(cfg.eval.methods),
           "a non-empty list (the rows of the results table: " + ", ".join(METHODS) + ")")
    validate_methods(cfg)  # each method's own checks (a target without a training split, missing data, ...)
    for name, ep in cfg.llm.endpoints.items():
        if ep.kind == "openai":
            _check(bool(ep.base_url) and ep.base_url.startswith(("http://", "https://")),
                   f"llm.endpoints.{name}.base_url", ep.base_url, "an http(s) URL with kind=openai")
            _check(bool(ep.model), f"llm.endpoints.{name}.model", ep.model, "set with kind=openai")
    for role in dict.fromkeys(r for stage in stage_names() for r in needed_endpoints(cfg, stage)):
        if role not in cfg.llm.endpoints:
            key = next(k for k in ENDPOINT_KEYS if OmegaConf.select(cfg, k) == role)
            _check(False, key, role, "a key of llm.endpoints (" + ", ".join(cfg.llm.endpoints) + ")")
