"""Backbone registry: architecture numbers (meta-device parameter counts), seeded init, the cache."""

from __future__ import annotations

import time

import pytest
import torch

from tracekit.llm.backbones import (
    BACKBONES,
    bundled_tokenizer,
    build_model_from_arch,
    cached_folder,
    count_parameters,
    get_spec,
    load_backbone,
)


def test_qwen3_30b_a3b_has_30_5b_parameters_on_meta():
    model = build_model_from_arch("qwen3_30b_a3b", device="meta")
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    assert next(model.parameters()).device.type == "meta"
    n = count_parameters(model)
    assert 30.4e9 < n < 30.6e9, n  # paper Table 5: ~30.5B
    cfg = model.config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (128, 8, 768)


def test_qwen3_8b_has_8_2b_parameters_on_meta():
    n = count_parameters(build_model_from_arch("qwen3_8b", device="meta"))
    assert 8.15e9 < n < 8.25e9, n  # Qwen3-8B: 8.2B


@pytest.mark.parametrize(
    "name,low,high",
    [("qwen3_1_7b", 1.6e9, 1.8e9), ("qwen3_6_27b", 26.0e9, 28.0e9), ("smollm2_135m", 134.0e6, 135.0e6)],
)
def test_other_backbones_build_on_meta(name, low, high):
    model = build_model_from_arch(name, device="meta", dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert low < count_parameters(model) < high


def test_qwen3_6_27b_is_the_hybrid_decoder():
    cfg = build_model_from_arch("qwen3_6_27b").config
    assert cfg.layer_types.count("full_attention") == 16 and cfg.layer_types.count("linear_attention") == 48
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (5120, 24, 4, 256)


def test_every_spec_is_consistent():
    for name, spec in BACKBONES.items():
        assert spec.name == name
        if spec.source == "hub":
            assert spec.hf_id and spec.dtype == "bfloat16"
        assert "hidden_size" in spec.arch and "vocab_size" in spec.arch and "tie_word_embeddings" in spec.arch


def test_random_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_model_from_arch("tiny", device="cpu", seed=7)
    assert torch.equal(torch.rand(1), before)  # global RNG untouched by the init
    b = build_model_from_arch("tiny", device="cpu", seed=7)
    c = build_model_from_arch("tiny", device="cpu", seed=8)
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_get_spec_overrides_and_errors():
    spec = get_spec({"name": "tiny", "seed": 3, "arch": {"num_hidden_layers": 1}})
    assert spec.seed == 3 and spec.arch["num_hidden_layers"] == 1 and spec.arch["hidden_size"] == 64
    assert BACKBONES["tiny"].arch["num_hidden_layers"] == 2  # the registry is not mutated
    with pytest.raises(KeyError, match="unknown backbone"):
        get_spec("gpt5")
    with pytest.raises(KeyError, match="unknown keys"):
        get_spec({"name": "tiny", "sed": 3})
    with pytest.raises(ValueError, match="chat_format"):
        get_spec({"name": "x", "source": "random", "arch": {"model_type": "qwen3"}, "chat_format": "chatml"})


def test_load_tiny_backbone_is_fast_after_first_time(monkeypatch):
    from tracekit.llm import backbones

    load_backbone("tiny")  # builds the tokenizer cache if this machine has none yet

    def rebuilt():
        raise AssertionError("the tokenizer was extracted from the GGUF again: the cache was not used")

    monkeypatch.setattr(backbones, "_gguf_tokenizer", rebuilt)  # fast = from the cache: checked, not timed
    t0 = time.perf_counter()
    model, tok = load_backbone("tiny")
    elapsed = time.perf_counter() - t0
    assert elapsed < 60.0, elapsed  # only a bound against a hang: a loaded machine takes seconds for ~0.2 s of work
    assert type(model).__name__ == "Qwen3ForCausalLM" and not model.training
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token == "<|im_end|>" and "# Tools" in tok.chat_template


def test_bundled_tokenizer_template_per_format():
    assert "<tools>[" in bundled_tokenizer("smollm2").chat_template
    with pytest.raises(ValueError, match="no bundled template"):
        bundled_tokenizer("qwen3_xml")


def test_cached_folder_is_atomic(tmp_path):
    final = tmp_path / "thing"

    def failing(tmp):
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="killed"):
        cached_folder(final, failing)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []  # no temp left

    calls = []

    def ok(tmp):
        calls.append(1)
        (tmp / "data.txt").write_text("hello")
        return {"n": 1}

    assert cached_folder(final, ok) == final and cached_folder(final, ok) == final
    assert calls == [1] and (final / "data.txt").read_text() == "hello"


def test_resolve_dtype():
    from tracekit.llm.backbones import resolve_dtype

    assert resolve_dtype(None, "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", device="cpu") == torch.float32
    assert resolve_dtype("auto", device="cuda:0") == torch.bfloat16
    assert resolve_dtype(torch.float16) == torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'fp32'"):
        resolve_dtype("fp32")
