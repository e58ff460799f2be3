"""The ``analysis`` config group's owner: :class:`AnalysisSettings` is its schema (one default and one rule per
knob), and this module says which of its knobs each analysis stage reads (its cache key) and builds that stage's
settings from exactly those, so what a stage uses and what its key holds are one list.

    discover: discovery_reads(cfg) / discovery_config(cfg.analysis, seed, pinned)
    label:    labeling_reads(cfg)  / labeling_config(cfg.analysis)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from tracekit.analysis.compact import CompactConfig
from tracekit.analysis.discovery import DiscoveryConfig
from tracekit.analysis.labeling import ON_MISSING, LabelingConfig
from tracekit.ranges import Choice, check_declared

DISCOVERY = ("reference", "llm", "pinned")  # the fixed dictionary of the target | an LLM reads the episodes | a file
LABELERS = ("reference", "llm", "imported")  # the target's heuristic labeler | an LLM | the authors' labeling runs


@dataclass
class AnalysisSettings:
    """Contrastive capability analysis (paper section 3.3): discovery, then ``thresholds.n`` labeling runs."""

    discovery: str = "reference"
    labeler: str = "reference"
    dictionary_path: str | None = None  # discovery=pinned: the dictionary file
    labels_from: str | None = None  # labeler=imported: a folder of the official TRACE labeling runs (run_NN.json)
    endpoint: str = "analysis"  # a key of llm.endpoints (discovery / labeler = llm)
    # the LLM calls' knobs: their defaults are the runtime classes' (LabelingConfig, DiscoveryConfig, CompactConfig),
    # the one place each lives; discovery_config / labeling_config build those classes from these values
    temperature: float = LabelingConfig.temperature  # the labeling calls' (discovery samples at its own, 0)
    capabilities_per_call: int = LabelingConfig.capabilities_per_call  # 0: the whole dictionary in one call
    max_retries: int = LabelingConfig.max_attempts - 1  # per call, after the first attempt
    on_missing: str = LabelingConfig.on_missing
    compact_chars: int = CompactConfig.max_chars  # each compacted trajectory's budget
    label_noise: float = 0.0  # reference labeler: seeded flip rate emulating annotator variance
    examples_per_capability: int = 3
    chunk_size: int = LabelingConfig.chunk_size  # labeling requests per client call (concurrency + checkpoint unit)
    # tell the labeler whether the episode succeeded (the paper contrasts outcomes)
    show_outcome: bool = LabelingConfig.show_outcome
    # JSON schema to the endpoint (grammar-constrained on the hf client)
    use_response_format: bool = LabelingConfig.use_response_format
    min_capabilities: int = DiscoveryConfig.min_capabilities
    max_capabilities: int = DiscoveryConfig.max_capabilities
    max_new_tokens: int = LabelingConfig.max_new_tokens

    RANGES: ClassVar[dict[str, str]] = {
        "temperature": "[0, 2]", "capabilities_per_call": ">= 0", "max_retries": ">= 0", "compact_chars": ">= 200",
        "label_noise": "[0, 0.5]", "examples_per_capability": ">= 0", "chunk_size": ">= 1",
        "min_capabilities": ">= 1", "max_capabilities": ">= 1", "max_new_tokens": ">= 1"}  # fmt: skip
    CHOICES: ClassVar[dict[str, Choice]] = {"discovery": DISCOVERY, "labeler": LABELERS, "on_missing": ON_MISSING}

    def __post_init__(self) -> None:
        check_declared("analysis", self)
        if self.min_capabilities > self.max_capabilities:
            raise ValueError(f"analysis.min_capabilities={self.min_capabilities!r} is invalid: must be <= "
                             f"analysis.max_capabilities={self.max_capabilities}")


# the knobs of an LLM call (discovery and labeling alike)
CLIENT_KNOBS = ("max_retries", "max_new_tokens", "compact_chars", "use_response_format")
DISCOVERY_KNOBS = ("min_capabilities", "max_capabilities", *CLIENT_KNOBS)
LABELING_KNOBS = ("temperature", "capabilities_per_call", "on_missing", "chunk_size", "show_outcome", *CLIENT_KNOBS)


def _knobs(a: DictConfig, names: tuple[str, ...]) -> dict[str, Any]:
    return {n: a[n] for n in names}


def discovery_reads(cfg: DictConfig) -> tuple[str, ...]:
    a = cfg.analysis
    if a.discovery == "reference":  # a fixed dictionary: nothing else matters
        return ("analysis.discovery",)
    reads = ("analysis.discovery", *(f"analysis.{k}" for k in DISCOVERY_KNOBS), "seed")
    if a.discovery == "pinned":
        return (*reads, "analysis.dictionary_path")
    return (*reads, "analysis.endpoint", f"llm.endpoints.{a.endpoint}", "backbone", "agent")


def discovery_config(a: DictConfig, seed: int, pinned: str | None) -> DiscoveryConfig:
    """The discover stage's settings, from the knobs :func:`discovery_reads` names (one call)."""
    k = AnalysisSettings(**_knobs(a, DISCOVERY_KNOBS))
    return DiscoveryConfig(min_capabilities=k.min_capabilities, max_capabilities=k.max_capabilities,
                           max_attempts=k.max_retries + 1, max_new_tokens=k.max_new_tokens, seed=seed,
                           compact=CompactConfig(max_chars=k.compact_chars), use_response_format=k.use_response_format,
                           pinned=pinned)


def labeling_reads(cfg: DictConfig) -> tuple[str, ...]:
    a = cfg.analysis
    if a.labeler == "imported":  # the runs' number is their files' (validate() holds thresholds.n to it)
        return ("analysis.labeler", "analysis.labels_from")
    if a.labeler == "reference":
        return ("analysis.labeler", "analysis.label_noise", "thresholds.n", "seed")
    return ("analysis.labeler", *(f"analysis.{k}" for k in LABELING_KNOBS), "analysis.endpoint",
            f"llm.endpoints.{a.endpoint}", "backbone", "agent", "thresholds.n", "seed")


def labeling_config(a: DictConfig) -> LabelingConfig:
    """The LLM labeler's settings, from the knobs :func:`labeling_reads` names (one call)."""
    k = AnalysisSettings(**_knobs(a, LABELING_KNOBS))
    return LabelingConfig(temperature=k.temperature, capabilities_per_call=k.capabilities_per_call,
                          max_attempts=k.max_retries + 1, max_new_tokens=k.max_new_tokens, chunk_size=k.chunk_size,
                          on_missing=k.on_missing, show_outcome=k.show_outcome,
                          compact=CompactConfig(max_chars=k.compact_chars), use_response_format=k.use_response_format)
