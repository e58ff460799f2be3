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
    temperature: float = 0.7
    capabilities_per_call: int = 10
    max_retries: int = 2
    on_missing: str = "skip"
    compact_chars: int = 6000
    label_noise: float = 0.0  # reference labeler: seeded flip rate emulating annotator variance
    examples_per_capability: int = 3
    chunk_size: int = 16  # labeling requests per client call (concurrency + checkpoint unit)
    show_outcome: bool = True  # tell the labeler whether the episode succeeded (the paper contrasts outcomes)
    use_response_format: bool = True  # JSON schema to the endpoint (grammar-constrained on the hf client)
    min_capabilities: int = 5
    max_capabilities: int = 10
    max_new_tokens: int = 1024

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
