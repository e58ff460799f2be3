"""LoRA merge math (tracekit.merging): exactness, TIES/DARE/TSV-M helpers, Core Space, peft I/O."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tracekit.merging import (
    LoraFactors,
    core_space_merge,
    core_tsv_merge,
    dare_drop,
    elect_sign,
    merge_cat,
    merge_dare_ties,
    merge_linear,
    merge_ties,
    polar_orthogonalize,
    read_adapter_config,
    read_lora_adapter,
    svd_refactor,
    ties_merge,
    ties_trim,
    tsv_merge,
    write_lora_adapter,
)
from tracekit.merging.core_space import core_bases, task_core

Q, V, O = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj"
SHAPES = {Q: (16, 12), V: (6, 12)}  # v: m = 6 < T r = 9 for three rank-3 adapters (a reduced core)


def factors(g: torch.Generator, m: int, n: int, r: int, scale: float) -> LoraFactors:
    return LoraFactors(0.5 * torch.randn(r, n, generator=g), 0.5 * torch.randn(m, r, generator=g), scale)


def adapter(seed: int, r: int = 3, scale: float = 2.0) -> dict[str, LoraFactors]:
    g = torch.Generator().manual_seed(seed)
    return {module: factors(g, m, n, r, scale) for module, (m, n) in SHAPES.items()}


def three() -> dict[str, dict[str, LoraFactors]]:
    return {"a": adapter(1, scale=2.0), "b": adapter(2, scale=0.5), "c": adapter(3, scale=1.0 / 3**0.5)}


def delta64(f: LoraFactors) -> torch.Tensor:
    return f.scale * (f.B.double() @ f.A.double())


def summed(adapters: dict[str, dict[str, LoraFactors]], module: str, weights=None) -> torch.Tensor:
    having = [a[module] for a in adapters.values() if module in a]
    weights = weights or [1.0] * len(having)
    return sum(w * delta64(f) for w, f in zip(weights, having))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol}"


# ---------------------------------------------------------------------------------------------
# exact and full-dW merges


def test_merge_cat_is_the_exact_sum_with_differing_ranks_and_modules():
    g = torch.Generator().manual_seed(0)
    adapters = {
        "a": {Q: factors(g, 16, 12, 2, 2.0), V: factors(g, 6, 12, 3, 1.0)},
        "b": {Q: factors(g, 16, 12, 4, 0.7)},
        "c": {V: factors(g, 6, 12, 1, 4.0), O: factors(g, 12, 16, 2, 0.25)},
    }
    merged = merge_cat(adapters)
    assert list(merged) == [Q, V, O]
    assert {m: f.rank for m, f in merged.items()} == {Q: 6, V: 4, O: 2}
    for module, f in merged.items():
        assert f.scale == 1.0
        assert_close(f.delta(), summed(adapters, module), 1e-6)


def test_merge_linear_is_the_weighted_sum_lossless_at_the_default_rank():
    adapters, w = three(), [0.5, -1.0, 2.0]
    merged = merge_linear(adapters, weights=w)
    assert merged[Q].rank == 9 and merged[V].rank == 6  # sum of ranks, capped at min(m, n)
    for module in SHAPES:
        assert_close(merged[module].delta(), summed(adapters, module, w), 1e-5)


def test_merge_ties_at_full_rank_equals_ties_on_the_full_updates():
    adapters = three()
    merged = merge_ties(adapters, density=0.4, rank=12)
    for module in SHAPES:
        stacked = torch.stack([f[module].delta() for f in adapters.values()])
        assert_close(merged[module].delta(), ties_merge(stacked, 0.4), 1e-5)
    assert merge_ties(adapters, density=0.4)[Q].rank == 9  # default: sum of ranks (truncates TIES's full-rank dW)


@pytest.mark.parametrize(
    "merge",
    [
        merge_cat,
        merge_linear,
        lambda a: merge_ties(a, density=1.0),
        lambda a: merge_dare_ties(a, density=1.0),
        lambda a: core_space_merge(a, "sum"),
        lambda a: core_space_merge(a, "ties"),
        lambda a: core_space_merge(a, "tsv"),
        lambda a: core_space_merge(a, "ties_tsv"),
        lambda a: core_tsv_merge(a, lam=1.0),
    ],
    ids=["cat", "linear", "ties", "dare_ties", "core_sum", "core_ties", "core_tsv", "core_ties_tsv", "core_tsv_merge"],
)
def test_merging_one_adapter_returns_its_update(merge):
    one = adapter(7, scale=1.5)
    merged = merge({"only": one})
    for module, f in one.items():
        assert_close(merged[module].delta(), delta64(f), 1e-5)


@pytest.mark.parametrize(
    "merge",
    [
        merge_linear,
        lambda a: merge_ties(a, density=0.5),
        lambda a: merge_dare_ties(a, density=0.5),
        lambda a: core_space_merge(a, "sum"),
        core_tsv_merge,
    ],
    ids=["linear", "ties", "dare_ties", "core_sum", "core_tsv"],
)
def test_equal_shape_merges_refuse_differing_ranks_and_modules_in_one_line(merge):
    base = adapter(1, r=3)
    for other, detail in ((adapter(2, r=2), "rank 2"), ({Q: adapter(2)[Q]}, V)):
        with pytest.raises(ValueError) as err:
            merge({"first": base, "second": other})
        msg = str(err.value)
        assert "\n" not in msg and "'first'" in msg and "'second'" in msg and detail in msg
    merge_cat({"first": base, "second": adapter(2, r=2)})  # the exact merge takes them


# ---------------------------------------------------------------------------------------------
# TIES / DARE helpers


T1 = [[1.0, -2.0, 0.5], [3.0, -0.1, 0.0]]
T2 = [[-4.0, 1.0, 0.2], [1.5, 0.3, -2.0]]
T3 = [[2.0, 0.5, -1.0], [-0.5, -3.0, 0.8]]


def test_ties_on_a_toy_with_a_known_answer():
    stacked = torch.tensor([T1, T2, T3])
    trimmed = torch.stack([ties_trim(t, 0.5) for t in stacked])  # top 3 of 6 entries by |value| each
    assert torch.equal(trimmed, torch.tensor([
        [[1.0, -2.0, 0.0], [3.0, 0.0, 0.0]],
        [[-4.0, 0.0, 0.0], [1.5, 0.0, -2.0]],
        [[2.0, 0.0, -1.0], [0.0, -3.0, 0.0]],
    ]))  # fmt: skip
    # sums [[-1, -2, -1], [4.5, -3, -2]]: entry (0, 0) elects "-" by mass although two of three tasks are "+"
    assert torch.equal(elect_sign(trimmed, "total"), torch.tensor([[-1.0, -1.0, -1.0], [1.0, -1.0, -1.0]]))
    assert torch.equal(elect_sign(trimmed, "frequency"), torch.tensor([[1.0, -1.0, -1.0], [1.0, -1.0, -1.0]]))
    # disjoint mean over the agreeing kept entries: (0, 0) = -4 alone; (1, 0) = (3 + 1.5) / 2
    assert torch.equal(ties_merge(stacked, 0.5, "total"), torch.tensor([[-4.0, -2.0, -1.0], [2.25, -3.0, -2.0]]))
    assert torch.equal(ties_merge(stacked, 0.5, "frequency"), torch.tensor([[1.5, -2.0, -1.0], [2.25, -3.0, -2.0]]))


def test_dare_drop_identity_reproducible_and_unbiased():
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(dare_drop(x, 0.0, torch.Generator().manual_seed(1)), x)
    a = dare_drop(x, 0.7, torch.Generator().manual_seed(5))
    assert torch.equal(a, dare_drop(x, 0.7, torch.Generator().manual_seed(5)))
    assert not torch.equal(a, dare_drop(x, 0.7, torch.Generator().manual_seed(6)))
    kept = a != 0  # on this fixed mask: kept entries rescaled by 1 / (1 - p), the rest dropped
    assert torch.allclose(a[kept], x[kept] / 0.3) and 0.2 < kept.float().mean() < 0.4
    g = torch.Generator().manual_seed(9)
    mean = torch.stack([dare_drop(x, 0.7, g) for _ in range(2000)]).mean(dim=0)
    assert (mean - x).abs().mean() < 0.05 * x.abs().mean()  # E[drop(x)] = x


def test_merge_dare_ties_is_reproducible_by_seed():
    adapters = three()
    a, b = merge_dare_ties(adapters, 0.5, seed=3), merge_dare_ties(adapters, 0.5, seed=3)
    c = merge_dare_ties(adapters, 0.5, seed=4)
    assert all(torch.equal(a[m].delta(), b[m].delta()) for m in SHAPES)
    assert not torch.equal(a[Q].delta(), c[Q].delta())


def test_svd_refactor_is_the_best_low_rank_approximation():
    dW = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    A, B = svd_refactor(dW, 3)
    assert A.shape == (3, 8) and B.shape == (10, 3)
    U, S, Vh = torch.linalg.svd(dW)
    assert_close(B @ A, U[:, :3] @ torch.diag(S[:3]) @ Vh[:3], 1e-5)
    A, B = svd_refactor(dW, 20)
    assert A.shape == (8, 8) and torch.allclose(B @ A, dW, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Core Space and TSV-M


def test_core_bases_are_lossless_for_every_task():
    adapters = three()
    for module in SHAPES:
        fs = [a[module] for a in adapters.values()]
        U_ref, V_ref = core_bases(fs)
        for f in fs:
            assert_close(U_ref @ task_core(f, U_ref, V_ref) @ V_ref.T, delta64(f), 1e-5)


def test_core_space_sum_equals_the_sum_of_the_full_updates():
    adapters = three()
    merged = core_space_merge(adapters, "sum", lam=1.0, isotropize=False)
    for module in SHAPES:
        assert_close(merged[module].delta(), summed(adapters, module), 1e-5)


def test_polar_step_gives_orthonormal_columns():
    for shape in ((9, 6), (6, 6)):
        U = polar_orthogonalize(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        assert_close(U.T @ U, torch.eye(shape[1]), 1e-5)


def test_tsv_merge_of_tasks_in_orthogonal_subspaces_is_their_sum():
    g = torch.Generator().manual_seed(0)
    Qu, Qv = (torch.linalg.qr(torch.randn(6, 6, generator=g))[0] for _ in range(2))
    block = [slice(2 * i, 2 * i + 2) for i in range(3)]  # task i owns columns 2i, 2i+1 of Qu and Qv
    cores = [Qu[:, b] @ torch.diag(torch.rand(2, generator=g) + 0.5) @ Qv[:, b].T for b in block]
    assert_close(tsv_merge(cores, k=2), sum(cores), 1e-5)


def test_isotropize_and_rank_policy():
    adapters = three()
    S_sum = torch.linalg.svdvals(summed(adapters, Q))
    full = core_space_merge(adapters, "sum", isotropize=True)[Q]
    assert full.rank == 9
    S = torch.linalg.svdvals(full.delta().double())[:9]
    assert_close(S, torch.full((9,), S_sum[:9].mean().item()), 1e-4)
    trunc = core_space_merge(adapters, "sum", rank_policy="truncate")[Q]
    A, B = svd_refactor(summed(adapters, Q).float(), 3)
    assert trunc.rank == 3 and torch.allclose(trunc.delta(), B @ A, atol=1e-4)
    iso = core_space_merge(adapters, "sum", isotropize=True, rank_policy="truncate")[Q]
    S = torch.linalg.svdvals(iso.delta().double())
    assert_close(S[:3], torch.full((3,), S_sum[:3].mean().item()), 1e-4)  # truncated first, then isotropized
    assert S[3:].abs().max() < 1e-5


def test_core_tsv_lambda_scales_the_update():
    adapters = three()
    one, fifth = core_tsv_merge(adapters, lam=1.0), core_tsv_merge(adapters)  # default lam 0.2
    for module in SHAPES:
        assert_close(fifth[module].delta(), 0.2 * one[module].delta(), 1e-5)


# ---------------------------------------------------------------------------------------------
# adapter directories


def test_write_read_roundtrip_with_rank_pattern(tmp_path):
    g = torch.Generator().manual_seed(0)
    fs = {Q: factors(g, 16, 12, 4, 3.0), V: factors(g, 6, 12, 4, 0.5), O: factors(g, 12, 16, 6, 1.0)}
    out = write_lora_adapter(tmp_path / "merged", fs, base_config={"task_type": "CAUSAL_LM", "r": 99})
    cfg = read_adapter_config(out)
    assert (cfg["r"], cfg["lora_alpha"], cfg["task_type"]) == (4, 4, "CAUSAL_LM")
    assert list(cfg["rank_pattern"].values()) == [6] and cfg["alpha_pattern"] == cfg["rank_pattern"]
    back = read_lora_adapter(out)
    assert set(back) == set(fs)
    for module, f in fs.items():
        assert back[module].scale == 1.0 and back[module].rank == f.rank
        assert_close(back[module].delta(), delta64(f), 1e-6)
    write_lora_adapter(out, {Q: fs[Q]})  # replaces the directory
    assert set(read_lora_adapter(out)) == {Q}
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # no temp dirs left behind


def test_read_refuses_malformed_adapters_in_one_line(tmp_path):
    g = torch.Generator().manual_seed(0)
    good = write_lora_adapter(tmp_path / "good", {Q: factors(g, 16, 12, 4, 1.0)})
    weights = load_file(str(good / "adapter_model.safetensors"))
    key_a, key_b = f"base_model.model.{Q}.lora_A.weight", f"base_model.model.{Q}.lora_B.weight"

    def broken(name: str, tensors: dict[str, torch.Tensor] | None, config: dict | None = None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(config or read_adapter_config(good)))
        if tensors is not None:
            save_file(tensors, str(d / "adapter_model.safetensors"))
        return d

    cases = [
        (broken("no_weights", None), "adapter_model.safetensors"),
        (broken("a_only", {key_a: weights[key_a]}), Q),
        (broken("shape", {key_a: weights[key_a], key_b: torch.zeros(16, 3)}), Q),
        (broken("rank", dict(weights), {**read_adapter_config(good), "r": 8}), Q),
    ]
    for d, detail in cases:
        with pytest.raises(ValueError) as err:
            read_lora_adapter(d)
        msg = str(err.value)
        assert "\n" not in msg and str(d) in msg and detail in msg


# ---------------------------------------------------------------------------------------------
# real peft adapters on a tiny Llama


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}

    def fresh():
        m = LlamaForCausalLM(config).eval()
        m.load_state_dict(state)
        return m

    return fresh


def _peft_adapter(fresh, path, seed: int, **lora):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(fresh(), LoraConfig(lora_dropout=0.0, **lora))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft initializes B to zero: randomize so dW != 0
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(path))
    return path


@pytest.mark.parametrize("merge", ["cat", "core_sum"])
def test_merged_real_peft_adapter_loads_and_applies_the_expected_update(tmp_path, merge):
    from peft import PeftModel

    fresh = _tiny_llama()
    first = _peft_adapter(fresh, tmp_path / "a", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    if merge == "cat":  # differing rank, modules and scaling rule: rank_pattern in the merged config
        second = _peft_adapter(fresh, tmp_path / "b", 2, r=2, lora_alpha=4, use_rslora=True, target_modules=["q_proj"])
    else:
        second = _peft_adapter(fresh, tmp_path / "b", 2, r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    adapters = {str(p): read_lora_adapter(p) for p in (first, second)}
    merged = merge_cat(adapters) if merge == "cat" else core_space_merge(adapters, "sum")
    out = write_lora_adapter(tmp_path / "merged", merged, base_config=read_adapter_config(first))

    expected = fresh()
    with torch.no_grad():
        for module in merged:
            expected.get_submodule(module).weight += summed(adapters, module).float()
    loaded = PeftModel.from_pretrained(fresh(), str(out)).eval()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = fresh()(ids).logits
        got, want = loaded(ids).logits, expected(ids).logits
    assert (want - base_logits).abs().max() > 1e-3  # the update is visible in the forward
    assert_close(got, want, 1e-5)
