"""The grouped routing plan: pairs sorted by adapter on the device, group offsets and host-side bounds."""

from __future__ import annotations

import torch

from tracekit.moe.layer import BlockRouting, RoutingSpec, make_plan


def test_plan_sorts_pairs_by_adapter_on_device():
    # slots per token (top-1, base slot at 0): 2, 0 (base), 3, 2, 1 -> adapters 1, -1, 2, 1, 0
    probs = torch.zeros(5, 4)
    for t, s in enumerate([2, 0, 3, 2, 1]):
        probs[t, s] = 0.7
        probs[t, (s + 1) % 4] = 0.3
    plan = make_plan(probs, BlockRouting(3, True, RoutingSpec(1, gather_max_tokens=0)), torch.float32)
    assert plan.adapters.tolist() == [-1, 0, 1, 1, 2]
    assert plan.tokens.tolist() == [1, 4, 0, 3, 2]  # stable: token 0 before token 3 in adapter 1
    assert plan.offsets.tolist() == [2, 4, 5] and plan.offsets.dtype == torch.int32  # base pair joins group 0
    assert plan.groups == [(0, 1, 1), (1, 2, 2), (2, 4, 1)]  # base pair skipped
    assert not plan.identity
    assert torch.allclose(plan.weights.squeeze(-1), torch.tensor([0.0, 0.7, 0.7, 0.7, 0.7]))  # base pair: 0


def test_plan_top2_pairs_map_back_to_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
    plan = make_plan(probs, BlockRouting(3, False, RoutingSpec(2)), torch.float32)
    # pairs: t0->0 (0.5), t0->1 (0.3), t1->2 (0.7), t1->1 (0.2); sorted by adapter
    assert plan.adapters.tolist() == [0, 1, 1, 2]
    assert plan.tokens.tolist() == [0, 0, 1, 1]
    assert torch.allclose(plan.weights.squeeze(-1), torch.tensor([0.5, 0.3, 0.2, 0.7]))
    assert plan.offsets.tolist() == [1, 3, 4]
