"""``sft_synthetic``: one adapter trained by SFT (assistant tokens only) on the capability environments'
trajectories collected by the per-capability GRPO runs (paper Table 4; official: TRL SFT, r 32, lr 2e-5).
Successful ones by default (``consolidation.sft.data``); the data costs no new episode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from tracekit.artifacts import Artifact
from tracekit.config import TRAJECTORY_SETS
from tracekit.llm.backbones import load_backbone
from tracekit.llm.hf import padding_id
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.policy import Budget
from tracekit.ranges import Choice
from tracekit.rl.sft import SFTSettings, sft_examples, train_sft
from tracekit.wiring import backbone_dict, device, dtype


@dataclass
class SftConfig(SFTSettings):
    """sft_synthetic: the SFT recipe's settings, plus which GRPO trajectories it trains on."""

    data: str = "successes"  # successes (the paper) | all (every trajectory: for runs with no success)

    CHOICES: ClassVar[dict[str, Choice]] = {**SFTSettings.CHOICES, "data": TRAJECTORY_SETS}


class SFTSynthetic(Strategy):
    name = "sft_synthetic"
    label = "SFT Synthetic"
    settings, mount = SftConfig, "sft"

    def reads(self, cfg):
        return ("consolidation.sft",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        from omegaconf import OmegaConf


        cfg, s = ctx.cfg, ctx.cfg.consolidation.sft
        examples = sft_examples([a.path for a in adapters.values()], successes_only=s.data == "successes")
        if not examples:
            raise RuntimeError(f"sft_synthetic: no {s.data} GRPO trajectories in {', '.join(adapters)} "
                               "(consolidation.sft.data=all trains on every one)")
        settings = SFTSettings(**{k: v for k, v in OmegaConf.to_container(s, resolve=True).items() if k != "data"})
        model, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        logger = ctx.record.logger
        summary = train_sft(model, padding_id(tokenizer), examples,
                            settings, ctx.work_dir / "sft", device=device(cfg),
                            callbacks=[lambda row: logger.scalars({f"sft/{k}": v for k, v in row.items()})])
        return Consolidated("adapter", "sft/adapter",
                            adapters_budget(adapters) + Budget(optimizer_steps=summary["optimizer_steps"]),
                            notes=(f"SFT on {len(examples)} assistant-token rows ({s.data} GRPO trajectories), "
                                   f"loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}",))
