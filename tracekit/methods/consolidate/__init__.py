"""Consolidation strategies by name (``consolidation.method``; paper Table 4)."""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import cache

from omegaconf import DictConfig

from tracekit.methods.consolidate.base import (CONSOLIDATED, Consolidated, ConsolidationSettings, Strategy,
                                               adapters_budget, read_consolidated, write_consolidated)
from tracekit.methods.consolidate.arrow import Arrow
from tracekit.methods.consolidate.merge import MERGES
from tracekit.methods.consolidate.moe import LoRAMoE
from tracekit.methods.consolidate.multi_grpo import MultiGRPO
from tracekit.methods.consolidate.on_policy_distill import OnPolicyDistill
from tracekit.methods.consolidate.route import Route
from tracekit.methods.consolidate.sft_synthetic import SFTSynthetic

STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (LoRAMoE(), *MERGES, MultiGRPO(), SFTSynthetic(), OnPolicyDistill(), Arrow(), Route())
}


def strategy_names() -> tuple[str, ...]:
    return tuple(STRATEGIES)


@cache
def consolidation_schema() -> type:
    """The ``consolidation`` group's schema: the shared fields (method, budget) plus one field per mount, typed by the
    settings class of the strategies mounted there (the merges share ``merge``)."""
    mounts: dict[str, type] = {}
    for s in STRATEGIES.values():
        if s.settings is not None:
            mounts.setdefault(s.mount or s.name, s.settings)
    return make_dataclass("ConsolidationConfig", [(m, cls, field(default_factory=cls)) for m, cls in mounts.items()],
                          bases=(ConsolidationSettings,),
                          namespace={"CHOICES": {"method": strategy_names}})


def compose_reads(cfg: DictConfig) -> tuple[str, ...]:
    """The ``compose`` stage's reads: the configured strategy's, beside the method, backbone and seed."""
    return ("consolidation.method", "backbone", "seed", *STRATEGIES[cfg.consolidation.method].reads(cfg))


def compose_inputs(cfg: DictConfig) -> tuple[str, ...]:
    """The ``compose`` stage's inputs: the capability adapters and what the configured strategy reads."""
    return ("train", *STRATEGIES[cfg.consolidation.method].stage_inputs(cfg))


__all__ = ["CONSOLIDATED", "STRATEGIES", "Consolidated", "Strategy", "adapters_budget", "compose_inputs",
           "compose_reads", "consolidation_schema", "read_consolidated", "strategy_names", "write_consolidated"]
