"""``adp_sft``: LoRA SFT (the SFT recipe, :mod:`tracekit.rl.sft`, assistant tokens only) on public agent
trajectories in the Agent Data Protocol's unified schema (paper Tables 1-3: "ADP"; official: LLaMA-Factory
QLoRA r 16, lr 1e-5, 1 epoch; here LoRA without 4-bit quantization).

Data: ``baselines.adp_sft.data``, ADP standardized files (``.jsonl``, or ``.json`` lists) or hub ids
``hf://<owner>/<dataset>/<subset>`` (neulab/agent-data-collection's ``<subset>/full_std.jsonl``), converted by
:mod:`tracekit.methods.adp_data`. A malformed record is counted and reported with its line number; the rest
are used. Budget: no environment episode, no sampled token; the SFT's optimizer steps.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import OmegaConf

from dataclasses import dataclass, field
from typing import ClassVar

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.config import ConfigError
from tracekit.llm.backbones import load_backbone
from tracekit.llm.hf import padding_id
from tracekit.methods.adp_data import load_adp, sft_rows
from tracekit.methods.base import Method, PolicyRow
from tracekit.pipeline import Stage
from tracekit.policy import Budget, Policy
from tracekit.ranges import Choice
from tracekit.rl.sft import SFTSettings, train_sft
from tracekit.wiring import backbone_dict, device, dtype


@dataclass
class AdpSftSettings(SFTSettings):
    """adp_sft: the SFT recipe on Agent Data Protocol trajectories (official: QLoRA r 16, lr 1e-5, 1 epoch)."""

    data: list[str] = field(default_factory=list)  # ADP standardized JSON/JSONL paths or hf://<owner>/<dataset>/<subset>
    max_records: int | None = None  # first n well-formed trajectories over all sources (None: all)
    max_tokens: int = 8192  # a training row longer than this is cut to its first max_tokens tokens

    RANGES: ClassVar[dict[str, str]] = {**SFTSettings.RANGES, "max_records": ">= 1", "max_tokens": ">= 16"}
    CHOICES: ClassVar[dict[str, Choice]] = {
        **SFTSettings.CHOICES,
        "data": r"(hf://[\w.\-]+/[\w.\-]+(/[\w.\-/]+)?|[^:]+|[A-Za-z]:.+)",  # paths or hub ids
        "lora.target_modules": r"[\w.\-*]+", "lora.target_parameters": r"[\w.\-*]+"}


LABEL = "ADP SFT"
REPORT = "adp_report.json"
_OWN_KEYS = ("data", "max_records", "max_tokens")


def data_identity(cfg):
    """The local files' content hashes (editing a file recomputes); hub ids as given."""
    out = {}
    for src in cfg.baselines.adp_sft.data:
        p = Path(src).expanduser()
        out[src] = hashlib.sha256(p.read_bytes()).hexdigest() if not src.startswith("hf://") and p.is_file() else src
    return out


def adp_stage(ctx) -> None:
    cfg, s = ctx.cfg, ctx.cfg.baselines.adp_sft
    records, report = load_adp(list(s.data), s.max_records)
    model, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
    examples = sft_rows(records, tokenizer, s.max_tokens, report)
    atomic_write_json(ctx.work_dir / REPORT, report.to_dict())
    if not examples:
        raise RuntimeError(f"adp_sft: no usable ADP trajectory in {', '.join(s.data)} ({report.summary()})")
    settings = SFTSettings(**{k: v for k, v in OmegaConf.to_container(s, resolve=True).items() if k not in _OWN_KEYS})
    logger = ctx.record.logger
    summary = train_sft(model, padding_id(tokenizer), examples,
                        settings, ctx.work_dir / "sft", device=device(cfg),
                        callbacks=[lambda row: logger.scalars({f"adp_sft/{k}": v for k, v in row.items()})])
    atomic_write_json(ctx.work_dir / "adp_sft.json", {"summary": summary, "report": report.summary(),
                                                     "sources": list(s.data)})


def adp_report(art: Artifact, ctx) -> None:
    r = read_json(art.path / "adp_sft.json")
    rep = read_json(art.path / REPORT)
    bad = "".join(f"\n- {m['source']}:{m['line']}: {m['reason']}" for m in rep["malformed"][:20])
    ctx.record.section("ADP SFT", f"{r['report']}; SFT {r['summary']['optimizer_steps']} optimizer steps, loss "
                       f"{r['summary']['loss_first']:.3f} -> {r['summary']['loss_last']:.3f}.{bad}")


class AdpSft(Method):
    settings = AdpSftSettings
    name = "adp_sft"
    summary = "LoRA SFT on Agent Data Protocol trajectories (public agent data, not the target's)"
    stages = (Stage("adp_sft", reads=("baselines.adp_sft", "backbone"), inputs=(), compute=adp_stage,
                    report=adp_report, key_extra=data_identity),)

    def inputs(self, cfg):
        return ("adp_sft",)

    def validate(self, cfg):
        s = cfg.baselines.adp_sft
        if not s.data:
            raise ConfigError("baselines.adp_sft.data=[] is invalid: must list ADP files or hf://<owner>/<dataset>/"
                              "<subset> ids when eval.methods has adp_sft")
        for src in s.data:
            if not src.startswith("hf://") and not Path(src).expanduser().is_file():
                raise ConfigError(f"baselines.adp_sft.data: {src} is not a file")
        try:
            SFTSettings(**{k: v for k, v in OmegaConf.to_container(s, resolve=True).items() if k not in _OWN_KEYS})
        except ValueError as e:
            raise ConfigError(str(e).replace("sft.", "baselines.adp_sft.", 1)) from None

    def rows(self, ctx):
        art = ctx.inputs["adp_sft"]
        r = read_json(art.path / "adp_sft.json")
        return [PolicyRow(LABEL, Policy("adapter", art, "sft/adapter"),
                          Budget(optimizer_steps=int(r["summary"]["optimizer_steps"])),
                          (f"SFT on {r['report']}",))]
