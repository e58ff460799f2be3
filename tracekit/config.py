"""Structured configs (types for every Hydra group), :class:`ConfigError` and the helpers that read a config
without the registries: the pinned dictionary, the imported labeling runs, the evaluation target's config, an
interpolation's message.

Hydra composes ``conf/config.yaml`` over the ``Config`` schema registered here, so a typo'd key or a
wrongly typed value fails at composition. The value checks (ranges, choices, cross-field rules, each target's and
method's own) are :func:`tracekit.validate.validate`. Open groups are the schema's ``dict[str, Any]`` fields
(``backbone.arch``, ``grpo.vllm``); ``llm.endpoints`` takes any name, each entry an :class:`EndpointConfig`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.imported import import_runs, run_files
from tracekit.analysis.select import Thresholds
from tracekit.artifacts import CorruptArtifact
from tracekit.envs.pool import REPLY_TIMEOUT_S
from tracekit.episodes import INFRA_RETRIES
from tracekit.moe.gate import GateTrainConfig
from tracekit.rl.distill import DistillSettings
from tracekit.rl.settings import GRPORecipe, GRPOSettings, LauncherSettings
from tracekit.rl.sft import SFTSettings


class ConfigError(ValueError):
    """An invalid configuration value (message: one line naming the key and the valid range)."""


# failures the user fixes from the message alone: `python -m tracekit` prints it as one line (no traceback)
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, CorruptArtifact)


@dataclass
class CodingBenchmarkConfig:
    package: str = "toolz"  # an installed pure-Python distribution that ships its tests
    seed: int = 0  # the tasks' seed (bug choice, split); the benchmark does not move with the master seed
    modifiers: list[str] = field(default_factory=list)  # swesmith modifier names; empty: all 13 Python ones
    max_per_modifier: int = 3
    max_candidates_per_modifier: int = 8
    heldout_fraction: float = 0.5
    test_wall_seconds: float = 60.0
    test_cpu_seconds: int = 60
    command_wall_seconds: float = 30.0  # the agent's bash tool, per command
    command_cpu_seconds: int = 30
    command_memory_mb: int = 2048
    command_processes: int = 128
    output_chars: int = 4000
    model_name: str = "tracekit"  # model_name_or_path of the exported SWE-bench predictions
    # kind=swebench
    dataset: str = "princeton-nlp/SWE-bench_Verified"  # hub dataset id, or a local .jsonl path
    repos_dir: str | None = None  # local clones <repos_dir>/<owner>__<name> (the agent's checkouts)
    max_workers: int = 4  # the harness's parallel containers


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
    coding: CodingBenchmarkConfig = field(default_factory=CodingBenchmarkConfig)  # kind=coding|swebench (tracekit/coding/config.py: ranges, checks, suites)


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
    labeler: str = "reference"  # reference | llm | imported
    dictionary_path: str | None = None  # for discovery=pinned
    labels_from: str | None = None  # labeler=imported: a folder of the official TRACE labeling runs (run_NN.json)
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
    target_low: float = 0.2  # the band of mean reward and success rate (calibration's target, acceptance's gate)
    target_high: float = 0.6
    min_informative: float = 0.5
    acceptance: str = "none"  # none | official: the official TRACE calibration gate on every ready environment
    acceptance_group_size: int = 16  # official: G, the base policy's samples per validation seed
    min_reward_std: float = 0.05  # official: the rewards' std at least this
    max_all_success: float = 0.2  # official: groups in which every sample succeeds at most this share
    max_all_zero: float = 0.2  # official: groups in which every reward is 0 at most this share
    difficulty: int = 1
    cpu_seconds: int = 30
    wall_seconds: int = 60
    memory_mb: int = 2048


@dataclass
class GrpoConfig(GRPORecipe):
    """The recipe plus the rollout engine (hf in process | vllm server with LoRA sync). What a run keeps of its
    rollouts is no knob: every tracekit run keeps them ``full`` (:func:`tracekit.runs.grpo_run`)."""

    engine: str = "hf"
    # engine=vllm: tracekit.rl.vllm_client.VLLMSettings fields (model_path required); validate() checks the keys, the
    # values and the engine's rules, and refuses them under another engine
    vllm: dict[str, Any] = field(default_factory=dict)

    def settings(self, save_rollouts: str) -> GRPOSettings:
        recipe = {f.name: getattr(self, f.name) for f in fields(GRPORecipe)}  # RANGES is no field
        return GRPOSettings(**recipe, save_rollouts=save_rollouts)


@dataclass
class MoeConfig(GateTrainConfig):
    """The gate's training knobs (:class:`tracekit.moe.gate.GateTrainConfig`) plus the routing and the gate's data."""

    top_k: int = 1  # inference routing
    train_top_k: int | None = None  # None: dense softmax mixture while training (the paper's formula)
    base_slot: bool = False  # an extra "no adapter" expert (as in the official code)
    renormalize: bool = False  # top-k weights: raw softmax probabilities (official code) or renormalized
    impl: str = "grouped"  # top-k compute: grouped (pairs sorted by expert on device; _grouped_mm on CUDA bf16, per-expert loop elsewhere) | grouped_mm | masked_dense
    gate_init_std: float = 0.0  # 0: uniform routing at the start
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
class ArrowConfig:
    """arrow: training-free routing by each adapter's prototype (peft ArrowConfig; tracekit.moe.arrow)."""

    top_k: int = 3  # adapters kept per token (peft's default; capped at the number of adapters, noted)
    temperature: float = 1.0  # softmax temperature over the kept scores (peft's router_temperature)


@dataclass
class SoftTargetConfig:
    """moe with gate_objective=soft_target: KL(target || gate) toward softmax(adapter rewards / temperature)."""

    temperature: float = 0.1  # of the softmax over each environment's measured adapter rewards (in [0, 1])
    seeds: int = 16  # instances per environment each adapter is measured on (greedy, disjoint from training seeds)


@dataclass
class GateGrpoConfig:
    """moe with gate_objective=grpo: GRPO on the gates alone (official train/grpo_gater.py's defaults)."""

    warm_start: str = "ce_lb"  # the gates GRPO starts from: ce_lb | soft_target
    iterations: int = 10
    groups: int = 4  # (environment, seed) groups per iteration (official --num-tasks)
    group_size: int = 4  # rollouts per group (official --rollouts-per)
    lr: float = 1.0e-3
    clip_eps: float = 0.2
    temperature: float = 0.9  # token sampling of the rollouts
    hint_fraction: float = 0.5  # share of each group's rollouts shown the gold actions (never at evaluation)
    updates: int = 2  # optimizer steps per iteration on its rollouts (the clip matters from the second)
    max_grad_norm: float = 1.0


@dataclass
class GateObjectiveConfig:
    """The ``moe`` strategy's gate objective (issue 39): ce_lb (the paper's), soft_target or grpo."""

    objective: str = "ce_lb"
    soft_target: SoftTargetConfig = field(default_factory=SoftTargetConfig)
    grpo: GateGrpoConfig = field(default_factory=GateGrpoConfig)


@dataclass
class ConsolidationConfig:
    method: str = "moe"  # a name of tracekit.methods.consolidate.STRATEGIES (conf/consolidation/<name>.yaml)
    budget: ConsolidationBudgetConfig = field(default_factory=ConsolidationBudgetConfig)
    merge: MergeConfig = field(default_factory=MergeConfig)
    core_tsv: CoreTSVConfig = field(default_factory=CoreTSVConfig)
    sft: SftConfig = field(default_factory=SftConfig)
    distill: DistillSettings = field(default_factory=DistillSettings)  # iterations: from the budget
    arrow: ArrowConfig = field(default_factory=ArrowConfig)
    # moe's gate objective: in no key while ce_lb (the default: TRACE's keys as before), else in compose's reads
    gate: GateObjectiveConfig = field(default_factory=GateObjectiveConfig)


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
    env_reply_timeout_s: float | None = REPLY_TIMEOUT_S  # a worker silent this long on one turn is killed; None: wait
    # runs of an episode again after an infrastructure failure (a worker died or hung, the environment server or the
    # coding sandbox failed; tracekit.episodes), then the stage fails naming the task. Execution only: a retry
    # replays the same seeded episode from scratch and a failed one never enters an artifact, so what an artifact
    # holds does not depend on it
    infra_retries: int = INFRA_RETRIES


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

def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: must be {valid}")



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
