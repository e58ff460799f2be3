"""Operations shared by the training recipes and the MoE gate: token log-probs from hidden states in vocabulary
chunks (never the full [tokens x vocab] logits)."""

from __future__ import annotations

import torch


class _ChunkedTokenLogProb(torch.autograd.Function):
    """log_softmax(h W^T / temperature)[target] computed ``chunk`` rows at a time.

    Forward keeps only the per-row log-sum-exp; backward recomputes each chunk's logits, so peak
    extra memory is [chunk, V] instead of [N, V].
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk):  # type: ignore[override]
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], chunk):
            logits = (hidden[s : s + chunk] @ weight.t()).float() / temperature
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            out[s : s + chunk] = logits.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse[s : s + chunk]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        hidden, weight, targets, lse = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk]
            logits = (h @ weight.t()).float() / t
            # d logp[target] / d logits = onehot(target) - softmax(logits); chain through 1/t.
            g = -torch.exp(logits - lse[s : s + chunk, None])
            g.scatter_add_(1, targets[s : s + chunk, None], torch.ones_like(g[:, :1]))
            g = g * (grad_out[s : s + chunk, None].float() / t)
            if grad_h is not None:
                grad_h[s : s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w += g.t() @ h.float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> torch.Tensor:
    """Log-probs of the taken tokens without materializing [N, V] logits at once.

    hidden: [N, H] final (normed) hidden states at the positions *before* each target;
    weight: [V, H] the lm_head; targets: [N] token ids -> [N] float32, differentiable in hidden
    (and weight if it requires grad). Logits are computed in float32 from the model dtype.
    """
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=torch.float32) + 0.0 * hidden.sum()
    return _ChunkedTokenLogProb.apply(hidden, weight, targets, float(temperature), int(chunk))
