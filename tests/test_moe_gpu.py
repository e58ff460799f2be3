"""LoRA-MoE on a CUDA GPU in bf16: every top-1 implementation routes alike and agrees, one-hot gates match peft."""

from __future__ import annotations

import pytest
import torch

from tracekit.moe.layer import RoutingSpec
from tracekit.moe.model import MoEConfig, build_lora_moe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def composed(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("gpu")
    # widths and ranks multiples of 8: torch._grouped_mm needs 16-byte aligned bf16 rows
    cfg = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "base")
    dirs = {}
    for i in range(3):
        torch.manual_seed(1 + i)
        peft_model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(root / "base"),
            LoraConfig(r=16, lora_alpha=32, target_modules=ALL, init_lora_weights=False),
        )
        peft_model.save_pretrained(root / f"a{i}")
        dirs[f"a{i}"] = root / f"a{i}"
    backbone = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16).cuda()
    # Well-separated gates (top-1 vs top-2 probability margin > 0.5 here): the implementations sum in different
    # orders, and with near-tied gates (std 1: margins of 1e-3) a bf16 rounding difference flips one token's
    # expert in the next block, which moves its logits (and, through attention, later tokens') by far more
    # than rounding; the flips are checked separately below.
    return root, dirs, build_lora_moe(backbone, dirs, MoEConfig(gate_init_std=100.0, seed=1))


def test_top1_implementations_agree(composed):
    _, _, moe = composed
    out = {}
    for shape in ((4, 64), (4, 8)):
        ids = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(0)).cuda()
        routes = {}
        for impl in ("grouped", "grouped_mm", "masked_dense"):
            with torch.no_grad(), moe.routing(RoutingSpec(1, impl=impl)):
                out[impl] = moe(input_ids=ids).logits.float()
            routes[impl] = [p.argmax(-1) for p in moe.gate_probs().values()]
        assert len(routes["masked_dense"][0].unique()) == 3 and len(routes["masked_dense"][1].unique()) == 3
        for impl in ("grouped", "grouped_mm"):
            assert all(torch.equal(a, b) for a, b in zip(routes[impl], routes["masked_dense"])), (shape, impl)
            assert (out[impl] - out["masked_dense"]).abs().max() < 0.05, (shape, impl)  # bf16 rounding of the sums


def test_grouped_top1_gate_gradients_match_masked_dense(composed):
    _, _, moe = composed
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2)).cuda()
    grads = {}
    for impl in ("grouped", "masked_dense"):
        moe.zero_grad()
        with moe.routing(RoutingSpec(1, impl=impl)):
            moe(input_ids=ids).logits.float().square().mean().backward()
        grads[impl] = moe.gates["0"].weight.grad.clone()
    assert grads["grouped"].abs().sum() > 0
    assert (grads["grouped"] - grads["masked_dense"]).norm() < 0.05 * grads["masked_dense"].norm()


def test_one_hot_gate_matches_peft(composed):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, dirs, moe = composed
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
    backbone = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.bfloat16).cuda()
    ref = PeftModel.from_pretrained(backbone, dirs["a1"])
    with torch.no_grad():
        for g in moe.gates.values():
            g.weight.zero_()
            g.bias.zero_()
            g.bias[1] = 100.0
        want = ref(input_ids=ids).logits.float()
        for impl in ("grouped", "grouped_mm", "masked_dense"):
            with moe.routing(RoutingSpec(1, impl=impl)):
                assert (moe(input_ids=ids).logits.float() - want).abs().max() < 0.05, impl
