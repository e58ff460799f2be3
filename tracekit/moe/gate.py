"""Gate training for a composed LoRA-MoE model (paper section 3.5).

    L = L_CE + lambda_LB * L_LB,   L_LB = S * sum_c f_c P_c   (lambda_LB = 0.05 by default)

L_CE: mean token cross-entropy on the agent's response tokens (``loss_mask == 1``), computed with
chunked log-softmax over the vocabulary (``tracekit.ops.token_logprobs``: never the full
[tokens x vocab] logits at once). L_LB per adapted block over the batch's real (non-padding) tokens:
f_c = fraction of tokens whose largest gate probability is slot c, P_c = mean gate probability of c,
S = number of gate slots (base slot included when present); L_LB is the mean over blocks. f is a
count (no gradient); the gradient reaches the gates through P. Only the gate parameters are
optimized (AdamW); the backbone stays in eval mode.

The other objectives of ``consolidation.gate.objective`` (issue 39) are below the CE + LB loop: soft targets
(:func:`soft_targets`, :func:`soft_target_kl`, :func:`train_gates_soft_target`) and the trajectory-level expert
policy GRPO updates (:func:`prompt_routing`, :func:`expert_logprobs`).
"""

from __future__ import annotations

import csv
import io
import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from tqdm.auto import tqdm

from tracekit.artifacts import atomic_write_text
from tracekit.moe.layer import RoutingSpec
from tracekit.moe.model import LoRAMoEModel
from tracekit.ops import token_logprobs
from tracekit.ranges import check_declared
from tracekit.types import TokenRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateExample:
    """One tokenized sequence: ``loss_mask[i] == 1`` iff token i is an agent response token."""

    input_ids: list[int]
    loss_mask: list[int]

    def __post_init__(self) -> None:
        if len(self.input_ids) != len(self.loss_mask):
            n, m = len(self.input_ids), len(self.loss_mask)
            raise ValueError(f"input_ids ({n}) and loss_mask ({m}) differ in length")


def as_examples(items: Iterable[GateExample | TokenRecord | Mapping[str, Any]]) -> list[GateExample]:
    """Accept GateExamples, TokenRecords or mappings with input_ids (or token_ids) and loss_mask."""
    out = []
    for it in items:
        if isinstance(it, GateExample):
            out.append(it)
        elif isinstance(it, TokenRecord):
            out.append(GateExample(list(it.token_ids), list(it.loss_mask)))
        elif isinstance(it, Mapping):
            ids = it.get("input_ids", it.get("token_ids"))
            if ids is None or "loss_mask" not in it:
                raise ValueError(f"gate example needs input_ids/token_ids and loss_mask, got keys {sorted(it)}")
            out.append(GateExample(list(ids), list(it["loss_mask"])))
        else:
            raise TypeError(f"not a gate example: {type(it).__name__}")
    return out


def mix_uniformly(
    groups: Mapping[str, Sequence[GateExample]], seed: int, per_group: int | None = None
) -> list[GateExample]:
    """Equal numbers of examples from each group (e.g. each capability's successful trajectories), shuffled.

    ``per_group`` defaults to the smallest group's size; larger groups are subsampled without
    replacement (seeded), so no capability dominates the gate's training data.
    """
    if not groups or any(len(g) == 0 for g in groups.values()):
        raise ValueError(f"every group needs examples, sizes: { {k: len(v) for k, v in groups.items()} }")
    n = per_group if per_group is not None else min(len(g) for g in groups.values())
    if n > min(len(g) for g in groups.values()):
        raise ValueError(f"per_group={n} exceeds the smallest group ({min(len(g) for g in groups.values())})")
    rng = random.Random(seed)
    out = [ex for name in sorted(groups) for ex in rng.sample(list(groups[name]), n)]
    rng.shuffle(out)
    return out


@dataclass
class GateTrainConfig:
    """Gate training hyperparameters (lambda_lb from the paper; lr as the official router SFT); the ``moe`` config
    group extends this class (:class:`tracekit.config.MoeConfig`), so each knob has one name, default and check.

    gradient_checkpointing: recompute decoder layers in backward (HF checkpoints only modules in
    train mode, so the backbone is put in train mode: refused if it has any dropout > 0).
    """

    lambda_lb: float = 0.05
    lr: float = 5e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    steps: int = 200
    batch_size: int = 4
    ce_chunk: int = 1024  # vocab-projection chunk for the CE (never the full [tokens x vocab] logits)
    gradient_checkpointing: bool = False

    RANGES: ClassVar[dict[str, str]] = {"lambda_lb": ">= 0", "lr": "> 0", "weight_decay": ">= 0",
                                        "max_grad_norm": ">= 0", "steps": ">= 1", "batch_size": ">= 1",
                                        "ce_chunk": ">= 1"}

    def __post_init__(self) -> None:
        check_declared("moe", self)


# --------------------------------------------------------------------------- pure losses


def load_balancing_loss(
    probs: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """L_LB = S * sum_c f_c P_c for probs [N, S] over the tokens where ``mask`` [N] is true.

    Returns (loss, f [S], P [S]); f_c = share of tokens whose argmax is c, P_c = mean p_c.
    """
    if mask is not None:
        probs = probs[mask.bool()]
    if probs.shape[0] == 0:
        raise ValueError("load-balancing loss over zero tokens")
    S = probs.shape[-1]
    f = torch.bincount(probs.argmax(dim=-1), minlength=S).to(probs.dtype) / probs.shape[0]
    P = probs.mean(dim=0)
    return S * (f * P).sum(), f, P


def collate(examples: Sequence[GateExample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence: input_ids, attention_mask, loss_mask [B, L]."""
    L = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), L), pad_id, dtype=torch.long)
    attn = torch.zeros((len(examples), L), dtype=torch.long)
    lm = torch.zeros((len(examples), L), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attn[i, :n] = 1
        lm[i, :n] = torch.tensor(e.loss_mask)
    return {"input_ids": ids, "attention_mask": attn, "loss_mask": lm}


def response_ce(model: LoRAMoEModel, batch: Mapping[str, torch.Tensor], chunk: int = 1024) -> tuple[torch.Tensor, int]:
    """Mean CE over response tokens (token i with loss_mask[i] = 1, predicted from position i-1).

    Runs the decoder stack for hidden states and the lm_head chunk by chunk. Returns (ce, n_tokens).
    """
    lm = model.model
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(lm.config, "final_logit_softcapping", None):
        raise NotImplementedError("response_ce supports a plain bias-free lm_head (no logit soft-capping)")
    device = head.weight.device
    ids = batch["input_ids"].to(device)
    attn = batch["attention_mask"].to(device)
    hidden = lm.model(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    sel = (batch["loss_mask"][:, 1:].to(device) * attn[:, 1:]).bool()
    n = int(sel.sum())
    if n == 0:
        raise ValueError("batch has no response tokens (loss_mask is 0 everywhere after position 0)")
    logp = token_logprobs(hidden[:, :-1][sel], head.weight, ids[:, 1:][sel], chunk=chunk)
    return -logp.mean(), n


def routing_loss(model: LoRAMoEModel, attention_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over adapted blocks of L_LB (latest forward); stats hold per-block LB, f (usage) and P."""
    mask = attention_mask.reshape(-1)
    losses, stats = [], {}
    for b, probs in model.gate_probs().items():
        loss, f, P = load_balancing_loss(probs, mask.to(probs.device))
        losses.append(loss)
        stats[f"lb/L{b}"] = loss.item()
        for name, fc, pc in zip(model.slot_names, f.tolist(), P.tolist()):
            stats[f"usage/L{b}/{name}"] = fc
            stats[f"prob/L{b}/{name}"] = pc
    return torch.stack(losses).mean(), stats


# --------------------------------------------------------------------------- training loop


def _batches(n: int, batch_size: int, steps: int, seed: int) -> Iterable[list[int]]:
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        if len(order) < batch_size:
            fresh = list(range(n))
            rng.shuffle(fresh)
            order += fresh
        yield order[:batch_size]
        order = order[batch_size:]


def train_gates(
    model: LoRAMoEModel, examples: Iterable[GateExample | TokenRecord | Mapping[str, Any]], cfg: GateTrainConfig,
    seed: int = 0, pad_id: int = 0,
) -> list[dict[str, float]]:
    """Optimize only the gates on L = CE + lambda_LB * LB; returns one log row per step (batches drawn by
    ``seed``, padded with ``pad_id``).

    Routing during training is ``model.training_spec`` (the paper's mixture over all experts unless
    ``train_top_k`` is set). Row keys: step, loss, ce, lb, tokens, lb/L<b>, usage/L<b>/<slot>,
    prob/L<b>/<slot>.
    """
    data = as_examples(examples)
    if not data:
        raise ValueError("no gate training examples")
    model.assert_frozen()
    params = list(model.trainable_parameters().values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    lm = model.model
    if cfg.gradient_checkpointing:
        dropouts = [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
        if dropouts or getattr(lm.config, "attention_dropout", 0.0):
            raise ValueError(f"gradient checkpointing needs train mode; the backbone has dropout ({dropouts[:3]})")
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
    else:
        lm.eval()  # no dropout in the frozen backbone
    rows = []
    with model.routing(model.training_spec):
        batches = _batches(len(data), min(cfg.batch_size, len(data)), cfg.steps, seed)
        for step, idx in enumerate(tqdm(batches, total=cfg.steps, desc="gate", leave=False)):
            batch = collate([data[i] for i in idx], pad_id)
            ce, n = response_ce(model, batch, cfg.ce_chunk)
            lb, stats = routing_loss(model, batch["attention_mask"])
            loss = ce + cfg.lambda_lb * lb
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            rows.append({"step": step, "loss": loss.item(), "ce": ce.item(), "lb": lb.item(), "tokens": n, **stats})
    if cfg.gradient_checkpointing:
        lm.gradient_checkpointing_disable()
    lm.eval()
    first, last = rows[0], rows[-1]
    log.info(
        "gate training: %d steps, ce %.4f -> %.4f, lb %.4f -> %.4f",
        cfg.steps, first["ce"], last["ce"], first["lb"], last["lb"],
    )  # fmt: skip
    return rows


@torch.no_grad()
def evaluate_ce(
    model: LoRAMoEModel,
    examples: Iterable[GateExample | TokenRecord | Mapping[str, Any]],
    spec: RoutingSpec | None = None,
    batch_size: int = 8,
    chunk: int = 1024,
    pad_id: int = 0,
) -> float:
    """Token-weighted mean response CE under routing ``spec`` (default: the model's current routing)."""
    data = as_examples(examples)
    total, count = 0.0, 0
    with model.routing(spec or model.spec):
        for s in range(0, len(data), batch_size):
            ce, n = response_ce(model, collate(data[s : s + batch_size], pad_id), chunk)
            total += float(ce) * n
            count += n
    if count == 0:
        raise ValueError("no response tokens to evaluate")
    return total / count


def split_heldout(
    groups: Mapping[str, Sequence[GateExample]], seed: int, fraction: float = 0.2, max_per_group: int = 16
) -> tuple[dict[str, list[GateExample]], dict[str, list[GateExample]]]:
    """(train, held-out) per group: a fixed, seeded share of each group's examples (``fraction``, at least 1 and
    at most ``max_per_group``; none from a group of one example) is held out of gate training, so the gate's CE
    can be compared before and after training on the same examples, none of which it was trained on."""
    if not 0 < fraction < 1:
        raise ValueError(f"held-out fraction must be in (0, 1), got {fraction}")
    train, held = {}, {}
    for name in sorted(groups):
        items = list(groups[name])
        order = list(range(len(items)))
        random.Random(f"{seed}:{name}:gate-heldout").shuffle(order)
        n = 0 if len(items) < 2 else min(max_per_group, max(1, round(fraction * len(items))))
        held[name] = [items[i] for i in order[:n]]
        train[name] = [items[i] for i in order[n:]]
    return train, held


def _count_routes(model: LoRAMoEModel, batch: Mapping[str, torch.Tensor], counts: dict[int, torch.Tensor]) -> int:
    """Add the latest forward's top gate slot per response token (``loss_mask == 1``) and block to ``counts``;
    the tokens counted."""
    sel = (batch["loss_mask"] * batch["attention_mask"]).reshape(-1).bool()
    for b, probs in model.gate_probs().items():
        c = torch.bincount(probs[sel.to(probs.device)].argmax(-1), minlength=len(model.slot_names)).cpu()
        counts[b] = counts[b] + c if b in counts else c
    return int(sel.sum())


def _example_routes(model: LoRAMoEModel, batch: Mapping[str, torch.Tensor]) -> list[str]:
    """The expert each example of the latest forward routes to: the slot that wins most of its response (token,
    block) pairs (ties: the lower slot)."""
    sel = (batch["loss_mask"] * batch["attention_mask"]).bool()
    wins = torch.zeros(sel.shape[0], len(model.slot_names), dtype=torch.long)
    for probs in model.gate_probs().values():
        top = probs.argmax(-1).reshape(sel.shape).cpu()
        wins += torch.nn.functional.one_hot(top, len(model.slot_names)).mul(sel.unsqueeze(-1)).sum(1)
    return [model.slot_names[int(i)] for i in wins.argmax(-1)]


def _usage(model: LoRAMoEModel, counts: Mapping[int, torch.Tensor], tokens: int) -> dict[str, Any]:
    if tokens == 0:
        raise ValueError("no response tokens to route")
    per_block = {b: {n: float(v) / tokens for n, v in zip(model.slot_names, c.tolist())} for b, c in sorted(counts.items())}
    mean = {n: sum(pb[n] for pb in per_block.values()) / len(per_block) for n in model.slot_names}
    return {"mean": mean, "per_block": per_block, "tokens": tokens}


@torch.no_grad()
def routing_usage(
    model: LoRAMoEModel,
    examples: Iterable[GateExample | TokenRecord | Mapping[str, Any]],
    spec: RoutingSpec | None = None,
    batch_size: int = 8,
    pad_id: int = 0,
) -> dict[str, Any]:
    """Which expert the gates pick on the examples' response tokens (``loss_mask == 1``) under routing ``spec``
    (default: the model's current routing): per slot, the share of (token, block) pairs whose largest gate
    probability is that slot (``mean``), the same per adapted block (``per_block``), and the tokens counted."""
    data = as_examples(examples)
    counts: dict[int, torch.Tensor] = {}
    tokens = 0
    device = model.model.get_output_embeddings().weight.device
    with model.routing(spec or model.spec):
        for s in range(0, len(data), batch_size):
            batch = collate(data[s : s + batch_size], pad_id)
            # the decoder stack alone: the gates sit in its blocks, the vocabulary logits are not needed
            model.model.model(input_ids=batch["input_ids"].to(device),
                              attention_mask=batch["attention_mask"].to(device), use_cache=False)
            tokens += _count_routes(model, batch, counts)
    return _usage(model, counts, tokens)


@torch.no_grad()
def heldout_measures(
    model: LoRAMoEModel,
    groups: Mapping[str, Sequence[GateExample]],
    batch_size: int = 8,
    chunk: int = 1024,
    pad_id: int = 0,
) -> dict[str, Any]:
    """The compose report's numbers on held-out examples (``groups``: per capability): response CE under the
    inference routing (``ce_inference``) and under the training mixture (``ce_training``), and the inference
    routing's usage, over all examples (``usage``) and per capability (``usage_by_capability``), and per example
    the expert it routes to against the capability it came from (``routes``: capability -> expert -> examples).
    Two decoder passes per example: the usage is read from the gates of the inference-CE pass."""
    counts: dict[int, torch.Tensor] = {}
    by_capability: dict[str, dict[str, float]] = {}
    routes: dict[str, dict[str, int]] = {}
    ce_sum = 0.0
    ce_tokens = route_tokens = 0
    with model.routing(model.spec):
        for name, items in sorted(groups.items()):
            data = as_examples(items)
            group_counts: dict[int, torch.Tensor] = {}
            group_tokens = 0
            for s in range(0, len(data), batch_size):
                batch = collate(data[s : s + batch_size], pad_id)
                ce, n = response_ce(model, batch, chunk)
                ce_sum += float(ce) * n
                ce_tokens += n
                group_tokens += _count_routes(model, batch, group_counts)
                row = routes.setdefault(name, dict.fromkeys(model.slot_names, 0))
                for expert in _example_routes(model, batch):
                    row[expert] += 1
            if group_tokens:
                by_capability[name] = _usage(model, group_counts, group_tokens)["mean"]
                for b, c in group_counts.items():
                    counts[b] = counts[b] + c if b in counts else c
                route_tokens += group_tokens
    if ce_tokens == 0:
        raise ValueError("no response tokens to evaluate")
    everything = [ex for _, items in sorted(groups.items()) for ex in items]
    return {"ce_inference": ce_sum / ce_tokens,
            "ce_training": evaluate_ce(model, everything, model.training_spec, batch_size, chunk, pad_id),
            "usage": _usage(model, counts, route_tokens)["mean"], "usage_by_capability": by_capability,
            "routes": routes}


def write_log_csv(rows: Sequence[Mapping[str, float]], path: str | Path) -> None:
    """Write the per-step log rows as CSV (columns = union of keys, in first-seen order), atomically."""
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


# --------------------------------------------------------------------------- other gate objectives (issue 39)
#
# soft_target (official train/warmstart_gater.py, per_layer scope): each example's routing target is a distribution
# over the gate slots built from every adapter's measured reward on the example's environment,
# ``softmax(reward / temperature)``; each block's gate probabilities, averaged over the example's tokens, are pulled
# to it by KL(target || mean p) (batch mean), and the blocks' KLs are averaged.
#
# grpo (official train/grpo_gater.py): the gates define a trajectory-level policy over experts from the first
# prompt, ``pi(c | prompt) = mean over blocks and prompt tokens of p_b,t(c)`` (:func:`prompt_routing`); one expert is
# sampled per trajectory and locked for all of it, and the gates are updated by GRPO's clipped surrogate on
# ``log pi(c | prompt)`` (tracekit.methods.consolidate.gate_objectives runs the loop).


def soft_targets(rewards: torch.Tensor, temperature: float) -> torch.Tensor:
    """Routing targets from measured rewards: rewards [..., S] (one per gate slot) -> softmax(rewards / T) [..., S]
    (float32). Equal rewards give the uniform target; T -> 0 the argmax."""
    if temperature <= 0:
        raise ValueError(f"soft-target temperature must be > 0, got {temperature}")
    return torch.softmax(rewards.double() / temperature, dim=-1).float()


def token_mean(probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """probs [B, L, S] averaged over each row's tokens where mask [B, L] is 1 -> [B, S]."""
    m = mask.to(probs.dtype).unsqueeze(-1)
    n = m.sum(1)
    if bool((n == 0).any()):
        raise ValueError("a row has no token to average the routing over")
    return (probs * m).sum(1) / n


def soft_target_kl(probs: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_b KL(target_b || q_b) with q_b = the row's token-mean gate probabilities (:func:`token_mean` of probs
    [B, L, S] over mask [B, L]); target [B, S]. 0 log 0 = 0; q is floored at 1e-9 (as the official code)."""
    q = token_mean(probs, mask).clamp_min(1e-9)
    t = target.to(q.dtype)
    return (torch.xlogy(t, t) - t * q.log()).sum(-1).mean()


def prompt_routing(probs: Sequence[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """The trajectory-level expert distribution: per-block gate probabilities [B, L, S] averaged over each row's
    prompt tokens (mask [B, L]) and then over the blocks -> [B, S], a distribution per row."""
    return torch.stack([token_mean(p, mask) for p in probs]).mean(0)


def _block_probs(model: LoRAMoEModel, shape: tuple[int, int]) -> list[torch.Tensor]:
    """The latest forward's gate probabilities per adapted block, as [B, L, S]."""
    return [p.view(*shape, -1) for _, p in sorted(model.gate_probs().items())]


def train_gates_soft_target(
    model: LoRAMoEModel, examples: Sequence[GateExample], targets: Sequence[Sequence[float]], cfg: GateTrainConfig,
    seed: int = 0, pad_id: int = 0,
) -> list[dict[str, float]]:
    """Optimize only the gates on mean over blocks of :func:`soft_target_kl` (every real token of each example,
    under the inference routing: the hidden states the gates will see); one log row per step (step, loss, tokens,
    kl/L<b>). ``targets[i]`` is example i's target over the gate slots. The decoder stack alone runs (no vocabulary
    logits)."""
    data = as_examples(examples)
    if not data or len(data) != len(targets):
        raise ValueError(f"need one target per example, got {len(data)} examples and {len(targets)} targets")
    model.assert_frozen()
    params = list(model.trainable_parameters().values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    lm = model.model
    lm.eval()
    device = lm.get_output_embeddings().weight.device
    target = torch.tensor([list(t) for t in targets], dtype=torch.float32)
    rows = []
    with model.routing(model.inference_spec):
        batches = _batches(len(data), min(cfg.batch_size, len(data)), cfg.steps, seed)
        for step, idx in enumerate(tqdm(batches, total=cfg.steps, desc="gate (soft target)", leave=False)):
            batch = collate([data[i] for i in idx], pad_id)
            attn = batch["attention_mask"].to(device)
            lm.model(input_ids=batch["input_ids"].to(device), attention_mask=attn, use_cache=False)
            t = target[idx].to(device)
            kls = [soft_target_kl(p, attn, t) for p in _block_probs(model, tuple(attn.shape))]
            loss = torch.stack(kls).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            opt.step()
            rows.append({"step": step, "loss": loss.item(), "tokens": int(attn.sum()),
                         **{f"kl/L{b}": k.item() for b, k in zip(sorted(model.routings), kls)}})
    log.info("gate training (soft target): %d steps, KL %.4f -> %.4f", cfg.steps, rows[0]["loss"], rows[-1]["loss"])
    return rows


def prompt_decisions(model: LoRAMoEModel, prompts: Sequence[Sequence[int]], starts: Sequence[int],
                     pad_id: int = 0) -> torch.Tensor:
    """The routing distribution [B, S] a turn or an episode is decided from (issue 53): the gates' probabilities
    under the token-level inference routing, averaged over each prompt's tokens from ``starts[i]`` on (the turn's
    new tokens, read in the context of the whole prompt) and then over the blocks (:func:`prompt_routing`)."""
    if len(prompts) != len(starts) or any(not 0 <= s < len(p) for p, s in zip(prompts, starts)):
        raise ValueError("each prompt needs a start inside it")
    batch = collate([GateExample(list(p), [0] * s + [1] * (len(p) - s)) for p, s in zip(prompts, starts)], pad_id)
    device = model.model.get_output_embeddings().weight.device
    attn = batch["attention_mask"].to(device)
    with torch.no_grad(), model.routing(model.inference_spec):
        model.model.model(input_ids=batch["input_ids"].to(device), attention_mask=attn, use_cache=False)
        return prompt_routing(_block_probs(model, tuple(attn.shape)), batch["loss_mask"].to(device)).cpu()


def expert_logprobs(model: LoRAMoEModel, prompts: Sequence[Sequence[int]], pad_id: int = 0) -> torch.Tensor:
    """log pi(c | prompt) [B, S] of the trajectory-level expert policy (:func:`prompt_routing`) on each prompt's
    tokens, under the inference routing, with the autograd graph to the gates when grad is enabled."""
    batch = collate([GateExample(list(p), [0] * len(p)) for p in prompts], pad_id)
    device = model.model.get_output_embeddings().weight.device
    attn = batch["attention_mask"].to(device)
    with model.routing(model.inference_spec):
        model.model.model(input_ids=batch["input_ids"].to(device), attention_mask=attn, use_cache=False)
        pi = prompt_routing(_block_probs(model, tuple(attn.shape)), attn)
    return pi.clamp_min(1e-12).log()
