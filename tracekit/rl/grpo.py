"""GRPO math as small pure functions (paper sec. 3.4 and Appendix A, eqs. (1) and (2)).

Shapes: ``G`` groups (seeds) x ``K`` rollouts per group; ``N`` rows of a padded token batch with
``T`` positions each; ``V`` vocabulary size; ``H`` hidden size. A "row" is one sequence fed to the
model; a trajectory may span several rows when its chat template breaks prefix-extension (see
``tracekit.rl.tokens``), which is why the loss takes per-token weights instead of assuming one row
per trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Eq. (1): ``A[g,k] = (r[g,k] - mean_g) / (std_g + eps)`` with the population std (divide by K).

    rewards: [G, K] -> advantages [G, K] (float32).
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [G, K] with K >= 2, got shape {tuple(rewards.shape)}")
    r = rewards.to(torch.float64)
    mean = r.mean(dim=1, keepdim=True)
    std = ((r - mean) ** 2).mean(dim=1, keepdim=True).sqrt()
    return ((r - mean) / (std + eps)).to(torch.float32)


def zero_variance_filter(rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Groups whose K rewards are all identical carry no signal (paper App. A) and are dropped.

    rewards: [G, K] -> (keep [G] bool, number of dropped groups).
    """
    keep = rewards.amax(dim=1) != rewards.amin(dim=1)
    return keep, int((~keep).sum())


def token_advantages(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Every generated token of a row gets its trajectory's advantage; context tokens get 0.

    advantages: [N] (one per row, the row's trajectory advantage), loss_mask: [N, T] -> [N, T].
    """
    return advantages[:, None].to(torch.float32) * loss_mask.to(torch.float32)


def trajectory_token_weights(loss_mask: torch.Tensor, traj_tokens: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Per-token weights ``m[i,t] / (T_traj(i) * |B|)`` that turn eq. (2)'s two means into one sum.

    loss_mask: [N, T]; traj_tokens: [N], the number of generated tokens ``T_{g,k}`` of the
    trajectory row i belongs to (over all its rows); batch_size: ``|B|``, trajectories in the
    minibatch (over all ranks). -> [N, T] float32.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    denom = traj_tokens.to(torch.float32).clamp(min=1.0)[:, None] * float(batch_size)
    return loss_mask.to(torch.float32) / denom


def clipped_surrogate(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    clip_eps: float,
    clip_eps_high: float | None = None,
) -> torch.Tensor:
    """Per-token ``min(rho * A, clip(rho, 1 - eps, 1 + eps_high) * A)`` with ``rho = exp(logp - old_logp)``.

    All inputs [N, T] (adv already broadcast to tokens); eps_high defaults to eps (eq. (2)). -> [N, T].
    """
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(logp - old_logp)
    return torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_eps, 1.0 + hi) * adv)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref) on tokens sampled from pi_theta:
    ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased; Schulman 2020). [N, T] -> [N, T]."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def truncated_is_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling (Yao et al. 2025): ``min(pi_old_trainer / pi_rollout, cap)``, no grad.

    Corrects the bias when the rollout engine's numerics (vLLM, bf16 kernels) differ from the
    trainer's for the same weights. [N, T] -> [N, T].
    """
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, differentiable
    policy_loss: torch.Tensor  # scalar, detached: -sum(w * surrogate)
    kl: torch.Tensor  # scalar, detached: sum(w * k3) (0 when no reference given)
    clip_count: torch.Tensor  # tokens where clipping removed the gradient
    ratio_sum: torch.Tensor  # sum of rho over masked tokens
    approx_kl_sum: torch.Tensor  # sum over masked tokens of (rho - 1) - log rho, KL(pi_old || pi_theta)
    tokens: torch.Tensor  # masked tokens


def grpo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    weights: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_beta: float = 0.0,
    is_weights: torch.Tensor | None = None,
) -> LossOutput:
    """Eq. (2) as a weighted token sum, plus an optional k3 KL term and TIS weights.

    ``loss = -sum_{i,t} w[i,t] * c[i,t] * min(rho A, clip(rho) A) + beta * sum_{i,t} w[i,t] * k3[i,t]``
    with ``w`` from :func:`trajectory_token_weights` (so with one row per trajectory this is exactly
    ``-1/|B| sum_traj 1/T sum_t min(...)``), ``c`` the TIS weights (1 when off) and k3 against the
    frozen base (``ref_logp``, adapter disabled). All tensors [N, T]; masked positions must have
    weight 0 (their log-probs may be anything finite).
    """
    mask = weights > 0
    surrogate = clipped_surrogate(logp, old_logp, adv, clip_eps, clip_eps_high)
    if is_weights is not None:
        surrogate = surrogate * is_weights
    policy = -(weights * surrogate).sum()
    loss = policy
    kl = torch.zeros((), dtype=policy.dtype, device=policy.device)
    if ref_logp is not None and kl_beta > 0:
        kl = (weights * k3_kl(logp, ref_logp)).sum()
        loss = loss + kl_beta * kl
    with torch.no_grad():
        hi = clip_eps if clip_eps_high is None else clip_eps_high
        ratio = torch.exp(logp - old_logp)
        clipped = ((ratio > 1.0 + hi) & (adv > 0)) | ((ratio < 1.0 - clip_eps) & (adv < 0))
        log_ratio = logp - old_logp
        stats = dict(
            clip_count=(clipped & mask).sum().to(torch.float64),
            ratio_sum=(ratio * mask).sum().to(torch.float64),
            approx_kl_sum=(((ratio - 1.0) - log_ratio) * mask).sum().to(torch.float64),
            tokens=mask.sum().to(torch.float64),
        )
    return LossOutput(loss=loss, policy_loss=policy.detach(), kl=kl.detach(), **stats)


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
