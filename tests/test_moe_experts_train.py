"""The update's grouped-GEMM path for LoRA on fused MoE experts (issue 22): ``lora_experts_forward`` (installed by
``set_fused_update_kernels``) gives peft's loss and gradients (attention and expert LoRA factors) on a tiny
Qwen3-MoE in float32 on the CPU (the grouped GEMM's exact loop fallback), with full checkpointing, with experts
that no token routes to, and falls back to peft's forward where it cannot run (adapters disabled)."""

from __future__ import annotations

import pytest
import torch

from tracekit.llm.decoding import causal_lm_of
from tracekit.llm.moe_experts import _Combine, _Dispatch, lora_experts_reason
from tracekit.rl.fused import set_fused_experts, set_fused_update_kernels
from tracekit.rl.settings import LoraSettings
from tracekit.rl.model import build_peft_model, set_activation_checkpointing

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                         initializer_range=0.1)  # fmt: skip
    torch.manual_seed(0)
    lora = LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS)
    m = build_peft_model(Qwen3MoeForCausalLM(cfg), lora, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _loss_and_grads(m, ids):
    m.zero_grad(set_to_none=True)
    logits = m(input_ids=ids).logits
    loss = logits.log_softmax(-1).gather(-1, ids.roll(-1, 1)[..., None]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def _compare(m, ids):
    lm = causal_lm_of(m)
    set_fused_experts(lm, False)
    ref_loss, ref = _loss_and_grads(m, ids)
    assert set_fused_experts(lm, True) == 2  # one outer peft wrapper per MoE block
    loss, got = _loss_and_grads(m, ids)
    set_fused_experts(lm, False)
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert ref.keys() == got.keys() and any("experts" in n for n in ref)
    for n in ref:
        # float32 reassociation error scales with the tensor's magnitude, not each element's: an element
        # near zero in a tensor of scale 1 may differ by a few ulps of 1 (seen: 3.3e-7 at scale 1.04)
        atol = 1e-6 * ref[n].abs().max().item()
        assert torch.allclose(got[n], ref[n], rtol=1e-4, atol=atol), (n, (got[n] - ref[n]).abs().max())
    return ref


def test_loss_and_lora_grads_match_peft(model):
    model.train()
    ids = torch.randint(0, 128, (3, 24), generator=torch.Generator().manual_seed(2))
    grads = _compare(model, ids)
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "experts" in n)


def test_untouched_experts_and_checkpointing_match_peft(model):
    # two tokens, top-2 of 8: at most 4 experts per block are routed to; the others' factors get exact zeros
    model.train()
    lm = causal_lm_of(model)
    set_activation_checkpointing(lm, True, "full")
    try:
        grads = _compare(model, torch.tensor([[5, 77]]))
    finally:
        set_activation_checkpointing(lm, False)
    w = lm.model.layers[0].mlp.experts  # outer wrapper; the factors of expert e: rows e*r.. of A
    A = grads[next(n for n in grads if n.startswith("base_model.model.model.layers.0.mlp.experts.lora_A"))]
    per_expert = A.view(w.num_experts, -1, A.shape[-1]).abs().sum((1, 2))
    assert 0 < int((per_expert > 0).sum()) <= 4


def test_falls_back_to_peft_when_it_cannot_run(model):
    lm = causal_lm_of(model)
    experts = lm.model.layers[0].mlp.experts
    assert lora_experts_reason(experts) is None
    assert set_fused_update_kernels(lm, True) >= 2 and experts._tracekit_fused
    assert set_fused_update_kernels(lm, True, experts=False) == 2 and not experts._tracekit_fused
    set_fused_experts(lm, True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad(), model.disable_adapter():
        assert lora_experts_reason(experts) == "adapters disabled or merged"
        off = model(input_ids=ids).logits
        set_fused_update_kernels(lm, False)
        plain = model(input_ids=ids).logits
    assert torch.allclose(off, plain, atol=1e-6)


def test_dispatch_and_combine_are_adjoint():
    g = torch.Generator().manual_seed(3)
    T, k, H = 5, 3, 4
    idx = torch.rand(T, 8, generator=g).topk(k, -1).indices.reshape(-1)
    perm = torch.sort(idx).indices
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    tokens = perm // k
    h = torch.randn(T, H, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(T * k, H, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.equal(_Dispatch.apply(h, tokens, inverse, k), h[tokens])
    assert torch.allclose(_Combine.apply(y, tokens, inverse, k), torch.zeros(T, H, dtype=torch.float64).index_add(0, tokens, y))
    assert torch.autograd.gradcheck(lambda t: _Dispatch.apply(t, tokens, inverse, k), (h,))
    assert torch.autograd.gradcheck(lambda t: _Combine.apply(t, tokens, inverse, k), (y,))
