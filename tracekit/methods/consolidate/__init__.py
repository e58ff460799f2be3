"""Consolidation strategies by name (``consolidation.method``; paper Table 4)."""

from __future__ import annotations

from omegaconf import DictConfig

from tracekit.methods.consolidate.base import (CONSOLIDATED, Consolidated, Strategy, adapters_budget, read_consolidated,
                                               write_consolidated)
from tracekit.methods.consolidate.arrow import Arrow
from tracekit.methods.consolidate.merge import MERGES
from tracekit.methods.consolidate.moe import LoRAMoE
from tracekit.methods.consolidate.multi_grpo import MultiGRPO
from tracekit.methods.consolidate.on_policy_distill import OnPolicyDistill
from tracekit.methods.consolidate.sft_synthetic import SFTSynthetic

STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (LoRAMoE(), *MERGES, MultiGRPO(), SFTSynthetic(), OnPolicyDistill(), Arrow())
}


def compose_reads(cfg: DictConfig) -> tuple[str, ...]:
    """The ``compose`` stage's reads: the configured strategy's, beside the method, backbone and seed."""
    return ("consolidation.method", "backbone", "seed", *STRATEGIES[cfg.consolidation.method].reads(cfg))


def compose_inputs(cfg: DictConfig) -> tuple[str, ...]:
    """The ``compose`` stage's inputs: the capability adapters and what the configured strategy reads."""
    return ("train", *STRATEGIES[cfg.consolidation.method].stage_inputs(cfg))


__all__ = ["CONSOLIDATED", "STRATEGIES", "Consolidated", "Strategy", "adapters_budget", "compose_inputs",
           "compose_reads", "read_consolidated", "write_consolidated"]
