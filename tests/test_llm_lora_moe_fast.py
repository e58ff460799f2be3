"""TRACE's composed LoRA-MoE on the fast decoder (issue 30): each adapted block's gate and bank run inside the
decode loop and the prefill, no forward hooks on the hot path; the same greedy tokens as the plain (hooked) path
and log-probs within float32 rounding, under every routing spec, after gate updates and spec changes, with
prefix reuse; bf16 tolerance on the GPU (``-m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracekit.llm.base import ChatRequest
from tracekit.llm.decoding import FastDecoder, FastSession, PlainSession, generate, open_session, unsupported_reason
from tracekit.llm.hf import HFChatClient
from tracekit.moe.layer import RoutingSpec
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.types import Message

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [list(range(5, 40)), list(range(50, 62)), [7, 8], list(range(100, 190))]


def _adapters(root, backbone, ranks=(4, 2, 8), targets=ALL) -> dict:
    """Random peft adapters (A and B non-zero) of ``backbone()``'s shape saved under root."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for i, r in enumerate(ranks):
        torch.manual_seed(10 + i)
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(targets), init_lora_weights=False)
        get_peft_model(backbone(), cfg).save_pretrained(root / f"ad{i}")
        out[f"cap{i}"] = root / f"ad{i}"
    return out


def _moe(adapters, backbone, **config):
    return build_lora_moe(backbone(), adapters, MoEConfig(gate_init_std=config.pop("gate_init_std", 1.0), seed=3, **config)).eval()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_backbone(tok):
    return lambda: tiny_model(len(tok), seed=1)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_backbone):
    return _adapters(tmp_path_factory.mktemp("ads"), tiny_backbone)


def _same(a, b, atol=1e-5):
    assert [c.ids for c in a] == [c.ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        assert np.allclose(x.logprobs, y.logprobs, atol=atol), (x.logprobs, y.logprobs)


def test_fast_lora_moe_equals_the_hooked_plain_path(adapters, tiny_backbone):
    moe = _moe(adapters, tiny_backbone)
    assert unsupported_reason(moe) is None
    dec = FastDecoder(moe)
    assert dec.applied_hooks == moe.gate_hook_ids and len(dec.applied_hooks) == 2 * len(moe.blocks)
    assert all(b is not None for b in dec.lora_moe)
    for kw in (dict(temperature=0.0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_p=0.9, seed=5)):
        _same(generate(moe, PROMPTS, max_new_tokens=12, **kw), generate(dec, PROMPTS, max_new_tokens=12, **kw))
    with torch.no_grad():  # the prompts' tokens really are split over every adapter, in every block
        moe(input_ids=torch.tensor([PROMPTS[3]]))
    assert all(len(p.argmax(-1).unique()) == 3 for p in moe.gate_probs().values())
    greedy = generate(dec, PROMPTS, max_new_tokens=12, temperature=0.0)
    base = generate(FastDecoder(tiny_backbone()), PROMPTS, max_new_tokens=12, temperature=0.0)
    assert [c.ids for c in greedy] != [c.ids for c in base]  # the banks change the policy


@pytest.mark.parametrize("config,spec", [
    (dict(), RoutingSpec(None)),  # the training mixture
    (dict(), RoutingSpec(2, renormalize=True)),
    (dict(), RoutingSpec(1, impl="masked_dense")),
    (dict(include_base_slot=True), RoutingSpec(1)),
])  # fmt: skip
def test_every_routing_spec_and_the_base_slot(adapters, tiny_backbone, config, spec):
    moe = _moe(adapters, tiny_backbone, **config)
    dec = FastDecoder(moe)
    kw = dict(max_new_tokens=10, temperature=1.0, seed=4)
    with moe.routing(spec):  # the spec changed after the decoder was built: read at each session
        _same(generate(moe, PROMPTS, **kw), generate(dec, PROMPTS, **kw))
    _same(generate(moe, PROMPTS, **kw), generate(dec, PROMPTS, **kw))  # and back


def test_partial_targets_other_architectures_and_moe_backbones(tmp_path, tok):
    """Banks on some of a fused projection's parts (q and v, not k; up only), a Llama backbone, and a Qwen3-MoE
    backbone whose attention carries the banks beside its fused-experts blocks."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

    common = dict(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    shapes = {
        "llama": (LlamaConfig(intermediate_size=96, **common), ["q_proj", "v_proj", "up_proj"]),
        "qwen3_moe": (Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                     head_dim=16, **common), ["q_proj", "k_proj", "o_proj"]),
    }  # fmt: skip
    for arch, (cfg, targets) in shapes.items():
        def backbone(cfg=cfg):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return AutoModelForCausalLM.from_config(cfg).eval()

        moe = _moe(_adapters(tmp_path / arch, backbone, ranks=(4, 8), targets=targets), backbone)
        dec = FastDecoder(moe)
        kw = dict(max_new_tokens=8, temperature=1.0, seed=2)
        _same(generate(moe, PROMPTS, **kw), generate(dec, PROMPTS, **kw))


def test_only_the_moes_own_hooks_are_bypassed(adapters, tiny_backbone):
    moe = _moe(adapters, tiny_backbone)
    dec = FastDecoder(moe)
    layer = moe.model.model.layers[1]
    handle = layer.register_forward_hook(lambda m, i, o: o)
    try:
        assert "model.model.layers.1 has forward hooks" in unsupported_reason(moe)
        assert isinstance(open_session(dec, PROMPTS, 0, 4), PlainSession)  # another hook, added later: plain
    finally:
        handle.remove()
    assert isinstance(open_session(dec, PROMPTS, 0, 4), FastSession)
    with pytest.raises(NotImplementedError, match="compile_layers with a LoRA-MoE"):
        FastDecoder(moe, compile_layers=True)
    # the backbone alone carries the gate hooks, which nothing bypasses there; without them, banks whose gate no
    # LoRAMoEModel runs: nothing would set their routing
    assert "model.layers.0 has forward hooks" in unsupported_reason(moe.model)
    for h in moe._hooks:
        h.remove()
    assert "outside a LoRAMoEModel" in unsupported_reason(moe.model)
    with pytest.raises(NotImplementedError, match="outside a LoRAMoEModel"):
        FastDecoder(moe.model)


def test_gate_updates_and_spec_changes_forget_stored_prefixes(adapters, tiny_backbone):
    moe = _moe(adapters, tiny_backbone)
    dec = FastDecoder(moe, prefix_cache_mib=64)
    system = list(range(5, 60))
    prompts = [system + [70, 71], system + [80, 81, 82], system[:40] + [90]]
    kw = dict(max_new_tokens=8, temperature=0.0)
    _same(generate(moe, prompts, **kw), generate(dec, prompts, **kw))
    assert len(dec.prefixes) == 1  # the shared system prompt, computed once
    with torch.no_grad():  # a gate update in place: another policy
        for g in moe.gates.values():
            g.weight.mul_(-1)
    dec.refresh_if_stale()
    assert len(dec.prefixes) == 0
    _same(generate(moe, prompts, **kw), generate(dec, prompts, **kw))
    with moe.routing(RoutingSpec(2)):
        dec.refresh_if_stale()
        assert len(dec.prefixes) == 0
        _same(generate(moe, prompts, **kw), generate(dec, prompts, **kw))


def test_client_turns_reuse_the_prefix_and_match_the_plain_path(adapters, tiny_backbone, tok):
    moe = _moe(adapters, tiny_backbone)
    cached, plain = HFChatClient(moe, tok, prefix_cache_mib=64), HFChatClient(moe, tok, fast="off")

    def turn(rows):
        return [ChatRequest(messages=m, temperature=t, seed=3 + i, max_new_tokens=6, return_tokens=True)
                for i, (m, t) in enumerate(zip(rows, [0.0, 1.0, 0.0]))]

    def check(a, b):
        assert [r.completion_token_ids for r in a] == [r.completion_token_ids for r in b]
        for x, y in zip(a, b):
            assert np.allclose(x.completion_logprobs, y.completion_logprobs, atol=1e-5)

    system = Message(role="system", content="You are a careful agent. " * 8)
    first = [[system, Message(role="user", content=f"request number {i} " * (1 + i))] for i in range(3)]
    a = cached.chat(turn(first))
    check(a, plain.chat(turn(first)))
    assert cached._decoder is not None and cached._decoder.lora_moe[0] is not None  # the fast path, not plain
    second = [m + [Message(role="assistant", content=r.text or "ok"), Message(role="user", content="and then?")]
              for m, r in zip(first, a)]
    store = cached._decoder.prefixes
    before = store.prompt_tokens, store.prefilled_tokens
    a2 = cached.chat(turn(second))
    check(a2, plain.chat(turn(second)))
    new_prompt, computed = store.prompt_tokens - before[0], store.prefilled_tokens - before[1]
    assert computed < new_prompt / 2  # each row continues its first turn: only the new messages are computed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_fast_lora_moe_within_tolerance(tmp_path, tok):
    """bf16 on CUDA, the decode step graph-captured or eager: teacher-forced log-probs along the plain bf16 path's
    greedy tokens, against the float32 model's, as close as the plain bf16 path's (a routing flip near a gate tie
    moves a token in either)."""
    from tracekit.llm.decoding import causal_lm_of

    arch = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=32)

    def backbone():
        return tiny_model(len(tok), seed=5, **arch)

    moe = _moe(_adapters(tmp_path, backbone, ranks=(8, 16, 8)), backbone).to("cuda")
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 130, 64, 1, 90)]
    n = 24
    with torch.no_grad():
        forced = [c.ids for c in generate(moe, prompts, max_new_tokens=n, temperature=0.0)]
        ref = []
        for p, f in zip(prompts, forced):
            x = torch.tensor([p + f], device="cuda")
            lp = torch.log_softmax(moe(input_ids=x).logits.float(), -1)[0, len(p) - 1 : -1]
            ref.append(lp.gather(1, torch.tensor(f, device="cuda")[:, None]).squeeze(1).cpu())
        ref = torch.stack(ref)
        moe = moe.to(torch.bfloat16)
        assert causal_lm_of(moe).model.layers[0].self_attn.q_proj.A3.dtype == torch.bfloat16

        def forced_lp(engine):
            sess = open_session(engine, prompts, 0, n)
            logits, out = sess.prefill(), []
            for t in range(n):
                tok_t = torch.tensor([f[t] for f in forced], device="cuda")
                out.append(torch.log_softmax(logits.float(), -1).gather(1, tok_t[:, None]).squeeze(1).cpu())
                if t + 1 < n:
                    logits = sess.step(tok_t, torch.ones(len(prompts), dtype=torch.bool))
            return torch.stack(out, 1)

        errs = {"plain": (forced_lp(moe) - ref).abs()}
        for graphs in (True, False):
            dec = FastDecoder(moe, cuda_graphs=graphs)
            assert dec.cuda_graphs == graphs
            errs[f"graphs={graphs}"] = (forced_lp(dec) - ref).abs()
    plain = errs["plain"]
    for k, e in errs.items():  # bf16: as far from float32 as the plain bf16 path, token for token in the bulk
        assert e.median() <= 2 * plain.median() + 0.01 and e.quantile(0.95) <= 2 * plain.quantile(0.95) + 0.05, \
            {k: (v.median().item(), v.quantile(0.95).item(), v.max().item()) for k, v in errs.items()}
