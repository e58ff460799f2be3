"""``moe``: TRACE's consolidation, a token-level LoRA mixture of experts over the capability adapters
(paper section 3.5): frozen adapters, per-block linear gates trained with CE + lambda_LB * LB on the
capabilities' GRPO rollouts, top-1 routing at inference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.methods.base import Budget
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget


def gate_examples(adapter_dir: Path, successes_only: bool) -> list[Any]:
    """Token rows of a capability's GRPO rollouts (its own adapter in its own env) for gate training."""
    from tracekit.moe.gate import GateExample
    from tracekit.rl.sft import sft_examples

    return [GateExample(ids, mask) for ids, mask in sft_examples([adapter_dir], successes_only)]


class LoRAMoE(Strategy):
    name = "moe"
    label = "TRACE"

    def reads(self, cfg):
        return ("moe",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        from tracekit.llm.backbones import load_backbone
        from tracekit.moe.gate import GateTrainConfig, mix_uniformly, train_gates, write_log_csv
        from tracekit.moe.model import MoEConfig, build_lora_moe
        from tracekit.stages import backbone_dict, device, dtype

        cfg, m = ctx.cfg, ctx.cfg.moe
        groups = {cap: gate_examples(a.path, m.gate_data == "successes") for cap, a in adapters.items()}
        empty = [c for c, ex in groups.items() if not ex]
        if empty:
            raise RuntimeError(f"compose: no {m.gate_data} gate-training rollouts for {', '.join(empty)} "
                               "(moe.gate_data=all trains the gate on every GRPO rollout)")
        examples = mix_uniformly(groups, seed=ctx.seed, per_group=m.trajectories_per_capability)
        backbone, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        model = build_lora_moe(backbone, {c: str(a.path / "adapter") for c, a in adapters.items()},
                               MoEConfig(top_k=m.top_k, renormalize=m.renormalize, impl=m.impl,
                                         train_top_k=m.train_top_k, include_base_slot=m.base_slot,
                                         gate_init_std=m.gate_init_std, seed=ctx.seed),
                               backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
        log_rows = train_gates(model, examples, GateTrainConfig(
            lambda_lb=m.lambda_lb, lr=m.lr, weight_decay=m.weight_decay, steps=m.steps, batch_size=m.batch_size,
            max_grad_norm=m.max_grad_norm, ce_chunk=m.ce_chunk, seed=ctx.seed,
            pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            gradient_checkpointing=m.gradient_checkpointing))
        write_log_csv(log_rows, ctx.work_dir / "gate_log.csv")
        for row in log_rows:
            ctx.record.logger.scalars({f"moe/{k}": v for k, v in row.items()})
        model.save(ctx.work_dir / "moe")
        atomic_write_json(ctx.work_dir / "compose.json", {
            "capabilities": list(adapters), "examples": len(examples),
            "first": {k: log_rows[0][k] for k in ("loss", "ce", "lb")},
            "last": {k: log_rows[-1][k] for k in ("loss", "ce", "lb")}, "parameters": model.parameter_counts()})
        gate = Budget(optimizer_steps=len(log_rows))  # the gate trains on the GRPO rollouts: no new episodes
        return Consolidated("moe", "moe", adapters_budget(adapters) + gate)

    def report(self, art, ctx) -> None:
        super().report(art, ctx)
        c = read_json(art.path / "compose.json")
        ctx.record.section("LoRA mixture of experts", (
            f"{len(c['capabilities'])} experts ({', '.join(c['capabilities'])}), {c['examples']} gate examples; "
            f"loss {c['first']['loss']:.3f} -> {c['last']['loss']:.3f} (CE {c['first']['ce']:.3f} -> "
            f"{c['last']['ce']:.3f}, LB {c['first']['lb']:.3f} -> {c['last']['lb']:.3f}).\n\nParameters: "
            + ", ".join(f"{k}: {v:,}" for k, v in c["parameters"].items() if isinstance(v, int))))
