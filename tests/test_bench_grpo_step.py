"""benchmarks/grpo_step.py at the paper's model types (issue 22): the capability adapter's targets, active-parameter
counts, and the touched-weight roofline's bytes, on the scaled-down MoE and hybrid siblings (CPU, seconds)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import grpo_step  # noqa: E402

from tracekit.llm.decoding import hooks_reason  # noqa: E402


def test_paper_archs_resolve_from_conf_backbone():
    moe = grpo_step.arch_config("qwen3_30b_a3b")
    assert (moe.model_type, moe.num_experts, moe.num_experts_per_tok, moe.num_hidden_layers) == ("qwen3_moe", 128, 8, 48)
    hyb = grpo_step.text_config(grpo_step.arch_config("qwen3_6_27b"))
    assert hyb.layer_types.count("full_attention") == 16 and hyb.num_hidden_layers == 64
    with pytest.raises(SystemExit, match="unknown --arch"):
        grpo_step.arch_config("qwen9")


def test_moe_adapter_targets_counts_and_roofline_bytes(tmp_path):
    tr, cfg = grpo_step.build_trainer("tiny_moe", torch.device("cpu"), str(tmp_path), lora_rank=4, microbatch_tokens=256, logprob_chunk=64)
    assert tr.s.lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"]  # the MoE has no gate/up/down Linear
    assert tr.s.lora.target_parameters == grpo_step.EXPERT_PARAMS
    assert all(layer.mlp.experts._tracekit_fused for layer in tr.model.base_model.model.model.layers)  # update_on's grouped-GEMM path
    c = grpo_step.model_counts(tr.model)
    H, L, E, k, I = 64, 2, 8, 2, 32  # noqa: E741
    attn = H * 64 + 2 * H * 32 + 64 * H
    assert c["body"] == L * (attn + E * H) and c["experts"] == L * E * 3 * H * I
    assert c["active"] == c["body"] + c["experts"] * k // E
    # LoRA per token: r (in + out) per attention linear, k experts' worth on gate_up (H -> 2I) and down (I -> H)
    r = 4
    assert c["lora_per_token"] == L * (r * (H + 64) + 2 * r * (H + 32) + r * (64 + H) + k * r * (H + 2 * I) + k * r * (I + H))
    assert c["expert_lora"] == L * E * (r * (H + 2 * I) + r * (I + H))
    full = grpo_step.decode_step_bytes(c, 1.0)
    assert grpo_step.decode_step_bytes(c, 0.25) == pytest.approx(full - 0.75 * 2 * (c["experts"] + c["expert_lora"]))
    prompts = [list(range(5, 20)), list(range(30, 45))]
    frac = grpo_step.measure_touched(tr.model, prompts, steps=3)
    assert 2 / E <= frac <= 1.0  # at least k experts per step, at most all
    assert hooks_reason(tr.model) is None  # the routers' observers are gone: fast decoding is not blocked


def test_hybrid_adapter_targets_every_linear_name_it_has(tmp_path):
    model, _ = grpo_step.build_base("tiny_hybrid", torch.device("cpu"))
    modules, params = grpo_step.lora_targets(model)
    assert modules == grpo_step.TARGETS and params == []
    assert grpo_step.model_counts(model)["attn_layers"] == 1
