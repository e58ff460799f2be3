"""SFT of one LoRA adapter on exact token rows (paper App. C, "SFT Synthetic").

The consolidation baseline trains a single adapter on the successful trajectories of all the
synthesized capability environments (official: TRL SFT, LoRA r 32, lr 2e-5). Its data are the
capability GRPO runs' own rollouts (kept ``full`` by every tracekit run, :func:`tracekit.runs.grpo_run`: no
config knob): :func:`sft_examples` turns each successful trajectory's recorded turns into the exact rows GRPO
trained on (``tokens.build_rows``: the prompt ids the policy received, the ids it sampled), nothing re-tokenized.

One optimizer step, top to bottom (:func:`train_sft`):

1. the step's batch: ``batch_size`` examples of this epoch's seeded permutation (the last batch
   of an epoch may be smaller);
2. the learning rate of the step (linear decay to 0 after an optional warmup, TRL's default; or
   constant);
3. length-bucketed microbatches -> chunked log-probs of the assistant tokens (``loss_mask``) ->
   ``-sum log p / N_batch`` -> backward, where ``N_batch`` is the number of assistant tokens of the
   *whole batch* (all microbatches): the loss is the token mean over the batch, as TRL's
   ``num_items_in_batch`` normalization, so the microbatch split never changes the gradient;
4. clip the gradient norm; AdamW on the adapter only;
5. a metrics row; a checkpoint every ``checkpoint_every`` steps (adapter, optimizer, RNG, step).

Context tokens (system/user/tool messages, the chat template's markup) are inputs only: the
loss never sees their log-probs.

Defaults and why: lr 2e-5, r 32 (alpha 64, as the GRPO adapters), 3 epochs, 8 examples per step,
max grad norm 1.0, linear schedule without warmup: the official TRACE SFT baseline runs TRL's
SFTTrainer with lr 2e-5 and r 32; the rest are TRL's ``SFTConfig`` defaults.

The second half of this module holds recipe components the distillation recipe shares and that
``GRPOTrainer`` keeps privately (single-process checkpoints, adapter saving, metrics CSV,
seeding); they are meant to move to a shared components module.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from tracekit.artifacts import iter_jsonl
from tracekit.llm.decoding import causal_lm_of
from tracekit.rl.components import (LocalBackend, MetricsCSV, load_checkpoint, place_model,
                                    save_checkpoint, save_peft_adapter, seed_everything)
from tracekit.rl.fused import set_fused_update_kernels
from tracekit.ranges import DTYPES, Choice, check_declared
from tracekit.rl.settings import LoraSettings, lora_ranges
from tracekit.rl.tokens import PolicyRow, Turn, build_rows, collate, pack_microbatches
from tracekit.rl.model import build_peft_model, sequence_logprobs, set_activation_checkpointing
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

Example = tuple[list[int], list[int]]  # (token_ids, loss_mask): loss_mask[i] == 1 iff token i is the assistant's


@dataclass
class SFTSettings:
    """Every knob of the SFT recipe."""

    lr: float = 2e-5  # official TRACE SFT (TRL)
    epochs: int = 3  # TRL default
    batch_size: int = 8  # examples per optimizer step (TRL per_device_train_batch_size default)
    max_grad_norm: float = 1.0  # 0 = no clipping
    schedule: str = "linear"  # linear (decay to 0, TRL default) | constant
    warmup_ratio: float = 0.0  # fraction of the steps with a linear warmup from 0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    microbatch_tokens: int = 8192  # padded tokens per forward/backward (length bucketing)
    logprob_chunk: int = 1024  # rows of the [tokens x vocab] logits alive at once
    gradient_checkpointing: bool = False
    fused_update_kernels: bool = True  # as GRPO's: LoRA as bf16 addmm, fused RMSNorm (rl/fused.py)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    seed: int = 0
    checkpoint_every: int = 50  # optimizer steps
    keep_checkpoints: int = 2
    lora: LoraSettings = field(default_factory=LoraSettings)  # r 32 / alpha 64 (official SFT: r 32)
    # train every weight instead of a LoRA adapter (a model from random initialization: the micro backbone's warm
    # start); writes out_dir/model, and keeps no resumable checkpoint (the caller's folder is built atomically)
    full_parameters: bool = False

    # checked here and by tracekit.validate for each config group built on this class (one check per knob)
    RANGES: ClassVar[dict[str, str]] = {
        "lr": "> 0", "epochs": ">= 1", "batch_size": ">= 1", "max_grad_norm": ">= 0", "warmup_ratio": "[0, 1)",
        "betas": "[0, 1)", "weight_decay": ">= 0", "microbatch_tokens": ">= 1", "logprob_chunk": ">= 1", "seed": ">= 0",
        "checkpoint_every": ">= 1", "keep_checkpoints": ">= 1", **lora_ranges()}  # fmt: skip

    CHOICES: ClassVar[dict[str, Choice]] = {"schedule": ("linear", "constant"), "dtype": DTYPES}

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        check_declared("sft", self)


SFT_METRIC_COLUMNS = [
    "step", "epoch", "loss", "grad_norm", "lr", "examples", "tokens_trained", "tokens_forward",
    "optimizer_steps", "tokens_generated", "episodes", "time_step_s",
]  # fmt: skip
# optimizer_steps / tokens_generated / episodes are per row (summed over the file they give the run's
# budget, as for GRPO's metrics.csv); SFT samples nothing and rolls out nothing: its data's cost is
# the GRPO runs that produced the rollouts.


# --------------------------------------------------------------------------------------------
# Data


def sft_examples(adapter_dirs: Iterable[str | Path], successes_only: bool = True) -> list[Example]:
    """Exact training rows from GRPO runs' rollouts: ``(token_ids, loss_mask)`` per row.

    ``adapter_dirs``: GRPO adapter artifact dirs, each with ``rollouts/iter_*.jsonl`` written with
    ``GRPOSettings.save_rollouts="full"``, as every tracekit run writes them (trajectories carry
    ``info['turns']``). Every trajectory (successful ones only by default) becomes the rows ``tokens.build_rows``
    makes of its turns: the assistant's sampled tokens are masked in, everything else is context. Order: dirs as given, files by name,
    lines in order (deterministic; :func:`train_sft` shuffles with its seed). Duplicates are kept
    (a behaviour that succeeded often weighs more, as in the rollouts).
    """
    out: list[Example] = []
    for d in adapter_dirs:
        files = sorted((Path(d) / "rollouts").glob("iter_*.jsonl"))
        if not files:
            raise ValueError(f"{d}: no rollouts/iter_*.jsonl (SFT data is a GRPO run's rollouts, kept by every tracekit "
                             "run: is this a train stage's adapter folder?)")
        for f in files:
            for n, row in enumerate(iter_jsonl(f), start=1):
                if successes_only and not row.get("success"):
                    continue
                turns = (row.get("info") or {}).get("turns")
                if turns is None:
                    raise ValueError(f"{f}:{n}: trajectory has no token turns (written with GRPOSettings.save_rollouts="
                                     "'messages', outside tracekit's runs; SFT needs 'full')")
                out += [(rec.token_ids, rec.loss_mask) for rec in build_rows([Turn.from_dict(t) for t in turns])]
    return out


def _rows(examples: Sequence[Example]) -> list[PolicyRow]:
    """Examples as collatable rows (advantage and rollout log-probs unused), checked."""
    if not examples:
        raise ValueError("SFT needs at least one example")
    rows = []
    for i, (ids, mask) in enumerate(examples):
        ids, mask = [int(t) for t in ids], [int(m) for m in mask]
        if len(ids) != len(mask):
            raise ValueError(f"example {i}: {len(ids)} token ids but {len(mask)} loss-mask entries")
        if mask and mask[0]:
            raise ValueError(f"example {i}: its first token is masked in but has no context to be predicted from")
        if not any(mask):
            raise ValueError(f"example {i} has no assistant token to train on")
        rows.append(PolicyRow(ids, mask, [0.0] * len(ids), 0.0, i, sum(mask)))
    return rows


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The seeded permutation of ``n`` examples for ``epoch`` (a function of (seed, epoch) only: resumable)."""
    order = list(range(n))
    random.Random(int(stable_hash([seed, epoch, "sft-order"], 15), 16)).shuffle(order)
    return order


def lr_at(step: int, total: int, s: SFTSettings) -> float:
    """The learning rate of optimizer step ``step`` (0-based) of ``total``: warmup, then linear decay or constant."""
    warm = int(math.ceil(s.warmup_ratio * total))
    if step < warm:  # transformers' warmup starts at 0; here the first step already moves
        return s.lr * (step + 1) / warm
    if s.schedule == "constant":
        return s.lr
    return s.lr * max(0.0, (total - step) / max(1, total - warm))  # transformers' linear: the last step is not 0


def masked_nll(model: torch.nn.Module, batch: Any, device: torch.device, chunk: int = 1024) -> torch.Tensor:
    """``-sum`` of the log-probs of the masked-in tokens of a collated batch (scalar, differentiable).

    The token at t is scored from position t - 1 (``sequence_logprobs``): only targets with
    ``loss_mask == 1`` enter, so a context token's identity never reaches the loss as a target.
    """
    return -sequence_logprobs(model, batch.input_ids.to(device), batch.attention_mask, batch.loss_mask, chunk=chunk).sum()


# --------------------------------------------------------------------------------------------
# The recipe


def train_sft(
    model: torch.nn.Module,
    tokenizer_pad_id: int,
    examples: Sequence[Example],
    settings: SFTSettings,
    out_dir: str | Path,
    *,
    device: str | torch.device | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> dict[str, Any]:
    """Train a fresh LoRA adapter on ``examples`` (resuming ``out_dir``'s checkpoint if there is one); with
    ``settings.full_parameters``, every weight of ``model`` instead (``out_dir/model``, no checkpoints).

    ``model``: the plain backbone (frozen here). Writes ``out_dir/adapter`` (peft), ``metrics.csv``
    (one row per optimizer step) and ``checkpoints/``. ``callbacks`` get each step's metrics; one
    that raises stops training after that step's checkpoint logic ran. Returns a summary (adapter
    dir, budget, first/last loss).
    """
    s = settings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = _rows(examples)
    model, dev = place_model(model, device, s.dtype)
    if s.full_parameters:
        model.requires_grad_(True)
    else:
        model = build_peft_model(model, s.lora, s.seed)
        set_fused_update_kernels(causal_lm_of(model), s.fused_update_kernels)
    if s.gradient_checkpointing:
        set_activation_checkpointing(causal_lm_of(model), True)
    backend = LocalBackend(model, s)
    steps_per_epoch = math.ceil(len(rows) / s.batch_size)
    total = s.epochs * steps_per_epoch
    metrics = MetricsCSV(out / "metrics.csv", SFT_METRIC_COLUMNS, index="step")
    ckpts = out / "checkpoints"

    last = None if s.full_parameters else load_checkpoint(ckpts, model, backend)
    if last is None:
        seed_everything(s.seed)  # LoRA dropout draws from torch's RNG
        start = 0
    else:
        start = last + 1
        metrics.keep_through(last)
    model.eval()
    for step in range(start, total):
        t0 = time.time()
        epoch, b = divmod(step, steps_per_epoch)
        idx = epoch_order(len(rows), s.seed, epoch)[b * s.batch_size : (b + 1) * s.batch_size]
        batch = [rows[i] for i in idx]
        lr = lr_at(step, total, s)
        for g in backend.opt.param_groups:
            g["lr"] = lr
        n_tokens = sum(sum(r.loss_mask) for r in batch)  # the batch's assistant tokens: the loss's denominator
        nll_sum, forward_tokens = 0.0, 0
        model.train()
        for micro in pack_microbatches([len(r) for r in batch], s.microbatch_tokens):
            mb = collate([batch[i] for i in micro], tokenizer_pad_id)
            nll = masked_nll(model, mb, dev, s.logprob_chunk)
            backend.backward(nll / n_tokens, boundary=True)
            nll_sum += float(nll.detach())
            forward_tokens += int(mb.attention_mask.sum())
        grad_norm = backend.step()
        model.eval()
        row = {
            "step": step, "epoch": epoch, "loss": nll_sum / n_tokens, "grad_norm": grad_norm, "lr": lr,
            "examples": len(batch), "tokens_trained": n_tokens, "tokens_forward": forward_tokens,
            "optimizer_steps": 1, "tokens_generated": 0, "episodes": 0, "time_step_s": time.time() - t0,
        }  # fmt: skip
        metrics.append(row)
        if not s.full_parameters and ((step + 1) % s.checkpoint_every == 0 or step + 1 == total):
            save_checkpoint(ckpts, step, model, backend, {"settings": asdict(s), "unit": "optimizer step"}, s.keep_checkpoints)
        for cb in callbacks:
            cb(row)
    if s.full_parameters:
        model.save_pretrained(out / "model")
    else:
        save_peft_adapter(model, out / "adapter")
    losses = [float(r["loss"]) for r in metrics.rows]
    return {
        ("model" if s.full_parameters else "adapter"): str(out / ("model" if s.full_parameters else "adapter")),
        "examples": len(rows),
        "optimizer_steps": total,
        "episodes": 0,
        "tokens_generated": 0,
        "tokens_trained": sum(int(float(r["tokens_trained"])) for r in metrics.rows),
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
    }

