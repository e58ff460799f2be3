"""Fused-experts MoE blocks in the fast decoder (CPU, float32): the adapter on attention and on the fused
experts (peft target_parameters) decodes exactly like the plain peft model, follows in-place updates,
honours disabled adapters; grouped GEMM fallback and the touched-experts count."""

from __future__ import annotations

import pytest
import torch

from tracekit.llm.decoding import FastDecoder, causal_lm_of, generate
from tracekit.llm.moe_experts import FusedExperts, fused_experts_reason, grouped_mm, touched_experts_fraction
from tracekit.rl.settings import LoraSettings
from tracekit.rl.model import build_peft_model

PROMPTS = [list(range(5, 40)), list(range(50, 62)), [7, 8]]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _moe(**over):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = dict(vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2)  # fmt: skip
    cfg.update(over)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).eval()


@pytest.fixture(scope="module")
def peft_moe():
    m = build_peft_model(_moe(), LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.eval()


def _same(a, b, atol=1e-5):
    assert [c.ids for c in a] == [c.ids for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


def test_grouped_mm_fallback_is_per_group_matmul():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    offs = torch.tensor([3, 3, 9, 9], dtype=torch.int32)  # group 1 and 3 empty, row 9 past the last offset
    out = grouped_mm(a, b, offs)
    assert torch.allclose(out[:3], a[:3] @ b[0]) and torch.allclose(out[3:9], a[3:9] @ b[2]) and (out[9] == 0).all()


def test_fused_experts_block_equals_the_peft_module(peft_moe):
    mlp = causal_lm_of(peft_moe).model.layers[1].mlp
    fe = FusedExperts(mlp)
    assert fe.adapted and fe.lora["gate_up_proj"][0].shape == (8, 4, 64) and fe.lora["down_proj"][1].shape == (8, 4, 64)
    h = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.allclose(fe(h), mlp(h[None])[0], atol=1e-5)


def test_fast_moe_decoding_with_the_adapter_equals_plain(peft_moe):
    dec = FastDecoder(peft_moe)
    assert all(m is not None and m.adapted for m in dec.moe_blocks)
    kw = dict(max_new_tokens=8, temperature=1.0, seed=3)
    _same(generate(peft_moe, PROMPTS, **kw), generate(dec, PROMPTS, **kw))
    _same(generate(FastDecoder(peft_moe, moe="module"), PROMPTS, **kw), generate(dec, PROMPTS, **kw))
    with torch.no_grad():  # an optimizer step in place: the working copies re-merge by version counter
        for n, p in peft_moe.named_parameters():
            if "experts" in n and "lora_B" in n:
                p.mul_(-2)
    _same(generate(peft_moe, PROMPTS, **kw), generate(dec, PROMPTS, **kw))
    with peft_moe.disable_adapter():
        base = generate(peft_moe, PROMPTS, max_new_tokens=6, temperature=0.0)
        _same(base, generate(FastDecoder(peft_moe), PROMPTS, max_new_tokens=6, temperature=0.0))
    assert [c.ids for c in base] != [c.ids for c in generate(dec, PROMPTS, max_new_tokens=6, temperature=0.0)]


def test_unsupported_blocks_fall_back_to_the_module_or_refuse():
    from torch import nn

    block = nn.Module()
    block.gate, block.experts = nn.Linear(4, 2), nn.Module()
    assert "router" in fused_experts_reason(block)
    model = _moe()
    model.model.layers[0].mlp.shared_expert = nn.Linear(64, 64)  # e.g. a shared-expert MoE
    assert FastDecoder(model).moe_blocks == [None, None]  # auto: the module path for the whole model
    with pytest.raises(NotImplementedError, match="shared experts"):
        FastDecoder(model, moe="fused")
    with pytest.raises(ValueError, match="moe must be"):
        FastDecoder(model, moe="graphs")


def test_touched_experts_fraction():
    steps = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[3, 3], [3, 3]])]
    assert touched_experts_fraction(steps, 4) == pytest.approx((3 / 4 + 1 / 4) / 2)
