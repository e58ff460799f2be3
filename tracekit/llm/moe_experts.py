"""Fused-experts MoE blocks in the fast decoder: routing, grouped GEMMs and the experts' LoRA, graph-capturable.

transformers 5.x stores a Qwen3-MoE block's experts fused, as 3-D parameters ``gate_up_proj``
[E, 2I, H] and ``down_proj`` [E, H, I], behind a top-k router (``mlp.gate.weight`` [E, H]). peft
adapts them through ``target_parameters`` (``lora.ParamWrapper``): per expert ``e`` a factor pair
``A_e`` [r, in], ``B_e`` [out, r] stored as ``lora_A`` = Linear(in, r*E) (rows e*r..e*r+r-1) and
``lora_B`` = Linear(r*E, out) (columns e, e+E, ...: ``B.reshape(out, r, E)[:, :, e]``). peft's forward
*materialises* ``W + s * B_e A_e`` for every expert of the block at every call (a second copy of the
block's expert weights, written and read per step); a decode step at batch 64 then moves about twice
the bytes the weights need.

:class:`FusedExperts` instead keeps the base 3-D weights where they are (no copy) and applies the
adapter per (token, expert) pair, the way the backbone applies its experts:

    y = sum_k w_k * down_e(act(g) * u),  [g | u] = x W_gu[e]^T + ((x A_gu[e]^T) (s B_gu[e])^T)

with the pairs sorted by expert once per block and every product a grouped GEMM over the sorted pairs
(``torch._grouped_mm``, group offsets computed on the device by ``searchsorted``: no host sync, static
shapes, so the block can be captured in a CUDA graph: routing only changes the offsets). The LoRA
factors live in working copies of the model dtype (``A`` [E, R, in], ``s B`` [E, R, out], R = the sum of
the active adapters' ranks), refreshed in place after an optimizer step. Extra bytes per step: the
factors of the touched experts (rank 32: ~2.6% of the expert weights).

Routing is transformers' own (``Qwen3MoeTopKRouter``): router logits in the model dtype, softmax in
float32, top-k, optional renormalisation, weights cast back; results go back to token order by the
inverse permutation and a sum over the k slots (as transformers' ``grouped_mm`` experts).
On CPU, or off bf16, the grouped GEMM is a loop over the non-empty groups (exact, host-synchronising).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def _wrappers(experts: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """(the innermost experts module, {parameter name: peft ParamWrapper}) of a possibly wrapped module."""
    wraps: dict[str, torch.nn.Module] = {}
    m = experts
    while hasattr(m, "parameter_name") and hasattr(m, "base_layer") and hasattr(m, "lora_A"):
        wraps[m.parameter_name] = m
        m = m.base_layer
    return m, wraps


def _router_attr(mlp: torch.nn.Module, name: str):
    """A routing setting on the router (transformers >= 5: ``Qwen3MoeTopKRouter``) or on the block (a plain
    ``nn.Linear`` gate, earlier layouts)."""
    return getattr(mlp.gate, name, getattr(mlp, name, None))


def fused_experts_reason(mlp: torch.nn.Module) -> str | None:
    """Why :class:`FusedExperts` cannot run this MLP block (None: it can)."""
    gate, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
    if gate is None or experts is None:
        return "not a router + experts MoE block"
    if not isinstance(getattr(gate, "weight", None), torch.Tensor) or getattr(gate, "bias", None) is not None:
        return f"router {type(gate).__name__} is not a bias-free linear router"
    if _router_attr(mlp, "top_k") is None:
        return f"router {type(gate).__name__} has no top_k"
    if _is_lora_module(gate):
        return "LoRA on the router"
    if hasattr(mlp, "shared_expert"):
        return "shared experts"
    base, wraps = _wrappers(experts)
    gu, dn = getattr(base, "gate_up_proj", None), getattr(base, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3):
        return f"{type(base).__name__} has no fused 3-D gate_up_proj / down_proj"
    if getattr(base, "is_transposed", False) or getattr(base, "has_bias", False):
        return "transposed or biased expert weights"
    if getattr(base, "has_gate", True) is False:
        return "experts without a gate projection"
    E, two_i, H = gu.shape
    if dn.shape != (E, H, two_i // 2) or gate.weight.shape != (E, H):
        return f"expert shapes gate_up {tuple(gu.shape)}, down {tuple(dn.shape)}, router {tuple(gate.weight.shape)} do not fit"
    for name, w in wraps.items():
        if name not in ("gate_up_proj", "down_proj"):
            return f"LoRA on experts.{name}"
        if getattr(w, "num_experts", E) != E:
            return f"LoRA on experts.{name} is not per expert"
        for a in _active(w):
            if w.lora_bias.get(a, False) or w.use_dora.get(a, False) or a in getattr(w, "lora_variant", {}):
                return f"LoRA variant / bias on experts.{name}"
    return None


def _is_lora_module(m: torch.nn.Module) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "base_layer")


def _active(w: torch.nn.Module) -> list[str]:
    if getattr(w, "disable_adapters", False) or getattr(w, "merged", False):
        return []  # disabled, or merged into the base weight in place (then the base is the adapted weight)
    return [a for a in w.active_adapters if a in w.lora_A]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[rows of group g] = a[rows of group g] @ b[g]``; a [P, K], b [G, K, N], offs [G] int32 cumulative
    row counts (rows past offs[-1] are left unwritten by the CUDA kernel, zero here)."""
    if a.is_cuda and a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    out = torch.zeros((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


class FusedExperts:
    """One MoE block's decode-time forward: the base weights by reference, the active LoRA as working copies.

    ``__call__(h [T, H]) -> [T, H]`` (the block's output; h is the post-attention normed hidden state).
    ``refresh()`` re-reads the LoRA factors in place (addresses stay: captured graphs remain valid);
    ``params()`` lists every tensor the working copies come from (staleness checks).
    """

    def __init__(self, mlp: torch.nn.Module, dtype: torch.dtype | None = None):
        reason = fused_experts_reason(mlp)
        if reason is not None:
            raise NotImplementedError(f"fused-experts decoding does not support this block: {reason}")
        self.router = mlp.gate
        base, self.wraps = _wrappers(mlp.experts)
        self.base = base
        self.act = base.act_fn
        self.top_k = int(_router_attr(mlp, "top_k"))
        self.norm_topk = bool(_router_attr(mlp, "norm_topk_prob") if _router_attr(mlp, "norm_topk_prob") is not None else True)
        self.n_experts = int(self.base.gate_up_proj.shape[0])
        self.dtype = dtype or self.base.gate_up_proj.dtype
        dev = self.base.gate_up_proj.device
        self.expert_ids = torch.arange(self.n_experts, device=dev)
        # per projection: (A [E, R, in], sB [E, R, out]) working copies, or None without an active adapter
        self.lora: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        for name in ("gate_up_proj", "down_proj"):
            w = self.wraps.get(name)
            rank = sum(w.r[a] for a in _active(w)) if w is not None else 0
            if rank == 0:
                self.lora[name] = None
                continue
            E, out_f, in_f = getattr(self.base, name).shape
            self.lora[name] = (
                torch.empty((E, rank, in_f), dtype=self.dtype, device=dev),
                torch.empty((E, rank, out_f), dtype=self.dtype, device=dev),
            )
        self.refresh()

    @property
    def adapted(self) -> bool:
        return any(v is not None for v in self.lora.values())

    def params(self) -> list[torch.Tensor]:
        out = [self.router.weight, self.base.gate_up_proj, self.base.down_proj]
        for w in self.wraps.values():
            for a in _active(w):
                out += [w.lora_A[a].weight, w.lora_B[a].weight]
        return out

    def refresh(self) -> None:
        """Copy the active adapters' factors (A_e and s * B_e, adapters stacked along the rank) into place."""
        with torch.no_grad():
            for name, pair in self.lora.items():
                if pair is None:
                    continue
                w, (A, sB) = self.wraps[name], pair
                E, _, out_f = sB.shape
                row = 0
                for a in _active(w):
                    r = w.r[a]
                    A[:, row : row + r].copy_(w.lora_A[a].weight.reshape(E, r, -1))
                    b = w.lora_B[a].weight.reshape(out_f, r, E).permute(2, 1, 0)  # [E, r, out]
                    sB[:, row : row + r].copy_(b.float() * w.scaling[a])
                    row += r

    def bytes_per_expert(self) -> int:
        """Bytes one expert's weights (and working LoRA factors) occupy: what a step reads per touched expert."""
        n = self.base.gate_up_proj[0].numel() * self.base.gate_up_proj.element_size()
        n += self.base.down_proj[0].numel() * self.base.down_proj.element_size()
        for pair in self.lora.values():
            if pair is not None:
                n += sum(t[0].numel() * t.element_size() for t in pair)
        return n

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """transformers' top-k router: -> (weights [T, k] in h's dtype, expert ids [T, k])."""
        logits = F.linear(h, self.router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(logits.dtype), idx

    def _project(self, x: torch.Tensor, name: str, offs: torch.Tensor) -> torch.Tensor:
        out = grouped_mm(x, getattr(self.base, name).transpose(1, 2), offs)  # [P, in] @ [E, in, out]
        pair = self.lora[name]
        if pair is not None:
            A, sB = pair
            out = out + grouped_mm(grouped_mm(x, A.transpose(1, 2), offs), sB, offs)
        return out

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        T, H = h.shape
        weights, idx = self.route(h)
        flat = idx.reshape(-1)
        sorted_ids, perm = torch.sort(flat)
        offs = torch.searchsorted(sorted_ids, self.expert_ids, right=True).to(torch.int32)  # pairs with id <= e
        x = h[perm // self.top_k]  # [P, H], grouped by expert
        g, u = self._project(x, "gate_up_proj", offs).chunk(2, dim=-1)
        y = self._project(self.act(g) * u, "down_proj", offs)  # [P, H]
        y = y * weights.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=perm.device)
        return y[inv].view(T, self.top_k, H).sum(dim=1)


# --------------------------------------------------------------------------------------------
# The update: the experts' LoRA through grouped GEMMs, differentiable w.r.t. the LoRA factors


def lora_experts_reason(experts: torch.nn.Module) -> str | None:
    """Why :func:`lora_experts_forward` cannot run this (possibly peft-wrapped) fused-experts module (None: it can)."""
    base, wraps = _wrappers(experts)
    gu, dn = getattr(base, "gate_up_proj", None), getattr(base, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3 and dn.dim() == 3):
        return f"{type(base).__name__} has no fused 3-D gate_up_proj / down_proj"
    if getattr(base, "is_transposed", False) or getattr(base, "has_bias", False) or getattr(base, "has_gate", True) is False:
        return "transposed, biased or gate-less expert weights"
    if getattr(base, "has_post_expert_norm", False) or getattr(base, "_is_expert_parallel", False):
        return "post-expert norm or expert parallelism"
    E, two_i, H = gu.shape
    if dn.shape != (E, H, two_i // 2):
        return f"expert shapes gate_up {tuple(gu.shape)}, down {tuple(dn.shape)} do not fit"
    for name, w in wraps.items():
        if name not in ("gate_up_proj", "down_proj"):
            return f"LoRA on experts.{name}"
        if getattr(w, "num_experts", E) != E or not getattr(w, "_did_swap_in_out_features", True):
            return f"LoRA on experts.{name} is not per expert in the [E, out, in] layout"
        if getattr(w, "disable_adapters", False) or getattr(w, "merged", False):
            return "adapters disabled or merged"
        for a in _active(w):
            if w.lora_bias.get(a, False) or w.use_dora.get(a, False) or a in getattr(w, "lora_variant", {}):
                return f"LoRA variant / bias on experts.{name}"
            if not isinstance(w.lora_dropout[a], torch.nn.Identity):
                return f"LoRA dropout on experts.{name}"
    return None


class _Dispatch(torch.autograd.Function):
    """Token rows to the sorted (token, expert) pairs: ``out[p] = h[tokens[p]]`` (tokens = perm // k).

    Backward is the adjoint, each token's k pair gradients summed, gathered through the inverse permutation
    (no atomics, deterministic), where autograd's index backward would sort and scatter-add."""

    @staticmethod
    def forward(ctx, h, tokens, inverse, k):
        ctx.save_for_backward(tokens, inverse)
        ctx.k = k
        return h.index_select(0, tokens)

    @staticmethod
    def backward(ctx, g):
        tokens, inverse = ctx.saved_tensors
        return _Combine.apply(g, tokens, inverse, ctx.k), None, None, None


class _Combine(torch.autograd.Function):
    """Sorted pairs back to tokens, summed over each token's k pairs: the adjoint of :class:`_Dispatch`."""

    @staticmethod
    def forward(ctx, y, tokens, inverse, k):
        ctx.save_for_backward(tokens, inverse)
        ctx.k = k
        return y.index_select(0, inverse).view(-1, k, y.shape[-1]).sum(dim=1)

    @staticmethod
    def backward(ctx, g):
        tokens, inverse = ctx.saved_tensors
        return _Dispatch.apply(g, tokens, inverse, ctx.k), None, None, None


def _lora_factors(w: torch.nn.Module, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per active adapter of a peft ``ParamWrapper`` on [E, out, in] experts: (A^T [E, in, r], s B^T [E, r, out])
    in ``dtype``, built from the trainable (float32) factors by differentiable casts and views: gradients reach
    peft's ``lora_A`` / ``lora_B`` weights. The layout is the one :meth:`FusedExperts.refresh` reads."""
    out = []
    E = w.num_experts
    for a in _active(w):
        A, B = w.lora_A[a].weight, w.lora_B[a].weight  # [E*r, in], [out, r*E] (column j*E + e: rank j of expert e)
        r, out_f = A.shape[0] // E, B.shape[0]
        At = A.to(dtype).view(E, r, -1).transpose(1, 2)  # column-major [E, in, r]: a grouped-GEMM operand as is
        sBt = (B * w.scaling[a]).to(dtype).view(out_f, r, E).permute(2, 1, 0).contiguous()  # [E, r, out]
        out.append((At, sBt))
    return out


def _grouped_project(x: torch.Tensor, weight: torch.Tensor, factors, offs: torch.Tensor) -> torch.Tensor:
    """``x`` [P, in] sorted by expert -> [P, out]: ``x W_e^T + (x A_e^T)(s B_e)^T`` per group, every product a
    grouped GEMM (autograd: input gradients through the frozen W_e, factor gradients through the rank-r GEMMs)."""
    out = grouped_mm(x, weight.transpose(1, 2), offs)
    for At, sBt in factors:
        out = out + grouped_mm(grouped_mm(x, At, offs), sBt, offs)
    return out


def lora_experts_forward(experts: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """A peft-wrapped fused-experts module's forward (transformers' ``experts(hidden, top_k_index, top_k_weights)``)
    without materialising ``W + s B A``: the LoRA of each expert is applied to its routed (token, expert) pairs.

    hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H]. The pairs are sorted by expert once; each
    projection is :func:`_grouped_project`; the routing weight multiplies the down projection's input
    (``w (a W^T) = (w a) W^T``: [P, I] instead of [P, H]) and the pairs go back to their tokens by
    :class:`_Combine`. Differentiable w.r.t. ``hidden``, the routing weights and the LoRA factors; the base
    expert weights are read in place (frozen: no gradient). Group offsets are computed on the device (no host
    sync); off CUDA bf16 the grouped GEMM is a loop over the non-empty groups (:func:`grouped_mm`).
    """
    base, wraps = _wrappers(experts)
    k = top_k_index.shape[-1]
    E = base.gate_up_proj.shape[0]
    dtype = base.gate_up_proj.dtype
    x_in = hidden.to(dtype)
    with torch.no_grad():
        sorted_ids, perm = torch.sort(top_k_index.reshape(-1))
        offs = torch.searchsorted(sorted_ids, torch.arange(E, device=hidden.device), right=True).to(torch.int32)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        tokens = perm // k
    x = _Dispatch.apply(x_in, tokens, inverse, k)  # [P, H], grouped by expert
    gu_w, dn_w = wraps.get("gate_up_proj"), wraps.get("down_proj")
    gu = _grouped_project(x, base.gate_up_proj, _lora_factors(gu_w, dtype) if gu_w is not None else [], offs)
    g, u = gu.chunk(2, dim=-1)
    a = base.act_fn(g) * u * top_k_weights.reshape(-1).to(dtype).index_select(0, perm).unsqueeze(-1)
    y = _grouped_project(a, base.down_proj, _lora_factors(dn_w, dtype) if dn_w is not None else [], offs)
    return _Combine.apply(y, tokens, inverse, k).to(hidden.dtype)


def touched_experts_fraction(indices: Sequence[torch.Tensor], n_experts: int) -> float:
    """Mean fraction of experts that at least one token of a step routes to (one [T, k] index tensor per step)."""
    if not indices:
        return float("nan")
    fr = [torch.zeros(n_experts, dtype=torch.bool, device=i.device).index_fill_(0, i.reshape(-1), True).float().mean() for i in indices]
    return float(torch.stack(fr).mean())
