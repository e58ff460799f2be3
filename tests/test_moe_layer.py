"""LoRAMoELinear math: routing weights, dense mixture, grouped vs masked-dense top-k, rank padding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tracekit.moe.layer import (
    INDEX_ADD_MAX_PAIRS,
    BlockRouting,
    LoRAMoELinear,
    RoutingSpec,
    masked_topk_probs,
    topk_weights,
)


def _bank(ranks, d_in=6, d_out=5, seed=0, base_slot=False, spec=RoutingSpec(1)):
    g = torch.Generator().manual_seed(seed)
    base = nn.Linear(d_in, d_out, bias=True)
    with torch.no_grad():
        base.weight.copy_(torch.randn(d_out, d_in, generator=g))
        base.bias.copy_(torch.randn(d_out, generator=g))
    factors = [(torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g)) for r in ranks]
    scales = [0.5 + i for i in range(len(ranks))]
    routing = BlockRouting(len(ranks), base_slot, spec)
    return LoRAMoELinear(base, factors, scales, routing), factors, scales


def _explicit(x, base, factors, scales, w):
    """W x + b + sum_c w[:, c] * s_c * B_c A_c x, term by term."""
    out = x @ base.weight.T + (base.bias if base.bias is not None else 0)
    for c, ((A, B), s) in enumerate(zip(factors, scales)):
        out = out + w[:, c : c + 1] * s * (x @ A.T @ B.T)
    return out


def test_topk_weights_raw_and_renormalized():
    p = torch.tensor([[0.2, 0.5, 0.3]])
    w, idx = topk_weights(p, 2, renormalize=False)
    assert idx.tolist() == [[1, 2]] and torch.allclose(w, torch.tensor([[0.5, 0.3]]))
    w, _ = topk_weights(p, 2, renormalize=True)
    assert torch.allclose(w, torch.tensor([[0.625, 0.375]]))
    assert torch.allclose(masked_topk_probs(p, 1, False), torch.tensor([[0.0, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="exceeds"):
        topk_weights(p, 4, False)


def test_dense_delta_is_weighted_sum_of_adapters():
    layer, factors, scales = _bank([3, 3, 3], spec=RoutingSpec(None))
    x = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))
    p = torch.softmax(torch.randn(7, 3, generator=torch.Generator().manual_seed(2)), -1)
    layer.routing.set_probs(p)
    assert torch.allclose(layer(x), _explicit(x, layer.base, factors, scales, p), rtol=1e-5, atol=1e-5)


def test_rank_padding_keeps_each_update():
    layer, factors, scales = _bank([2, 5, 1], spec=RoutingSpec(None))
    assert layer.rank == 5 and layer.ranks == [2, 5, 1]
    assert layer.A3.shape == (3, 5, 6) and layer.B3.shape == (3, 5, 5)
    for c, ((A, B), s) in enumerate(zip(factors, scales)):
        assert torch.allclose(layer.B3[c] @ layer.A3[c], s * B @ A)  # zero padding adds nothing; B3 holds s_c B_c
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 6, generator=g)
    p = torch.softmax(torch.randn(4, 3, generator=g), -1)
    layer.routing.set_probs(p)
    assert torch.allclose(layer(x), _explicit(x, layer.base, factors, scales, p), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("base_slot", [False, True])
@pytest.mark.parametrize("gather_max_tokens", [0, 64])  # top-1: sorted groups (prefill) / per-token gather (decode)
def test_grouped_equals_masked_dense(k, renormalize, base_slot, gather_max_tokens):
    layer, _, _ = _bank([2, 4, 3], base_slot=base_slot)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(13, 6, generator=g)
    p = torch.softmax(3 * torch.randn(13, layer.routing.n_slots, generator=g), -1)
    outs = {}
    for impl in ("grouped", "masked_dense"):
        layer.routing.spec = RoutingSpec(k, renormalize, impl, gather_max_tokens)
        layer.routing.set_probs(p)
        outs[impl] = layer(x)
    assert torch.allclose(outs["grouped"], outs["masked_dense"], rtol=1e-5, atol=1e-5)
    # and the masked-dense reference is the formula with the top-k weights
    w = masked_topk_probs(p, k, renormalize)[:, 1 if base_slot else 0 :]
    expl = _explicit(x, layer.base, [(layer.A3[c], layer.B3[c]) for c in range(3)], [1.0] * 3, w)  # B3 = s_c B_c
    assert torch.allclose(outs["masked_dense"], expl, rtol=1e-5, atol=1e-5)


def _cpu_grouped_mm() -> bool:
    """torch._grouped_mm has a CPU fallback in recent torch only (a CUDA sm90 kernel otherwise)."""
    try:
        torch._grouped_mm(torch.zeros(4, 8), torch.zeros(2, 8, 4), offs=torch.tensor([2, 4], dtype=torch.int32))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="torch._grouped_mm does not run on CPU in this torch")
@pytest.mark.parametrize("k,base_slot,tokens", [(1, False, 11), (2, True, 11), (1, True, INDEX_ADD_MAX_PAIRS + 5)])
def test_grouped_mm_equals_masked_dense(k, base_slot, tokens):
    # torch._grouped_mm wants 16-byte aligned rows: float32 widths and rank multiples of 4. Top-1 over more
    # than INDEX_ADD_MAX_PAIRS tokens returns to token order by the inverse permutation, not index_add_
    layer, _, _ = _bank([4, 8, 4], d_in=8, d_out=16, base_slot=base_slot)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, 8, generator=g)
    p = torch.softmax(3 * torch.randn(tokens, layer.routing.n_slots, generator=g), -1)
    outs = {}
    for impl in ("grouped_mm", "masked_dense"):
        layer.routing.spec = RoutingSpec(k, False, impl)
        layer.routing.set_probs(p)
        with torch.no_grad():
            outs[impl] = layer(x)
        if impl == "grouped_mm":
            assert (layer.routing.plan().inverse is not None) == (k == 1 and tokens > INDEX_ADD_MAX_PAIRS)
    assert torch.allclose(outs["grouped_mm"], outs["masked_dense"], rtol=1e-5, atol=1e-5)


def test_grouped_identity_path_when_all_tokens_pick_one_expert():
    layer, factors, scales = _bank([3, 3])
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    p = torch.tensor([[0.2, 0.8]] * 5)
    layer.routing.spec = RoutingSpec(1, gather_max_tokens=0)
    layer.routing.set_probs(p)
    plan = layer.routing.plan()
    assert plan.identity and plan.groups == [(1, 0, 5)]
    w = torch.tensor([[0.0, 0.8]] * 5)  # raw top-1 probability (official code), not renormalized to 1
    assert torch.allclose(layer(x), _explicit(x, layer.base, factors, scales, w), rtol=1e-5, atol=1e-5)


def test_grouped_top_k_training_gradients_match_masked_dense():
    layer, _, _ = _bank([3, 3, 3])
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 6, generator=g)
    logits = torch.randn(9, 3, generator=g)
    grads = {}
    for impl in ("grouped", "masked_dense"):
        lg = logits.clone().requires_grad_(True)
        layer.routing.spec = RoutingSpec(2, True, impl)
        layer.routing.set_probs(torch.softmax(lg, -1))
        layer(x).square().sum().backward()
        grads[impl] = lg.grad
    assert grads["grouped"].abs().sum() > 0
    assert torch.allclose(grads["grouped"], grads["masked_dense"], rtol=1e-5, atol=1e-4)  # grads are O(100)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="top_k"):
        RoutingSpec(0)
    with pytest.raises(ValueError, match="impl"):
        RoutingSpec(1, impl="sparse")
    layer, _, _ = _bank([2, 2])
    with pytest.raises(RuntimeError, match="no routing plan"):
        layer(torch.randn(3, 6))
    layer.routing.set_probs(torch.full((4, 2), 0.5))
    with pytest.raises(RuntimeError, match="tokens"):
        layer(torch.randn(3, 6))
    with pytest.raises(ValueError, match=r"\[tokens, 2\]"):
        layer.routing.set_probs(torch.full((4, 3), 1 / 3))
    with pytest.raises(ValueError, match="do not fit"):
        routing = BlockRouting(1, False, RoutingSpec())
        LoRAMoELinear(nn.Linear(6, 5), [(torch.zeros(2, 7), torch.zeros(5, 2))], [1.0], routing)


def _block(widths, ranks, base_slot=False, seed=0):
    """Projections (d_in, d_out) of one block sharing a routing, as LoRAMoEModel builds them."""
    g = torch.Generator().manual_seed(seed)
    routing = BlockRouting(len(ranks[0]), base_slot, RoutingSpec(1))
    layers, refs = [], []
    for (d_in, d_out), rs in zip(widths, ranks):
        base = nn.Linear(d_in, d_out, bias=False)
        with torch.no_grad():
            base.weight.copy_(torch.randn(d_out, d_in, generator=g))
        factors = [(torch.randn(r, d_in, generator=g), torch.randn(d_out, r, generator=g)) for r in rs]
        scales = [1.0 + 0.5 * c for c in range(len(rs))]
        layers.append(LoRAMoELinear(base, factors, scales, routing))
        refs.append((factors, scales))
    return routing, layers, refs


@pytest.mark.parametrize("gather_max_tokens", [0, 64])
@pytest.mark.parametrize("base_slot", [False, True])
def test_block_bank_shared_by_projections(gather_max_tokens, base_slot):
    # q/k-like projections share an input, a third has another width and a larger rank (pads the whole bank)
    routing, layers, refs = _block([(6, 5), (6, 3), (4, 6)], [[2, 3, 2], [2, 3, 2], [4, 1, 2]], base_slot)
    assert routing.bank_A.shape == (3, 4, 16) and routing.bank_B.shape == (3, 4, 14)
    assert [(m.a_cols, m.b_cols) for m in layers] == [(0, 0), (6, 5), (12, 8)]
    g = torch.Generator().manual_seed(8)
    x, x2 = torch.randn(9, 6, generator=g), torch.randn(9, 4, generator=g)
    p = torch.softmax(3 * torch.randn(9, routing.n_slots, generator=g), -1)
    w = masked_topk_probs(p, 1, False)[:, 1 if base_slot else 0 :]
    routing.spec = RoutingSpec(1, gather_max_tokens=gather_max_tokens)
    routing.set_probs(p)
    for layer, inp, (factors, scales) in zip(layers, (x, x, x2), refs):
        want = inp @ layer.base.weight.T
        for c, ((A, B), s) in enumerate(zip(factors, scales)):
            want = want + w[:, c : c + 1] * s * (inp @ A.T @ B.T)
        assert torch.allclose(layer(inp), want, rtol=1e-5, atol=1e-5)


def test_shared_input_gather_is_keyed_by_tensor_identity():
    routing, (q, k, _), _ = _block([(6, 5), (6, 3), (4, 6)], [[2, 2], [2, 2], [2, 2]])
    g = torch.Generator().manual_seed(9)
    p = torch.softmax(3 * torch.randn(7, 2, generator=g), -1)
    routing.spec = RoutingSpec(1, gather_max_tokens=0)
    routing.set_probs(p)
    x, other = torch.randn(7, 6, generator=g), torch.randn(7, 6, generator=g)
    plan = routing.plan()
    out = q(x)
    gathered = plan._input[2]
    k(x)
    assert plan._input[2] is gathered  # k reused q's gather of the same input tensor
    fresh = k(other)  # same shape, another tensor: its own gather
    assert plan._input[2] is not gathered
    routing.set_probs(p)
    assert torch.allclose(k(other), fresh) and torch.allclose(q(x), out)


def test_bank_views_follow_a_dtype_move():
    # the routing caches its projections' bank views; a .to() gives the bank new storage and the views follow it
    routing, layers, refs = _block([(6, 5), (6, 3), (4, 6)], [[2, 3], [2, 3], [4, 1]])
    g = torch.Generator().manual_seed(10)
    p = torch.softmax(3 * torch.randn(5, 2, generator=g), -1)
    routing.spec = RoutingSpec(None)
    routing.set_probs(p)
    x = torch.randn(5, 6, generator=g)
    layers[0](x)  # builds the float32 views
    assert routing._views
    nn.ModuleList([routing, *layers]).double()
    assert not routing._views  # dropped with the move: no view keeps the float32 bank alive
    routing.set_probs(p)
    factors, scales = refs[0]
    want = _explicit(x.double(), layers[0].base, [(A.double(), B.double()) for A, B in factors], scales, p.double())
    got = layers[0](x.double())
    assert got.dtype == torch.float64 and routing.views(layers[0]).A.dtype == torch.float64
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)  # the bank was built, and rounded, in float32


@pytest.mark.parametrize("tokens", [2, 3, 9])  # top-1 decode: fewer tokens than adapters gather, else the dense plan
@pytest.mark.parametrize("base_slot", [False, True])
def test_top1_decode_plans_equal_masked_dense(tokens, base_slot):
    from tracekit.moe.layer import _DensePlan, _GatherPlan

    layer, factors, scales = _bank([2, 4, 3], base_slot=base_slot)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(tokens, 6, generator=g)
    p = torch.softmax(3 * torch.randn(tokens, layer.routing.n_slots, generator=g), -1)
    layer.routing.spec = RoutingSpec(1, gather_max_tokens=64)
    layer.routing.set_probs(p)
    plan = layer.routing.plan()
    assert isinstance(plan, _GatherPlan if tokens < 3 else _DensePlan)
    with torch.no_grad():  # the dense plan scales in place without autograd
        got = layer(x)
    w = masked_topk_probs(p, 1, False)[:, 1 if base_slot else 0 :]
    assert torch.allclose(got, _explicit(x, layer.base, factors, scales, w), rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_(True)
    layer(xg).sum().backward()  # with autograd the same plan, out of place
    assert torch.allclose(xg.grad, torch.autograd.functional.vjp(lambda t: _explicit(t, layer.base, factors, scales, w), x, torch.ones_like(got))[1], rtol=1e-5, atol=1e-5)
