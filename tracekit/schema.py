"""The whole config's schema, assembled above the registries: the groups' owners (:mod:`tracekit.config` and the
analysis, synthesis and selection packages), the ``benchmark`` group from the targets registry
(:func:`tracekit.targets.registry.benchmark_schema`), the ``baselines`` group from the methods registry
(:func:`tracekit.methods.baselines_schema`) and the ``consolidation`` group from the strategies registry
(:func:`tracekit.methods.consolidate.consolidation_schema`). Hydra composes ``conf/config.yaml`` over it, so a typo'd key or a
wrongly typed value fails at composition; :func:`tracekit.validate.validate` checks every value against the rules the
owners declare (:func:`tracekit.ranges.declared`).
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import cache
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from tracekit.analysis.select import Thresholds
from tracekit.analysis.settings import AnalysisSettings
from tracekit.config import (AgentConfig, BackboneConfig, EvalConfig, GrpoConfig, LlmConfig,
                             LoggerConfig, MoeConfig, PathsConfig, RolloutConfig, ScaleConfig, UserConfig)
from tracekit.methods import METHODS, baselines_schema
from tracekit.methods.consolidate import consolidation_schema
from tracekit.rl.settings import LauncherSettings
from tracekit.stages import build_pipeline
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.targets.registry import benchmark_schema


def method_names() -> tuple[str, ...]:
    return tuple(METHODS)


def stage_names() -> tuple[str, ...]:
    return tuple(build_pipeline().stages)


# the choices that name a registry's entries whose groups live below the registries: declared here, where they
# are seen
REGISTRY_CHOICES = {"stages": stage_names, "eval.methods": method_names}


@cache
def config_schema() -> type:
    """The ``Config`` dataclass: one field per config group, each typed by its owner's settings class."""
    groups: list[tuple[str, type]] = [
        ("benchmark", benchmark_schema()), ("backbone", BackboneConfig), ("agent", AgentConfig),
        ("user", UserConfig), ("thresholds", Thresholds), ("analysis", AnalysisSettings),
        ("synthesis", SynthesisConfig), ("grpo", GrpoConfig), ("moe", MoeConfig),
        ("consolidation", consolidation_schema()), ("baselines", baselines_schema()), ("llm", LlmConfig),
        ("eval", EvalConfig), ("rollout", RolloutConfig), ("launcher", LauncherSettings), ("logger", LoggerConfig),
        ("paths", PathsConfig)]
    return make_dataclass("Config", [
        *((name, cls, field(default_factory=cls)) for name, cls in groups),
        ("experiment", Any, field(default=None)),
        # a shipped warm start (tracekit/warmstart/warmstarts/<name>/) installed instead of training backbone.planted's:
        # the same weights bit for bit, so no stage reads it (keys unchanged); checked against the planted key
        ("warm_start", Optional[str], field(default=None)),
        # {preset: the preset this one is built on, cuts: {key: why}}: named in the first log line and summary.md
        ("built_on", Any, field(default=None)),
        ("scale", ScaleConfig, field(default_factory=ScaleConfig)),
        ("stages", list[str], field(default_factory=lambda: ["evaluate"])),
        ("seed", int, field(default=42)),
        ("name", str, field(default="default")),
    ], namespace={"RANGES": {"seed": ">= 0"},
                  # warm_start: a name; which names are shipped is warmstart.shipped.s to say (validate: one line)
                  "CHOICES": {**REGISTRY_CHOICES, "warm_start": r"[A-Za-z0-9_.-]+"}})


def register_configs() -> None:
    ConfigStore.instance().store(name="tracekit_schema", node=config_schema())
