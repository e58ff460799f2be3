"""``moe``: TRACE's consolidation, a token-level LoRA mixture of experts over the capability adapters
(paper section 3.5): frozen adapters, per-block linear gates trained with CE + lambda_LB * LB on the
capabilities' GRPO rollouts, top-1 routing at inference.

``consolidation.gate.objective`` picks what trains the gates (issue 39; top-1 inference whichever): ``ce_lb`` (the
paper's, the default: its cache key is TRACE's as before, no other value read), ``soft_target`` (KL to per-environment
routing targets from the adapters' measured rewards) or ``grpo`` (GRPO on the gates from a ce_lb or soft_target warm
start); :mod:`tracekit.methods.consolidate.gate_objectives` says what each mirrors and how it deviates."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import torch

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.llm.backbones import load_backbone
from tracekit.llm.hf import padding_id
from tracekit.config import _check
from tracekit.methods.consolidate.composite import (COMPOSITE_WORDS, chain_examples, composite_inputs,
                                                    composite_on, composite_reads, with_chains)
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget, check_top_k, dictionary_size
from tracekit.methods.consolidate.gate_objectives import (GATE_OBJECTIVES, PAPER_GATE, GateObjectiveConfig,
                                                          RoutingConfig, measure_rewards, train_gates_grpo)
from tracekit.moe.gate import (GateExample, GateTrainConfig, heldout_measures, mix_uniformly, soft_targets,
                               split_heldout, train_gates, train_gates_soft_target, write_log_csv)
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.policy import Budget
from tracekit.rl.sft import sft_examples
from tracekit.runs import ready_capabilities
from tracekit.wiring import backbone_dict, device, dtype


def routing_of(cfg) -> RoutingConfig:
    """``consolidation.gate.routing``; the paper's routing where the compose stage's view masks it (it reads the group
    only when it is not the default)."""
    node: Any = cfg
    for part in ("consolidation", "gate", "routing"):
        node = OmegaConf.select(node, part, default=None) if isinstance(node, DictConfig) else None
    if not isinstance(node, DictConfig):
        return RoutingConfig()
    return RoutingConfig(**{f.name: node[f.name] for f in fields(RoutingConfig)})


def gate_objective(cfg) -> str:
    """``consolidation.gate.objective``; the paper's where the compose stage's view masks it (it reads it only
    otherwise)."""
    node: Any = cfg
    for part in ("consolidation", "gate"):  # one level at a time: a masked group reads as a MISSING string
        node = OmegaConf.select(node, part, default=None) if isinstance(node, DictConfig) else None
    return OmegaConf.select(node, "objective", default=PAPER_GATE) if isinstance(node, DictConfig) else PAPER_GATE


def warm_objective(cfg) -> str:
    """The objective that trains the gates first: the configured one, or grpo's warm start."""
    o = gate_objective(cfg)
    return cfg.consolidation.gate.grpo.warm_start if GATE_OBJECTIVES[o].gate_grpo else o


def gate_examples(adapter_dir: Path, successes_only: bool) -> list[Any]:
    """Token rows of a capability's GRPO rollouts (its own adapter in its own env) for gate training."""
    return [GateExample(ids, mask) for ids, mask in sft_examples([adapter_dir], successes_only)]


class LoRAMoE(Strategy):
    name = "moe"
    # the gate objective: in no key while the paper's (the default: TRACE's keys as before), else in compose's reads
    settings, mount = GateObjectiveConfig, "gate"
    label = "TRACE"

    def row_label(self, cfg) -> str:
        """TRACE under the paper's gate and routing; a gate trained otherwise or routed otherwise says so
        (``TRACE (soft-target gate)``, ``TRACE (turn routing, soft top-2)``)."""
        objective = GATE_OBJECTIVES[gate_objective(cfg)]
        words = ([] if objective.paper else [f"{objective.words} gate"]) + [routing_of(cfg).label()] + (
            [COMPOSITE_WORDS] if composite_on(cfg) else [])  # composite gate data: beyond the paper (issue 53)
        words = [w for w in words if w]
        return f"{self.label} ({', '.join(words)})" if words else self.label

    def validate(self, cfg) -> None:
        """Gate GRPO needs groups of two or more and no base slot; a temperature without soft top-k is a knob that
        does nothing; soft top-k over more slots than the dictionary could ever select is refused here (against the
        selected adapters again when compose starts)."""
        super().validate(cfg)
        if GATE_OBJECTIVES[gate_objective(cfg)].gate_grpo:
            gr = cfg.consolidation.gate.grpo
            # GRPO learns only from groups whose rewards differ: a group of one never does, whatever else varies
            _check(gr.group_size >= 2, "consolidation.gate.grpo.group_size", gr.group_size,
                   ">= 2 with consolidation.gate.objective=grpo (a group of one rollout has no reward variance: "
                   "GRPO's advantage is 0)")
            _check(not cfg.moe.base_slot, "moe.base_slot", True,
                   "false with consolidation.gate.objective=grpo (each trajectory's expert is a capability adapter; "
                   "the base slot has none to roll out)")
        r = routing_of(cfg)
        _check(r.soft_top_k is not None or r.temperature == 1.0, "consolidation.gate.routing.temperature",
               r.temperature, "1.0 without consolidation.gate.routing.soft_top_k (it tempers soft top-k mixing only)")
        bound = dictionary_size(cfg) if r.soft_top_k is not None else None
        if bound is not None:
            slots = bound + (1 if cfg.moe.base_slot else 0)
            _check(r.soft_top_k <= slots, "consolidation.gate.routing.soft_top_k", r.soft_top_k,
                   f"<= {slots}, the gate slots of the most adapters this dictionary can select")

    def reads(self, cfg):
        objective = gate_objective(cfg)
        routing = () if routing_of(cfg).is_default else ("consolidation.gate.routing",)
        if GATE_OBJECTIVES[objective].paper:  # the paper's gate: TRACE's keys as before the other objectives existed
            return ("moe", *routing, *composite_reads(cfg))
        reads = ["moe", "consolidation.gate.objective", *routing, *composite_reads(cfg)]
        for o in dict.fromkeys([warm_objective(cfg), objective]):  # the warm start's reads, then the objective's
            reads += GATE_OBJECTIVES[o].reads
        return tuple(dict.fromkeys(reads))

    def stage_inputs(self, cfg):
        # the other objectives roll the adapters out in the capability environments
        inputs = () if GATE_OBJECTIVES[gate_objective(cfg)].paper else ("synthesize",)
        return tuple(dict.fromkeys(inputs + composite_inputs(cfg)))  # chained episodes live in the synthesize artifact

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        cfg, m = ctx.cfg, ctx.cfg.moe
        routing = routing_of(cfg)
        check_top_k(routing.soft_top_k, len(adapters) + (1 if m.base_slot else 0), "consolidation.gate.routing.soft_top_k")
        objective, warm = gate_objective(cfg), warm_objective(cfg)
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
        chain_note, chain_spent = None, None
        if composite_on(cfg):  # beyond the paper (issue 53): each chain's episodes, a gate-training group of its own
            chains, chain_spent, chain_note = chain_examples(ctx.inputs["synthesize"].path, tokenizer,
                                                             m.gate_data == "successes")
            chain_train, chain_held = split_heldout(chains, seed=ctx.seed)
            examples = with_chains(examples, chain_train, per_group, ctx.seed)
            held_groups.update(chain_held)
            held = [ex for cap in sorted(held_groups) for ex in held_groups[cap]]
        model = build_lora_moe(backbone, {c: str(a.path / "adapter") for c, a in adapters.items()},
                               MoEConfig(top_k=m.top_k, renormalize=m.renormalize, impl=m.impl,
                                         train_top_k=m.train_top_k, include_base_slot=m.base_slot,
                                         gate_init_std=m.gate_init_std, seed=ctx.seed,
                                         granularity=routing.granularity, soft_top_k=routing.soft_top_k,
                                         soft_temperature=routing.temperature),
                               backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
        pad = padding_id(tokenizer)

        def measure() -> dict[str, Any]:
            groups = {cap: ex for cap, ex in held_groups.items() if ex}
            return heldout_measures(model, groups, m.batch_size, m.ce_chunk, pad) if groups else {}

        before = measure()
        train_cfg = GateTrainConfig(**{f.name: m[f.name] for f in fields(GateTrainConfig)})
        extra: dict[str, Any] = {"objective": objective}
        spent = Budget()
        if chain_spent is not None:  # every chained episode sampled counts in TRACE's budget
            spent += chain_spent
        pkgs = {}
        if not GATE_OBJECTIVES[objective].paper:
            syn = ctx.inputs["synthesize"]
            ready = set(ready_capabilities(syn))
            pkgs = {cap: syn.path / cap for cap in sorted(ready & set(adapters))}
        if not GATE_OBJECTIVES[warm].soft_targets:  # CE + LB
            log_rows = train_gates(model, examples, train_cfg, seed=ctx.seed, pad_id=pad)
        else:  # soft targets: every slot's measured reward on each example's environment
            st = cfg.consolidation.gate.soft_target
            slots = {s: None if m.base_slot and i == 0 else adapters[s] for i, s in enumerate(model.slot_names)}
            rewards = measure_rewards(ctx, slots, pkgs, int(st.seeds))
            missing = sorted(set(train_groups) - set(rewards))
            if missing:
                raise RuntimeError(f"compose: no ready environment to measure rewards on for {', '.join(missing)}")
            target = {cap: soft_targets(torch.tensor([rewards[cap][s] for s in model.slot_names]),
                                        float(st.temperature)).tolist() for cap in rewards}
            of = {id(ex): cap for cap, exs in train_groups.items() for ex in exs}
            log_rows = train_gates_soft_target(model, examples, [target[of[id(ex)]] for ex in examples], train_cfg,
                                               seed=ctx.seed, pad_id=pad)
            spent += Budget(episodes=len(slots) * len(pkgs) * int(st.seeds))
            extra.update(rewards=rewards, targets=target)
        if GATE_OBJECTIVES[objective].gate_grpo:
            grpo_rows, grpo_spent = train_gates_grpo(ctx, model, tokenizer, adapters, pkgs, cfg.consolidation.gate.grpo)
            write_log_csv(grpo_rows, ctx.work_dir / "gate_grpo_log.csv")
            for row in grpo_rows:
                ctx.record.logger.scalars({f"moe/grpo/{k}": v for k, v in row.items()})
            spent += grpo_spent
            extra["grpo"] = {"iterations": len(grpo_rows), "reward_first": grpo_rows[0]["reward_mean"],
                             "reward_last": grpo_rows[-1]["reward_mean"], **grpo_spent.to_dict()}
        after = measure()
        write_log_csv(log_rows, ctx.work_dir / "gate_log.csv")
        for row in log_rows:
            ctx.record.logger.scalars({f"moe/{k}": v for k, v in row.items()})
        model.save(ctx.work_dir / "moe")
        atomic_write_json(ctx.work_dir / "compose.json", {
            "capabilities": list(adapters), "examples": len(examples), "steps": len(log_rows),
            "heldout": {"examples": len(held), "per_capability": {c: len(v) for c, v in held_groups.items()},
                        "before": before, "after": after},
            "parameters": model.parameter_counts(), **({} if GATE_OBJECTIVES[objective].paper else extra)})
        # the warm start trains on the GRPO rollouts (no new episodes); soft targets' measurements and gate GRPO's
        # rollouts are episodes of their own
        gate = Budget(optimizer_steps=len(log_rows)) + spent
        notes = () if GATE_OBJECTIVES[objective].paper else (gate_note(objective, warm, extra),)
        if chain_note is not None:
            notes += (chain_note,)
        if not routing.is_default:
            notes += (f"inference routing: {routing.label()} (consolidation.gate.routing)",)
        return Consolidated("moe", "moe", adapters_budget(adapters) + gate, notes=notes)

    def report(self, art, ctx) -> None:
        super().report(art, ctx)
        c = read_json(art.path / "compose.json")
        ctx.record.section("LoRA mixture of experts", moe_report(c))


def gate_note(objective: str, warm: str, extra: dict[str, Any]) -> str:
    """The results-table note of a gate trained by another objective than the paper's CE + LB."""
    parts = [f"gate objective {objective}" + (f" (warm start {warm})" if GATE_OBJECTIVES[objective].gate_grpo else "")]
    if "targets" in extra:
        parts.append("soft targets " + "; ".join(f"{cap}: " + ", ".join(f"{p:.2f}" for p in t)
                                                 for cap, t in extra["targets"].items()))
    if "grpo" in extra:
        g = extra["grpo"]
        parts.append(f"GRPO {g['iterations']} iterations, reward {g['reward_first']:.3f} -> {g['reward_last']:.3f}")
    return "; ".join(parts)


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
    if c.get("rewards"):  # soft targets: each slot's measured reward per environment, and the target it gave
        slots = list(next(iter(c["rewards"].values())))
        lines += ["", f"Gate objective {c['objective']}: measured mean reward of each expert per environment -> "
                  "routing target:", "", "| environment | " + " | ".join(slots) + " | target |",
                  "|---|" + "---|" * (len(slots) + 1)]
        for env, r in c["rewards"].items():
            lines.append(f"| {env} | " + " | ".join(f"{r[s]:.3f}" for s in slots) + " | "
                         + ", ".join(f"{p:.2f}" for p in c["targets"][env]) + " |")
    if c.get("grpo"):
        g = c["grpo"]
        lines += ["", f"Gate GRPO: {g['iterations']} iterations, {g['episodes']:,} episodes, {g['optimizer_steps']} "
                  f"steps; mean reward {g['reward_first']:.3f} (first iteration) -> {g['reward_last']:.3f} (last); "
                  "per iteration in gate_grpo_log.csv."]
    lines += ["", "Parameters: " + ", ".join(f"{k}: {v:,}" for k, v in c["parameters"].items() if isinstance(v, int))]
    return "\n".join(lines)
