"""LoRA mixture-of-experts linear layer (paper section 3.5).

At an adapted projection with frozen base weight W and a bank of C frozen LoRA adapters,

    y = W x + sum_c w_c(h) * s_c * B_c A_c x,        s_c = alpha_c / r_c (alpha_c / sqrt(r_c) for rsLoRA)

where h is the block's input hidden state and w(h) comes from the block's gate:
p = softmax(gate(h)), gate = Linear(d -> C). Routing modes (:class:`RoutingSpec`):

- ``top_k=None``: the paper's training mixture, w = p over all experts (dense: two GEMMs, like one
  LoRA of rank C*r).
- ``top_k=k``: each token keeps its k most probable slots. ``renormalize=False`` keeps the raw
  softmax probabilities (w_c = p_c for kept c), as the official TRACE routed model does
  ("hard top-1 cap routing with multiplicative gating": a base-slot bias of 5 gives a gate weight
  0.974, i.e. the raw probability); ``renormalize=True`` divides the kept ones by their sum.
  ``impl="grouped"`` (default) computes only the chosen experts' low-rank products, planned once per
  block on the device (no host sync):
  - top-1 over C to ``gather_max_tokens`` tokens (decode at a batch of at least the adapter count): every
    adapter on every token with the non-chosen weights zero, i.e. per projection one [T, C*r] shrink GEMM,
    an in-place weight multiply and one expand-and-add ``addmm``. Each projection reads its bank once,
    where gathering T copies of the chosen factors reads T/C banks' worth (16x at batch 64, 4 adapters).
    Qwen3-30B-A3B shape, 4 adapters on q/k/v/o, decode at 64 on an H200: 75.2 vs 82.6 ms of device time
    per profiled eager step; the eager step is host-bound and its wall time is the same within 2.5%
    (124.1 vs 121.1 ms; ``benchmarks/results/paper_backbones_h200.md``);
  - top-1 over fewer than C tokens (decode at batch 1): every token's chosen factors of all the block's
    projections are gathered in two kernels, then each projection is two batched rank-r products
    (shrink, expand-and-add);
  - otherwise (prefill, top-k): (token, slot) pairs sorted by expert; each projection gathers the
    pairs' inputs (once per input tensor: q, k and v share theirs), runs ``torch._grouped_mm`` with
    device-side group offsets (CUDA bf16, 16-byte aligned rows) or a loop over experts on contiguous
    slices of the sorted pairs (elsewhere; group bounds read on the host once per block), and adds
    the result back in token order.
  Eager prefill at batch 1 is bound by host time per op, so a projection's bank views are built once
  (cached until the bank's storage changes) and a sorted-path projection over at most
  ``INDEX_ADD_MAX_PAIRS`` pairs costs three kernels (scatter back with one ``index_add_``); above that
  the GPU is the bound, and top-1 gathers back through the inverse permutation instead (bf16 atomics
  cost 2-3x a gather-and-add: 91 vs 35 us at 2048 x 6144 on an H200).
  ``impl="grouped_mm"`` forces the ``torch._grouped_mm`` backend for the sorted pairs (a private
  torch API: bf16 grouped GEMM on sm90+ GPUs, a loop elsewhere). ``impl="masked_dense"`` computes
  every expert with the non-kept weights zeroed (the reference the grouped paths are tested against).

Arrow routing (:mod:`tracekit.moe.arrow`, ``consolidation=arrow``): a projection given prototypes
(:meth:`LoRAMoELinear.set_arrow`) ignores its block's gate and weighs its adapters per token on its own input x by
``arrow_weights(x, prototypes, top_k, temperature)``, every adapter computed (as peft's Arrow layer).

Optional base slot (official code's "no adapter" slot 0): the gate has C+1 outputs and slot 0
contributes a zero update. Adapters of different ranks share the bank by zero-padding A's rows and
B's columns to the block's largest rank, which leaves every B_c A_c unchanged.

Storage: one bank per block (:class:`BlockRouting`), shared by its projections: ``bank_A``
[C, r, sum d_in] holds each projection's A_c side by side and ``bank_B`` [C, r, sum d_out] its
(s_c B_c)^T (the scale folded in), so a projection's factors are column slices (views), the dense
mixture is two GEMMs on [C*r, d] views, and one gather per bank serves every projection of the
block. The brief's shapes A: C x r x d_in and B: C x d_out x r are :attr:`LoRAMoELinear.A3` and
:attr:`LoRAMoELinear.B3` (B3 includes s_c).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tracekit.moe.arrow import arrow_weights
from tracekit.ranges import check_choice


MOE_IMPLS = ("grouped", "grouped_mm", "masked_dense")  # how top-k routing computes (RoutingSpec.impl)


@dataclass(frozen=True)
class RoutingSpec:
    """How gate probabilities become per-token expert weights.

    top_k: None = mix all experts with p (training default); k = keep the k most probable slots.
    renormalize: divide the kept probabilities by their sum (False = raw, as the official code).
    impl: "grouped" (run only the chosen experts; backend by device and token count) / "grouped_mm" (the
    torch._grouped_mm backend) or "masked_dense" (reference; every expert computed).
    gather_max_tokens: "grouped" top-1 over at most this many tokens runs a decode plan (fewer tokens than
    adapters: each token's chosen factors gathered; otherwise every adapter with the non-chosen weights
    zero) instead of sorting tokens into per-expert groups (prefill). None: 64 on CUDA, 16 elsewhere.
    The decode plans save the sorted path's launches, so they pay while launches dominate, i.e. at any
    decode batch in eager CUDA (host-bound), and up to about 4 tokens per adapter on a CPU (tiny Qwen3,
    4 adapters, gathered: 4 tokens 1.87 vs 2.57 ms a forward, 16 tokens 2.98 vs 2.94, 64 tokens 6.85 vs 3.31).
    """

    top_k: int | None = 1
    renormalize: bool = False
    impl: str = "grouped"
    gather_max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        check_choice("impl", self.impl, MOE_IMPLS)
        if self.impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            raise ValueError(f"impl 'grouped_mm' needs torch._grouped_mm (torch >= 2.8); torch is {torch.__version__}")


# Top-1 decode plans (at most gather_max_tokens tokens): from this many tokens on (None: the block's adapter
# count) every adapter runs on every token with the non-chosen weights zero; fewer gather their chosen factors.
DENSE_DECODE_MIN_TOKENS: int | None = None

# Sorted pairs up to which results go back to token order by one index_add_ (host-bound regime) rather than
# a gather and an add (one launch more, less GPU time). H200, Qwen3-1.7B shape, 4 adapters: prefill 1 x 2048
# 1.06-1.10x peft_1 with index_add_ vs 1.18-1.21x without; 8 x 2048 0.95x with it vs 0.76x without.
INDEX_ADD_MAX_PAIRS = 4096

# --------------------------------------------------------------------------- pure routing math


def topk_weights(probs: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [T, S] -> (weights [T, k], slots [T, k]); weights are raw p or p / sum of kept p."""
    if k > probs.shape[-1]:
        raise ValueError(f"top_k={k} exceeds the number of gate slots {probs.shape[-1]}")
    w, idx = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def decision_weights(probs: torch.Tensor, soft_top_k: int | None, temperature: float = 1.0) -> torch.Tensor:
    """One routing decision per row (a turn or an episode, issue 53): its routing distribution ``probs`` [B, S] ->
    slot weights [B, S] summing to 1 per row. Hard (``soft_top_k=None``): all weight on the most probable slot (the
    chosen adapter at full weight, as it was trained). Soft top-k: the k most probable slots weighed by
    softmax(log p / temperature) over those k, 0 elsewhere."""
    if soft_top_k is None:
        return torch.zeros_like(probs).scatter(-1, probs.argmax(-1, keepdim=True), 1.0)
    if soft_top_k > probs.shape[-1]:
        raise ValueError(f"soft_top_k={soft_top_k} exceeds the number of gate slots {probs.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    p, idx = torch.topk(probs, soft_top_k, dim=-1)
    w = torch.softmax(p.clamp_min(1e-30).log() / temperature, dim=-1)
    return torch.zeros_like(probs).scatter(-1, idx, w)


def masked_topk_probs(probs: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
    """probs [T, S] -> [T, S] with every slot outside each token's top-k set to 0."""
    w, idx = topk_weights(probs, k, renormalize)
    return torch.zeros_like(probs).scatter(-1, idx, w)


def gate_probs(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A block gate's p = softmax(h W^T + b) for h [..., d] -> [..., S], float32 whatever the backbone dtype
    (:meth:`BlockGate.probs`; a function of tensors so that a decoder can run it on its own copies)."""
    return torch.softmax(F.linear(h.to(weight.dtype), weight, bias).float(), dim=-1)


def adapter_weights(probs: torch.Tensor, top_k: int | None, renormalize: bool, base_slot: bool) -> torch.Tensor:
    """Gate probabilities [T, S] -> each adapter's weight per token [T, C] (the base slot dropped): the mixture
    p (``top_k=None``) or the kept top-k p (raw or renormalized), 0 elsewhere. The per-token weights every plan of
    :func:`make_plan` applies, as one dense matrix (the fast decoder's fused delta multiplies by it)."""
    w = probs if top_k is None else masked_topk_probs(probs, top_k, renormalize)
    return w[:, 1:] if base_slot else w


class _DensePlan:
    """Weights for every adapter (base slot dropped), repeated over the rank: [T, C*r] in the activation
    dtype, matching the row blocks of the [C*r, d] bank views. The mixture, the masked top-k reference, or
    top-1 decode over C..gather_max tokens (the non-chosen weights zero)."""

    def __init__(self, weights: torch.Tensor, rank: int, dtype: torch.dtype):
        w = weights.to(dtype)  # [T, C] -> [T, C*r]: an expand and one copy (repeat_interleave costs more host time)
        self.weights = w.unsqueeze(-1).expand(*w.shape, rank).reshape(*w.shape[:-1], w.shape[-1] * rank)

    def delta(self, proj: LoRAMoELinear, out: torch.Tensor, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        """Two GEMMs on the [C*r, d] views, like one LoRA of rank C*r with per-token row weights."""
        v = proj.routing.views(proj)
        z = F.linear(x2d, v.A)
        z = z * self.weights if torch.is_grad_enabled() else z.mul_(self.weights)
        return torch.addmm(out, z, v.Bt)


class _GroupPlan:
    """(token, slot) pairs sorted by adapter on the device: ``tokens``, ``adapters`` (-1 = base slot,
    sorted first), ``weights`` [P, 1] (gate weights in the activation dtype, 0 for base-slot pairs), each
    of P = T * k pairs; ``offsets`` [C] (int32, device): group ends, pairs of adapter <= c (base-slot
    pairs, weight 0, join group 0); ``inverse`` [T]: top-1 over more than ``INDEX_ADD_MAX_PAIRS`` tokens,
    each token's position in the sorted order (None otherwise: results are scattered back with index_add_).

    Group bounds (host, one sync) are derived lazily by the loop backend and shared by the block's
    projections, as is the gathered input of each input tensor.
    """

    def __init__(self, tokens, adapters, weights, offsets, n_adapters: int, k: int, impl: str, base_slot: bool, dtype):
        self.tokens, self.adapters, self.offsets = tokens, adapters, offsets
        self.n_adapters, self.k, self.impl = n_adapters, k, impl
        self.weights = (weights * (adapters >= 0) if base_slot else weights).to(dtype).unsqueeze(-1)
        self._groups: list[tuple[int, int, int]] | None = None
        self._input: tuple[weakref.ref, int, torch.Tensor] | None = None
        self._inverse: torch.Tensor | None = None

    @property
    def inverse(self) -> torch.Tensor | None:
        """Built on first use: top-1 over more than INDEX_ADD_MAX_PAIRS tokens only."""
        if self._inverse is None and self.k == 1 and self.tokens.numel() > INDEX_ADD_MAX_PAIRS:
            self._inverse = torch.empty_like(self.tokens)
            self._inverse[self.tokens] = torch.arange(self.tokens.numel(), device=self.tokens.device)
        return self._inverse

    @property
    def groups(self) -> list[tuple[int, int, int]]:
        """[(adapter, start, count)] of the non-empty adapter groups, read on the host (one sync per block)."""
        if self._groups is None:
            ids = torch.arange(-1, self.n_adapters, device=self.adapters.device, dtype=self.adapters.dtype)
            ends = torch.searchsorted(self.adapters, ids, right=True).tolist()  # ends[0]: base-slot pairs
            self._groups = [(a, ends[a], ends[a + 1] - ends[a]) for a in range(self.n_adapters) if ends[a + 1] > ends[a]]
        return self._groups

    @property
    def identity(self) -> bool:
        """k == 1 and every token chose the same adapter: the sorted pairs are tokens 0..T-1 in order."""
        g = self.groups
        return self.k == 1 and len(g) == 1 and g[0][2] == self.tokens.numel()

    def gather_input(self, x: torch.Tensor, x2d: torch.Tensor, start: int) -> torch.Tensor:
        """Pairs ``start:`` of the sorted order: their tokens' rows of x2d times their gate weights [P - start,
        d_in] (w (B A x) = B A (w x)). Computed once per input tensor ``x``: the block's projections that share
        an input (q/k/v, gate/up) share it. A weak reference: a freed input never matches."""
        hit = self._input
        if hit is not None and hit[0]() is x and hit[1] == start:
            return hit[2]
        xs = x2d.index_select(0, self.tokens[start:] if start else self.tokens) * self.weights[start:]
        self._input = (weakref.ref(x), start, xs)
        return xs

    def delta(self, proj: LoRAMoELinear, out: torch.Tensor, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        """out + the chosen experts' updates: grouped GEMMs on CUDA bf16 (or when forced), a loop elsewhere."""
        v = proj.routing.views(proj)
        if self.impl == "grouped_mm" or (x2d.is_cuda and v.grouped_mm_fits and x2d.dtype == torch.bfloat16):
            return self._grouped_mm_delta(v, out, x, x2d)
        return self._loop_delta(proj, v, out, x, x2d)

    def _grouped_mm_delta(self, v: _BankViews, out, x, x2d) -> torch.Tensor:
        """The sorted pairs' weighted inputs, one grouped GEMM per factor (device offsets), back to token order."""
        z = torch._grouped_mm(self.gather_input(x, x2d, 0), v.A3t, offs=self.offsets)  # [P, r]
        y = torch._grouped_mm(z, v.Bt3, offs=self.offsets)  # [P, d_out]
        inverse = self.inverse
        if inverse is not None:
            return out.add_(y.index_select(0, inverse))
        return out.index_add_(0, self.tokens, y)

    def _loop_delta(self, proj: LoRAMoELinear, v: _BankViews, out, x, x2d) -> torch.Tensor:
        """Each expert on its contiguous slice of the sorted pairs (group bounds read on the host)."""
        groups = self.groups
        if not groups:  # every token chose the base slot
            return out
        r = proj.rank
        if self.identity:  # one expert for all tokens, in order: no gather/scatter
            a = groups[0][0]
            return torch.addcmul(out, F.linear(x2d, v.A[a * r : a * r + r]) @ v.Bt[a * r : a * r + r], self.weights)
        off = groups[0][1]  # base-slot pairs sort first and are skipped
        xs = self.gather_input(x, x2d, off)
        ys = [F.linear(xs[s - off : s - off + n], v.A[a * r : a * r + r]) @ v.Bt[a * r : a * r + r] for a, s, n in groups]
        return out.index_add_(0, self.tokens[off:], torch.cat(ys) if len(ys) > 1 else ys[0])


class _GatherPlan:
    """Top-1 over few tokens (decode): every token's chosen factors of all the block's projections, gathered
    once: ``A`` [T, r, sum d_in] and ``B`` [T, r, sum d_out] already multiplied by the token's gate weight
    (0 for the base slot). Each projection is then two batched rank-r products on column views."""

    def __init__(self, routing: BlockRouting, adapters: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype):
        index = adapters.clamp(min=0)
        w = weights * (adapters >= 0) if routing.base_slot else weights
        self.A = routing.bank_A.index_select(0, index)
        self.B = routing.bank_B.index_select(0, index) * w.to(dtype).view(-1, 1, 1)

    def delta(self, proj: LoRAMoELinear, out: torch.Tensor, x: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
        """[T, 1, d_in] @ [T, d_in, r] -> [T, 1, r]; out + [T, 1, r] @ [T, r, d_out]."""
        a0, b0 = proj.a_cols, proj.b_cols
        z = torch.bmm(x2d.unsqueeze(1), self.A[:, :, a0 : a0 + proj.in_features].transpose(1, 2))
        return torch.baddbmm(out.unsqueeze(1), z, self.B[:, :, b0 : b0 + proj.out_features]).squeeze(1)


def make_plan(probs: torch.Tensor, routing: BlockRouting, dtype: torch.dtype):
    """Turn one block's gate probabilities [T, S] into the computation every projection of the block shares.

    Computed once per block and forward, on the device (no host sync)."""
    spec, off = routing.spec, 1 if routing.base_slot else 0
    if spec.top_k is None or spec.impl == "masked_dense":
        return _DensePlan(adapter_weights(probs, spec.top_k, spec.renormalize, routing.base_slot), routing.rank, dtype)
    k = spec.top_k
    w, slots = topk_weights(probs, k, spec.renormalize)
    gather_max = spec.gather_max_tokens if spec.gather_max_tokens is not None else (64 if probs.is_cuda else 16)
    dense_min = routing.n_adapters if DENSE_DECODE_MIN_TOKENS is None else DENSE_DECODE_MIN_TOKENS
    if k == 1 and spec.impl == "grouped" and dense_min <= probs.shape[0] <= gather_max:
        # decode with at least as many tokens as adapters: T gathered factor copies would cost T/C bank reads;
        # every adapter on every token, the others' weights zero, reads the bank once, in fewer kernels
        dense = torch.zeros_like(probs).scatter(-1, slots, w)
        return _DensePlan(dense[:, off:] if off else dense, routing.rank, dtype)
    adapters = slots.reshape(-1) - off if off else slots.reshape(-1)
    if k == 1 and spec.impl == "grouped" and adapters.numel() <= gather_max:
        return _GatherPlan(routing, adapters, w.reshape(-1), dtype)
    adapters, order = torch.sort(adapters, stable=True)
    tokens = order if k == 1 else order // k  # pair p of the [T, k] layout belongs to token p // k
    offsets = torch.searchsorted(adapters, routing.slot_ids(adapters.device), right=True, out_int32=True)
    return _GroupPlan(
        tokens, adapters, w.reshape(-1)[order], offsets, routing.n_adapters, k, spec.impl, routing.base_slot, dtype
    )


class _BankViews(NamedTuple):
    """One projection's views of its block's bank: ``A`` [C*r, d_in], ``Bt`` [C*r, d_out] (dense and loop
    paths), ``A3t`` [C, d_in, r] and ``Bt3`` [C, r, d_out] (grouped GEMM operands); ``grouped_mm_fits``:
    the bank suits torch._grouped_mm's fast kernel (bf16, 16-byte aligned rows)."""

    A: torch.Tensor
    Bt: torch.Tensor
    A3t: torch.Tensor
    Bt3: torch.Tensor
    grouped_mm_fits: bool


class BlockRouting(nn.Module):
    """One block's routing state and LoRA bank, shared by its gate (writer) and adapted projections (readers).

    ``bank_A`` [C, r, sum d_in] / ``bank_B`` [C, r, sum d_out] (frozen): the projections' A_c and
    (s_c B_c)^T side by side, in registration order. ``probs`` [T, S] (float32) are the gate
    probabilities of the block's latest forward; ``set_probs`` builds the block's plan at once (in the
    gate's pre-hook, outside any checkpointed block forward, so a recomputed block reruns the same ops).
    """

    def __init__(self, n_adapters: int, base_slot: bool, spec: RoutingSpec):
        super().__init__()
        self.n_adapters = n_adapters
        self.base_slot = base_slot
        self.spec = spec
        self.probs: torch.Tensor | None = None
        self._plan = None
        self._slot_ids: torch.Tensor | None = None
        self._views: dict[int, tuple[tuple[int, int], _BankViews]] = {}  # projection's a_cols -> (bank ptrs, views)
        self.bank_A = nn.Parameter(torch.zeros(n_adapters, 0, 0), requires_grad=False)
        self.bank_B = nn.Parameter(torch.zeros(n_adapters, 0, 0), requires_grad=False)

    @property
    def rank(self) -> int:
        return self.bank_A.shape[1]

    @property
    def n_slots(self) -> int:
        return self.n_adapters + (1 if self.base_slot else 0)

    def slot_ids(self, device: torch.device) -> torch.Tensor:
        """arange(C) on ``device`` (int64), kept: the sorted path's group offsets search for it every forward."""
        ids = self._slot_ids
        if ids is None or ids.device != device:
            ids = self._slot_ids = torch.arange(self.n_adapters, device=device)
        return ids

    def views(self, proj: LoRAMoELinear) -> _BankViews:
        """``proj``'s views of the bank, built once per bank storage: an eager prefill at batch 1 is bound by
        host time per op, views included. Dropped when the bank grows (``register``) or moves (``_apply``:
        ``.to()``, ``.half()``, ...), so no view keeps an old storage alive; a bank swapped any other way is
        caught by its data pointer."""
        key = (self.bank_A.data_ptr(), self.bank_B.data_ptr())
        hit = self._views.get(proj.a_cols)
        if hit is not None and hit[0] == key:
            return hit[1]
        C, r, d_in, d_out = self.n_adapters, self.rank, proj.in_features, proj.out_features
        a3, bt3 = proj.A3, proj.Bt3
        # torch._grouped_mm's fast kernel: bf16 operands with 16-byte aligned rows
        fits = a3.dtype == torch.bfloat16 and all(d % 8 == 0 for d in (r, d_in, d_out))
        views = _BankViews(a3.reshape(C * r, d_in), bt3.reshape(C * r, d_out), a3.transpose(1, 2), bt3, fits)
        self._views[proj.a_cols] = (key, views)
        return views

    def _apply(self, fn, recurse: bool = True):
        self._views.clear()
        return super()._apply(fn, recurse)

    def register(self, a3: torch.Tensor, bt3: torch.Tensor) -> tuple[int, int]:
        """Append one projection's A [C, r_p, d_in] and (s B)^T [C, r_p, d_out]; -> its (A, B) column offsets.
        A larger rank than the bank's zero-pads the bank (no change to any product)."""
        old_a, old_b = self.bank_A.data, self.bank_B.data
        if old_a.shape[2]:
            if a3.device != old_a.device or a3.dtype != old_a.dtype:
                raise ValueError(f"projection on {a3.device}/{a3.dtype}, its block's bank on {old_a.device}/{old_a.dtype}")
        else:
            old_a, old_b = old_a.to(a3), old_b.to(a3)
        r = max(old_a.shape[1], a3.shape[1])

        def pad(t: torch.Tensor) -> torch.Tensor:
            return F.pad(t, (0, 0, 0, r - t.shape[1]))

        offsets = (old_a.shape[2], old_b.shape[2])
        self.bank_A = nn.Parameter(torch.cat([pad(old_a), pad(a3)], dim=2), requires_grad=False)
        self.bank_B = nn.Parameter(torch.cat([pad(old_b), pad(bt3)], dim=2), requires_grad=False)
        self._plan = None
        self._views.clear()
        return offsets

    def set_probs(self, probs: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Store the block's gate probabilities and build its plan (weights cast to ``dtype``, default the bank's)."""
        if probs.dim() != 2 or probs.shape[1] != self.n_slots:
            raise ValueError(f"gate probs must be [tokens, {self.n_slots}], got {tuple(probs.shape)}")
        self.probs = probs
        self._plan = make_plan(probs, self, dtype or self.bank_A.dtype)

    def release(self) -> None:
        """The block's forward is done: drop the plan's per-forward tensors (decode's gathered factors are
        T x r x (sum of widths) per block, all blocks' alive at once otherwise). Without autograd nothing
        reruns the block, so the whole plan goes; with it, a checkpointed block may rerun its projections
        on the same plan, so only the shared input gather (recomputed on demand) is dropped."""
        if not torch.is_grad_enabled():
            self._plan = None
        elif isinstance(self._plan, _GroupPlan):
            self._plan._input = None

    def set_spec(self, spec: RoutingSpec) -> None:
        """Route with ``spec`` from the next forward on."""
        self.spec = spec
        self._plan = None

    def plan(self):
        if self._plan is None:
            raise RuntimeError("no routing plan: the block's gate pre-hook has not run since the routing was set")
        return self._plan

    def extra_repr(self) -> str:
        return f"adapters={self.n_adapters}, base_slot={self.base_slot}, rank={self.rank}, spec={self.spec}"


class BlockGate(nn.Linear):
    """One gate per transformer block: p = softmax(Linear(d -> S)(h)), S = C (+1 with a base slot)."""

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> p [..., S] in float32 (softmax in float32 whatever the backbone dtype)."""
        return gate_probs(h, self.weight, self.bias)


class LoRAMoELinear(nn.Module):
    """A frozen base Linear plus its columns of the block's frozen bank of C LoRA adapters, weighted by the
    block's gate.

    Built from per-adapter factors (A_c [r_c, d_in], B_c [d_out, r_c], scale s_c), which it appends to
    ``routing``'s bank (ranks zero-padded to the block's largest).
    """

    def __init__(
        self,
        base: nn.Linear,
        factors: list[tuple[torch.Tensor, torch.Tensor]],
        scales: list[float],
        routing: BlockRouting,
    ):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRAMoELinear wraps nn.Linear, got {type(base).__name__}")
        if len(factors) != len(scales) or not factors:
            raise ValueError("need one (A, B) pair and one scale per adapter, at least one adapter")
        if routing.n_adapters != len(factors):
            raise ValueError(f"routing has {routing.n_adapters} adapters, bank has {len(factors)}")
        d_in, d_out = base.in_features, base.out_features
        self.ranks = [int(a.shape[0]) for a, _ in factors]
        r = max(self.ranks)
        C = len(factors)
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        a3, bt3 = torch.zeros(C, r, d_in, **kw), torch.zeros(C, r, d_out, **kw)
        for c, ((a, b), s) in enumerate(zip(factors, scales)):
            if a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"adapter {c}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit Linear({d_in} -> {d_out})"
                )
            a3[c, : a.shape[0]] = a
            bt3[c, : a.shape[0]] = (b.double() * s).t()  # the scale folded into B, rounded once
        self.base = base
        self.scales = [float(s) for s in scales]
        self.n_adapters = C
        self._plain_base = type(base) is nn.Linear  # F.linear directly; subclasses (quantized, ...) keep their forward
        # Arrow routing (:mod:`tracekit.moe.arrow`): the projection routes each token on its own input by its
        # adapters' prototypes [C, d_in] instead of the block's gate (None: the gate routes)
        self.register_buffer("prototypes", None, persistent=False)
        self.arrow_top_k, self.arrow_temperature = 0, 1.0
        # A plain attribute (not a submodule): the block's model owns the routing; projections read it.
        object.__setattr__(self, "routing", routing)
        self.a_cols, self.b_cols = routing.register(a3, bt3)

    def set_arrow(self, prototypes: torch.Tensor, top_k: int, temperature: float) -> None:
        """Route this projection by Arrow: each token's weights are ``arrow_weights(x, prototypes, top_k,
        temperature)`` on the projection's own input x (prototypes [C, d_in], one per adapter of the bank)."""
        if prototypes.shape != (self.n_adapters, self.in_features):
            raise ValueError(f"prototypes must be [{self.n_adapters}, {self.in_features}], got {tuple(prototypes.shape)}")
        if self.routing.base_slot:
            raise ValueError("Arrow routing has no base slot (every slot is an adapter with a prototype)")
        self.prototypes = prototypes.to(device=self.base.weight.device, dtype=self.base.weight.dtype)
        self.arrow_top_k, self.arrow_temperature = int(top_k), float(temperature)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def rank(self) -> int:
        return self.routing.rank

    @property
    def A3(self) -> torch.Tensor:
        """This projection's A bank [C, r, d_in] (a view of the block bank)."""
        return self.routing.bank_A[:, :, self.a_cols : self.a_cols + self.in_features]

    @property
    def Bt3(self) -> torch.Tensor:
        """This projection's (s_c B_c)^T bank [C, r, d_out] (a view of the block bank)."""
        return self.routing.bank_B[:, :, self.b_cols : self.b_cols + self.out_features]

    @property
    def B3(self) -> torch.Tensor:
        """s_c B_c as [C, d_out, r] (a view)."""
        return self.Bt3.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, adapters={self.n_adapters}, rank={self.rank}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear saves a module call per projection (decode is bound by host time per op)
        x2d = x.reshape(-1, x.shape[-1])
        out = F.linear(x2d, self.base.weight, self.base.bias) if self._plain_base else self.base(x2d)
        if self.prototypes is not None:  # Arrow: this projection's own routing, every adapter weighed (peft's einsum)
            w = arrow_weights(x2d, self.prototypes, self.arrow_top_k, self.arrow_temperature)
            plan = _DensePlan(w, self.rank, x2d.dtype)
            return plan.delta(self, out, x, x2d).view(*x.shape[:-1], out.shape[-1])
        probs = self.routing.probs
        if probs is not None and probs.shape[0] != x2d.shape[0]:
            raise RuntimeError(
                f"projection saw {x2d.shape[0]} tokens but its block's gate routed {probs.shape[0]}: "
                "LoRAMoELinear needs a projection that sees every token of the block (not per-expert MLP inputs)"
            )
        return self.routing.plan().delta(self, out, x, x2d).view(*x.shape[:-1], out.shape[-1])
