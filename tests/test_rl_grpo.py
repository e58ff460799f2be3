"""GRPO math (tracekit.rl.grpo) against loop implementations of the paper's formulas and hand values."""

from __future__ import annotations

import math

import pytest
import torch

from tracekit import ops
from tracekit.rl import grpo


def _loop_advantages(rewards: list[list[float]], eps: float) -> list[list[float]]:
    out = []
    for group in rewards:
        K = len(group)
        mean = sum(group) / K
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / K)  # population std, eq. (1)
        out.append([(r - mean) / (std + eps) for r in group])
    return out


def test_group_advantages_hand_values():
    # mean 0.25, population std sqrt(3)/4 -> A = (1 - 0.25) / (sqrt(3)/4) = sqrt(3), (0 - 0.25)/(sqrt(3)/4) = -1/sqrt(3)
    a = grpo.group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    assert a[0].tolist() == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], rel=1e-6)
    # two values: mean 0.5, std 0.5 -> +-1 (a sample std would give +-0.707)
    assert grpo.group_advantages(torch.tensor([[0.0, 1.0]]), eps=0.0)[0].tolist() == pytest.approx([-1.0, 1.0])
    # eps enters the denominator: constant group -> 0 / (0 + eps) = 0, no NaN
    assert grpo.group_advantages(torch.tensor([[0.3, 0.3, 0.3]]), eps=1e-6)[0].tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_match_loop_on_random_rewards():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(7, 5, generator=g)
    r[2] = (r[2] > 0.5).float()  # a binary group
    got = grpo.group_advantages(r, eps=1e-6)
    want = _loop_advantages(r.tolist(), 1e-6)
    assert got.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-6) for row in want]
    with pytest.raises(ValueError, match="K >= 2"):
        grpo.group_advantages(torch.tensor([[1.0], [0.0]]))


def test_zero_variance_filter_counts_and_mask():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.5, 0.5, 0.5], [0.0, 0.0, 1e-3]])
    keep, dropped = grpo.zero_variance_filter(r)
    assert keep.tolist() == [False, True, False, True]
    assert dropped == 2


def test_token_advantages_broadcast_only_on_generated_tokens():
    adv = torch.tensor([0.5, -2.0])
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]])
    assert grpo.token_advantages(adv, mask).tolist() == [[0.0, 0.5, 0.5, 0.0], [0.0, 0.0, -2.0, -2.0]]


def _loop_loss(logp, old, adv, mask, eps, eps_hi):
    """Eq. (2) literally: -(1/|B|) sum_traj (1/T) sum_t min(rho A, clip(rho, 1-eps, 1+eps_hi) A)."""
    total = 0.0
    for i in range(len(adv)):
        ts = [t for t in range(len(mask[i])) if mask[i][t]]
        s = 0.0
        for t in ts:
            rho = math.exp(logp[i][t] - old[i][t])
            s += min(rho * adv[i], min(max(rho, 1 - eps), 1 + eps_hi) * adv[i])
        total += s / len(ts)
    return -total / len(adv)


def _random_batch(n=6, t=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(n, t, generator=g) * 3
    old = logp + (torch.rand(n, t, generator=g) - 0.5) * 0.8  # ratios roughly in [0.67, 1.5]
    adv = torch.randn(n, generator=g)
    lens = torch.randint(1, t, (n,), generator=g)
    mask = torch.zeros(n, t)
    for i in range(n):
        start = int(torch.randint(0, t - int(lens[i]) + 1, (1,), generator=g))
        mask[i, start : start + int(lens[i])] = 1
    return logp, old, adv, mask


@pytest.mark.parametrize("eps_hi", [None, 0.28])
def test_grpo_loss_matches_eq2_loop(eps_hi):
    logp, old, adv, mask = _random_batch()
    w = grpo.trajectory_token_weights(mask, mask.sum(1).long(), batch_size=mask.shape[0])
    out = grpo.grpo_loss(logp, old, grpo.token_advantages(adv, mask), w, clip_eps=0.2, clip_eps_high=eps_hi)
    want = _loop_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, eps_hi or 0.2)
    assert float(out.loss) == pytest.approx(want, rel=1e-5)
    assert float(out.kl) == 0.0


def test_grpo_loss_after_group_filtering_matches_loop():
    # 3 groups x 4 rollouts; group 1 has equal rewards and is dropped; |B| = 8 kept trajectories.
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.2, 0.9, 0.4, 0.4]])
    keep, dropped = grpo.zero_variance_filter(rewards)
    assert dropped == 1
    adv_all = grpo.group_advantages(rewards)
    adv = adv_all[keep].reshape(-1)
    logp, old, _, mask = _random_batch(n=8, t=7, seed=3)
    w = grpo.trajectory_token_weights(mask, mask.sum(1).long(), batch_size=8)
    out = grpo.grpo_loss(logp, old, grpo.token_advantages(adv, mask), w, clip_eps=0.2)
    want = _loop_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 0.2)
    assert float(out.loss) == pytest.approx(want, rel=1e-5)


def test_split_rows_give_the_same_loss_as_one_row_per_trajectory():
    """A trajectory split into two rows (template broke prefix-extension) keeps eq. (2)'s 1/T_traj."""
    logp, old, adv, mask = _random_batch(n=3, t=10, seed=5)
    mask[0] = torch.tensor([0, 1, 1, 1, 0, 0, 1, 1, 0, 0], dtype=torch.float32)
    w = grpo.trajectory_token_weights(mask, mask.sum(1).long(), batch_size=3)
    whole = grpo.grpo_loss(logp, old, grpo.token_advantages(adv, mask), w, clip_eps=0.2)
    # row 0 split into two rows at position 5; both carry T_traj = 5 and the same advantage
    m_a, m_b = mask[0].clone(), mask[0].clone()
    m_a[5:] = 0
    m_b[:5] = 0
    mask2 = torch.stack([m_a, m_b, mask[1], mask[2]])
    idx = [0, 0, 1, 2]
    traj_tokens = torch.tensor([5, 5, int(mask[1].sum()), int(mask[2].sum())])
    w2 = grpo.trajectory_token_weights(mask2, traj_tokens, batch_size=3)
    split = grpo.grpo_loss(logp[idx], old[idx], grpo.token_advantages(adv[idx], mask2), w2, clip_eps=0.2)
    assert float(split.loss) == pytest.approx(float(whole.loss), rel=1e-6)


def test_grpo_loss_hand_computed_case():
    # One trajectory, 4 generated tokens, |B| = 1, eps = 0.2:
    #   A=+1: rho 1.5 -> min(1.5, 1.2) = 1.2;  rho 0.5 -> min(0.5, 0.8) = 0.5
    #   A=-1 (second call): rho 1.5 -> min(-1.5, -1.2) = -1.5; rho 0.5 -> min(-0.5, -0.8) = -0.8
    ratios = torch.tensor([[1.5, 0.5, 1.0, 1.1]])
    old = torch.zeros(1, 4)
    logp = ratios.log()
    mask = torch.ones(1, 4)
    w = grpo.trajectory_token_weights(mask, torch.tensor([4]), 1)
    pos = grpo.grpo_loss(logp, old, grpo.token_advantages(torch.tensor([1.0]), mask), w, clip_eps=0.2)
    assert float(pos.loss) == pytest.approx(-(1.2 + 0.5 + 1.0 + 1.1) / 4)
    assert float(pos.clip_count) == 1  # only rho=1.5 with A>0 is clipped
    neg = grpo.grpo_loss(logp, old, grpo.token_advantages(torch.tensor([-1.0]), mask), w, clip_eps=0.2)
    assert float(neg.loss) == pytest.approx(-(-1.5 - 0.8 - 1.0 - 1.1) / 4)
    assert float(neg.clip_count) == 1  # rho=0.5 with A<0
    assert float(pos.ratio_sum) / float(pos.tokens) == pytest.approx((1.5 + 0.5 + 1.0 + 1.1) / 4)
    # approx KL(pi_old || pi) = mean((rho - 1) - log rho)
    want_kl = sum((r - 1) - math.log(r) for r in [1.5, 0.5, 1.0, 1.1]) / 4
    assert float(pos.approx_kl_sum) / float(pos.tokens) == pytest.approx(want_kl, rel=1e-6)


def test_grpo_loss_gradient_zero_where_clipped():
    ratios = torch.tensor([[1.5, 1.1, 0.5]])
    logp = ratios.log().requires_grad_(True)
    mask = torch.ones(1, 3)
    w = grpo.trajectory_token_weights(mask, torch.tensor([3]), 1)
    out = grpo.grpo_loss(logp, torch.zeros(1, 3), grpo.token_advantages(torch.tensor([2.0]), mask), w, clip_eps=0.2)
    out.loss.backward()
    # d/dlogp of -(1/3) * rho * A = -(1/3) * A * rho where not clipped; 0 where clipped (rho=1.5, A>0)
    assert logp.grad[0].tolist() == pytest.approx([0.0, -(2.0 / 3) * 1.1, -(2.0 / 3) * 0.5])


def test_asymmetric_clip_high():
    logp = torch.tensor([[math.log(1.25)]])
    mask = torch.ones(1, 1)
    w = grpo.trajectory_token_weights(mask, torch.tensor([1]), 1)
    adv = torch.ones(1, 1)
    sym = grpo.grpo_loss(logp, torch.zeros(1, 1), adv, w, clip_eps=0.2)
    hi = grpo.grpo_loss(logp, torch.zeros(1, 1), adv, w, clip_eps=0.2, clip_eps_high=0.28)
    assert float(sym.loss) == pytest.approx(-1.2)
    assert float(hi.loss) == pytest.approx(-1.25)


def test_k3_kl_term():
    logp, _, adv, mask = _random_batch(seed=7)
    ref = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    k3 = grpo.k3_kl(logp, ref)
    d = (ref - logp).tolist()
    want = [[math.exp(x) - x - 1 for x in row] for row in d]
    assert k3.tolist() == [pytest.approx(row, rel=1e-5, abs=1e-7) for row in want]
    assert bool((k3 >= 0).all())
    w = grpo.trajectory_token_weights(mask, mask.sum(1).long(), mask.shape[0])
    a = grpo.token_advantages(adv, mask)
    base = grpo.grpo_loss(logp, logp, a, w, clip_eps=0.2)
    withkl = grpo.grpo_loss(logp, logp, a, w, clip_eps=0.2, ref_logp=ref, kl_beta=0.1)
    assert float(withkl.loss) == pytest.approx(float(base.loss) + 0.1 * float((w * k3).sum()), rel=1e-6)
    # at ref == logp the KL term and its gradient vanish
    x = logp.clone().requires_grad_(True)
    grpo.k3_kl(x, logp).sum().backward()
    assert x.grad.abs().max() == 0


def test_truncated_is_weights():
    old = torch.tensor([0.0, 0.0, -1.0])
    rollout = torch.tensor([-0.5, 1.0, -1.0])
    w = grpo.truncated_is_weights(old, rollout, cap=1.5)
    assert w.tolist() == pytest.approx([1.5, math.exp(-1.0), 1.0])  # exp(0.5)=1.65 -> capped at 1.5
    assert not w.requires_grad


def test_trajectory_token_weights_validation():
    with pytest.raises(ValueError, match="batch_size"):
        grpo.trajectory_token_weights(torch.ones(1, 2), torch.tensor([2]), 0)


@pytest.mark.parametrize("chunk,temperature", [(3, 1.0), (1024, 1.0), (4, 0.7)])
def test_chunked_token_logprobs_match_full_logsoftmax(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(11, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    tgt = torch.randint(0, 50, (11,), generator=g)
    got = ops.token_logprobs(h, w, tgt, temperature=temperature, chunk=chunk)
    upstream = torch.randn(11, generator=g)
    (got * upstream).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    ref = torch.log_softmax((h @ w.t()) / temperature, dim=-1).gather(1, tgt[:, None]).squeeze(1)
    (ref.float() * upstream).sum().backward()
    assert torch.allclose(got.double(), ref, atol=1e-5)
    assert torch.allclose(gh, h.grad, atol=1e-5)
    assert torch.allclose(gw, w.grad, atol=1e-5)


def test_chunked_token_logprobs_frozen_weight_and_empty():
    h = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(20, 8)  # frozen lm_head: no weight grad computed
    lp = ops.token_logprobs(h, w, torch.tensor([1, 2, 3, 4, 5]), chunk=2)
    lp.sum().backward()
    assert h.grad is not None and w.grad is None
    empty = ops.token_logprobs(h[:0], w, torch.tensor([], dtype=torch.long))
    assert empty.shape == (0,)
