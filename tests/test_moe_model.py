"""Composed LoRA-MoE models built from peft adapters: equivalence with peft, routing, freezing, save/load."""

from __future__ import annotations

import json

import pytest
import torch

from tracekit.moe.layer import LoRAMoELinear, RoutingSpec
from tracekit.moe.model import LoRAMoEModel, MoEConfig, build_lora_moe, load_backbone

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def _config(arch: str):
    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64)  # fmt: skip
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(intermediate_size=48, head_dim=8, tie_word_embeddings=True, **common)
    if arch == "qwen3_moe":
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(intermediate_size=48, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                              head_dim=8, tie_word_embeddings=False, **common)  # fmt: skip
    from transformers import LlamaConfig

    return LlamaConfig(intermediate_size=48, tie_word_embeddings=True, **common)


def _make(root, arch="qwen3", ranks=(4, 2, 8), targets=ALL, seed=0):
    """Save a random tiny backbone and len(ranks) random peft adapters under root; return (base_dir, {name: dir})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base_dir = root / "base"
    AutoModelForCausalLM.from_config(_config(arch)).save_pretrained(base_dir)
    adapters = {}
    for i, r in enumerate(ranks):
        torch.manual_seed(seed + 10 + i)
        model = AutoModelForCausalLM.from_pretrained(base_dir)
        cfg = LoraConfig(r=r, lora_alpha=2 * r + i, target_modules=list(targets), init_lora_weights=False)
        get_peft_model(model, cfg).save_pretrained(root / f"ad{i}")
        adapters[f"cap{i}"] = root / f"ad{i}"
    return base_dir, adapters


def _backbone(base_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir)


def _peft_logits(base_dir, adapter_dir, ids):
    from peft import PeftModel

    ref = PeftModel.from_pretrained(_backbone(base_dir), adapter_dir)
    with torch.no_grad():
        return ref(input_ids=ids).logits


def _one_hot_gates(moe: LoRAMoEModel, slot: int) -> None:
    with torch.no_grad():
        for g in moe.gates.values():
            g.weight.zero_()
            g.bias.zero_()
            g.bias[slot] = 100.0  # softmax -> exactly 1.0 on slot in float32


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("qwen3"))


IDS = torch.tensor([[5, 9, 1, 33, 60, 2, 7], [8, 8, 40, 3, 11, 12, 0]])


@pytest.mark.parametrize("spec", [RoutingSpec(None), RoutingSpec(1), RoutingSpec(1, impl="masked_dense")])
def test_one_hot_gate_equals_peft_adapter(qwen3, spec):
    base_dir, adapters = qwen3
    with torch.no_grad():
        plain = _backbone(base_dir)(input_ids=IDS).logits
    moe = build_lora_moe(_backbone(base_dir), adapters)
    for c, d in enumerate(adapters.values()):
        _one_hot_gates(moe, c)
        with torch.no_grad(), moe.routing(spec):
            got = moe(input_ids=IDS).logits
        want = _peft_logits(base_dir, d, IDS)
        assert (want - plain).abs().max() > 0.1  # the adapter really changes the logits
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("arch,targets", [("qwen3_moe", ATTN), ("llama", ALL)])
def test_other_architectures_one_hot_equivalence(tmp_path, arch, targets):
    base_dir, adapters = _make(tmp_path, arch, ranks=(4, 3), targets=targets)
    moe = build_lora_moe(_backbone(base_dir), adapters)
    assert len(moe.blocks) == 2
    assert all(isinstance(moe.model.get_submodule(m), LoRAMoELinear) for m in moe.adapted_modules)
    _one_hot_gates(moe, 1)
    with torch.no_grad():
        got = moe(input_ids=IDS).logits
    assert (got - _peft_logits(base_dir, adapters["cap1"], IDS)).abs().max() < 1e-5


def test_base_slot_routes_to_the_backbone(qwen3):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(include_base_slot=True))
    assert moe.slot_names == ["base", "cap0", "cap1", "cap2"] and moe.gates["0"].out_features == 4
    _one_hot_gates(moe, 0)
    with torch.no_grad():
        got = moe(input_ids=IDS).logits
        want = _backbone(base_dir)(input_ids=IDS).logits
    assert (got - want).abs().max() < 1e-6


def test_top1_grouped_equals_masked_dense_at_model_level(qwen3):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(gate_init_std=2.0, seed=3))
    ids = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(0))
    out = {}
    for impl in ("grouped", "masked_dense"):
        with torch.no_grad(), moe.routing(RoutingSpec(1, impl=impl)):
            out[impl] = moe(input_ids=ids).logits
    top = {b: p.argmax(-1) for b, p in moe.gate_probs().items()}
    assert all(len(t.unique()) == 3 for t in top.values())  # tokens really are split over all experts
    assert (out["grouped"] - out["masked_dense"]).abs().max() < 1e-5


def test_inference_forward_releases_each_blocks_plan(qwen3):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(gate_init_std=0.5))
    with torch.no_grad():
        moe(input_ids=IDS[:, :3])  # 6 tokens: the decode gather plan, its factors T x r x (sum of widths)
    assert all(r._plan is None for r in moe.routings.values())  # nothing reruns a block without autograd
    with pytest.raises(RuntimeError, match="no routing plan"):
        moe.model.model.layers[0].self_attn.q_proj(torch.zeros(6, moe.config.hidden_size))
    assert set(moe.gate_probs()) == set(moe.routings)  # the probabilities stay for inspection
    moe(input_ids=IDS).logits.sum().backward()
    assert all(r._plan is not None for r in moe.routings.values())  # a checkpointed block may rerun on it


def test_greedy_generate_matches_peft(qwen3):
    from peft import PeftModel

    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters)
    _one_hot_gates(moe, 2)
    ref = PeftModel.from_pretrained(_backbone(base_dir), adapters["cap2"])
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(moe.generate(input_ids=IDS[:1], **kw), ref.generate(input_ids=IDS[:1], **kw))


def test_gradients_reach_only_gates(qwen3):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(gate_init_std=0.5))
    assert set(moe.trainable_parameters()) == {f"gates.{b}.{k}" for b in (0, 1) for k in ("weight", "bias")}
    for spec in (moe.training_spec, RoutingSpec(2, True)):
        moe.zero_grad(set_to_none=True)
        with moe.routing(spec):
            moe(input_ids=IDS).logits.logsumexp(-1).sum().backward()
        for name, p in moe.named_parameters():
            if name.startswith("gates."):
                assert p.grad is not None and p.grad.abs().sum() > 0, name
            else:
                assert p.grad is None and not p.requires_grad, name
    moe.banks["0"].bank_A.requires_grad_(True)
    with pytest.raises(RuntimeError, match="only the gates"):
        moe.assert_frozen()


def test_gate_gradients_unchanged_by_gradient_checkpointing(qwen3):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(gate_init_std=0.5))

    def gate_grads():
        moe.zero_grad(set_to_none=True)
        with moe.routing(moe.training_spec):
            moe(input_ids=IDS, use_cache=False).logits.logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in moe.trainable_parameters().items()}

    plain = gate_grads()
    moe.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    moe.model.train()  # HF checkpoints decoder layers only in train mode
    checkpointed = gate_grads()
    assert all(torch.allclose(plain[n], checkpointed[n], atol=1e-6) for n in plain)


def test_save_load_round_trip(qwen3, tmp_path):
    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters, MoEConfig(gate_init_std=1.0, include_base_slot=True, seed=7))
    saved = moe.save(tmp_path / "composed")
    meta = json.loads((saved / "moe_config.json").read_text())
    assert meta["backbone"] == {"name_or_path": str(base_dir)} and meta["slot_names"][0] == "base"
    for i in range(3):
        src = adapters[f"cap{i}"] / "adapter_model.safetensors"
        assert (saved / meta["adapters"][i]["dir"] / "adapter_model.safetensors").read_bytes() == src.read_bytes()
    loaded = LoRAMoEModel.load(saved)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for spec in (RoutingSpec(1), RoutingSpec(None)):
        with torch.no_grad(), moe.routing(spec), loaded.routing(spec):
            assert torch.equal(moe(input_ids=ids).logits, loaded(input_ids=ids).logits)
    moe.save(saved)  # overwrite in place
    assert LoRAMoEModel.load(saved, backbone=_backbone(base_dir)).moe_config == moe.moe_config


def test_random_init_backbone_reference(qwen3, tmp_path):
    cfg = _config("qwen3").to_dict()
    spec = {"hf_config": cfg, "seed": 5}
    a, b = load_backbone(spec), load_backbone(spec)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    moe = build_lora_moe(a, qwen3[1], backbone_spec=spec)
    loaded = LoRAMoEModel.load(moe.save(tmp_path / "m"))
    with torch.no_grad():
        assert torch.equal(moe(input_ids=IDS).logits, loaded(input_ids=IDS).logits)


def test_parameter_counts_match_peft(qwen3):
    from peft import PeftModel

    base_dir, adapters = qwen3
    moe = build_lora_moe(_backbone(base_dir), adapters)
    counts = moe.parameter_counts()
    assert counts["backbone"] == sum(p.numel() for p in _backbone(base_dir).parameters())
    for name, d in adapters.items():
        peft_model = PeftModel.from_pretrained(_backbone(base_dir), d)
        lora = sum(p.numel() for n, p in peft_model.named_parameters() if "lora_" in n)
        assert counts["adapters"][name] == lora
    assert counts["gates_total"] == 2 * (32 * 3 + 3) and counts["n_slots"] == 3


def test_bad_adapters_raise(qwen3, tmp_path):
    from peft import LoraConfig, get_peft_model

    base_dir, adapters = qwen3
    get_peft_model(_backbone(base_dir), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(tmp_path / "q")
    with pytest.raises(ValueError, match="adapt different modules"):
        build_lora_moe(_backbone(base_dir), {"a": adapters["cap0"], "b": tmp_path / "q"})
    dora = LoraConfig(r=2, target_modules=ALL, use_dora=True)
    get_peft_model(_backbone(base_dir), dora).save_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="use_dora"):
        build_lora_moe(_backbone(base_dir), [tmp_path / "d"])
    with pytest.raises(FileNotFoundError, match="missing adapter_config.json"):
        build_lora_moe(_backbone(base_dir), [tmp_path])
    with pytest.raises(ValueError, match="unique"):
        build_lora_moe(_backbone(base_dir), [adapters["cap0"], adapters["cap0"]])
    with pytest.raises(TypeError, match="model.model.layers"):
        build_lora_moe(torch.nn.Linear(2, 2), [adapters["cap0"]])
    shallow = _backbone(base_dir)
    del shallow.model.layers[1]  # the adapters also adapt block 1
    with pytest.raises(TypeError, match="model.layers.1.mlp.down_proj is missing"):
        build_lora_moe(shallow, [adapters["cap0"]])
    assert isinstance(shallow.model.layers[0].mlp.down_proj, torch.nn.Linear)  # nothing was replaced
    with pytest.raises(ValueError, match="no backbone reference"):
        moe = build_lora_moe(_backbone(base_dir), [adapters["cap0"]])
        moe.backbone_spec = None
        moe.save(tmp_path / "x")
