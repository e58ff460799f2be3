"""Arrow routing (``consolidation=arrow``): the prototype and weight math against their definitions, the composed
model against peft 0.21's ``create_arrow_model`` on a tiny random Llama (the same top-k adapters per token, per layer
and module, the same weights and logits up to float32 rounding), the fast decoder against the hooked-free plain path,
and one-line refusals of adapters Arrow cannot compare."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracekit.llm.decoding import FastDecoder, generate, unsupported_reason
from tracekit.moe import layer as moe_layer
from tracekit.moe.arrow import arrow_prototype, arrow_weights
from tracekit.moe.layer import LoRAMoELinear
from tracekit.moe.model import LoRAMoEModel, MoEConfig, build_lora_moe

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_prototype_is_the_top_right_singular_vector_of_BA():
    g = torch.Generator().manual_seed(0)
    A, B = torch.randn(4, 24, generator=g), torch.randn(16, 4, generator=g)
    v = arrow_prototype(A, B)
    ref = torch.linalg.svd((B @ A).double())[2][0]
    assert v.shape == (24,) and abs(float(v.norm()) - 1) < 1e-6
    assert abs(float(v.double() @ ref)) > 1 - 1e-9  # the same direction, up to sign
    assert v[v.abs().argmax()] > 0  # the sign is fixed
    assert torch.equal(arrow_prototype(A, -B), v)  # -dW has the same prototype
    with pytest.raises(ValueError, match="not LoRA factors"):
        arrow_prototype(A, B.t())


def test_weights_softmax_the_top_k_absolute_scores_and_zero_the_rest():
    x = torch.tensor([[1.0, 0.0], [0.0, -2.0], [1.0, 1.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, -0.8]])
    w = arrow_weights(x, protos, top_k=2, temperature=0.5)
    sim = (x @ protos.t()).abs()  # [[1, 0, .6], [0, 2, 1.6], [1, 1, .2]]
    for t in range(3):
        keep = sim[t].topk(2).indices
        expect = torch.zeros(3)
        expect[keep] = torch.softmax(sim[t, keep] / 0.5, dim=0)
        assert torch.allclose(w[t], expect, atol=1e-6)
    assert torch.allclose(arrow_weights(x, protos, top_k=1), torch.nn.functional.one_hot(sim.argmax(1), 3).float())
    fused = arrow_weights(x, torch.stack([protos, protos.flip(0)]), top_k=2, temperature=0.5)  # parts [P, C, d]
    assert fused.shape == (3, 2, 3) and torch.allclose(fused[:, 0], w) and torch.allclose(fused[:, 1], w.flip(-1))
    for bad, match in (dict(top_k=4), "top_k must be in"), (dict(top_k=0), "top_k must be in"), \
                      (dict(top_k=1, temperature=0.0), "temperature must be > 0"):
        with pytest.raises(ValueError, match=match):
            arrow_weights(x, protos, **bad)


# --------------------------------------------------------------------------------------------- against peft


def _llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def _peft_adapters(root, n: int, ranks=None, targets=None) -> list:
    """n peft LoRA adapters of the tiny Llama, A and B random (init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model

    paths = []
    for i in range(n):
        r = (ranks or [4] * n)[i]
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list((targets or [ALL] * n)[i]), init_lora_weights=False)
        base = _llama()
        torch.manual_seed(100 + i)  # after the backbone's own seed: each adapter its own factors
        model = get_peft_model(base, cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        model.save_pretrained(root / f"task{i}")
        paths.append(root / f"task{i}")
    return paths


def _arrow_moe(paths, top_k, temperature=1.0) -> LoRAMoEModel:
    return build_lora_moe(_llama(), {f"task_{i}": p for i, p in enumerate(paths)},
                          MoEConfig(router="arrow", top_k=top_k, router_temperature=temperature)).eval()


@pytest.mark.parametrize("n,top_k,temperature", [(2, 1, 1.0), (3, 2, 0.7)])
def test_the_same_routing_and_outputs_as_peft_create_arrow_model(tmp_path, monkeypatch, n, top_k, temperature):
    from peft import ArrowConfig, create_arrow_model
    from peft.tuners.lora.arrow import ArrowLoraLinearLayer

    # peft's prototype is 15 power-iteration steps from a random start, ours the exact singular vector (the named
    # deviation): run peft's own iteration to convergence, so the two compute the same routing
    power = ArrowLoraLinearLayer.top_right_singular_vec_from_BA
    monkeypatch.setattr(ArrowLoraLinearLayer, "top_right_singular_vec_from_BA",
                        lambda self, A, B: power(self, A, B, iters=500))
    paths = _peft_adapters(tmp_path, n)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(5))
    peft_model = create_arrow_model(_llama(), [str(p) for p in paths],
                                    ArrowConfig(top_k=top_k, router_temperature=temperature, rng_seed=0)).eval()
    peft_routes: dict[str, torch.Tensor] = {}
    peft_coeff: dict[str, torch.Tensor] = {}

    def record_peft(name):
        def hook(module, args, kwargs, _out):
            tok = args[0].reshape(-1, args[0].shape[-1])
            sim = (tok @ module.prototypes.t()).abs()
            top, idx = torch.topk(sim, module.top_k, dim=1)
            peft_routes[name] = idx.sort(dim=1).values
            full = torch.full_like(sim, float("-inf")).scatter(1, idx, top)
            peft_coeff[name] = torch.softmax(full / module.temperature, dim=1)
        return hook

    for name, m in peft_model.named_modules():
        if isinstance(m, ArrowLoraLinearLayer):
            m.register_forward_hook(record_peft(name.split(".lora_arrow")[0].split("base_model.model.")[1]),
                                    with_kwargs=True)
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids).logits

    moe = _arrow_moe(paths, top_k, temperature)
    assert moe.gate_hook_ids == frozenset() and not list(moe.trainable_parameters())
    ours: dict[str, torch.Tensor] = {}
    names = {id(m): n for n, m in moe.model.named_modules() if isinstance(m, LoRAMoELinear)}
    real = moe_layer.arrow_weights
    current: list[str] = []

    def recording(x, protos, k, temp):
        w = real(x, protos, k, temp)
        ours[current[-1]] = w
        return w

    orig_forward = LoRAMoELinear.forward

    def forward(self, x):
        current.append(names[id(self)])
        return orig_forward(self, x)

    monkeypatch.setattr(moe_layer, "arrow_weights", recording)
    monkeypatch.setattr(LoRAMoELinear, "forward", forward)
    with torch.no_grad():
        logits = moe(input_ids=ids).logits

    assert set(ours) == set(peft_routes) and len(ours) == 2 * len(ALL)  # every module of every layer
    for name, w in ours.items():
        ours_idx = torch.topk(w, top_k, dim=1).indices.sort(dim=1).values
        assert torch.equal(ours_idx, peft_routes[name]), name  # the same adapters, token by token
        assert torch.allclose(w, peft_coeff[name], atol=1e-4), (name, (w - peft_coeff[name]).abs().max())
        m = moe.model.get_submodule(name)
        peft_protos = peft_model.base_model.model.get_submodule(name).lora_arrow["arrow_router"].prototypes
        cos = (m.prototypes * peft_protos).sum(-1).abs()  # both unit: |cos|
        assert bool((cos > 1 - 1e-5).all()), (name, cos)
    if top_k < n:  # the routing is really split: some tokens pick another adapter than others
        assert any(len(w.argmax(1).unique()) > 1 for w in ours.values())
    assert torch.allclose(logits, peft_logits, atol=1e-4), (logits - peft_logits).abs().max()


def test_fast_decoder_runs_arrow_banks_as_the_plain_path(tmp_path):
    paths = _peft_adapters(tmp_path, 3)
    moe = _arrow_moe(paths, top_k=2, temperature=0.5)
    assert unsupported_reason(moe) is None
    dec = FastDecoder(moe)
    assert all(b is not None and b.gate is None for b in dec.lora_moe)
    prompts = [list(range(5, 30)), [7, 8], list(range(40, 90))]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
        a = generate(moe, prompts, max_new_tokens=10, **kw)
        b = generate(dec, prompts, max_new_tokens=10, **kw)
        assert [c.ids for c in a] == [c.ids for c in b]
        for x, y in zip(a, b):
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)
    base = generate(FastDecoder(_llama()), prompts, max_new_tokens=10, temperature=0.0)
    assert [c.ids for c in generate(dec, prompts, max_new_tokens=10, temperature=0.0)] != [c.ids for c in base]


def test_save_and_load_keep_arrow_routing(tmp_path):
    paths = _peft_adapters(tmp_path, 2)
    moe = build_lora_moe(_llama(), {f"t{i}": p for i, p in enumerate(paths)},
                         MoEConfig(router="arrow", top_k=1), backbone_spec={"hf_config": {}, "seed": 0})
    moe.save(tmp_path / "moe")
    back = LoRAMoEModel.load(tmp_path / "moe", backbone=_llama())
    ids = torch.tensor([[3, 9, 27, 81, 5, 1]])
    with torch.no_grad():
        assert back.router == "arrow" and torch.equal(back(input_ids=ids).logits, moe(input_ids=ids).logits)


def test_arrow_refuses_adapters_of_other_ranks_or_modules_in_one_line(tmp_path):
    ranked = _peft_adapters(tmp_path / "r", 2, ranks=[4, 8])
    with pytest.raises(ValueError, match=r"^Arrow needs adapters of one rank: 'task_0' has rank 4 and 'task_1' "
                                         r"rank 8 \(on model\.layers\.0\.mlp\.down_proj and 13 more modules\)$"):
        _arrow_moe(ranked, top_k=1)
    targeted = _peft_adapters(tmp_path / "t", 2, targets=[ALL, ["q_proj", "v_proj"]])
    with pytest.raises(ValueError, match=r"^Arrow needs adapters on the same target modules: 'task_0' targets "
                                         r"\[down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj\] \(14 "
                                         r"modules\), 'task_1' \[q_proj, v_proj\] \(4 modules\)$"):
        _arrow_moe(targeted, top_k=1)
    with pytest.raises(ValueError, match=r"Arrow top_k=3 must be in \[1, 2\]"):
        _arrow_moe(_peft_adapters(tmp_path / "k", 2), top_k=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_captured_arrow_decoding_equals_the_plain_path(tmp_path):
    """float32 on CUDA: the graph-captured decode step (Arrow's top-k, scatter and softmax inside the graph) and the
    eager one give the plain path's greedy tokens and log-probs; bf16 runs through the captured step too."""
    paths = _peft_adapters(tmp_path, 3)
    moe = _arrow_moe(paths, top_k=2, temperature=0.5).to("cuda")
    prompts = [list(range(5, 30)), [7, 8], list(range(40, 90)), list(range(3, 60))]
    plain = generate(moe, prompts, max_new_tokens=16, temperature=0.0)
    for graphs in (True, False):
        dec = FastDecoder(moe, cuda_graphs=graphs)
        assert dec.cuda_graphs == graphs
        fast = generate(dec, prompts, max_new_tokens=16, temperature=0.0)
        assert [c.ids for c in fast] == [c.ids for c in plain]
        for x, y in zip(fast, plain):
            assert np.allclose(x.logprobs, y.logprobs, atol=1e-4)
    dec = FastDecoder(moe.to(torch.bfloat16), cuda_graphs=True)
    out = generate(dec, prompts, max_new_tokens=16, temperature=0.0)
    assert all(len(c.ids) == 16 for c in out) and all(np.isfinite(c.logprobs).all() for c in out)
