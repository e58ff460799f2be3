"""The update's grouped-GEMM path for LoRA on fused MoE experts on a CUDA GPU in bf16 (issue 22):
``torch._grouped_mm`` forward and backward, loss and LoRA gradients (attention and experts) against peft's path
(which materialises ``W + s B A`` per expert) within bf16 tolerance, experts no token routes to included."""

from __future__ import annotations

import pytest
import torch

from tracekit.llm.decoding import causal_lm_of
from tracekit.rl.fused import set_fused_experts
from tracekit.rl.settings import LoraSettings
from tracekit.rl.model import build_peft_model, set_activation_checkpointing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # widths and ranks multiples of 8: torch._grouped_mm needs 16-byte aligned bf16 rows
    cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4,
                         initializer_range=0.05)  # fmt: skip
    torch.manual_seed(0)
    base = Qwen3MoeForCausalLM(cfg).to("cuda", torch.bfloat16)
    lora = LoraSettings(rank=16, alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)
    m = build_peft_model(base, lora, seed=0)
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g, device="cuda") * 0.2)
    return m.train()


def _loss_and_grads(m, ids):
    m.zero_grad(set_to_none=True)
    logits = m(input_ids=ids).logits.float()
    loss = logits.log_softmax(-1).gather(-1, ids.roll(-1, 1)[..., None]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("shape,ckpt", [((4, 256), False), ((4, 256), True), ((1, 3), False)])
def test_update_path_matches_peft(model, shape, ckpt):
    """Against a float32 reference (the same weights upcast, peft's path, on the CPU): the grouped path's loss and
    LoRA gradients are as close as peft's own bf16 path. bf16 alone moves this model's gradients by up to ~10%
    (routing flips downstream of rounding differences; a first version comparing the two bf16 paths directly at
    5% failed at 5.9% on one layer-1 expert factor), so the bound is relative to peft's bf16 error."""
    import copy

    lm = causal_lm_of(model)
    ids = torch.randint(0, 512, shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    set_fused_experts(lm, False)
    ref32 = copy.deepcopy(model).to("cpu", torch.float32)
    ref_loss, ref = _loss_and_grads(ref32, ids.cpu())
    del ref32
    set_activation_checkpointing(lm, ckpt, "full")
    try:
        peft_loss, peft = _loss_and_grads(model, ids)
        assert set_fused_experts(lm, True) == 2
        loss, got = _loss_and_grads(model, ids)
    finally:
        set_fused_experts(lm, False)
        set_activation_checkpointing(lm, False)
    tol = abs(float(peft_loss.cpu() - ref_loss)) + 1e-2 * abs(float(ref_loss)) + 1e-3
    assert abs(float(loss.cpu() - ref_loss)) <= tol
    assert any("experts" in n for n in ref)
    for n, r in ref.items():
        g, p = got[n].cpu(), peft[n].cpu()
        assert torch.isfinite(g).all(), n
        err, peft_err = (float((x - r).norm() / r.norm().clamp_min(1e-12)) for x in (g, p))
        assert err <= 1.25 * peft_err + 1e-2, (n, err, peft_err)
        if "experts" in n and "lora_A" in n and shape == (1, 3):  # experts no pair routes to: exact zeros in all
            E = 32
            zero = [x.view(E, -1, x.shape[-1]).abs().sum((1, 2)) == 0 for x in (r, p, g)]
            assert torch.equal(zero[1], zero[2]) and int(zero[2].sum()) >= E - 12, n  # 3 tokens x top-4 at most
