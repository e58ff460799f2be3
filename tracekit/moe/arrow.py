"""Arrow routing (Ostapenko et al. 2024, "Towards Modular LLMs by Building and Reusing a Library of LoRAs"; peft's
``ArrowConfig`` / ``create_arrow_model``): a training-free router over a bank of LoRA adapters.

Per adapted projection (each module routes on its own input, no gate and no training):

- each adapter's **prototype** is the top right singular vector of its update ``dW_c = B_c A_c`` (unit norm, in the
  projection's input space; its sign is arbitrary, so every use is sign-invariant);
- a token x of the projection's input scores each adapter by ``|<x, v_c>|`` (x is *not* normalized: peft 0.21's
  ``ArrowLoraLinearLayer.forward`` takes ``abs(tok @ prototypes.T)``; the ranking is the |cosine|'s, the softmax
  weights are not);
- the token keeps its ``top_k`` adapters and weighs them by ``softmax(score / temperature)`` over the kept ones
  (zero elsewhere); the update is ``sum_c w_c s_c B_c A_c x``.

Deviation from peft, named: peft finds the prototype by 15 steps of power iteration on ``A^T B^T B A`` from a random
start (``rng_seed``), which stops short of the singular vector when the top two singular values are close; here it is
the exact one (QR of A^T, then the SVD of the small ``B R^T``), so the routing does not depend on a random start.
GenKnowSub (peft ``use_gks``: subtracting the mean of general adapters) is not offered: TRACE has no general
adapters.
"""

from __future__ import annotations

import torch


def arrow_prototype(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The top right singular vector of ``B @ A`` (A [r, d_in], B [d_out, r]) -> [d_in] float32, unit norm, without
    forming the d_out x d_in product: with ``A^T = Q R`` (Q [d_in, r]), ``B A = (B R^T) Q^T``, so the right singular
    vectors are Q times those of the small ``B R^T`` [d_out, r]. Sign fixed (largest-magnitude entry positive)."""
    if A.dim() != 2 or B.dim() != 2 or A.shape[0] != B.shape[1]:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} are not LoRA factors (A [r, d_in], B [d_out, r])")
    a, b = A.detach().double().cpu(), B.detach().double().cpu()
    q, r = torch.linalg.qr(a.t())  # [d_in, r], [r, r]
    _, _, vh = torch.linalg.svd(b @ r.t(), full_matrices=False)
    v = q @ vh[0]
    v = v / v.norm().clamp_min(1e-300)
    return (v * torch.sign(v[v.abs().argmax()])).float()


def arrow_weights(x: torch.Tensor, prototypes: torch.Tensor, top_k: int, temperature: float = 1.0) -> torch.Tensor:
    """Arrow's per-token adapter weights: x [T, d], prototypes [..., C, d] (one set of C per leading index, e.g. the
    parts of a fused projection) -> [T, ..., C] float32: ``softmax(|x . v_c| / temperature)`` over each token's
    ``top_k`` highest scores, 0 elsewhere. The scores are taken in x's dtype, as peft does (prototypes cast to it)."""
    C, d = prototypes.shape[-2:]
    if not 1 <= top_k <= C:
        raise ValueError(f"Arrow top_k must be in [1, {C}] (the number of adapters), got {top_k}")
    if temperature <= 0:
        raise ValueError(f"Arrow temperature must be > 0, got {temperature}")
    lead = prototypes.shape[:-2]
    sim = (x @ prototypes.reshape(-1, d).to(x.dtype).t()).abs().view(x.shape[0], *lead, C)
    top, idx = torch.topk(sim, top_k, dim=-1)
    full = torch.full(sim.shape, float("-inf"), dtype=torch.float32, device=x.device).scatter(-1, idx, top.float())
    return torch.softmax(full / temperature, dim=-1)
