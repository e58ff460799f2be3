"""Paper Table 5 parameter counts on the meta device."""

from __future__ import annotations

import pytest
import torch

from tracekit.report.table5 import (
    ATTENTION,
    MLP,
    OFFICIAL_TARGETS,
    format_counts,
    gate_param_count,
    lora_param_count,
    meta_causal_lm,
    qwen3_30b_a3b_config,
    table5,
)


@pytest.fixture(scope="module")
def qwen3_30b():
    return meta_causal_lm(qwen3_30b_a3b_config())


def test_gate_formula():
    assert gate_param_count(2048, 48, 5) == 48 * (2048 * 5 + 5) == 491_760
    assert gate_param_count(4, 2, 3) == 2 * (4 * 3 + 3)


def test_table5_qwen3_30b_a3b(qwen3_30b):
    assert all(p.device.type == "meta" for p in qwen3_30b.parameters())
    t = table5(n_capabilities=5, model=qwen3_30b)
    assert t["gates_total"] == 491_760  # paper: "491,760 parameters in total"
    assert t["backbone"] == 30_532_122_624  # paper: ~30.5 B
    # r=32 on q,k,v,o + every expert's gate/up/down (one Linear per expert, as the official adapters):
    # 48 * 32 * (attention 17,408 + 128 experts * 3 * (2048 + 768)) = 1,687,683,072 (~1.6-1.7 B, 5.5%)
    assert t["adapter_each"] == 1_687_683_072
    assert "491,760" in format_counts(t)


def test_fused_expert_layout_counts(qwen3_30b):
    # transformers 5.x fuses gate and up: E * r * (H + 2I) + E * r * (I + H) per block for the experts
    n = lora_param_count(qwen3_30b, 32, OFFICIAL_TARGETS, "fused")
    assert n == 48 * 32 * (17_408 + 128 * ((2048 + 1536) + (768 + 2048))) == 1_285_029_888
    assert lora_param_count(qwen3_30b, 40, OFFICIAL_TARGETS, "fused") == 1_606_287_360
    assert lora_param_count(qwen3_30b, 32, ATTENTION) == 48 * 32 * 17_408
    with pytest.raises(ValueError, match="gate_proj and up_proj"):
        lora_param_count(qwen3_30b, 8, ["gate_proj"], "fused")


def test_fused_count_equals_peft_target_parameters():
    """peft's own LoRA on the fused 3-D expert parameters (target_parameters) has the closed-form size."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=50, hidden_size=24, intermediate_size=40, moe_intermediate_size=12,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=6,
                         num_experts=5, num_experts_per_tok=2)  # fmt: skip
    model = meta_causal_lm(cfg)
    fused = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=3, target_modules=list(ATTENTION), target_parameters=fused)
    with torch.device("meta"):
        peft_model = get_peft_model(meta_causal_lm(cfg), lora)
    trainable, _ = peft_model.get_nb_trainable_parameters()
    assert trainable == lora_param_count(model, 3, ATTENTION + MLP, "fused")
