"""The settings classes of the generic config groups (backbone, agent, user, grpo, moe, llm, eval, rollout, logger,
scale, paths), each declaring its rules (``RANGES`` / ``CHOICES``, :mod:`tracekit.ranges`);
:class:`ConfigError`; and the helpers that read a config without the registries (the pinned dictionary, the imported
labeling runs, an interpolation's message).

The groups other modules own live with them (``thresholds``: :class:`tracekit.analysis.select.Thresholds`;
``analysis``, ``synthesis``: their packages' ``settings``; ``benchmark.<kind>``: each target; ``baselines.<name>``:
each method; ``consolidation.<mount>``: each strategy), and :mod:`tracekit.schema` assembles the whole schema above
the registries. Open groups are the schema's ``dict[str, Any]`` fields (``backbone.arch``, ``grpo.vllm``);
``llm.endpoints`` takes any name, each entry an :class:`EndpointConfig`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.imported import import_runs, run_files
from tracekit.artifacts import CorruptArtifact
from tracekit.envs.pool import REPLY_TIMEOUT_S
from tracekit.episodes import INFRA_RETRIES
from tracekit.llm.backbones import SOURCES as BACKBONE_SOURCE_KINDS
from tracekit.llm.constrained import TOOL_CHOICES
from tracekit.llm.decoding import PREFIX_CACHE_MIB
from tracekit.llm.tools import CHAT_FORMATS
from tracekit.moe.gate import GateTrainConfig
from tracekit.moe.layer import MOE_IMPLS
from tracekit.moe.model import MoEConfig
from tracekit.ranges import DTYPES, Choice
from tracekit.rl.settings import GRPORecipe, GRPOSettings


class ConfigError(ValueError):
    """An invalid configuration value (message: one line naming the key and the valid range)."""


# failures the user fixes from the message alone: `python -m tracekit` prints it as one line (no traceback)
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CorruptArtifact)


CONF = Path(__file__).resolve().parent.parent / "conf"
# which GRPO trajectories a consumer trains on (the MoE gate, SFT on synthetic successes): the successful ones (the
# paper) or all
TRAJECTORY_SETS = ("successes", "all")


def conf_names(group: str) -> tuple[str, ...]:
    """The names of a ``conf/<group>/`` folder's options."""
    return tuple(sorted(p.stem for p in (CONF / group).glob("*.yaml")))


def benchmark_names() -> tuple[str, ...]:  # eval.benchmark: a conf/benchmark name (evaluation elsewhere, Table 8)
    return conf_names("benchmark")


def backbone_names() -> tuple[str, ...]:
    return conf_names("backbone")


def scale_names() -> tuple[str, ...]:
    return ("none", *conf_names("scale"))


@dataclass
class BackboneConfig:
    name: str = MISSING
    source: str = MISSING  # random (seeded init from arch) | gguf (bundled SmolLM2) | hub
    hf_id: str | None = None
    chat_format: str = "qwen3"  # qwen3 | smollm2
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"
    arch: dict[str, Any] = field(default_factory=dict)  # architecture numbers (meta/random builds)
    planted: Any = None  # a planted warm start (a dict or None) (tracekit/warmstart/planted.py; experiment=planted)

    CHOICES: ClassVar[dict[str, Choice]] = {
        "source": BACKBONE_SOURCE_KINDS, "chat_format": CHAT_FORMATS, "dtype": (*DTYPES, "float16"),
        "device": r"auto|cpu|mps|cuda(:\d+)?"}


@dataclass
class AgentConfig:
    kind: str = "llm"  # llm | gold
    max_new_tokens: int = 256
    top_p: float = 1.0
    constrained_tool_calls: bool = False  # xgrammar: every tool call the model starts is schema-valid
    tool_choice: str = "auto"  # auto (text or a call) | required (every turn a call; needs constrained_tool_calls)
    copy_ids: bool = False  # narrow id arguments to ids seen in the conversation (needs constrained_tool_calls)
    batch_size: int = 8
    # in-process models: K/V of prompt prefixes (a turn's conversation so far, a shared system prompt) kept to skip
    # their prefill in later prompts; 0: off
    prefix_cache_mib: float = 1024

    RANGES: ClassVar[dict[str, str]] = {"max_new_tokens": ">= 1", "top_p": "(0, 1]", "batch_size": ">= 1",
                                        "prefix_cache_mib": PREFIX_CACHE_MIB}
    CHOICES: ClassVar[dict[str, Choice]] = {"kind": ("llm", "gold"), "tool_choice": TOOL_CHOICES}


@dataclass
class UserConfig:
    kind: str = "scripted"  # scripted | llm
    endpoint: str = "user"  # key into llm.endpoints for kind=llm
    max_turns: int | None = 10  # the user ends the conversation after this many replies (None: never)
    temperature: float = 0.0  # tau2's default for the LLM user
    max_new_tokens: int = 512

    RANGES: ClassVar[dict[str, str]] = {"max_turns": ">= 1", "temperature": "[0, 2]", "max_new_tokens": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"kind": ("scripted", "llm")}


@dataclass
class GrpoConfig(GRPORecipe):
    """The recipe plus the rollout engine (hf in process | vllm server with LoRA sync). What a run keeps of its
    rollouts is no knob: every tracekit run keeps them ``full`` (:func:`tracekit.runs.grpo_run`)."""

    # hf (in process) | agent (in process, the agent's client: its tool-call grammar) | vllm (a managed `vllm serve`,
    # adapter-only sync)
    engine: str = "hf"
    # engine=vllm: +grpo.vllm.<field>=... (tracekit.rl.vllm_client.VLLMSettings fields; model_path required);
    # validate() checks the keys, the values and the engine's rules, and refuses them under another engine
    vllm: dict[str, Any] = field(default_factory=dict)

    def settings(self, save_rollouts: str) -> GRPOSettings:
        recipe = {f.name: getattr(self, f.name) for f in fields(GRPORecipe)}  # RANGES is no field
        return GRPOSettings(**recipe, save_rollouts=save_rollouts)

    CHOICES: ClassVar[dict[str, Choice]] = {**GRPORecipe.CHOICES, "engine": ("hf", "agent", "vllm")}


@dataclass
class MoeConfig(GateTrainConfig):
    """The gate's training knobs (:class:`tracekit.moe.gate.GateTrainConfig`) plus the routing and the gate's data."""

    # the routing knobs' defaults are the composed model's (tracekit.moe.model.MoEConfig), the one place they live
    top_k: int = MoEConfig.top_k  # inference routing
    train_top_k: int | None = MoEConfig.train_top_k  # None: dense softmax mixture while training (the paper's formula)
    base_slot: bool = MoEConfig.include_base_slot  # an extra "no adapter" expert (as in the official code)
    # top-k weights: raw softmax probabilities (official code) or renormalized
    renormalize: bool = MoEConfig.renormalize
    # top-k compute: grouped (pairs sorted by expert on device; _grouped_mm on CUDA bf16, per-expert loop elsewhere) |
    # grouped_mm | masked_dense
    impl: str = MoEConfig.impl
    gate_init_std: float = MoEConfig.gate_init_std  # 0: uniform routing at the start
    gate_data: str = "successes"  # GRPO rollouts the gate trains on: successes (paper) | all
    trajectories_per_capability: int = 32

    RANGES: ClassVar[dict[str, str]] = {**GateTrainConfig.RANGES, "top_k": ">= 1", "train_top_k": ">= 1",
                                        "gate_init_std": ">= 0", "trajectories_per_capability": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"impl": MOE_IMPLS,
                                            "gate_data": TRAJECTORY_SETS}


@dataclass
class EndpointConfig:
    kind: str = "hf"  # hf (the configured backbone, in process) | openai
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 3
    concurrency: int = 8

    RANGES: ClassVar[dict[str, str]] = {"timeout_s": "> 0", "max_retries": ">= 0", "concurrency": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"kind": ("hf", "openai")}


@dataclass
class LlmConfig:
    endpoints: dict[str, EndpointConfig] = field(default_factory=dict)


@dataclass
class EvalConfig:
    mode: str = "greedy"  # greedy (T=0, seed 42) | stochastic (T=0.7, 3 seeds, mean +- 95% CI)
    methods: list[str] = field(default_factory=lambda: ["base"])  # rows of the results table
    temperature: float = 0.0
    seeds: list[int] = field(default_factory=lambda: [42])  # one sampled run per entry (stochastic); greedy: the seed
    max_steps: int = 50
    context_budget: int = 32000
    benchmark: str | None = None  # a conf/benchmark name: evaluate every policy there (paper Table 8); None: the target

    RANGES: ClassVar[dict[str, str]] = {"temperature": ">= 0", "seeds": ">= 0", "max_steps": ">= 1",
                                        "context_budget": ">= 256"}
    # eval.methods names the methods registry's entries: the schema assembled above it declares that choice
    CHOICES: ClassVar[dict[str, Choice]] = {"mode": ("greedy", "stochastic"), "benchmark": benchmark_names}


@dataclass
class RolloutConfig:
    """How rollouts execute (in no cache key: results are identical whatever they are)."""

    env_workers: Any = "auto"  # auto | 0 (in-process) | N: processes stepping expensive environments (tracekit.envs.pool)
    env_reply_timeout_s: float | None = REPLY_TIMEOUT_S  # a worker silent this long on one turn is killed; None: wait
    # runs of an episode again after an infrastructure failure (a worker died or hung, the environment server or the
    # coding sandbox failed; tracekit.episodes), then the stage fails naming the task. Execution only: a retry
    # replays the same seeded episode from scratch and a failed one never enters an artifact, so what an artifact
    # holds does not depend on it
    infra_retries: int = INFRA_RETRIES

    RANGES: ClassVar[dict[str, str]] = {"env_reply_timeout_s": "> 0", "infra_retries": ">= 0"}


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb (offline by default: no key, no network; `wandb sync` uploads later) | none
    project: str = "tracekit"
    mode: str = "offline"
    entity: str | None = None

    CHOICES: ClassVar[dict[str, Choice]] = {"kind": ("wandb", "none"), "mode": ("offline", "online", "disabled")}


@dataclass
class ScaleConfig:
    """The scale profile (``conf/scale/``): which backbones and budgets a run uses. ``paper``: the paper's (a GPU
    cluster); ``embedded``: the bundled model on 2 CPU cores with budgets cut; ``none``: no profile applied (the
    groups' and the experiment's own values). The run's first log line and summary name every value that
    differs from the paper's (:mod:`tracekit.report.paper`), whatever the profile."""

    name: str = "none"
    backbone: str | None = None  # a table's blocks all run on this backbone (None: each block's own)
    targets: dict[str, str] = field(default_factory=dict)  # a table's target -> the benchmark it runs on here

    CHOICES: ClassVar[dict[str, Choice]] = {"name": scale_names, "backbone": backbone_names}


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    cache_dir: str = MISSING
    run_dir: str = MISSING


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {valid}")


def owner_settings(cfg: DictConfig, group: str, schema: type) -> Any:
    """The owner's settings class ``schema`` built from the config group ``group`` (its fields only), so that the
    owner's own cross-field rules run: a ValueError of theirs is a one-line ConfigError."""
    values = OmegaConf.to_container(OmegaConf.select(cfg, group), resolve=True)
    try:
        return schema(**{k: v for k, v in values.items() if k in {f.name for f in fields(schema)}})
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def read_pinned_dictionary(cfg: DictConfig) -> list[Any]:
    """The capabilities of the ``analysis.dictionary_path`` file, read as discovery reads it; ConfigError
    naming the file and what is wrong with it."""
    value = cfg.analysis.dictionary_path
    _check(bool(value) and Path(value).expanduser().is_file(), "analysis.dictionary_path", value,
           "an existing file when analysis.discovery=pinned")
    path = Path(value).expanduser()
    try:
        return load_dictionary(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"analysis.dictionary_path: {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except ValueError as e:  # its message starts with the path
        raise ConfigError(f"analysis.dictionary_path: {e}") from None


def imported_run_files(cfg: DictConfig) -> list[Path]:
    """The run files of ``analysis.labels_from`` (labeler=imported); ConfigError when it names no folder of them."""
    value = cfg.analysis.labels_from
    _check(bool(value), "analysis.labels_from", value,
           "a folder of the official labeling runs (run_NN.json) when analysis.labeler=imported")
    try:
        return run_files(value)
    except ValueError as e:
        raise ConfigError(f"analysis.labels_from: {e}") from None


def read_imported_labels(cfg: DictConfig) -> list[Any]:
    """The labels of the ``analysis.labels_from`` runs over the pinned dictionary's candidates, read as the label
    stage reads them; ConfigError naming the file and its first offending entry."""
    imported_run_files(cfg)
    candidates = [c.name for c in read_pinned_dictionary(cfg)]
    try:
        return import_runs(cfg.analysis.labels_from, candidates)[0]
    except ValueError as e:  # its message starts with the file
        raise ConfigError(f"analysis.labels_from: {e}") from None


def eval_benchmark(cfg: DictConfig) -> str | None:
    """``eval.benchmark``; None when unset. Unset, it is not among the evaluate stage's reads (its keys stay as they
    were), so in that stage's read view it is MISSING: that reads as unset too."""
    return OmegaConf.select(cfg, "eval.benchmark", throw_on_missing=False)


def interpolation_message(e: InterpolationResolutionError, cfg: DictConfig | None = None) -> str:
    """One line for a value whose ``${...}`` cannot be resolved (``~seed`` removes what ``grpo.seed: ${seed}``
    names): the key, its interpolation, why, and what to set."""
    key = getattr(e, "full_key", None) or ""
    raw = None
    try:
        node = cfg
        for part in key.split("."):
            node = node._get_node(part)
        raw = node._value()
    except Exception:  # a list index, or no config: the message goes without the raw value
        pass
    why = " ".join(str(e).split("\n")[0].split())
    named = re.fullmatch(r"Interpolation key '(.+)' not found", why)
    shown = f"{key}={raw}" if isinstance(raw, str) else (key or "a value")
    if named:
        return (f"{shown}: {named.group(1)} is not in the config (an override like ~{named.group(1)} removes it); "
                f"give {named.group(1)} a value, or set {key} itself")
    return f"{shown} cannot be resolved: {why}; set {key or 'it'} to a value"
