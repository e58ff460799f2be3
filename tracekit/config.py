"""Structured configs (types for every Hydra group) and value checks that run before any work.

Hydra composes ``conf/config.yaml`` over the ``Config`` schema registered here, so a typo'd key or a
wrongly typed value fails at composition; :func:`validate` then checks ranges and cross-field rules
and raises :class:`ConfigError` with one line naming the key and its valid range.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from tracekit.rl.settings import GRPOSettings, LauncherSettings

STAGES = ("rollout", "discover", "label", "select", "synthesize", "train", "compose", "evaluate")


METHODS = ("base", "single_capability", "trace")


class ConfigError(ValueError):
    """An invalid configuration value (message: one line naming the key and the valid range)."""


@dataclass
class BenchmarkConfig:
    name: str = MISSING  # tau2_airline | tau2_retail | tau2 | tau2_mini | ...
    kind: str = "tau2"  # adapter family: tau2 (the real benchmark) | synthetic (library environments' held-out seeds)
    domains: list[str] = field(default_factory=list)
    split: str = "test"  # train | test | base (tau2's split_tasks.json)
    task_ids: list[str] | None = None  # explicit subset (ids as the benchmark names them)
    limit: int | None = None  # first-n tasks per domain after split/subset
    policy: str = "full"  # full: tau2's own policy text
    max_errors: int = 10  # tau2: end the episode after this many error tool results
    agent_can_stop: bool = True  # an agent message containing ###STOP### ends the episode
    envs: list[str] = field(default_factory=list)  # kind=synthetic: library environments (limit = seeds per env)
    difficulty: int = 0  # kind=synthetic: the environments' difficulty level


@dataclass
class BackboneConfig:
    name: str = MISSING
    source: str = MISSING  # random (seeded init from arch) | gguf (bundled SmolLM2) | hub
    hf_id: str | None = None
    chat_format: str = "qwen3"  # qwen3 | smollm2
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"
    arch: dict[str, Any] = field(default_factory=dict)  # architecture numbers (meta/random builds)


@dataclass
class AgentConfig:
    kind: str = "llm"  # llm | gold
    max_new_tokens: int = 256
    top_p: float = 1.0
    constrained_tool_calls: bool = False  # xgrammar: every tool call the model starts is schema-valid
    tool_choice: str = "auto"  # auto (text or a call) | required (every turn a call; needs constrained_tool_calls)
    copy_ids: bool = False  # narrow id arguments to ids seen in the conversation (needs constrained_tool_calls)
    batch_size: int = 8


@dataclass
class UserConfig:
    kind: str = "scripted"  # scripted | llm
    endpoint: str = "user"  # key into llm.endpoints for kind=llm
    max_turns: int | None = 10  # the user ends the conversation after this many replies (None: never)
    temperature: float = 0.0  # tau2's default for the LLM user
    max_new_tokens: int = 512


@dataclass
class ThresholdsConfig:
    delta: float = 0.20  # contrastive gap ER- - ER+ (paper sec. 3.3)
    rho: float = 0.10  # failure coverage
    k: int = 8  # keep a capability selected in at least k ...
    n: int = 10  # ... of n independent labeling runs
    undefined_er_pos: str = "zero"  # no applicable success: ER+ := 0 (flagged) | unselectable


@dataclass
class AnalysisConfig:
    discovery: str = "reference"  # reference (fixed tau2 dictionary) | llm | pinned
    labeler: str = "reference"  # reference | llm
    dictionary_path: str | None = None  # for discovery=pinned
    endpoint: str = "analysis"
    temperature: float = 0.7
    capabilities_per_call: int = 10
    max_retries: int = 2
    on_missing: str = "skip"  # skip | fail
    compact_chars: int = 6000
    label_noise: float = 0.0  # reference labeler: seeded flip rate emulating annotator variance
    examples_per_capability: int = 3
    chunk_size: int = 16  # labeling requests per client call (concurrency + checkpoint unit)
    show_outcome: bool = True  # tell the labeler whether the episode succeeded (the paper contrasts outcomes)
    use_response_format: bool = True  # JSON schema to the endpoint (grammar-constrained on the hf client)
    min_capabilities: int = 5
    max_capabilities: int = 10
    max_new_tokens: int = 1024


@dataclass
class SynthesisConfig:
    source: str = "library"  # library | generate
    endpoint: str = "generation"
    repair_rounds: int = 3
    mutation_rounds: int = 5
    validation_seeds: int = 50
    calibrate: bool = False
    calibration_seeds: int = 4
    calibration_k: int = 16
    target_low: float = 0.2
    target_high: float = 0.6
    min_informative: float = 0.5
    difficulty: int = 1
    cpu_seconds: int = 30
    wall_seconds: int = 60
    memory_mb: int = 2048


@dataclass
class GrpoConfig(GRPOSettings):
    """The trainer's settings plus the rollout engine (hf in process | vllm server with LoRA sync)."""

    engine: str = "hf"
    vllm: dict[str, Any] = field(default_factory=dict)  # tracekit.rl.engines.VLLMSettings fields

    def settings(self) -> GRPOSettings:
        return GRPOSettings(**{k: getattr(self, k) for k in GRPOSettings.__dataclass_fields__})


@dataclass
class MoeConfig:
    lambda_lb: float = 0.05
    top_k: int = 1  # inference routing
    train_top_k: int | None = None  # None: dense softmax mixture while training (the paper's formula)
    base_slot: bool = False  # an extra "no adapter" expert (as in the official code)
    renormalize: bool = False  # top-k weights: raw softmax probabilities (official code) or renormalized
    impl: str = "grouped"  # top-k compute: grouped (pairs sorted by expert on device; _grouped_mm on CUDA bf16, per-expert loop elsewhere) | grouped_mm | masked_dense
    gate_init_std: float = 0.0  # 0: uniform routing at the start
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    steps: int = 200
    batch_size: int = 4
    ce_chunk: int = 1024  # vocab-projection chunk for the CE (never the full [tokens x vocab] logits)
    gradient_checkpointing: bool = False
    gate_data: str = "successes"  # GRPO rollouts the gate trains on: successes (paper) | all
    trajectories_per_capability: int = 32


@dataclass
class ConsolidationConfig:
    method: str = "moe"  # moe | merge_ties | merge_core_tsv | multi_grpo | sft_synthetic | on_policy_distill


@dataclass
class EndpointConfig:
    kind: str = "hf"  # hf (the configured backbone, in process) | openai
    base_url: str | None = None
    model: str | None = None
    api_key_env: str | None = None
    timeout_s: float = 60.0
    max_retries: int = 3
    concurrency: int = 8


@dataclass
class LlmConfig:
    endpoints: dict[str, EndpointConfig] = field(default_factory=dict)


@dataclass
class EvalConfig:
    mode: str = "greedy"  # greedy (T=0, seed 42) | stochastic (T=0.7, 3 seeds, mean +- 95% CI)
    methods: list[str] = field(default_factory=lambda: ["base"])  # rows of the results table
    temperature: float = 0.0
    seeds: list[int] = field(default_factory=lambda: [42])
    max_steps: int = 50
    context_budget: int = 32000
    batch_size: int = 8


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb | none
    project: str = "tracekit"
    mode: str = "offline"
    entity: str | None = None


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    cache_dir: str = MISSING
    run_dir: str = MISSING


@dataclass
class Config:
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    user: UserConfig = field(default_factory=UserConfig)
    thresholds: ThresholdsConfig = field(default_factory=ThresholdsConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    synthesis: SynthesisConfig = field(default_factory=SynthesisConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    consolidation: ConsolidationConfig = field(default_factory=ConsolidationConfig)
    llm: LlmConfig = field(default_factory=LlmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    launcher: LauncherSettings = field(default_factory=LauncherSettings)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    experiment: Any = None
    stages: list[str] = field(default_factory=lambda: ["evaluate"])
    seed: int = 42
    name: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="tracekit_schema", node=Config)


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {valid}")


def _choice(cfg: DictConfig, key: str, options: tuple[str, ...]) -> None:
    value = OmegaConf.select(cfg, key)
    _check(value in options, key, value, "one of " + ", ".join(options))


def validate(cfg: DictConfig) -> None:
    """Check ranges and cross-field rules; raise ConfigError (one line) on the first problem."""
    t = cfg.thresholds
    for key in ("delta", "rho"):
        _check(0.0 <= t[key] <= 1.0, f"thresholds.{key}", t[key], "in [0, 1]")
    _check(t.n >= 1, "thresholds.n", t.n, ">= 1")
    _check(1 <= t.k <= t.n, "thresholds.k", t.k, f"in [1, thresholds.n={t.n}]")
    _choice(cfg, "thresholds.undefined_er_pos", ("zero", "unselectable"))
    for stage in cfg.stages:
        _check(stage in STAGES, "stages", stage, "a list of " + ", ".join(STAGES))
    _choice(cfg, "benchmark.split", ("train", "test", "base"))
    _choice(cfg, "backbone.source", ("random", "gguf", "hub"))
    _choice(cfg, "agent.kind", ("llm", "gold"))
    _choice(cfg, "agent.tool_choice", ("auto", "required"))
    for key in ("tool_choice", "copy_ids"):
        if cfg.agent[key] not in ("auto", False):
            _check(cfg.agent.constrained_tool_calls, "agent.constrained_tool_calls", False,
                   f"true when agent.{key}={cfg.agent[key]} (both are grammar constraints)")
    _choice(cfg, "user.kind", ("scripted", "llm"))
    _choice(cfg, "analysis.discovery", ("reference", "llm", "pinned"))
    _choice(cfg, "analysis.labeler", ("reference", "llm"))
    _choice(cfg, "analysis.on_missing", ("skip", "fail"))
    if cfg.analysis.discovery == "pinned":
        path = cfg.analysis.dictionary_path
        _check(bool(path) and Path(path).expanduser().is_file(), "analysis.dictionary_path", path,
               "an existing file when analysis.discovery=pinned")
    _check(0.0 <= cfg.analysis.label_noise <= 0.5, "analysis.label_noise", cfg.analysis.label_noise, "in [0, 0.5]")
    _choice(cfg, "synthesis.source", ("library", "generate"))
    for group, schema in (("grpo", GRPOSettings), ("launcher", LauncherSettings)):
        values = OmegaConf.to_container(cfg[group], resolve=True)
        try:  # the settings dataclasses carry their own range checks
            schema(**{k: v for k, v in values.items() if k in schema.__dataclass_fields__})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _choice(cfg, "grpo.engine", ("hf", "agent", "vllm"))
    if cfg.grpo.engine == "agent" and cfg.agent.constrained_tool_calls:
        _check(cfg.grpo.old_logprobs == "recompute", "grpo.old_logprobs", cfg.grpo.old_logprobs,
               "recompute with grpo.engine=agent and constrained tool calls (the sampler's log-probs are masked)")
    m = cfg.moe
    _check(m.lambda_lb >= 0, "moe.lambda_lb", m.lambda_lb, ">= 0")
    _check(m.top_k >= 1, "moe.top_k", m.top_k, ">= 1")
    _choice(cfg, "moe.impl", ("grouped", "grouped_mm", "masked_dense"))
    _choice(cfg, "moe.gate_data", ("successes", "all"))
    _choice(cfg, "consolidation.method", ("moe", "merge_ties", "merge_core_tsv", "multi_grpo", "sft_synthetic", "on_policy_distill"))
    # named by the paper, not built yet: fail before any work rather than at the compose stage
    _check(cfg.consolidation.method == "moe", "consolidation.method", cfg.consolidation.method,
           "moe (the other consolidations of paper Table 4 are not built yet)")
    _check(cfg.benchmark.kind in ("tau2", "synthetic"), "benchmark.kind", cfg.benchmark.kind,
           "tau2 or synthetic (SWE-bench and ToolSandbox targets are not built yet)")
    if cfg.benchmark.kind == "synthetic":
        from tracekit.synthesis.library import LIBRARY_NAMES

        _check(len(cfg.benchmark.envs) > 0 and all(e in LIBRARY_NAMES for e in cfg.benchmark.envs), "benchmark.envs",
               list(cfg.benchmark.envs), "a non-empty list of " + ", ".join(LIBRARY_NAMES))
        _check(cfg.benchmark.limit is not None and cfg.benchmark.limit >= 1, "benchmark.limit", cfg.benchmark.limit,
               ">= 1 (instances per environment)")
        from tracekit.synthesis.library import library_env

        for env in cfg.benchmark.envs:
            levels = list(library_env(env).difficulty_levels)
            _check(cfg.benchmark.difficulty in levels, "benchmark.difficulty", cfg.benchmark.difficulty,
                   f"a difficulty level of {env} ({levels})")
    _choice(cfg, "eval.mode", ("greedy", "stochastic"))
    _check(cfg.eval.temperature >= 0, "eval.temperature", cfg.eval.temperature, ">= 0")
    _check(len(cfg.eval.seeds) >= 1, "eval.seeds", list(cfg.eval.seeds), "a non-empty list")
    for m in cfg.eval.methods:
        _check(m in METHODS, "eval.methods", m, "a list of " + ", ".join(METHODS))
    _check(cfg.eval.max_steps >= 1, "eval.max_steps", cfg.eval.max_steps, ">= 1")
    _check(cfg.eval.context_budget >= 256, "eval.context_budget", cfg.eval.context_budget, ">= 256 tokens")
    _choice(cfg, "logger.kind", ("wandb", "none"))
    _choice(cfg, "logger.mode", ("offline", "online", "disabled"))
    for name, ep in cfg.llm.endpoints.items():
        _choice(cfg, f"llm.endpoints.{name}.kind", ("hf", "openai"))
        if ep.kind == "openai":
            _check(bool(ep.base_url), f"llm.endpoints.{name}.base_url", ep.base_url, "set for kind=openai")
