"""``moe``: TRACE's consolidation, a token-level LoRA mixture of experts over the capability adapters
(paper section 3.5): frozen adapters, per-block linear gates trained with CE + lambda_LB * LB on the
capabilities' GRPO rollouts, top-1 routing at inference."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.llm.backbones import load_backbone
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.moe.gate import (GateExample, GateTrainConfig, heldout_measures, mix_uniformly, split_heldout,
                               train_gates, write_log_csv)
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.policy import Budget
from tracekit.rl.sft import sft_examples
from tracekit.wiring import backbone_dict, device, dtype


def gate_examples(adapter_dir: Path, successes_only: bool) -> list[Any]:
    """Token rows of a capability's GRPO rollouts (its own adapter in its own env) for gate training."""
    return [GateExample(ids, mask) for ids, mask in sft_examples([adapter_dir], successes_only)]


class LoRAMoE(Strategy):
    name = "moe"
    label = "TRACE"

    def reads(self, cfg):
        return ("moe",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        cfg, m = ctx.cfg, ctx.cfg.moe
        groups = {cap: gate_examples(a.path, m.gate_data == "successes") for cap, a in adapters.items()}
        empty = [c for c, ex in groups.items() if not ex]
        if empty:
            raise RuntimeError(f"compose: no {m.gate_data} gate-training rollouts for {', '.join(empty)} "
                               "(moe.gate_data=all trains the gate on every GRPO rollout)")
        # a fixed held-out share of each capability's examples: the gate's CE before and after training is
        # measured on the same examples, none of which it trains on
        train_groups, held_groups = split_heldout(groups, seed=ctx.seed)
        per_group = min(m.trajectories_per_capability, *(len(g) for g in train_groups.values()))
        examples = mix_uniformly(train_groups, seed=ctx.seed, per_group=per_group)
        held = [ex for cap in sorted(held_groups) for ex in held_groups[cap]]
        backbone, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        model = build_lora_moe(backbone, {c: str(a.path / "adapter") for c, a in adapters.items()},
                               MoEConfig(top_k=m.top_k, renormalize=m.renormalize, impl=m.impl,
                                         train_top_k=m.train_top_k, include_base_slot=m.base_slot,
                                         gate_init_std=m.gate_init_std, seed=ctx.seed),
                               backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

        def measure() -> dict[str, Any]:
            groups = {cap: ex for cap, ex in held_groups.items() if ex}
            return heldout_measures(model, groups, m.batch_size, m.ce_chunk, pad) if groups else {}

        before = measure()
        log_rows = train_gates(model, examples, GateTrainConfig(**{f.name: m[f.name] for f in fields(GateTrainConfig)}),
                               seed=ctx.seed, pad_id=pad)
        after = measure()
        write_log_csv(log_rows, ctx.work_dir / "gate_log.csv")
        for row in log_rows:
            ctx.record.logger.scalars({f"moe/{k}": v for k, v in row.items()})
        model.save(ctx.work_dir / "moe")
        atomic_write_json(ctx.work_dir / "compose.json", {
            "capabilities": list(adapters), "examples": len(examples), "steps": len(log_rows),
            "heldout": {"examples": len(held), "per_capability": {c: len(v) for c, v in held_groups.items()},
                        "before": before, "after": after},
            "parameters": model.parameter_counts()})
        gate = Budget(optimizer_steps=len(log_rows))  # the gate trains on the GRPO rollouts: no new episodes
        return Consolidated("moe", "moe", adapters_budget(adapters) + gate)

    def report(self, art, ctx) -> None:
        super().report(art, ctx)
        c = read_json(art.path / "compose.json")
        ctx.record.section("LoRA mixture of experts", moe_report(c))


def moe_report(c: dict[str, Any]) -> str:
    """The compose report: the gate's CE on the fixed held-out examples before and after training (inference
    routing, top-k, and the training mixture) and the share of response tokens routed to each expert."""
    h = c.get("heldout") or {}
    head = (f"{len(c['capabilities'])} experts ({', '.join(c['capabilities'])}), {c['examples']} gate training "
            f"examples, {c.get('steps', '?')} steps; {h.get('examples', 0)} held-out examples "
            f"({', '.join(f'{k}: {v}' for k, v in (h.get('per_capability') or {}).items())}).")
    lines = [head, ""]
    b, a = h.get("before") or {}, h.get("after") or {}
    if b and a:
        lines += ["| held-out gate examples | before training | after training |", "|---|---|---|",
                  f"| CE, inference routing (top-k) | {b['ce_inference']:.3f} | {a['ce_inference']:.3f} |",
                  f"| CE, training mixture | {b['ce_training']:.3f} | {a['ce_training']:.3f} |"]
        slots = list(a["usage"])
        lines += ["", "Routing on held-out response tokens (share of token x block pairs whose top gate slot is the "
                  "expert, mean over blocks):", "",
                  "| examples of | " + " | ".join(slots) + " |", "|---|" + "---|" * len(slots)]
        for when, m in (("before", b), ("after", a)):
            lines.append(f"| all ({when}) | " + " | ".join(f"{m['usage'][s]:.2f}" for s in slots) + " |")
        for cap, u in a.get("usage_by_capability", {}).items():
            lines.append(f"| {cap} (after) | " + " | ".join(f"{u[s]:.2f}" for s in slots) + " |")
        if a.get("routes") and b.get("routes"):
            lines += ["", "Held-out examples by the expert they route to (most of their response token x block picks), "
                      "against the capability each needs (its environment), before -> after gate training:", "",
                      "| examples of | " + " | ".join(slots) + " | routed to their own expert |",
                      "|---|" + "---|" * (len(slots) + 1)]
            for cap, row in a["routes"].items():
                before = b["routes"].get(cap, {})
                own = [f"{before.get(cap, 0)} -> {row.get(cap, 0)} of {sum(row.values())}"] if cap in row else ["n/a"]
                lines.append(f"| {cap} | " + " | ".join(f"{before.get(s, 0)} -> {row[s]}" for s in slots)
                             + f" | {own[0]} |")
    else:
        lines.append("No held-out gate examples (every capability had a single rollout): no CE before/after.")
    lines += ["", "Parameters: " + ", ".join(f"{k}: {v:,}" for k, v in c["parameters"].items() if isinstance(v, int))]
    return "\n".join(lines)
