"""Paper Appendix D, Table 5: backbone, per-adapter LoRA and MoE gate counts of the paper's backbone
(``python -m tracekit.report.table5``).

Counts come from a model built on the meta device (no memory, no download) and closed forms:

- gates: one Linear(d -> S) with bias per adapted block: n_blocks * (d * S + S).
- LoRA on an nn.Linear(d_in -> d_out) at rank r: r * (d_in + d_out).
- Qwen3-MoE experts. transformers 5.x stores each block's experts fused as 3-D parameters
  ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]; peft adapts them only through
  ``target_parameters`` (``lora.ParamWrapper``: lora_A = Linear(in, r*E), lora_B = Linear(r*E, out)),
  i.e. E * r * (H + 2I) for gate_up (gate and up share one A per expert) and E * r * (I + H) for down.
  transformers < 5 (and the official TRACE adapters, "128 experts x {gate,up,down} x 48 layers")
  have one nn.Linear per expert and projection: E * r * (H + I) each for gate, up and down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from tracekit.llm.backbones import build_config
from tracekit.moe.counts import count_params, format_counts, gate_param_count

log = logging.getLogger(__name__)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# what the official TRACE adapters adapt: attention + every expert's gate/up/down (18,624 pairs on 48 blocks)
OFFICIAL_TARGETS = ATTENTION + MLP


def qwen3_30b_a3b_config() -> Any:
    return build_config("qwen3_30b_a3b")  # the public config.json numbers (tracekit.llm.backbones)


def meta_causal_lm(config: Any) -> nn.Module:
    """An HF causal LM for ``config`` with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _fused_experts(module: nn.Module) -> tuple[int, int, int] | None:
    """(E, H, I) of a fused-experts module (3-D gate_up_proj [E, 2I, H] and down_proj [E, H, I])."""
    gu, dn = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3:
        E, two_i, H = gu.shape
        return E, H, two_i // 2
    return None


def lora_param_count(model: nn.Module, rank: int, targets: Sequence[str], expert_layout: str = "per_expert") -> int:
    """LoRA parameters of one adapter of rank ``rank`` on the modules named ``targets`` (last name component).

    ``expert_layout`` for fused experts: "per_expert" (one Linear per expert, transformers < 5 / official
    adapters) or "fused" (peft target_parameters on the 3-D parameters, transformers 5.x).
    """
    if expert_layout not in ("per_expert", "fused"):
        raise ValueError(f"expert_layout must be 'per_expert' or 'fused', got {expert_layout!r}")
    targets = set(targets)
    total = 0
    for _, mod in model.named_modules():
        fused = _fused_experts(mod)
        if fused is not None:
            E, H, I = fused
            if expert_layout == "fused":
                if len(targets & {"gate_proj", "up_proj"}) == 1:
                    raise ValueError("fused experts: gate_proj and up_proj are one parameter, target both or neither")
                if "gate_proj" in targets:
                    total += E * rank * (H + 2 * I)
                if "down_proj" in targets:
                    total += E * rank * (I + H)
            else:
                total += sum(E * rank * (H + I) for t in MLP if t in targets)
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and name.rpartition(".")[2] in targets:
            total += rank * (mod.in_features + mod.out_features)
    return total


def table5(
    n_capabilities: int = 5,
    rank: int = 32,
    targets: Sequence[str] = OFFICIAL_TARGETS,
    expert_layout: str = "per_expert",
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """Paper Table 5 on the meta device (default: Qwen3-30B-A3B, every block adapted, S = n_capabilities gate slots)."""
    model = model if model is not None else meta_causal_lm(qwen3_30b_a3b_config())
    config = model.config
    backbone = count_params(model)
    adapter = lora_param_count(model, rank, targets, expert_layout)
    n_blocks = config.num_hidden_layers
    gates = gate_param_count(config.hidden_size, n_blocks, n_capabilities)
    return {
        "backbone": backbone,
        "adapter_each": adapter,
        "adapter_pct_of_backbone": 100.0 * adapter / backbone,
        "gates_total": gates,
        "gate_per_block": gates // n_blocks,
        "n_blocks": n_blocks,
        "n_slots": n_capabilities,
        "rank": rank,
        "targets": list(targets),
        "expert_layout": expert_layout,
    }


def rank_search(
    model: nn.Module,
    target_sets: dict[str, Sequence[str]],
    ranks: Sequence[int] = (8, 16, 32, 40, 64),
    goal: float = 1.6e9,
) -> list[dict[str, Any]]:
    """Adapter size for every (targets, expert layout, rank), sorted by distance to ``goal`` parameters."""
    backbone = count_params(model)
    rows = []
    for label, targets in target_sets.items():
        for layout in ("per_expert", "fused"):
            for r in ranks:
                n = lora_param_count(model, r, targets, layout)
                rows.append({"targets": label, "layout": layout, "rank": r, "params": n, "pct": 100.0 * n / backbone})
    return sorted(rows, key=lambda row: abs(row["params"] - goal))


def main() -> None:
    model = meta_causal_lm(qwen3_30b_a3b_config())
    print("Table 5 (Qwen3-30B-A3B, 5 gate slots, r=32 on q,k,v,o + each expert's gate/up/down):")
    print(format_counts(table5(model=model)))
    sets = {"attn": ATTENTION, "experts": MLP, "attn+experts": OFFICIAL_TARGETS}
    print("\nadapter size by targets / expert layout / rank (closest to 1.6 B first):")
    for row in rank_search(model, sets)[:8]:
        print(f"  {row['targets']:<14}{row['layout']:<12}r={row['rank']:<4}{row['params']:>15,}  {row['pct']:.2f}%")


if __name__ == "__main__":
    main()
