"""Parameter counts of a composed LoRA-MoE (backbone, each adapter at its own rank, gates, bank storage) and
their plain-text table; paper Table 5 for the paper's backbone is :mod:`tracekit.report.table5`."""

from __future__ import annotations

from typing import Any

from torch import nn

from tracekit.moe.layer import LoRAMoELinear


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def gate_param_count(hidden_size: int, n_blocks: int, n_slots: int) -> int:
    """n_blocks * (d * S + S): one Linear(d -> S) with bias per adapted block."""
    return n_blocks * (hidden_size * n_slots + n_slots)


def composed_parameter_counts(moe: nn.Module) -> dict[str, Any]:
    """Counts for a built LoRAMoEModel: backbone, each adapter (its own rank, unpadded), gates, bank storage."""
    projections = [m for m in moe.model.modules() if isinstance(m, LoRAMoELinear)]
    backbone = count_params(moe.model)  # the banks live in moe.banks, outside the backbone
    adapters = {
        name: sum(m.ranks[c] * (m.in_features + m.out_features) for m in projections)
        for c, name in enumerate(moe.adapter_names)
    }
    gates = count_params(moe.gates)
    return {
        "backbone": backbone,
        "adapters": adapters,
        "gates_total": gates,
        "gate_per_block": gates // max(1, len(moe.gates)),
        "n_blocks": len(moe.gates),
        "n_slots": len(moe.slot_names),
        "bank_storage": count_params(moe.banks),
    }


def format_counts(counts: dict[str, Any]) -> str:
    """A plain-text table of :func:`composed_parameter_counts` or ``tracekit.report.table5.table5`` output."""
    lines = [f"{'component':<44}{'parameters':>18}", "-" * 62]
    lines.append(f"{'backbone (frozen)':<44}{counts['backbone']:>18,}")
    adapters = counts.get("adapters") or {"LoRA adapter (each)": counts["adapter_each"]}
    for name, n in adapters.items():
        pct = 100.0 * n / counts["backbone"]
        lines.append(f"{name[:34] + ' (' + format(pct, '.2f') + '%)':<44}{n:>18,}")
    label = f"MoE gates ({counts['n_blocks']} x Linear(d->{counts['n_slots']}))"
    lines.append(f"{label:<44}{counts['gates_total']:>18,}")
    return "\n".join(lines)
