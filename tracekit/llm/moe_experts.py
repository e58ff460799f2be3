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


def touched_experts_fraction(indices: Sequence[torch.Tensor], n_experts: int) -> float:
    """Mean fraction of experts that at least one token of a step routes to (one [T, k] index tensor per step)."""
    if not indices:
        return float("nan")
    fr = [torch.zeros(n_experts, dtype=torch.bool, device=i.device).index_fill_(0, i.reshape(-1), True).float().mean() for i in indices]
    return float(torch.stack(fr).mean())
