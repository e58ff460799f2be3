"""Structured configs (types for every Hydra group) and value checks that run before any work.

Hydra composes ``conf/config.yaml`` over the ``Config`` schema registered here, so a typo'd key or a
wrongly typed value fails at composition. A ``+key=value`` override adds keys even in struct mode
(Hydra applies it with ``force_add``), so :func:`validate` walks the composed config against the
schema again, checks every value against its range (``RANGES``) or choices (``CHOICES``) and the
cross-field rules, and raises :class:`ConfigError` with one line naming the key and what is valid.
Open groups are the schema's ``dict[str, Any]`` fields (``backbone.arch``, ``grpo.vllm``);
``llm.endpoints`` takes any name, each entry an :class:`EndpointConfig`.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from tracekit.analysis.select import Thresholds
from tracekit.artifacts import CorruptArtifact
from tracekit.coding.config import CHOICES as CODING_CHOICES
from tracekit.coding.config import RANGES as CODING_RANGES
from tracekit.coding.config import CodingBenchmarkConfig
from tracekit.rl.distill import DistillSettings
from tracekit.rl.settings import KINDS, GRPOSettings, LauncherSettings
from tracekit.rl.sft import SFTSettings




class ConfigError(ValueError):
    """An invalid configuration value (message: one line naming the key and the valid range)."""


# failures the user fixes from the message alone: `python -m tracekit` prints it as one line (no traceback)
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CorruptArtifact)


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
    train_domains: list[str] = field(default_factory=list)  # kind=toolsandbox: the variants learned in ([]: evaluated)
    train_split: str | None = None  # kind=toolsandbox: heldout | eval (tracekit/targets/toolsandbox.py); None: heldout
    train_seed: int | None = None  # kind=toolsandbox: the heldout split's seed (None: 0)
    coding: CodingBenchmarkConfig = field(default_factory=CodingBenchmarkConfig)  # kind=coding|swebench (tracekit/coding/config.py)


@dataclass
class BackboneConfig:
    name: str = MISSING
    source: str = MISSING  # random (seeded init from arch) | gguf (bundled SmolLM2) | hub
    hf_id: str | None = None
    chat_format: str = "qwen3"  # qwen3 | smollm2
    dtype: str = "auto"  # auto: bf16 on GPU, fp32 on CPU
    device: str = "auto"
    arch: dict[str, Any] = field(default_factory=dict)  # architecture numbers (meta/random builds)
    planted: Any = None  # a planted warm start (a dict or None) (tracekit/planted/warmstart.py; experiment=planted)


@dataclass
class AgentConfig:
    kind: str = "llm"  # llm | gold
    max_new_tokens: int = 256
    top_p: float = 1.0
    constrained_tool_calls: bool = False  # xgrammar: every tool call the model starts is schema-valid
    tool_choice: str = "auto"  # auto (text or a call) | required (every turn a call; needs constrained_tool_calls)
    copy_ids: bool = False  # narrow id arguments to ids seen in the conversation (needs constrained_tool_calls)
    batch_size: int = 8
    prefix_cache_mib: float = 1024  # in-process models: K/V of prompt prefixes kept for reuse (0: off)


@dataclass
class UserConfig:
    kind: str = "scripted"  # scripted | llm
    endpoint: str = "user"  # key into llm.endpoints for kind=llm
    max_turns: int | None = 10  # the user ends the conversation after this many replies (None: never)
    temperature: float = 0.0  # tau2's default for the LLM user
    max_new_tokens: int = 512


@dataclass
class ThresholdsConfig(Thresholds):
    """The selection's own dataclass (one schema: its checks run in validate()); the Literal typed as str for
    OmegaConf."""

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
class ConsolidationBudgetConfig:
    episodes: int | None = None  # training episodes of strategies that train; None: the capability runs' summed


@dataclass
class MergeConfig:
    """merge_cat | merge_linear | merge_ties | merge_dare_ties (on the full dW, SVD re-factored)."""

    weights: list[float] | None = None  # per capability, sorted by name; None: 1/T (linear) or 1 (TIES)
    density: float = 0.2  # TIES: fraction of entries kept; DARE: keep probability
    majority_sign: str = "total"  # total | frequency
    rank: int | None = None  # SVD rank of the merged adapter; None: the sum of the ranks
    lam: float = 1.0  # global scale of the merged update


@dataclass
class CoreTSVConfig:
    """merge_core_tsv: Core Space + TIES sign resolution + TSV-M in the core."""

    lam: float = 0.2
    density: float = 1.0
    majority_sign: str = "total"
    isotropize: bool = False
    rank_policy: str = "full"  # full (all T*r core directions) | truncate (top r, before isotropizing)


@dataclass
class SftConfig(SFTSettings):
    """sft_synthetic: the SFT recipe's settings, plus which GRPO trajectories it trains on."""

    data: str = "successes"  # successes (the paper) | all


@dataclass
class ConsolidationConfig:
    method: str = "moe"  # a name of tracekit.methods.consolidate.STRATEGIES (conf/consolidation/<name>.yaml)
    budget: ConsolidationBudgetConfig = field(default_factory=ConsolidationBudgetConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    core_tsv: CoreTSVConfig = field(default_factory=CoreTSVConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    distill: DistillSettings = field(default_factory=DistillSettings)  # iterations: from the budget


@dataclass
class GrpoTargetConfig:
    """grpo_target: the ``grpo`` recipe on the target's own training tasks with the target's reward."""

    episodes: int | None = None  # training episodes; None: TRACE's per-capability GRPO episodes summed (matched)
    train_limit: int | None = None  # tau2: first n train-split tasks per domain (None: all); synthetic: instances per env (None: one per group)
    checkpoint_iterations: int | None = None  # a kept checkpoint every n iterations (Figure 4b); None: grpo.iterations


@dataclass
class GepaConfig:
    """gepa: the ``gepa`` package's optimize loop over the capabilities block of the system prompt."""

    endpoint: str = "analysis"  # the reflection LM: a key of llm.endpoints
    max_metric_calls: int | None = None  # target training episodes GEPA may roll out; None: TRACE's episodes (matched)
    reflection_minibatch_size: int = 3  # gepa's default
    valset_size: int | None = None  # training tasks held out for GEPA's Pareto tracking; None: auto (see methods/gepa.py)
    train_limit: int | None = None  # target training tasks GEPA draws from (official: 200 seeds); None: all
    candidate_selection: str = "pareto"  # pareto | current_best | epsilon_greedy | top_k_pareto (gepa's strategies)
    module_selector: str = "round_robin"  # round_robin (one capability description per proposal) | all
    use_merge: bool = False
    reflection_temperature: float = 0.7  # official TRACE GEPA run
    reflection_max_new_tokens: int = 1024


@dataclass
class UntargetedConfig:
    """untargeted_synthetic: GRPO on every library environment of the target's family, uniformly (AWM-style control)."""

    episodes: int | None = None  # None: TRACE's per-capability GRPO episodes summed (matched)
    envs_dir: str | None = None  # a folder of environment packages (<dir>/<name>/env.json) to use instead


@dataclass
class AdpSftConfig(SFTSettings):
    """adp_sft: the SFT recipe on Agent Data Protocol trajectories (official: QLoRA r 16, lr 1e-5, 1 epoch)."""

    data: list[str] = field(default_factory=list)  # ADP standardized JSON/JSONL paths or hf://<owner>/<dataset>/<subset>
    max_records: int | None = None  # first n well-formed trajectories over all sources (None: all)
    max_tokens: int = 8192  # a training row longer than this is cut to its first max_tokens tokens


@dataclass
class BaselinesConfig:
    """Settings of the external baselines of paper Tables 1-3 and Figure 4 (conf/baselines/paper.yaml)."""

    grpo_target: GrpoTargetConfig = field(default_factory=GrpoTargetConfig)
    gepa: GepaConfig = field(default_factory=GepaConfig)
    untargeted_synthetic: UntargetedConfig = field(default_factory=UntargetedConfig)
    adp_sft: AdpSftConfig = field(default_factory=AdpSftConfig)
    swe_rl: GrpoTargetConfig = field(default_factory=GrpoTargetConfig)  # SWE-RL: grpo_target's settings, its own reward


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
    benchmark: str | None = None  # a conf/benchmark name: evaluate every policy there (paper Table 8); None: the target


@dataclass
class RolloutConfig:
    """How rollouts execute (in no cache key: results are identical whatever they are)."""

    env_workers: Any = "auto"  # auto | 0 (in-process) | N: processes stepping expensive environments (tracekit.envs.pool)


@dataclass
class LoggerConfig:
    kind: str = "wandb"  # wandb | none
    project: str = "tracekit"
    mode: str = "offline"
    entity: str | None = None


@dataclass
class ScaleConfig:
    """The scale profile (``conf/scale/``): which backbones and budgets a run uses. ``paper``: the paper's (a GPU
    cluster); ``embedded``: the bundled model on 2 CPU cores with budgets cut; ``none``: no profile applied (the
    groups' and the experiment's own values). The run's first log line and summary name every value that
    differs from the paper's (:mod:`tracekit.reproduce.paper`), whatever the profile."""

    name: str = "none"
    backbone: str | None = None  # a table's blocks all run on this backbone (None: each block's own)
    targets: dict[str, str] = field(default_factory=dict)  # a table's target -> the benchmark it runs on here


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
    baselines: BaselinesConfig = field(default_factory=BaselinesConfig)
    llm: LlmConfig = field(default_factory=LlmConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    launcher: LauncherSettings = field(default_factory=LauncherSettings)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    experiment: Any = None
    scale: ScaleConfig = field(default_factory=ScaleConfig)
    stages: list[str] = field(default_factory=lambda: ["evaluate"])
    seed: int = 42
    name: str = "default"


def register_configs() -> None:
    ConfigStore.instance().store(name="tracekit_schema", node=Config)


# every numeric field's valid range ("[a, b]", "(a, b]", "> a", ">= a"; null passes where the field is
# optional; a list field: each element)
RANGES: dict[str, str] = {
    "benchmark.limit": ">= 1", "benchmark.max_errors": ">= 1", "benchmark.difficulty": ">= 0",
    "benchmark.train_seed": ">= 0",  # kind=toolsandbox: the heldout training split's seed
    "agent.max_new_tokens": ">= 1", "agent.top_p": "(0, 1]", "agent.batch_size": ">= 1", "agent.prefix_cache_mib": ">= 0",
    "user.max_turns": ">= 1", "user.temperature": "[0, 2]", "user.max_new_tokens": ">= 1",
    "thresholds.delta": "[0, 1]", "thresholds.rho": "[0, 1]", "thresholds.k": ">= 1", "thresholds.n": ">= 1",
    "analysis.temperature": "[0, 2]", "analysis.capabilities_per_call": ">= 0", "analysis.max_retries": ">= 0",
    "analysis.compact_chars": ">= 200", "analysis.label_noise": "[0, 0.5]", "analysis.examples_per_capability": ">= 0",
    "analysis.chunk_size": ">= 1", "analysis.min_capabilities": ">= 1", "analysis.max_capabilities": ">= 1",
    "analysis.max_new_tokens": ">= 1",
    "synthesis.repair_rounds": ">= 0", "synthesis.mutation_rounds": ">= 0", "synthesis.validation_seeds": ">= 1",
    "synthesis.calibration_seeds": ">= 1", "synthesis.calibration_k": ">= 2", "synthesis.target_low": "[0, 1]",
    "synthesis.target_high": "[0, 1]", "synthesis.min_informative": "[0, 1]", "synthesis.difficulty": ">= 0",
    "synthesis.cpu_seconds": ">= 1", "synthesis.wall_seconds": ">= 1", "synthesis.memory_mb": ">= 256",
    "grpo.iterations": ">= 1", "grpo.groups": ">= 1", "grpo.group_size": ">= 2", "grpo.temperature": "> 0",
    "grpo.top_p": "(0, 1]", "grpo.max_new_tokens": ">= 1", "grpo.max_steps": ">= 1", "grpo.max_prompt_tokens": ">= 256",
    "grpo.clip_eps": "(0, 1)", "grpo.clip_eps_high": "> 0", "grpo.adv_eps": "> 0", "grpo.kl_beta": ">= 0",
    "grpo.tis_cap": ">= 1", "grpo.max_resample_rounds": ">= 0", "grpo.lr": "> 0", "grpo.betas": "[0, 1)",
    "grpo.weight_decay": ">= 0", "grpo.grad_clip": ">= 0", "grpo.epochs": ">= 1", "grpo.num_minibatches": ">= 1",
    "grpo.microbatch_tokens": ">= 1", "grpo.logprob_chunk": ">= 1", "grpo.rollout_batch_size": ">= 1",
    "grpo.seed": ">= 0", "grpo.checkpoint_every": ">= 1", "grpo.keep_checkpoints": ">= 1",
    "grpo.early_stop_patience": ">= 0", "grpo.early_stop_min_delta": ">= 0",
    "grpo.lora.rank": ">= 1", "grpo.lora.alpha": "> 0", "grpo.lora.dropout": "[0, 1)",
    "moe.lambda_lb": ">= 0", "moe.top_k": ">= 1", "moe.train_top_k": ">= 1", "moe.gate_init_std": ">= 0",
    "moe.lr": "> 0", "moe.weight_decay": ">= 0", "moe.max_grad_norm": ">= 0", "moe.steps": ">= 1",
    "moe.batch_size": ">= 1", "moe.ce_chunk": ">= 1", "moe.trajectories_per_capability": ">= 1",
    "llm.endpoints.*.timeout_s": "> 0", "llm.endpoints.*.max_retries": ">= 0", "llm.endpoints.*.concurrency": ">= 1",
    "eval.temperature": ">= 0", "eval.seeds": ">= 0", "eval.max_steps": ">= 1", "eval.context_budget": ">= 256",
    "launcher.nproc": ">= 1", "launcher.master_port": "[1, 65535]", "launcher.concurrent_runs": ">= 1",
    "consolidation.budget.episodes": ">= 1", "consolidation.merge.weights": "[-10, 10]",
    "consolidation.merge.density": "(0, 1]", "consolidation.merge.rank": ">= 1", "consolidation.merge.lam": "> 0",
    "consolidation.core_tsv.lam": "> 0", "consolidation.core_tsv.density": "(0, 1]",
    **{f"consolidation.{g}.{k}": v for g in ("sft", "distill") for k, v in {
        "lr": "> 0", "max_grad_norm": ">= 0", "betas": "[0, 1)", "weight_decay": ">= 0", "microbatch_tokens": ">= 1",
        "logprob_chunk": ">= 1", "seed": ">= 0", "checkpoint_every": ">= 1", "keep_checkpoints": ">= 1",
        "lora.rank": ">= 1", "lora.alpha": "> 0", "lora.dropout": "[0, 1)"}.items()},
    "consolidation.sft.epochs": ">= 1", "consolidation.sft.batch_size": ">= 1", "consolidation.sft.warmup_ratio": "[0, 1)",
    "consolidation.distill.iterations": ">= 1", "consolidation.distill.groups": ">= 1",
    "consolidation.distill.samples_per_task": ">= 1", "consolidation.distill.temperature": "> 0",
    "consolidation.distill.top_p": "(0, 1]", "consolidation.distill.kl_coef": "> 0",
    "consolidation.distill.max_new_tokens": ">= 1", "consolidation.distill.max_steps": ">= 1",
    "consolidation.distill.max_prompt_tokens": ">= 256", "consolidation.distill.num_minibatches": ">= 1",
    "consolidation.distill.rollout_batch_size": ">= 1",
    "baselines.grpo_target.episodes": ">= 1", "baselines.grpo_target.train_limit": ">= 1",
    "baselines.grpo_target.checkpoint_iterations": ">= 1",
    "baselines.swe_rl.episodes": ">= 1", "baselines.swe_rl.train_limit": ">= 1",
    "baselines.swe_rl.checkpoint_iterations": ">= 1",
    **CODING_RANGES,  # benchmark.coding.* (tracekit/coding/config.py)
    "baselines.gepa.max_metric_calls": ">= 1", "baselines.gepa.reflection_minibatch_size": ">= 1",
    "baselines.gepa.valset_size": ">= 1", "baselines.gepa.train_limit": ">= 2",
    "baselines.gepa.reflection_temperature": "[0, 2]", "baselines.gepa.reflection_max_new_tokens": ">= 1",
    "baselines.untargeted_synthetic.episodes": ">= 1",
    **{f"baselines.adp_sft.{k}": v for k, v in {
        "lr": "> 0", "max_grad_norm": ">= 0", "betas": "[0, 1)", "weight_decay": ">= 0", "microbatch_tokens": ">= 1",
        "logprob_chunk": ">= 1", "seed": ">= 0", "checkpoint_every": ">= 1", "keep_checkpoints": ">= 1",
        "lora.rank": ">= 1", "lora.alpha": "> 0", "lora.dropout": "[0, 1)", "epochs": ">= 1", "batch_size": ">= 1",
        "warmup_ratio": "[0, 1)", "max_records": ">= 1", "max_tokens": ">= 16"}.items()},
    "seed": ">= 0",
}


def _library_names() -> tuple[str, ...]:
    from tracekit.synthesis.library import LIBRARY_NAMES

    return LIBRARY_NAMES


def _benchmark_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "benchmark").glob("*.yaml")))


def _target_domains() -> tuple[str, ...]:
    # tau^2's domains (tracekit.envs.tau2.DOMAINS: importing it loads tau2, seconds) and ToolSandbox's scenario sets
    from tracekit.envs.toolsandbox import DOMAINS as TOOLSANDBOX
    from tracekit.targets.tau2 import TAU2_DOMAINS

    return (*TAU2_DOMAINS, *TOOLSANDBOX)


def _toolsandbox_variants() -> tuple[str, ...]:
    from tracekit.envs.toolsandbox import VARIANTS

    return VARIANTS


def _toolsandbox_train_splits() -> tuple[str, ...]:
    from tracekit.targets.toolsandbox import TRAIN_SPLITS

    return tuple(TRAIN_SPLITS)


def _stage_names() -> tuple[str, ...]:
    from tracekit.stages import build_pipeline

    return tuple(build_pipeline().stages)


def _method_names() -> tuple[str, ...]:
    from tracekit.methods import METHODS

    return tuple(METHODS)


def _strategy_names() -> tuple[str, ...]:
    from tracekit.methods.consolidate import STRATEGIES

    return tuple(STRATEGIES)


def _scale_names() -> tuple[str, ...]:
    return ("none", *sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "scale").glob("*.yaml")))


def _backbone_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in (Path(__file__).resolve().parent.parent / "conf" / "backbone").glob("*.yaml")))


def _chat_formats() -> tuple[str, ...]:
    from tracekit.llm.tools import CHAT_FORMATS

    return CHAT_FORMATS


# every string field with a fixed set of values: a tuple, a function giving one (imported when used), or a
# regular expression; the other strings are names, paths and URLs
CHOICES: dict[str, tuple[str, ...] | Callable[[], tuple[str, ...]] | str] = {
    "benchmark.kind": ("tau2", "synthetic", "toolsandbox", "coding", "swebench"),  # tracekit.targets (+ issue 20's)
    "benchmark.domains": _target_domains,  # which go with which kind: the target's validate()
    "benchmark.train_domains": _toolsandbox_variants,  # ToolSandbox's variants learned from (the target's validate())
    "benchmark.train_split": _toolsandbox_train_splits,  # ToolSandbox's training split (tracekit/targets/toolsandbox.py)
    "benchmark.split": ("train", "test", "base"),
    "benchmark.policy": ("full",),
    "benchmark.envs": _library_names,
    **CODING_CHOICES,  # benchmark.coding.modifiers: swesmith's Python modifiers
    "backbone.source": ("random", "gguf", "hub"),
    "backbone.chat_format": _chat_formats,
    "backbone.dtype": ("auto", "float32", "bfloat16", "float16"),
    "backbone.device": r"auto|cpu|mps|cuda(:\d+)?",
    "agent.kind": ("llm", "gold"),
    "agent.tool_choice": ("auto", "required"),
    "user.kind": ("scripted", "llm"),
    "thresholds.undefined_er_pos": ("zero", "unselectable"),
    "analysis.discovery": ("reference", "llm", "pinned"),
    "analysis.labeler": ("reference", "llm"),
    "analysis.on_missing": ("skip", "fail"),
    "synthesis.source": ("library", "generate"),
    "grpo.old_logprobs": ("rollout", "recompute"),
    "grpo.checkpoint_policy": ("full", "selective"),
    "grpo.rollout_fast": ("auto", "on", "off"),
    "grpo.dtype": ("auto", "float32", "bfloat16"),
    "grpo.save_rollouts": ("none", "messages", "full"),
    "grpo.engine": ("hf", "agent", "vllm"),
    "moe.impl": ("grouped", "grouped_mm", "masked_dense"),
    "moe.gate_data": ("successes", "all"),
    "consolidation.method": _strategy_names,
    "consolidation.merge.majority_sign": ("total", "frequency"),
    "consolidation.core_tsv.majority_sign": ("total", "frequency"),
    "consolidation.core_tsv.rank_policy": ("full", "truncate"),
    "consolidation.sft.data": ("successes", "all"),
    "consolidation.sft.schedule": ("linear", "constant"),
    "consolidation.sft.dtype": ("auto", "float32", "bfloat16"),
    "consolidation.distill.rollout_fast": ("auto", "on", "off"),
    "consolidation.distill.dtype": ("auto", "float32", "bfloat16"),
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
    "baselines.adp_sft.dtype": ("auto", "float32", "bfloat16"),
    "baselines.adp_sft.lora.target_modules": r"[\w.\-*]+",
    "baselines.adp_sft.lora.target_parameters": r"[\w.\-*]+",
}

_BOUND_OPS = {">": operator.gt, ">=": operator.ge}


def _in_range(x: float, spec: str) -> bool:
    if spec[0] in "[(":
        lo, hi = (float(v) for v in spec[1:-1].split(","))
        return (lo <= x if spec[0] == "[" else lo < x) and (x <= hi if spec[-1] == "]" else x < hi)
    op, bound = spec.split()
    return _BOUND_OPS[op](x, float(bound))


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {valid}")


def _check_leaf(key: str, pattern: str, value: Any) -> None:
    for item in value if isinstance(value, ListConfig) else [value]:
        if item is None:
            continue
        if pattern in RANGES:
            spec = RANGES[pattern]
            _check(_in_range(item, spec), key, item, spec if spec[0] in "<>" else f"in {spec}")
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
    from tracekit.stages import build_pipeline

    prefix = "llm.endpoints."
    return [r[len(prefix):] for r in build_pipeline().reads(cfg, stage) if r.startswith(prefix)]


PROBE_TIMEOUT_S = 3.0


def probe_endpoints(cfg: DictConfig, roles: Iterable[str]) -> None:
    """Ask each openai endpoint among ``roles`` for ``<base_url>/models`` with a short timeout (hf endpoints run
    in process: nothing to ask); ConfigError naming the endpoint, its URL and the error on the first that fails."""
    from tracekit.llm.base import EndpointError
    from tracekit.llm.openai import OpenAIChatClient

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


def read_pinned_dictionary(cfg: DictConfig) -> list[Any]:
    """The capabilities of the ``analysis.dictionary_path`` file, read as discovery reads it; ConfigError
    naming the file and what is wrong with it."""
    from tracekit.analysis.discovery import load_dictionary

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


def eval_benchmark(cfg: DictConfig) -> str | None:
    """``eval.benchmark``; None when unset. Unset, it is not among the evaluate stage's reads (its keys stay as they
    were), so in that stage's read view it is MISSING: that reads as unset too."""
    return OmegaConf.select(cfg, "eval.benchmark", throw_on_missing=False)


def evaluation_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``benchmark`` replaced by ``conf/benchmark/<eval.benchmark>.yaml`` (over the schema's defaults):
    what every evaluation rollout runs on when ``eval.benchmark`` names another target; ``cfg`` itself otherwise.
    An unknown name: ConfigError listing the known ones."""
    name = eval_benchmark(cfg)
    if name is None:
        return cfg
    folder = Path(__file__).resolve().parent.parent / "conf" / "benchmark"
    path = folder / f"{name}.yaml"
    _check(path.is_file(), "eval.benchmark", name, "a conf/benchmark name (" + ", ".join(
        sorted(p.stem for p in folder.glob("*.yaml"))) + ")")
    out = cfg.copy()
    with open_dict(out):
        out.benchmark = OmegaConf.merge(OmegaConf.structured(BenchmarkConfig), OmegaConf.load(path))
    return out


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


def validate(cfg: DictConfig) -> None:
    """Check every key against the schema, every value's range or choices and the cross-field rules; raise
    ConfigError (one line) on the first problem, a value whose interpolation cannot be resolved included."""
    try:
        _validate(cfg)
    except InterpolationResolutionError as e:
        raise ConfigError(interpolation_message(e, cfg)) from None


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
        from tracekit.envs.pool import valid_setting

        _check(valid_setting(cfg.rollout.env_workers), "rollout.env_workers", cfg.rollout.env_workers,
               "auto, 0 (in-process) or a positive integer (worker processes)")
    t = cfg.thresholds
    _check(t.k <= t.n, "thresholds.k", t.k, f"in [1, thresholds.n={t.n}]")
    if cfg.backbone.get("planted") is not None:  # a planted set naming a capability the library lacks: one line
        from tracekit.planted.warmstart import PlantedSpec

        try:
            PlantedSpec.from_config(cfg.backbone.planted)
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
    for key in ("tool_choice", "copy_ids"):
        if cfg.agent[key] not in ("auto", False):
            _check(cfg.agent.constrained_tool_calls, "agent.constrained_tool_calls", False,
                   f"true when agent.{key}={cfg.agent[key]} (both are grammar constraints)")
    _check(cfg.user.kind != "scripted" or cfg.user.max_turns is not None, "user.max_turns", None,
           ">= 1 with user.kind=scripted (the scripted user needs a last turn)")
    a = cfg.analysis
    _check(a.min_capabilities <= a.max_capabilities, "analysis.min_capabilities", a.min_capabilities,
           f"<= analysis.max_capabilities={a.max_capabilities}")
    if a.discovery == "pinned":
        read_pinned_dictionary(cfg)
    sy = cfg.synthesis
    _check(sy.target_low <= sy.target_high, "synthesis.target_low", sy.target_low,
           f"<= synthesis.target_high={sy.target_high}")
    for group, schema in (("grpo", GRPOSettings), ("launcher", LauncherSettings), ("thresholds", Thresholds),
                          ("consolidation.sft", SFTSettings), ("consolidation.distill", DistillSettings)):
        values = OmegaConf.to_container(OmegaConf.select(cfg, group), resolve=True)
        try:  # the settings dataclasses' own cross-field checks (tis_cap needs old_logprobs=recompute)
            schema(**{k: v for k, v in values.items() if k in schema.__dataclass_fields__})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check(cfg.consolidation.distill.iterations == DistillSettings.iterations, "consolidation.distill.iterations",
           cfg.consolidation.distill.iterations, "left unset: set consolidation.budget.episodes (matched budgets)")
    if cfg.grpo.engine == "agent" and cfg.agent.constrained_tool_calls:
        _check(cfg.grpo.old_logprobs == "recompute", "grpo.old_logprobs", cfg.grpo.old_logprobs,
               "recompute with grpo.engine=agent and constrained tool calls (the sampler's log-probs are masked)")
    if cfg.launcher.kind == "deepspeed_zero3" and cfg.launcher.nproc > 1:  # as tracekit.rl.launch.check_supported
        _check(cfg.grpo.engine != "hf", "grpo.engine", "hf",
               "agent or vllm with launcher=deepspeed_zero3 and nproc > 1 (hf rollouts are not rank-synchronized)")
    from tracekit.targets import target_of

    target_of(cfg).validate(cfg)  # the target's own checks (tracekit/targets/<kind>.py: domains, environments, ...)
    if eval_benchmark(cfg) is not None:  # evaluation on another target (Table 8): that target's checks too
        from tracekit.targets import target_of

        target_of(evaluation_config(cfg)).validate(evaluation_config(cfg))
    _check(len(cfg.eval.seeds) >= 1, "eval.seeds", list(cfg.eval.seeds), "a non-empty list")
    _check(len(cfg.eval.methods) >= 1, "eval.methods", list(cfg.eval.methods),
           "a non-empty list (the rows of the results table: " + ", ".join(_method_names()) + ")")
    from tracekit.methods import validate_methods

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
