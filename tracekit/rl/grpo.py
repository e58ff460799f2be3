"""GRPO math as small pure functions (paper sec. 3.4 and Appendix A, eqs. (1) and (2)), and the
run-health and control rules the trainer applies (entropy, log-prob gap, task retirement, early stop).

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


# --------------------------------------------------------------------------------------------
# Run health and control (the trainer's metrics row, task retirement, early stop)


def entropy_from_logits(logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per row, ``H = lse - sum_v p_v logits_v`` with ``lse`` the rows'
    log-sum-exp. [N, V], [N] -> [N] float32.

    One softmax kernel and one batched dot product: the only [N, V] temporary is ``p`` (the cancellation
    in ``lse - p . logits`` costs ~1e-7 relative to the logits' scale in float32)."""
    p = torch.softmax(logits, dim=-1)
    return lse - (p.unsqueeze(1) @ logits.unsqueeze(2)).reshape(-1)


def logprob_gap_sums(rollout_logp: torch.Tensor, trainer_logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(rollout - trainer), sum(|rollout - trainer|))`` over tokens (float64 scalars): divided by the
    token count, the mean and mean absolute gap between the rollout engine's log-probs and the trainer's.
    Under constrained decoding the rollout's are of the grammar-masked, renormalized distribution, so the
    gap is >= 0 on those tokens."""
    d = (rollout_logp.double() - trainer_logp.double())
    return d.sum(), d.abs().sum()


def solved_groups(rewards: torch.Tensor, success: torch.Tensor) -> torch.Tensor:
    """Groups solved by every sample: all K successes and one reward (zero variance). [G, K] x2 -> [G] bool."""
    return success.bool().all(dim=1) & (rewards.amax(dim=1) == rewards.amin(dim=1))


def update_retired(retired: list[str], outcomes: list[tuple[str, bool]]) -> list[str]:
    """The retired-task record after one round of groups: ``outcomes`` are (task key, solved) in draw order;
    a task is retired iff the last of its groups in the round was solved, untouched if it was not drawn.
    -> sorted keys (the record is part of a checkpoint: a canonical order)."""
    last = dict(outcomes)  # later groups of the same task overwrite earlier ones
    keep = {k for k in retired if k not in last}
    return sorted(keep | {k for k, solved in last.items() if solved})


def pool_reward(reward_mean: float, retired: int, n_tasks: int) -> float:
    """The mean reward over the whole task pool when ``retired`` of its ``n_tasks`` tasks are retired as solved
    (``skip_saturated``) and the drawn ones averaged ``reward_mean``: ``R/N + (1 - R/N) * reward_mean``. Retiring
    makes the drawn tasks harder as training goes, so their own mean is no measure of progress."""
    if n_tasks <= 0 or not 0 <= retired <= n_tasks:
        raise ValueError(f"pool_reward: {retired} retired of {n_tasks} tasks")
    share = retired / n_tasks
    return share + (1 - share) * reward_mean


def early_stop_reason(informative: list[int], rewards: list[float], patience: int, min_delta: float) -> str | None:
    """Whether to stop after the last iteration of a history (``informative`` groups and ``reward_mean`` per
    iteration, oldest first); the rule of ``GRPOSettings.early_stop_patience``:

    - ``no_informative_groups``: the last ``patience`` iterations had no informative group;
    - ``reward_plateau``: with ``m_t`` the mean of ``rewards[t-p+1 .. t]`` (from ``t = p-1``), the last new best
      (``m_t > best + min_delta``; the first ``m_t`` is one) was at ``b`` and ``len - 1 - b >= patience``.

    ``patience == 0``: never. -> the reason or None.
    """
    if len(informative) != len(rewards):
        raise ValueError(f"history lengths differ: {len(informative)} informative counts, {len(rewards)} rewards")
    p = patience
    if p <= 0:
        return None
    if len(informative) >= p and all(n == 0 for n in informative[-p:]):
        return "no_informative_groups"
    best, best_at = -float("inf"), None
    for t in range(p - 1, len(rewards)):
        m = sum(rewards[t - p + 1 : t + 1]) / p
        if best_at is None or m > best + min_delta:
            best, best_at = m, t
    if best_at is not None and len(rewards) - 1 - best_at >= p:
        return "reward_plateau"
    return None
