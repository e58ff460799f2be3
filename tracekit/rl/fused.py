"""Fewer, cheaper kernels in the update's forward/backward: LoRA and RMSNorm forwards replaced in place.

peft keeps adapters in float32 on a bf16 backbone and computes ``base(x) + (B(A(x.float())) * s)``:
each adapted linear adds float32 passes over [tokens x out] (the cast, the scale, the add, the cast
back) and saves a float32 copy of its input for backward. transformers' RMSNorm is seven
elementwise kernels (fp32 cast, pow, mean, add, rsqrt, mul, cast) plus the weight multiply, and as
many again in backward. :func:`set_fused_update_kernels` swaps, per module instance:

- LoRA linear: ``out = addmm(base(x), dropout(x) A^T, (s B)^T)`` with A, B cast to the
  activation dtype (bf16 GEMMs with fp32 accumulation; the gradients still reach the float32
  master weights through the casts). The scale and the add ride in the GEMM.
- RMSNorm: ``F.rms_norm(x) * w`` (the fused kernel, forward and backward; same rounding points as
  transformers: normalized in fp32, cast, then the weight in the model dtype).
- LoRA on fused MoE experts (peft ``target_parameters``, ``ParamWrapper`` on ``experts.gate_up_proj`` /
  ``down_proj``): peft materialises ``W + s B A`` for every expert of the block in the forward, again in
  the recompute and in backward (on Qwen3-30B-A3B about 40% of an update's GPU time). The outermost
  wrapper's forward becomes :func:`tracekit.llm.moe_experts.lora_experts_forward`: the routed (token,
  expert) pairs sorted once, base experts and the experts' LoRA as grouped GEMMs on them, autograd
  through the factors only (:func:`set_fused_experts` alone switches just this one).

The swap is persistent (not a context) so that activation-checkpoint recomputation runs exactly
the code the forward ran. Anything else (DoRA and other variants, mixed-adapter batches, merged or
disabled adapters) goes through peft's own forward. In float32 both are the same function up to
rounding order (tests compare losses and gradients).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from tracekit.llm.moe_experts import _wrappers, lora_experts_forward, lora_experts_reason

_ATTR = "_tracekit_fused"


def _is_rmsnorm(m: torch.nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon") and getattr(m, "weight", None) is not None


def _is_lora_linear(m: torch.nn.Module) -> bool:
    return hasattr(m, "lora_A") and hasattr(m, "lora_variant") and isinstance(getattr(m, "base_layer", None), torch.nn.Linear)


def _rmsnorm_forward(self, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast(x.device.type, enabled=False):  # autocast would upcast rms_norm off the fused kernel
        return F.rms_norm(x, (x.shape[-1],), None, self.variance_epsilon) * self.weight


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    adapters = [a for a in self.active_adapters if a in self.lora_A]
    if args or kwargs or self.disable_adapters or self.merged or any(a in self.lora_variant for a in adapters):
        return type(self).forward(self, x, *args, **kwargs)
    out = self.base_layer(x)
    shape = out.shape
    out = out.reshape(-1, shape[-1])
    x2 = x.reshape(-1, x.shape[-1])
    for a in adapters:
        xa = F.linear(self.lora_dropout[a](x2), self.lora_A[a].weight.to(x.dtype))
        out = torch.addmm(out, xa, (self.lora_B[a].weight * self.scaling[a]).to(x.dtype).t())
    return out.view(shape)


def _experts_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    if len(args) != 2 or kwargs or lora_experts_reason(self) is not None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return lora_experts_forward(self, hidden_states, *args)


def _lora_experts_wrappers(lm: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost peft ``ParamWrapper`` of every fused 3-D experts module (wrappers nest, one per parameter)."""
    def is_wrapper(m):
        return hasattr(m, "parameter_name") and hasattr(m, "base_layer") and hasattr(m, "lora_A")

    inner = {id(m.base_layer) for m in lm.modules() if is_wrapper(m)}
    out = []
    for m in lm.modules():
        if is_wrapper(m) and id(m) not in inner:
            base, _ = _wrappers(m)
            gu = getattr(base, "gate_up_proj", None)
            if isinstance(gu, torch.Tensor) and gu.dim() == 3:
                out.append(m)
    return out


def set_fused_experts(lm: torch.nn.Module, on: bool) -> int:
    """Install (``on``) or remove the grouped-GEMM LoRA forward on every peft-wrapped fused-experts module of
    ``lm`` (a module it cannot run falls back to peft's forward at call time). -> modules changed. Idempotent."""
    n = 0
    for m in _lora_experts_wrappers(lm):
        if bool(getattr(m, _ATTR, False)) == on:
            continue
        if on:
            m.forward = types.MethodType(_experts_forward, m)
        else:
            del m.forward
        setattr(m, _ATTR, on)
        n += 1
    return n


def set_fused_update_kernels(lm: torch.nn.Module, on: bool, experts: bool = True) -> int:
    """Install (``on``) or remove the fused forwards on every LoRA linear and RMSNorm of ``lm`` and, with
    ``experts`` (default), on its LoRA-adapted fused MoE experts (:func:`set_fused_experts`; ``experts=False``
    leaves them on peft's forward).

    -> number of modules changed. Idempotent.
    """
    n = set_fused_experts(lm, on and experts)
    for m in lm.modules():
        kind = _lora_forward if _is_lora_linear(m) else _rmsnorm_forward if _is_rmsnorm(m) else None
        if kind is None or bool(getattr(m, _ATTR, False)) == on:
            continue
        if on:
            m.forward = types.MethodType(kind, m)
        else:
            del m.forward
        setattr(m, _ATTR, on)
        n += 1
    return n
