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
  ``impl="grouped"`` (default) computes only the chosen experts' low-rank products: once per
  block, (token, slot) pairs are sorted by expert on the device (no host sync); each projection
  then gathers the pairs' inputs and runs one of two backends, numerically the same:
  - ``torch._grouped_mm`` with device-side group offsets (CUDA bf16 with 16-byte aligned rows):
    two grouped GEMMs and an index_add_ back, no host sync;
  - a loop over experts on contiguous slices of the sorted pairs (CPU and everything else; reads
    the group bounds on the host once per block).
  ``impl="grouped_mm"`` forces the ``torch._grouped_mm`` backend (a private torch API: bf16 grouped
  GEMM on sm90+ GPUs, a loop elsewhere; rank and widths must give 16-byte aligned rows).
  ``impl="masked_dense"`` computes every expert with the non-kept weights zeroed (the reference the
  grouped paths are tested against).

Optional base slot (official code's "no adapter" slot 0): the gate has C+1 outputs and slot 0
contributes a zero update. Adapters of different ranks share the bank by zero-padding A's rows and
B's columns to the largest rank, which leaves every B_c A_c unchanged.

Storage: A is kept as [C*r, d_in] (rows c*r..c*r+r-1 are A_c) and B as [d_out, C*r] (columns are
B_c), so the dense mixture is exactly two GEMMs and each expert's factors are views. The brief's
shapes A: C x r x d_in and B: C x d_out x r are :attr:`LoRAMoELinear.A3` and :attr:`LoRAMoELinear.B3`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class RoutingSpec:
    """How gate probabilities become per-token expert weights.

    top_k: None = mix all experts with p (training default); k = keep the k most probable slots.
    renormalize: divide the kept probabilities by their sum (False = raw, as the official code).
    impl: "grouped" (run only the chosen experts; backend by device and token count) / "grouped_mm" (the
    torch._grouped_mm backend) or "masked_dense" (reference; every expert computed).
    gather_max_tokens: "grouped" top-1 over at most this many tokens gathers each token's chosen factors
    (decode) instead of sorting tokens into per-expert groups (prefill).
    """

    top_k: int | None = 1
    renormalize: bool = False
    impl: str = "grouped"
    gather_max_tokens: int = 64

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.impl not in ("grouped", "grouped_mm", "masked_dense"):
            raise ValueError(f"impl must be 'grouped', 'grouped_mm' or 'masked_dense', got {self.impl!r}")
        if self.impl == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
            raise ValueError(f"impl 'grouped_mm' needs torch._grouped_mm (torch >= 2.8); torch is {torch.__version__}")


# --------------------------------------------------------------------------- pure routing math


def topk_weights(probs: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [T, S] -> (weights [T, k], slots [T, k]); weights are raw p or p / sum of kept p."""
    if k > probs.shape[-1]:
        raise ValueError(f"top_k={k} exceeds the number of gate slots {probs.shape[-1]}")
    w, idx = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, idx


def masked_topk_probs(probs: torch.Tensor, k: int, renormalize: bool) -> torch.Tensor:
    """probs [T, S] -> [T, S] with every slot outside each token's top-k set to 0."""
    w, idx = topk_weights(probs, k, renormalize)
    return torch.zeros_like(probs).scatter(-1, idx, w)


class _Plan:
    """Per-block routing computation shared by the block's projections.

    ``precompute(layer, dtype)`` stores, per distinct (scales, rank) of the block's projections, the
    gate weights multiplied by each pair's adapter scale and cast to the activation dtype, so each
    projection adds only its own matmuls. It runs in the gate's pre-hook, before the block's forward,
    so that a checkpointed block recomputes exactly the ops it ran the first time.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def key(layer: LoRAMoELinear, dtype: torch.dtype) -> tuple:
        return (layer.scale_key, dtype)

    def precompute(self, layer: LoRAMoELinear, dtype: torch.dtype) -> None:
        self._cache[self.key(layer, dtype)] = self._scale(layer.scale, layer.rank).to(dtype)

    def scaled(self, layer: LoRAMoELinear, dtype: torch.dtype) -> torch.Tensor:
        hit = self._cache.get(self.key(layer, dtype))
        return hit if hit is not None else self._scale(layer.scale, layer.rank).to(dtype)


class _DensePlan(_Plan):
    """Weights [T, C] for every adapter (base slot dropped): the mixture, or the masked top-k reference."""

    def __init__(self, weights: torch.Tensor):
        super().__init__()
        self.weights = weights

    def _scale(self, scale: torch.Tensor, rank: int) -> torch.Tensor:
        return (self.weights * scale).repeat_interleave(rank, dim=-1)  # [T, C*r], matches A's row blocks


class _GroupPlan(_Plan):
    """(token, slot) pairs sorted by adapter on the device: ``tokens``, ``adapters`` (-1 = base slot,
    sorted first), ``weights`` (raw gate weights), each [P] with P = T * k.

    Group offsets (device) and group bounds (host, one sync) are derived lazily by the backends that
    need them and shared by the block's projections.
    """

    def __init__(self, tokens, adapters, weights, n_adapters: int, k: int, impl: str, base_slot: bool):
        super().__init__()
        self.tokens, self.adapters, self.weights = tokens, adapters, weights
        self.n_adapters, self.k, self.impl, self.base_slot = n_adapters, k, impl, base_slot
        self._offsets: torch.Tensor | None = None
        self._inverse: torch.Tensor | None = None
        self._groups: list[tuple[int, int, int]] | None = None

    def _scale(self, scale: torch.Tensor, rank: int) -> torch.Tensor:
        """weights * s_adapter, 0 for base-slot pairs: [P]."""
        if self.base_slot:
            return self.weights * scale[self.adapters.clamp(min=0)] * (self.adapters >= 0)
        return self.weights * scale[self.adapters]

    @property
    def offsets(self) -> torch.Tensor:
        """Group ends [C] (int32, on device): pairs of adapter <= c. Base-slot pairs (weight 0) join group 0."""
        if self._offsets is None:
            ids = torch.arange(self.n_adapters, device=self.adapters.device, dtype=self.adapters.dtype)
            self._offsets = torch.searchsorted(self.adapters, ids, right=True, out_int32=True)
        return self._offsets

    @property
    def inverse(self) -> torch.Tensor:
        """Top-1: position of each token's pair in the sorted order [T] (a gather brings results back to token
        order without scatter-add atomics, which are slow in bf16)."""
        if self._inverse is None:
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


class _GatherPlan(_Plan):
    """Top-1 over few tokens (decode): each token's chosen adapter id and gate weight, in token order
    (``adapters`` -1 = base slot). Each projection gathers the chosen factors per token and runs two batched
    rank-r products: only the chosen expert's, with no sort, no grouping and fewer launches than
    per-expert GEMMs (decode is bound by launches, not FLOPs)."""

    def __init__(self, adapters: torch.Tensor, weights: torch.Tensor, base_slot: bool):
        super().__init__()
        self.adapters, self.weights, self.base_slot = adapters, weights, base_slot
        self.index = adapters.clamp(min=0)

    def _scale(self, scale: torch.Tensor, rank: int) -> torch.Tensor:
        """weights * s_adapter, 0 for the base slot: [T, 1, 1] (broadcast over the [T, r, 1] shrink)."""
        w = self.weights * scale[self.index]
        if self.base_slot:
            w = w * (self.adapters >= 0)
        return w.view(-1, 1, 1)


def make_plan(probs: torch.Tensor, spec: RoutingSpec, n_adapters: int, base_slot: bool) -> _Plan:
    """Turn one block's gate probabilities [T, S] into the computation every projection of the block shares.

    Computed once per block and forward; the grouped plan's sort runs on the device (no host sync).
    """
    off = 1 if base_slot else 0
    if spec.top_k is None:
        return _DensePlan(probs[:, off:])
    if spec.impl == "masked_dense":
        return _DensePlan(masked_topk_probs(probs, spec.top_k, spec.renormalize)[:, off:])
    k = spec.top_k
    w, slots = topk_weights(probs, k, spec.renormalize)
    adapters = slots.reshape(-1) - off if off else slots.reshape(-1)
    if k == 1 and spec.impl == "grouped" and adapters.numel() <= spec.gather_max_tokens:
        return _GatherPlan(adapters, w.reshape(-1), base_slot)
    adapters, order = torch.sort(adapters, stable=True)
    tokens = order if k == 1 else order // k  # pair p of the [T, k] layout belongs to token p // k
    return _GroupPlan(tokens, adapters, w.reshape(-1)[order], n_adapters, k, spec.impl, base_slot)


class BlockRouting:
    """Routing state shared by one block's gate (writer) and its adapted projections (readers).

    ``probs`` [T, S] (float32) are the gate probabilities of the block's latest forward; ``set_probs``
    builds the block's plan at once (in the gate's pre-hook, outside any checkpointed block forward).
    """

    def __init__(self, n_adapters: int, base_slot: bool, spec: RoutingSpec):
        self.n_adapters = n_adapters
        self.base_slot = base_slot
        self.spec = spec
        self.probs: torch.Tensor | None = None
        self._plan: _Plan | None = None
        self._layers: dict[tuple, LoRAMoELinear] = {}  # one projection per distinct (scales, rank)

    def register(self, layer: LoRAMoELinear) -> None:
        self._layers.setdefault(layer.scale_key, layer)

    @property
    def n_slots(self) -> int:
        return self.n_adapters + (1 if self.base_slot else 0)

    def set_probs(self, probs: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Store the block's gate probabilities and build its plan (weights pre-cast to ``dtype``)."""
        if probs.dim() != 2 or probs.shape[1] != self.n_slots:
            raise ValueError(f"gate probs must be [tokens, {self.n_slots}], got {tuple(probs.shape)}")
        self.probs = probs
        self._plan = make_plan(probs, self.spec, self.n_adapters, self.base_slot)
        for layer in self._layers.values():
            self._plan.precompute(layer, dtype or layer.base.weight.dtype)

    def set_spec(self, spec: RoutingSpec) -> None:
        """Route with ``spec`` from the next forward on."""
        self.spec = spec
        self._plan = None

    def plan(self) -> _Plan:
        if self._plan is None:
            raise RuntimeError("no routing plan: the block's gate pre-hook has not run since the routing was set")
        return self._plan


class BlockGate(nn.Linear):
    """One gate per transformer block: p = softmax(Linear(d -> S)(h)), S = C (+1 with a base slot)."""

    def probs(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., d] -> p [..., S] in float32 (softmax in float32 whatever the backbone dtype)."""
        return torch.softmax(self(h.to(self.weight.dtype)).float(), dim=-1)


class LoRAMoELinear(nn.Module):
    """A frozen base Linear plus a frozen bank of C LoRA adapters weighted by the block's gate.

    Built from per-adapter factors (A_c [r_c, d_in], B_c [d_out, r_c], scale s_c); ranks are padded
    with zeros to r = max r_c (no change to any B_c A_c).
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
        A = torch.zeros(C * r, d_in, dtype=base.weight.dtype, device=base.weight.device)
        B = torch.zeros(d_out, C * r, dtype=base.weight.dtype, device=base.weight.device)
        for c, (a, b) in enumerate(factors):
            if a.shape[1] != d_in or b.shape[0] != d_out or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"adapter {c}: A {tuple(a.shape)} / B {tuple(b.shape)} do not fit Linear({d_in} -> {d_out})"
                )
            A[c * r : c * r + a.shape[0]] = a
            B[:, c * r : c * r + a.shape[0]] = b
        self.base = base
        self.A = nn.Parameter(A, requires_grad=False)
        self.B = nn.Parameter(B, requires_grad=False)
        self.register_buffer(
            "scale", torch.tensor(scales, dtype=torch.float32, device=base.weight.device), persistent=False
        )
        self.scales = [float(s) for s in scales]
        self.rank = r
        self.scale_key = (tuple(self.scales), r)  # projections with equal keys share the plan's scaled weights
        self._plain_base = type(base) is nn.Linear  # F.linear directly; subclasses (quantized, ...) keep their forward
        self.n_adapters = C
        # A plain attribute (not a submodule): the gate owns the state, projections only read it.
        self.routing = routing
        routing.register(self)

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
    def A3(self) -> torch.Tensor:
        """A bank as [C, r, d_in] (a view)."""
        return self.A.view(self.n_adapters, self.rank, -1)

    @property
    def B3(self) -> torch.Tensor:
        """B bank as [C, d_out, r] (a view)."""
        return self.B.view(-1, self.n_adapters, self.rank).permute(1, 0, 2)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, adapters={self.n_adapters}, rank={self.rank}"

    def add_delta(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out [T, d_out] + gate-weighted adapter update of x [T, d_in] under the block's current plan."""
        plan = self.routing.plan()
        w = plan.scaled(self, x.dtype)
        if isinstance(plan, _DensePlan):
            return torch.addmm(out, F.linear(x, self.A) * w, self.B.t())
        if isinstance(plan, _GatherPlan):  # [T, r, d_in] @ [T, d_in, 1] -> [T, r, 1]; [T, d_out, r] @ -> [T, d_out, 1]
            z = torch.bmm(self.A3.index_select(0, plan.index), x.unsqueeze(-1)) * w
            return out.unsqueeze(-1).baddbmm_(self.B3.index_select(0, plan.index), z).squeeze(-1)
        if plan.impl == "grouped_mm" or (x.is_cuda and self._grouped_mm_fits(x)):
            return self._grouped_mm_delta(out, x, plan, w)
        return self._loop_delta(out, x, plan, w)

    def _grouped_mm_fits(self, x: torch.Tensor) -> bool:
        """torch._grouped_mm's fast kernel: bf16 operands with 16-byte aligned rows."""
        dims = (self.rank, self.in_features, self.out_features)
        return x.dtype == self.A.dtype == torch.bfloat16 and all(d % 8 == 0 for d in dims)

    def _grouped_mm_delta(self, out: torch.Tensor, x: torch.Tensor, plan: _GroupPlan, w: torch.Tensor) -> torch.Tensor:
        """Gather the sorted pairs' inputs, one grouped GEMM per factor (device offsets), index_add_ back."""
        xs = x.index_select(0, plan.tokens)
        z = torch._grouped_mm(xs, self.A3.transpose(1, 2), offs=plan.offsets) * w.unsqueeze(-1)  # [P, r]
        y = torch._grouped_mm(z, self.B3.transpose(1, 2), offs=plan.offsets)  # [P, d_out]
        if plan.k == 1:
            return out.add_(y.index_select(0, plan.inverse))
        return out.index_add_(0, plan.tokens, y)

    def _loop_delta(self, out: torch.Tensor, x: torch.Tensor, plan: _GroupPlan, w: torch.Tensor) -> torch.Tensor:
        """Each expert on its contiguous slice of the sorted pairs (group bounds read on the host)."""
        r = self.rank
        groups = plan.groups
        if not groups:  # every token chose the base slot
            return out
        w = w.unsqueeze(-1)
        if plan.identity:  # one expert for all tokens, in order: no gather/scatter
            a = groups[0][0]
            return torch.addcmul(out, F.linear(F.linear(x, self.A[a * r : a * r + r]), self.B[:, a * r : a * r + r]), w)
        off = groups[0][1]  # base-slot pairs sort first and are skipped
        xs = x.index_select(0, plan.tokens[off:])
        ys = []
        for a, s, n in groups:
            z = F.linear(xs[s - off : s - off + n], self.A[a * r : a * r + r]) * w[s : s + n]
            ys.append(F.linear(z, self.B[:, a * r : a * r + r]))
        return out.index_add_(0, plan.tokens[off:], torch.cat(ys) if len(ys) > 1 else ys[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.linear saves a module call per projection (decode is bound by host time per op)
        out = F.linear(x, self.base.weight, self.base.bias) if self._plain_base else self.base(x)
        x2d = x.reshape(-1, x.shape[-1])
        probs = self.routing.probs
        if probs is not None and probs.shape[0] != x2d.shape[0]:
            raise RuntimeError(
                f"projection saw {x2d.shape[0]} tokens but its block's gate routed {probs.shape[0]}: "
                "LoRAMoELinear needs a projection that sees every token of the block (not per-expert MLP inputs)"
            )
        return self.add_delta(out.reshape(-1, out.shape[-1]), x2d).view(out.shape)
