"""``arrow``: a training-free router over the capability adapters (Ostapenko et al. 2024; peft 0.21's
``ArrowConfig`` / ``create_arrow_model``, whose routing it reproduces: ``tests/test_moe_arrow.py``).

Every adapted projection routes each token of its own input: the adapters' prototypes are the top right-singular
vectors of their ``B A`` (:mod:`tracekit.moe.arrow`), a token keeps the ``top_k`` adapters of highest
``|<x, prototype>|`` and weighs them by ``softmax(score / temperature)``. The result is a LoRA-MoE directory
(``moe/``, router ``arrow``: no gate), evaluated and decoded (the fast decoder's LoRA-MoE blocks) like TRACE's.

Deviations from peft, named: the prototype is the exact singular vector, not 15 power-iteration steps from a random
start; ``top_k`` above the number of adapters keeps them all (peft's ``torch.topk`` would fail), said in the notes;
no GenKnowSub (TRACE has no general adapters). Budget: the capability runs', nothing more (no training).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tracekit.artifacts import Artifact, atomic_write_json
from tracekit.config import ConfigError
from tracekit.llm.backbones import load_backbone
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.wiring import backbone_dict, device, dtype


@dataclass
class ArrowConfig:
    """arrow: training-free routing by each adapter's prototype (peft ArrowConfig; tracekit.moe.arrow)."""

    top_k: int = 3  # adapters kept per token (peft's default; capped at the number of adapters, noted)
    temperature: float = 1.0  # softmax temperature over the kept scores (peft's router_temperature)

    RANGES: ClassVar[dict[str, str]] = {"top_k": ">= 1", "temperature": "> 0"}


class Arrow(Strategy):
    name = "arrow"
    settings = ArrowConfig
    label = "Arrow"

    def reads(self, cfg):
        return ("consolidation.arrow",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        cfg, a = ctx.cfg, ctx.cfg.consolidation.arrow
        top_k = min(int(a.top_k), len(adapters))
        backbone, _ = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        try:
            model = build_lora_moe(backbone, {c: str(art.path / "adapter") for c, art in adapters.items()},
                                   MoEConfig(router="arrow", top_k=top_k, router_temperature=float(a.temperature)),
                                   backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
        except ValueError as e:  # adapters Arrow cannot compare (ranks, target modules): one line
            if str(e).startswith("Arrow"):
                raise ConfigError(f"consolidation=arrow: {e}") from None
            raise
        model.save(ctx.work_dir / "moe")
        notes = [f"Arrow routing over {len(adapters)} adapters, top {top_k}, temperature {a.temperature:g}; no training"]
        if top_k < a.top_k:
            notes.append(f"consolidation.arrow.top_k={a.top_k} > {len(adapters)} adapters: all {top_k} kept")
        atomic_write_json(ctx.work_dir / "compose.json", {"capabilities": list(adapters), "top_k": top_k,
                                                          "temperature": float(a.temperature),
                                                          "parameters": model.parameter_counts()})
        return Consolidated("moe", "moe", adapters_budget(adapters), notes=tuple(notes))
