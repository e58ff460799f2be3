"""Consolidation strategies by name (``consolidation.method``; paper Table 4)."""

from __future__ import annotations

from tracekit.methods.consolidate.base import (
    CONSOLIDATED, Consolidated, Strategy, adapters_budget, read_consolidated, write_consolidated,
)
from tracekit.methods.consolidate.merge import MERGES
from tracekit.methods.consolidate.moe import LoRAMoE
from tracekit.methods.consolidate.multi_grpo import MultiGRPO
from tracekit.methods.consolidate.on_policy_distill import OnPolicyDistill
from tracekit.methods.consolidate.sft_synthetic import SFTSynthetic

STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (LoRAMoE(), *MERGES, MultiGRPO(), SFTSynthetic(), OnPolicyDistill())
}

__all__ = ["CONSOLIDATED", "STRATEGIES", "Consolidated", "Strategy", "adapters_budget", "read_consolidated",
           "write_consolidated"]
