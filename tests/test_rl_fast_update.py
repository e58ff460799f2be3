"""The update path: fused LoRA/RMSNorm forwards, selective checkpointing and the mask-free right-padded
forward give the plain computation's loss and gradients; what each checkpoint policy keeps."""

from __future__ import annotations

import pytest
import torch

from tracekit.rl import grpo
from tracekit.rl.fused import set_fused_update_kernels
from tracekit.rl.settings import GRPOSettings, LoraSettings
from tracekit.rl.toy import tiny_model
from tracekit.llm.decoding import causal_lm_of
from tracekit.rl.model import (build_peft_model, selective_checkpoint_context, sequence_logprobs,
                               set_activation_checkpointing)

VOCAB = 384


def _model(seed: int = 0, dropout: float = 0.0) -> torch.nn.Module:
    model = build_peft_model(tiny_model(VOCAB, seed=seed), LoraSettings(rank=4, alpha=8, dropout=dropout), seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def _batch(lengths=(24, 17, 9), seed: int = 1):
    """Right-padded rows, the second half of each generated; advantages +-1; rollout log-probs 0."""
    g = torch.Generator().manual_seed(seed)
    n, t = len(lengths), max(lengths)
    ids = torch.randint(5, VOCAB, (n, t), generator=g)
    attn = torch.zeros(n, t, dtype=torch.long)
    lmask = torch.zeros(n, t)
    for i, L in enumerate(lengths):
        attn[i, :L] = 1
        lmask[i, L // 2 : L] = 1
        ids[i, L:] = 0
    return ids, attn, lmask


def _loss_and_grads(model, ids, attn, lmask):
    model.train()
    model.zero_grad(set_to_none=True)
    logp = sequence_logprobs(model, ids, attn, lmask, chunk=5)
    sel = lmask[:, 1:] > 0
    adv = grpo.token_advantages(torch.tensor([1.0, -1.0, 0.5], device=lmask.device), lmask)[:, 1:][sel]
    w = grpo.trajectory_token_weights(lmask, lmask.sum(1).long(), 3)[:, 1:][sel]
    old = logp.detach() - 0.1  # rho = e^0.1: the clip is active for positive advantages
    loss = grpo.grpo_loss(logp, old, adv, w, clip_eps=0.05).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), logp.detach(), grads


def _close(a, b, tol=1e-5):
    la, lpa, ga = a
    lb, lpb, gb = b
    assert torch.allclose(la, lb, atol=tol) and torch.allclose(lpa, lpb, atol=tol)
    assert ga.keys() == gb.keys() and all(torch.allclose(ga[k], gb[k], atol=tol) for k in ga)
    assert any(g.abs().sum() > 0 for g in ga.values())


def test_fused_kernels_equal_peft_and_transformers_forwards():
    model = _model()
    batch = _batch()
    ref = _loss_and_grads(model, *batch)
    assert set_fused_update_kernels(causal_lm_of(model), True) == 7 * 2 + 2 * 4 + 1  # 14 LoRA linears, 9 RMSNorms
    assert set_fused_update_kernels(causal_lm_of(model), True) == 0  # idempotent
    _close(ref, _loss_and_grads(model, *batch))
    set_fused_update_kernels(causal_lm_of(model), False)
    _close(ref, _loss_and_grads(model, *batch), tol=0.0)  # peft's own forward again, bit for bit


def test_fused_lora_applies_dropout_and_honours_disabled_adapters():
    model = _model(dropout=0.5)
    set_fused_update_kernels(causal_lm_of(model), True)
    ids, attn, lmask = _batch()
    model.train()
    torch.manual_seed(0)
    a = sequence_logprobs(model, ids, attn, lmask)
    torch.manual_seed(1)
    b = sequence_logprobs(model, ids, attn, lmask)
    assert not torch.allclose(a, b)  # dropout on the LoRA input is live in train mode
    model.eval()
    with torch.no_grad(), model.disable_adapter():
        off = sequence_logprobs(model, ids, attn, lmask)
    set_fused_update_kernels(causal_lm_of(model), False)
    with torch.no_grad(), model.disable_adapter():
        assert torch.allclose(off, sequence_logprobs(model, ids, attn, lmask), atol=1e-6)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_gives_the_same_loss_and_gradients(policy):
    model = _model()
    set_fused_update_kernels(causal_lm_of(model), True)
    batch = _batch()
    ref = _loss_and_grads(model, *batch)
    set_activation_checkpointing(causal_lm_of(model), True, policy)
    _close(ref, _loss_and_grads(model, *batch), tol=1e-6)


def _backward_matmuls(model, batch) -> tuple[int, int]:
    """(big, small) mm/addmm calls during backward (inner dim > 256 or not): backward grads plus
    whatever checkpointing recomputes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    counts = [0, 0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (aten.mm.default, aten.addmm.default):
                a = args[0] if func is aten.mm.default else args[1]
                counts[0 if a.shape[-1] > 256 else 1] += 1
            return func(*args, **(kwargs or {}))

    model.train()
    loss = sequence_logprobs(model, *batch).sum()
    with Count():
        loss.backward()
    return counts[0], counts[1]


def test_selective_checkpointing_recomputes_no_big_matmul_full_recomputes_all():
    # every base projection's inner dim > 256 (hidden 320, 4 x 80 query dims, MLP 640); LoRA rank 4
    arch = dict(hidden_size=320, intermediate_size=640, num_attention_heads=4, num_key_value_heads=2, head_dim=80)
    model = build_peft_model(tiny_model(VOCAB, seed=0, **arch), LoraSettings(rank=4, alpha=8), 0)
    set_fused_update_kernels(causal_lm_of(model), True)
    batch = _batch()
    lm = causal_lm_of(model)
    big0, small0 = _backward_matmuls(model, batch)
    set_activation_checkpointing(lm, True, "selective")
    big_s, small_s = _backward_matmuls(model, batch)
    set_activation_checkpointing(lm, True, "full")
    big_f, small_f = _backward_matmuls(model, batch)
    layers = 2
    assert big_f - big0 >= 14 * layers  # full redoes at least the 7 base GEMMs and 7 x A^T of every layer
    assert big_s - big0 <= (big_f - big0) // 8  # selective: (almost) none of them
    assert small_s >= small0 + 7 * layers  # ... but LoRA's rank-r (xA)(sB)^T of all 7 linears


def test_selective_policy_saves_big_matmuls_and_attention_only():
    from torch.utils.checkpoint import CheckpointPolicy

    policy = selective_checkpoint_context().args[0]
    aten = torch.ops.aten
    x, lora_a_out = torch.empty(8, 512), torch.empty(8, 4)
    assert policy(None, aten.mm.default, x, torch.empty(512, 64)) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.addmm.default, torch.empty(8, 64), lora_a_out, torch.empty(4, 64)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, aten.addmm.default, torch.empty(64), x, torch.empty(512, 64)) == CheckpointPolicy.MUST_SAVE
    assert policy(None, aten.mul.Tensor, x, x) == CheckpointPolicy.PREFER_RECOMPUTE
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert policy(None, sdpa, x, x, x) == CheckpointPolicy.MUST_SAVE


def test_right_padded_mask_is_dropped_other_masks_are_used():
    model = _model().eval()
    ids, attn, lmask = _batch()
    with torch.no_grad():
        lp = sequence_logprobs(model, ids, attn, lmask)
        ref = []  # each row alone, unpadded
        for i in range(ids.shape[0]):
            L = int(attn[i].sum())
            ref.append(sequence_logprobs(model, ids[i : i + 1, :L], attn[i : i + 1, :L], lmask[i : i + 1, :L]))
        assert torch.allclose(lp, torch.cat(ref), atol=1e-5)
        left = torch.flip(attn, [1])  # a left-padded mask must reach the model: compare with its own forward
        lflip = torch.flip(lmask, [1])
        got = sequence_logprobs(model, ids, left, lflip)
        full = torch.log_softmax(model(input_ids=ids, attention_mask=left).logits.float(), -1)[:, :-1]
        want = full.gather(2, ids[:, 1:, None]).squeeze(2)[lflip[:, 1:] > 0]
        assert torch.allclose(got, want, atol=1e-5)


def test_new_settings_validate():
    with pytest.raises(ValueError, match="checkpoint_policy"):
        GRPOSettings(checkpoint_policy="some")
    with pytest.raises(ValueError, match="rollout_fast"):
        GRPOSettings(rollout_fast="maybe")
    with pytest.raises(ValueError, match="checkpoint policy"):
        set_activation_checkpointing(causal_lm_of(_model()), True, "some")


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gpu_fused_bf16_update_matches_float32_within_bf16_tolerance(compiled):
    batch = [t.cuda() for t in _batch(lengths=(200, 150, 90))]
    ref_model = _model(seed=3).cuda()  # float32 backbone: the reference
    ref = _loss_and_grads(ref_model, *batch)
    model = _model(seed=3).cuda()
    for n, p in model.named_parameters():  # a bf16 backbone with float32 adapters (what the trainer builds)
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)
    set_fused_update_kernels(causal_lm_of(model), True)
    set_activation_checkpointing(causal_lm_of(model), True, "selective", compile=compiled)
    out = _loss_and_grads(model, *batch)
    assert all(g.dtype == torch.float32 for g in out[2].values())
    for k, g in ref[2].items():
        assert (out[2][k] - g).norm() <= 0.05 * g.norm() + 1e-6, k


@pytest.mark.parametrize("policy", ["full", pytest.param("selective", marks=pytest.mark.slow), pytest.param("off", marks=pytest.mark.slow)])
def test_compiled_layers_give_the_same_loss_and_gradients(policy):
    """Every decoder layer through one compiled function, checkpointing (if on) inside it: loss,
    log-probs and adapter gradients equal the eager fused path; transformers' own checkpointing
    stays off; compile=False restores the eager layers."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    torch._dynamo.reset()
    model = _model()
    lm = causal_lm_of(model)
    set_fused_update_kernels(lm, True)
    batch = _batch()
    ref = _loss_and_grads(model, *batch)
    set_activation_checkpointing(lm, policy != "off", "full" if policy == "off" else policy, compile=True)
    layers = [m for m in lm.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and all("forward" in m.__dict__ and not m.gradient_checkpointing for m in layers)
    _close(ref, _loss_and_grads(model, *batch), tol=1e-5)
    set_activation_checkpointing(lm, False)
    assert all("forward" not in m.__dict__ for m in layers)
    _close(ref, _loss_and_grads(model, *batch), tol=1e-6)


def test_trainer_compile_update_installs_compiled_layers(tmp_path):
    """grpo.compile_update: the trainer's decoder layers run through the compiled wrapper, with the
    configured checkpoint policy inside it (compilation itself happens at the first forward)."""
    from tracekit.rl.toy import KeywordSuite, tiny_tokenizer
    from tracekit.rl.trainer import GRPOTrainer

    tok = tiny_tokenizer()
    s = GRPOSettings(compile_update=True, gradient_checkpointing=True, checkpoint_policy="full", lora=LoraSettings(rank=4, alpha=8))
    tr = GRPOTrainer(tiny_model(len(tok), seed=0), tok, KeywordSuite(), s, tmp_path, device="cpu")
    layers = list(causal_lm_of(tr.model).model.layers)
    assert all("forward" in m.__dict__ and m._tracekit_ckpt == {"use_reentrant": False} and not m.gradient_checkpointing for m in layers)
