"""``route``: TRACE's task-level router (the official repository's ``docs/inference_routing_subsection.tex``; not
the paper's Table 4 method, which is the LoRA-MoE): per episode, the base model picks among the capability adapters
and "no adapter", the top-p of its probabilities weigh the chosen adapters, and the episode runs on
``W' = W + sum_c alpha_c B_c A_c``, decided once from the opening and held for every turn.

Compose writes a LoRA-MoE directory (``moe/``: the adapter bank, a base slot, ``decider="task"``,
``granularity="trajectory"``) with the router's files (:mod:`tracekit.moe.task_router`): the selected capabilities'
descriptions (from ``select``), ``consolidation.route``'s settings and the retrieval corpus, i.e. up to
``trajectories_per_capability`` successful rollouts of each capability's GRPO run (its own adapter in its own
environment), each with its embedding. At evaluation, :class:`tracekit.moe.routed.PromptRoutedClient` asks the
router for each new episode's weights and pins the bank to them (:meth:`tracekit.moe.model.LoRAMoEModel.pinned`:
exactly ``W + sum_c alpha_c B_c A_c`` on every token, computed as unmerged low-rank terms). Budget: the capability
runs', nothing more (no training, no new episode).

Deviations from the official description, named:
- the embedding model is the backbone itself (mean-pooled last hidden state of the task text), not a separate
  embedding model; the task text is the opening's user messages (the system prompt where there is none), cut;
- the corpus is the capability GRPO runs' successful rollouts (the official: trajectories demonstrating each
  capability applied correctly); each example is shown as its task and its tool calls, cut to ``example_chars``;
- a candidate is shown with its best-ranked retrieved example only; the labels are single letters scored by the
  first token's probability, renormalized over the labels (a tokenizer without one-token letters is refused);
- the weights are applied as the pinned bank rather than merged into W in place (the same function: the official
  text itself says precomputing W' introduces no approximation); ``top_p`` is not stated there (default 0.9).

Serving it with vLLM (one merged adapter per request): for each episode, compute its weights from the opening with
the saved router (``load_task_router(moe_dir, ...).decide``), write the merged adapter with
:func:`write_merged_adapter` (``merge_cat`` of ``alpha_c``-scaled factors: exactly ``sum_c alpha_c B_c A_c``, rank
the sum of the chosen ranks; weights all on "no adapter": no adapter at all), start ``vllm serve <backbone>
--enable-lora --max-lora-rank <that rank>``, load the adapter at runtime (``POST /v1/load_lora_adapter`` with a name
of the weights' hash) and send every request of the episode with ``model=<that name>``. Episodes of equal weights
share one adapter.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from tracekit.artifacts import Artifact, atomic_write_json, iter_jsonl, read_json
from tracekit.config import TRAJECTORY_SETS, ConfigError
from tracekit.llm.backbones import load_backbone
from tracekit.llm.hf import padding_id
from tracekit.llm.tools import encode_prompt
from tracekit.merging.lora_io import LoraFactors, read_adapter_config, read_lora_adapter, write_lora_adapter
from tracekit.merging.merges import merge_cat
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.moe.task_router import TaskRouter, example_text, save_task_router, task_text
from tracekit.ranges import Choice
from tracekit.types import Message
from tracekit.wiring import backbone_dict, device, dtype

SELECTED_NAMES = "selected_names.json"  # the select stage's selection: names and descriptions


@dataclass
class RouteConfig:
    """route: TRACE's task-level router (official docs/inference_routing_subsection.tex)."""

    top_p: float = 0.9  # nucleus over the chosen capabilities' probabilities (not stated in the official text)
    retrieve_k: int = 4  # corpus trajectories retrieved per episode; their capabilities are the candidates
    trajectories_per_capability: int = 32  # GRPO rollouts of each capability in the corpus
    corpus: str = "successes"  # which GRPO rollouts: successes (the official: correct applications) | all
    example_chars: int = 600  # characters of a retrieved example shown to the classifier

    RANGES: ClassVar[dict[str, str]] = {"top_p": "(0, 1]", "retrieve_k": ">= 1", "trajectories_per_capability": ">= 1",
                                        "example_chars": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"corpus": TRAJECTORY_SETS}


class Route(Strategy):
    name = "route"
    settings = RouteConfig
    label = "TRACE task router"
    inputs = ("select",)

    def reads(self, cfg):
        return ("consolidation.route",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        cfg, r = ctx.cfg, ctx.cfg.consolidation.route
        selected = {c["name"]: c.get("description") or "" for c in read_json(ctx.inputs["select"].path / SELECTED_NAMES)}
        blank = [c for c in adapters if not selected.get(c, "").strip()]
        if blank:  # before any work, one line (a dictionary without descriptions is refused at validation already)
            raise ConfigError(f"consolidation=route is invalid: the selected capabilities {', '.join(blank)} have no "
                              "description (the task router classifies over the capabilities' descriptions)")
        corpus = _corpus(adapters, int(r.trajectories_per_capability), int(r.example_chars), ctx.seed,
                         r.corpus == "successes")
        backbone, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
        model = build_lora_moe(backbone, {c: str(a.path / "adapter") for c, a in adapters.items()},
                               MoEConfig(include_base_slot=True, granularity="trajectory", decider="task", seed=ctx.seed),
                               backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
        spec = {"descriptions": {c: selected[c] for c in adapters}, "top_p": float(r.top_p),
                "retrieve_k": int(r.retrieve_k), "corpus": corpus}
        hidden = model.config.hidden_size
        try:
            router = TaskRouter(model, lambda m, t: encode_prompt(tokenizer, m, t), tokenizer, padding_id(tokenizer),
                                spec, torch.zeros(0, hidden))
        except ValueError as e:  # labels the tokenizer cannot score as one token each: one line
            raise ConfigError(f"consolidation=route: {e}") from None
        embeddings = torch.cat([router.embed([e["task"] for e in corpus[i: i + 16]]) for i in range(0, len(corpus), 16)])
        model.save(ctx.work_dir / "moe")
        save_task_router(ctx.work_dir / "moe", spec["descriptions"], spec["top_p"], spec["retrieve_k"], corpus, embeddings)
        per_cap = {c: sum(e["capability"] == c for e in corpus) for c in adapters}
        atomic_write_json(ctx.work_dir / "compose.json", {"capabilities": list(adapters), "corpus": per_cap,
                                                          "top_p": spec["top_p"], "retrieve_k": spec["retrieve_k"],
                                                          "parameters": model.parameter_counts()})
        notes = (f"task-level router over {len(adapters)} adapters and no adapter: {len(corpus)} retrieval trajectories "
                 f"({', '.join(f'{c}: {n}' for c, n in per_cap.items())}), top {spec['retrieve_k']} retrieved, top-p "
                 f"{spec['top_p']:g}; one merged adapter per episode; no training",)
        return Consolidated("moe", "moe", adapters_budget(adapters), notes=notes)


def _corpus(adapters: dict[str, Artifact], per_capability: int, chars: int, seed: int, successes_only: bool
            ) -> list[dict[str, str]]:
    """Up to ``per_capability`` GRPO rollouts of each capability (successful ones only by default; seeded sample),
    as router entries."""
    out = []
    for cap, art in adapters.items():
        rows = [row for f in sorted((art.path / "rollouts").glob("iter_*.jsonl")) for row in iter_jsonl(f)
                if row.get("success") or not successes_only]
        if not rows:
            raise RuntimeError(f"compose: no {'successful ' if successes_only else ''}GRPO rollout of {cap} to retrieve "
                               "(consolidation.route.corpus=all takes every rollout into the task router's corpus)")
        for row in random.Random(f"{seed}-{cap}").sample(rows, min(per_capability, len(rows))):
            messages = [Message.model_validate(m) for m in row["messages"]]
            out.append({"capability": cap, "task": task_text(messages), "example": example_text(messages, chars)})
    return out


def write_merged_adapter(moe_dir: str | Path, weights: dict[str, float], out: str | Path) -> Path | None:
    """One peft adapter holding ``sum_c weights[c] B_c A_c`` (exact: the scaled factors concatenated) of the
    adapters saved in the LoRA-MoE directory ``moe_dir``, for a server that takes one adapter per request (vLLM).
    None when no weight is positive (the base model serves the episode)."""
    moe_dir = Path(moe_dir)
    meta = read_json(moe_dir / "moe_config.json")
    dirs = {a["name"]: moe_dir / a["dir"] for a in meta["adapters"]}
    unknown = sorted(set(weights) - set(dirs) - {"base"})
    if unknown:
        raise ValueError(f"weights for adapters {unknown} not in {moe_dir} (it holds {sorted(dirs)})")
    chosen = {c: w for c, w in weights.items() if c != "base" and w > 0}
    if not chosen:
        return None
    factors = {c: {m: LoraFactors(f.A, f.B * w, f.scale) for m, f in read_lora_adapter(dirs[c]).items()}
               for c, w in chosen.items()}
    write_lora_adapter(out, merge_cat(factors), base_config=read_adapter_config(dirs[next(iter(chosen))]))
    return Path(out)


__all__ = ["Route", "RouteConfig", "write_merged_adapter"]
