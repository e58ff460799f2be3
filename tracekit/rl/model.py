"""Model-side components the training recipes share (GRPO, SFT, on-policy distillation): the distributed
helpers (:class:`Dist`), a fresh seeded LoRA adapter (:func:`build_peft_model`), activation checkpointing (full,
selective, compiled layers), and the chunked log-probs of a batch's generated tokens (:func:`sequence_logprobs`,
never the full logits).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tracekit.llm.decoding import causal_lm_of
from tracekit.ops import _ChunkedTokenLogProb, token_logprobs
from tracekit.rl import grpo
from tracekit.ranges import check_choice
from tracekit.rl.settings import CHECKPOINT_POLICIES, LoraSettings

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Distributed helpers (no-ops in a single process)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def active(self) -> bool:
        return self.world > 1

    def sum(self, values: Sequence[float]) -> list[float]:
        if not self.active:
            return [float(v) for v in values]
        import torch.distributed as td

        t = torch.tensor(list(values), dtype=torch.float64, device=_comm_device())
        td.all_reduce(t, op=td.ReduceOp.SUM)
        return t.cpu().tolist()

    def max(self, value: int) -> int:
        if not self.active:
            return value
        import torch.distributed as td

        t = torch.tensor([value], dtype=torch.long, device=_comm_device())
        td.all_reduce(t, op=td.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as td

            td.barrier()


def _comm_device() -> torch.device:
    import torch.distributed as td

    return torch.device("cuda", torch.cuda.current_device()) if td.get_backend() == "nccl" else torch.device("cpu")


# --------------------------------------------------------------------------------------------
# Model plumbing


def build_peft_model(model: torch.nn.Module, lora: LoraSettings, seed: int) -> torch.nn.Module:
    """Freeze ``model`` and add a fresh LoRA adapter (init seeded: same seed -> same adapter)."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    missing = [t for t in lora.target_modules if t not in names]
    if missing:
        raise ValueError(f"grpo.lora.target_modules {missing} match no module of {type(model).__name__}")
    params = [n for n, _ in model.named_parameters()]
    missing = [t for t in lora.target_parameters if not any(n == t or n.endswith("." + t) for n in params)]
    if missing:
        raise ValueError(f"grpo.lora.target_parameters {missing} match no parameter of {type(model).__name__}")
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        target_parameters=list(lora.target_parameters) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, cfg)


def selective_checkpoint_context():
    """``context_fn`` for ``torch.utils.checkpoint``: save matmul and attention outputs, recompute the rest.

    Saved in forward: outputs of ``mm``/``addmm`` whose inner dim exceeds 256 (the base q/k/v/o/
    gate/up/down projections and LoRA's ``x A^T``) and of the SDPA kernels (output + log-sum-exp).
    Recomputed in backward: RMSNorms, RoPE, SiLU * up, residual adds, dtype casts, LoRA's
    ``(x A^T) B^T`` (inner dim = rank: cheap to redo, as large as the base output to keep) and any
    GEMM with inner dim <= 256. So the recompute is elementwise passes and rank-r GEMMs, no
    attention and (almost) no large GEMM (tests: 1 of the 29 large GEMMs full checkpointing redoes
    on a 2-layer model); its FLOPs are not counted as model FLOPs in the benchmark's MFU.
    """
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    attention = {
        getattr(aten, n).default
        for n in (
            "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention",
            "_scaled_dot_product_flash_attention_for_cpu",
        )
        if hasattr(aten, n)
    }
    matmuls = {aten.mm.default: 0, aten.addmm.default: 1}  # op -> index of the [M, K] operand

    def policy(ctx, op, *args, **kwargs):
        if op in matmuls:
            big = args[matmuls[op]].shape[-1] > 256
            return CheckpointPolicy.MUST_SAVE if big else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in attention else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def set_activation_checkpointing(lm: torch.nn.Module, on: bool, policy: str = "full", compile: bool = False) -> None:
    """Recompute activations in backward (non-reentrant: the frozen embeddings need no input grads).

    policy ``full``: keep each decoder layer's input only, recompute the whole layer;
    ``selective``: :func:`selective_checkpoint_context` (recompute elementwise work only).
    ``compile``: every decoder layer runs through one ``torch.compile``d :func:`_layer_call`
    (checkpointing, if on, inside the compiled region, so inductor fuses the elementwise ops and
    its partitioner applies the policy); off restores the eager layers.
    transformers >= 5.2x names it ``activation_checkpointing_*``; earlier 5.x ``gradient_checkpointing_*``.
    """
    check_choice("checkpoint policy", policy, CHECKPOINT_POLICIES)
    kw: dict[str, Any] = {"use_reentrant": False}
    if policy == "selective":
        kw["context_fn"] = selective_checkpoint_context()
    hf_on = on and not compile  # compiled layers checkpoint themselves (transformers' wrapper sits outside them in 5.1x)
    if hasattr(lm, "activation_checkpointing_enable"):
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs=kw) if hf_on else lm.activation_checkpointing_disable()
    else:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw) if hf_on else lm.gradient_checkpointing_disable()
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    if compile and not layers:
        raise NotImplementedError(f"compile needs transformers GradientCheckpointingLayer decoder layers; {type(lm).__name__} has none")
    runner = _CompiledLayers() if compile else None
    for layer in layers:
        if runner is None:
            layer.__dict__.pop("forward", None)  # back to the class forward
            layer.__dict__.pop("_tracekit_ckpt", None)
        else:
            layer._tracekit_ckpt = kw if on else None
            layer.forward = partial(runner, layer)


def _layer_call(layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``layer``'s class forward, under a non-reentrant checkpoint with ``layer._tracekit_ckpt``'s
    kwargs when that is set and a backward will follow (training, grad enabled)."""
    kw = layer._tracekit_ckpt
    forward = type(layer).forward
    if kw is not None and layer.training and torch.is_grad_enabled():
        return checkpoint(partial(forward, layer, **kwargs), *args, **kw)
    return forward(layer, *args, **kwargs)


class _CompiledLayers:
    """Decoder layers' forwards through one compiled :func:`_layer_call` (layers share the artifact:
    their weights are graph inputs of one shape). On a compiler-backend failure (e.g. no C++
    compiler for CPU code) the reason is logged and the layers run eagerly from then on."""

    def __init__(self) -> None:
        self.fn: Callable[..., Any] | None = torch.compile(_layer_call)

    def __call__(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.fn is not None:
            try:
                return self.fn(layer, *args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as e:
                log.warning("compiled layers off, running eagerly: %s", str(e).strip().splitlines()[0])
                self.fn = None
        return _layer_call(layer, *args, **kwargs)


@contextmanager
def lm_head_weight(lm: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The lm_head weight; under ZeRO-3 a gathered, frozen copy (the backward pass of the chunked
    log-prob recomputes logits after the parameter went back to its partition)."""
    w = lm.get_output_embeddings().weight
    if not hasattr(w, "ds_id"):
        yield w
        return
    if w.requires_grad:
        raise NotImplementedError("a trainable lm_head under ZeRO-3 is not supported (LoRA keeps it frozen)")
    import deepspeed

    with deepspeed.zero.GatheredParameters([w], modifier_rank=None):
        full = w.detach().clone()
    yield full


class _ChunkedTokenLogProbEntropy(_ChunkedTokenLogProb):
    """:class:`tracekit.ops._ChunkedTokenLogProb` that also returns each row's entropy of
    ``softmax(h W^T / temperature)``, from the very chunk of logits the log-prob is read from (one softmax
    and one batched dot product more: the peak stays two [chunk, V] buffers, as in the backward). The
    entropy is a statistic (no gradient); the backward is the parent's."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse, ent = torch.empty_like(out), torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.t()).float() / temperature
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            out[s : s + chunk] = logits.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
            ent[s : s + chunk] = grpo.entropy_from_logits(logits, lse[s : s + chunk])
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out, grad_ent):  # type: ignore[override]
        return _ChunkedTokenLogProb.backward(ctx, grad_out)


def token_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tracekit.ops.token_logprobs`` plus the per-row entropy of the tempered distribution (no grad),
    computed in the same chunked pass. [N, H], [V, H], [N] -> ([N], [N]) float32."""
    if hidden.shape[0] == 0:
        zero = hidden.new_zeros(0, dtype=torch.float32)
        return zero + 0.0 * hidden.sum(), zero
    return _ChunkedTokenLogProbEntropy.apply(hidden, weight, targets, float(temperature), int(chunk))


def sequence_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk: int = 1024,
    entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the generated tokens of a right-padded batch, flattened in row-major order.

    input_ids/attention_mask/loss_mask: [n, T] -> [M] with M = loss_mask.sum(). The token at t is
    scored from the hidden state at t - 1; only those M positions go through the lm_head, in
    ``chunk``-row pieces (``tracekit.ops.token_logprobs``), never the full [n*T, V] logits. A right-padded
    mask is not passed to the model: causal attention never lets a real token see a trailing pad,
    and without a mask SDPA can run its causal flash kernel (a non-right-padded mask is passed on).
    The masks may stay on the host (the trainer's are): then selecting the M positions needs no
    device-to-host read, so the host keeps queueing the loss and backward while the forward runs.
    ``entropy``: also return the [M] entropies of the tempered policy at those positions (no grad), from
    the same chunked pass (:func:`token_logprobs_entropy`).
    """
    lm = causal_lm_of(model)
    dev = input_ids.device
    right_padded = bool((attention_mask[:, 1:] <= attention_mask[:, :-1]).all()) and bool(attention_mask[:, 0].all())
    hidden = lm.get_decoder()(
        input_ids=input_ids, attention_mask=None if right_padded else attention_mask.to(dev), use_cache=False
    ).last_hidden_state
    n, T = input_ids.shape
    rows, cols = (loss_mask[:, 1:] > 0).nonzero(as_tuple=True)  # generated token (r, c + 1), scored at (r, c)
    at = (rows * T + cols).to(dev, non_blocking=True)
    h = hidden.reshape(n * T, -1).index_select(0, at)
    targets = input_ids.reshape(-1).index_select(0, at + 1)
    with lm_head_weight(lm) as w:
        if entropy:
            return token_logprobs_entropy(h, w, targets, temperature=temperature, chunk=chunk)
        return token_logprobs(h, w, targets, temperature=temperature, chunk=chunk)
