"""The shared decoding core: merged-weight fast sessions equal the plain peft forward (greedy and
seeded sampling on CPU, bf16 tolerance on GPU), re-merging after updates, fallbacks, both clients."""

from __future__ import annotations

import pytest
import torch

from tracekit.llm.base import ChatRequest
from tracekit.llm.hf import HFChatClient
from tracekit.rl.engines import HFEngine, sample_completions
from tracekit.llm.decoding import FastDecoder, PlainSession, filter_top_p, open_session, sample_step, unsupported_reason
from tracekit.rl.settings import LoraSettings
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.model import build_peft_model
from tracekit.types import Message

PROMPTS = [list(range(5, 40)), list(range(50, 62)), [7, 8], list(range(100, 190))]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _adapted(vocab: int, seed: int = 2, **arch) -> torch.nn.Module:
    """A tiny Qwen3 with a LoRA adapter whose B is non-zero (so merging changes every projection)."""
    model = build_peft_model(tiny_model(vocab, seed=seed, **arch), LoraSettings(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


@pytest.fixture(scope="module")
def peft_model(tok):
    return _adapted(len(tok))


def _same(a, b, atol=1e-5):
    assert [c.ids for c in a] == [c.ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b):
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


def test_greedy_fast_equals_plain_with_mixed_lengths_and_stops(peft_model):
    plain = sample_completions(peft_model, PROMPTS, max_new_tokens=12, temperature=0.0)
    ids = plain[0].ids
    k = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # row 0 stops at its (k+1)-th token
    stop = ids[k]
    dec = FastDecoder(peft_model)
    plain = sample_completions(peft_model, PROMPTS, max_new_tokens=12, temperature=0.0, stop_ids=[stop])
    fast = sample_completions(dec, PROMPTS, max_new_tokens=12, temperature=0.0, stop_ids=[stop])
    _same(plain, fast)
    assert fast[0].finish_reason == "stop" and fast[0].ids[-1] == stop and len(fast[0].ids) == k + 1
    assert any(c.finish_reason == "length" for c in fast)


def test_bmm_decode_attention_equals_plain(peft_model):
    kw = dict(max_new_tokens=10, temperature=1.0, seed=3)
    _same(sample_completions(FastDecoder(peft_model, attention="bmm"), PROMPTS, **kw), sample_completions(peft_model, PROMPTS, **kw))
    with pytest.raises(ValueError, match="attention"):
        FastDecoder(peft_model, attention="flash")


def test_fast_logprobs_match_a_full_forward_of_the_adapted_model(peft_model):
    (c,) = sample_completions(FastDecoder(peft_model), [PROMPTS[1]], max_new_tokens=8, temperature=0.7, seed=4)
    x = torch.tensor([PROMPTS[1] + c.ids])
    with torch.no_grad():
        lp = torch.log_softmax(peft_model(input_ids=x).logits.float() / 0.7, -1)[0, len(PROMPTS[1]) - 1 : -1]
    assert torch.allclose(lp.gather(1, torch.tensor(c.ids)[:, None]).squeeze(1), torch.tensor(c.logprobs), atol=1e-5)


def test_seeded_sampling_is_deterministic_and_equals_plain(peft_model):
    dec = FastDecoder(peft_model)
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = sample_completions(dec, PROMPTS, seed=11, **kw)
    b = sample_completions(dec, PROMPTS, seed=11, **kw)
    c = sample_completions(dec, PROMPTS, seed=12, **kw)
    assert [x.ids for x in a] == [x.ids for x in b] and [x.ids for x in a] != [x.ids for x in c]
    _same(a, sample_completions(peft_model, PROMPTS, seed=11, **kw))


def test_merged_copy_follows_optimizer_updates(tok):
    model = _adapted(len(tok), seed=3)
    dec = FastDecoder(model)
    before = sample_completions(dec, PROMPTS, max_new_tokens=8, temperature=0.0)
    params = [p for n, p in model.named_parameters() if "lora_" in n]
    opt = torch.optim.SGD(params, lr=0.5)
    (model(input_ids=torch.tensor([PROMPTS[0]])).logits.square().mean()).backward()
    opt.step()  # in-place update: version counters move, the next session re-merges by itself
    after = sample_completions(dec, PROMPTS, max_new_tokens=8, temperature=0.0)
    _same(after, sample_completions(model, PROMPTS, max_new_tokens=8, temperature=0.0))
    assert [c.ids for c in after] != [c.ids for c in before]
    for p in params:  # a ``.data`` write bypasses version counters: refresh() is the explicit sync
        p.data.mul_(-1.0)
    stale = sample_completions(dec, PROMPTS, max_new_tokens=8, temperature=0.0)
    assert [c.ids for c in stale] == [c.ids for c in after]
    dec.refresh()
    _same(sample_completions(dec, PROMPTS, max_new_tokens=8, temperature=0.0), sample_completions(model, PROMPTS, max_new_tokens=8, temperature=0.0))


def test_disabled_adapter_merges_nothing(peft_model):
    with peft_model.disable_adapter():
        base = sample_completions(peft_model, PROMPTS, max_new_tokens=8, temperature=0.0)
        fast = sample_completions(FastDecoder(peft_model), PROMPTS, max_new_tokens=8, temperature=0.0)
    _same(base, fast)


def test_moe_mlp_runs_as_a_module_without_graphs(tok):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    dec = FastDecoder(model)
    assert not dec.cuda_graphs
    _same(sample_completions(model, PROMPTS, max_new_tokens=6, temperature=0.0), sample_completions(dec, PROMPTS, max_new_tokens=6, temperature=0.0))


def test_unsupported_models_are_named_and_hooks_fall_back(tok, peft_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    assert "model_type 'gpt2'" in unsupported_reason(gpt2)
    with pytest.raises(NotImplementedError, match="gpt2"):
        FastDecoder(gpt2)
    dec = FastDecoder(peft_model)
    head = peft_model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, o: o)
    try:
        assert "has forward hooks" in unsupported_reason(peft_model)
        assert isinstance(open_session(dec, PROMPTS, 0, 4), PlainSession)  # hooks added later: plain
    finally:
        handle.remove()
    assert not isinstance(open_session(dec, PROMPTS, 0, 4), PlainSession)


def test_sample_step_hand_computed():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    tok, lp = sample_step(logits, 0.0, 1.0, None)
    assert tok.tolist() == [2, 0]
    z0 = torch.log(torch.tensor(1 + torch.e + torch.e**2))
    assert torch.allclose(lp, torch.stack([2.0 - z0, 3.0 - torch.log(torch.tensor(torch.e**3 + 2.0))]))
    # top_p 0.5 keeps only the most likely token of row 0 (p = 0.665 >= 0.5)
    kept = filter_top_p(logits[:1], 0.5)
    assert torch.isinf(kept[0, :2]).all() and kept[0, 2] == 2.0


def test_hf_chat_client_fast_equals_plain(tok, peft_model):
    reqs = [
        ChatRequest(
            messages=[Message(role="user", content="hello " * (1 + 5 * i))],
            temperature=t,
            seed=7 + i,
            max_new_tokens=5 + 3 * i,
            return_tokens=True,
        )
        for i, t in enumerate([0.0, 1.0, 0.7])
    ]
    fast = HFChatClient(peft_model, tok, max_batch_size=3, fast="on").chat(reqs)
    plain = HFChatClient(peft_model, tok, max_batch_size=3, fast="off").chat(reqs)
    assert [r.completion_token_ids for r in fast] == [r.completion_token_ids for r in plain]
    for a, b in zip(fast, plain):
        assert torch.allclose(torch.tensor(a.completion_logprobs), torch.tensor(b.completion_logprobs), atol=1e-5)


def test_hf_engine_modes(tok, peft_model):
    from transformers import GPT2Config, GPT2LMHeadModel

    eng = HFEngine(peft_model, tok, fast="auto")
    assert eng.decoder is not None
    assert HFEngine(peft_model, tok, fast="off").decoder is None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(NotImplementedError, match="rollout_fast=on"):
        HFEngine(gpt2, tok, fast="on")
    with pytest.raises(ValueError, match="fast=.yes. is invalid: must be one of auto, on, off"):
        HFEngine(peft_model, tok, fast="yes")
    compiled = HFEngine(peft_model, tok, compile_layers=True).decoder  # grpo.rollout_compile
    assert compiled.compiled is not None and compiled.attention == "bmm" and eng.decoder.compiled is None
    with pytest.raises(NotImplementedError, match="rollout_compile needs fast decoding"):
        HFEngine(peft_model, tok, fast="off", compile_layers=True)


def _forced(engine, prompts, forced, pad: int = 0) -> torch.Tensor:
    """Teacher-forced log-probs [B, n] of ``forced`` continuations through a session of ``engine``."""
    n = len(forced[0])
    sess = open_session(engine, prompts, pad, n)
    logits, out = sess.prefill(), []
    for t in range(n):
        tok = torch.tensor([f[t] for f in forced], device=logits.device)
        out.append(torch.log_softmax(logits.float(), -1).gather(1, tok[:, None]).squeeze(1).cpu())
        if t + 1 < n:
            logits = sess.step(tok, torch.ones(len(prompts), dtype=torch.bool))
    return torch.stack(out, 1)


def _check_against_float32(tok, device: str, dtype: torch.dtype, compiled: tuple[bool, ...] = (False,)) -> dict[str, float]:
    """Fast decoding (each attention, graphs on/off, each of ``compiled``) vs the plain path, both
    teacher-forced along the plain path's greedy tokens, against a float32 full-forward reference.
    -> max errors by path."""
    model = _adapted(len(tok), seed=5, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, head_dim=32)
    ref_model = model.to(device)
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 130, 64, 1, 90)]
    n = 24
    with torch.no_grad():
        ref = []
        forced = [c.ids for c in sample_completions(ref_model, prompts, max_new_tokens=n, temperature=0.0)]
        for p, f in zip(prompts, forced):
            x = torch.tensor([p + f], device=device)
            lp = torch.log_softmax(ref_model(input_ids=x).logits.float(), -1)[0, len(p) - 1 : -1]
            ref.append(lp.gather(1, torch.tensor(f, device=device)[:, None]).squeeze(1).cpu())
        ref = torch.stack(ref)
        model = ref_model.to(dtype)  # the model under test (float32 stays the same object on CPU)
        errs = {"plain": (_forced(model, prompts, forced) - ref).abs().max().item()}
        for attention in ("sdpa", "bmm"):
            for graphs in (True, False):
                for comp in compiled:
                    dec = FastDecoder(model, attention=attention, cuda_graphs=graphs, compile_layers=comp)
                    errs[f"{attention}/graphs={dec.cuda_graphs}/compiled={comp}"] = (_forced(dec, prompts, forced) - ref).abs().max().item()
    return errs


def test_teacher_forced_fast_paths_match_float32_on_cpu(tok):
    errs = _check_against_float32(tok, "cpu", torch.float32)
    assert all(e < 1e-4 for e in errs.values()), errs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fast_paths_within_bf16_tolerance(tok):
    errs = _check_against_float32(tok, "cuda", torch.bfloat16, compiled=(False, True))
    assert "sdpa/graphs=True/compiled=True" in errs and errs["plain"] > 0, errs
    for k, e in errs.items():  # bf16 weights/activations: as far from float32 as the plain bf16 path
        assert e <= 2 * errs["plain"] + 0.02, errs


def test_compiled_decode_layers_equal_eager_with_one_artifact_for_all_layers(tok):
    """compile_layers: same greedy tokens and log-probs as the uncompiled core; the layers share the
    compiled artifact (graphs: one static, then one dynamic in the attended length, whatever the
    layer count), and a repeat compiles nothing."""
    from torch._dynamo.utils import counters

    model = _adapted(len(tok), num_hidden_layers=3)
    kw = dict(max_new_tokens=6, temperature=0.0)
    ref = sample_completions(FastDecoder(model), PROMPTS, **kw)
    torch._dynamo.reset()
    counters.clear()
    dec = FastDecoder(model, compile_layers=True)
    _same(ref, sample_completions(dec, PROMPTS, **kw), atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    assert dec.compiled is not None and 1 <= graphs <= 2, dict(counters["stats"])
    _same(ref, sample_completions(dec, PROMPTS, **kw), atol=1e-5)
    assert counters["stats"]["unique_graphs"] == graphs
    with pytest.raises(NotImplementedError, match="compile_layers needs dense MLPs"):
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2)  # fmt: skip
        FastDecoder(Qwen3MoeForCausalLM(cfg), compile_layers=True)


def test_compile_backend_failure_falls_back_to_eager(tok, monkeypatch, caplog):
    """No working C++ compiler for inductor's CPU code: decoding and the update run uncompiled, logged."""
    import torch._inductor.config as inductor_config

    from tracekit.llm.decoding import causal_lm_of
    from tracekit.rl.model import sequence_logprobs, set_activation_checkpointing

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "/nonexistent/c++"))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)  # a cached artifact would need no compiler
    torch._dynamo.reset()
    model = _adapted(len(tok), num_hidden_layers=2)  # the failure in layer 0 switches layer 1 off too
    kw = dict(max_new_tokens=3, temperature=0.0)
    ref = sample_completions(FastDecoder(model), PROMPTS[:2], **kw)
    dec = FastDecoder(model, compile_layers=True)
    with caplog.at_level("WARNING"):
        _same(ref, sample_completions(dec, PROMPTS[:2], **kw))
        assert dec.compiled is None and "decoding uncompiled" in caplog.text
        ids = torch.tensor([PROMPTS[1]])
        mask = torch.ones_like(ids)
        want = sequence_logprobs(model, ids, mask, mask)
        set_activation_checkpointing(causal_lm_of(model), False, compile=True)
        torch._dynamo.reset()
        got = sequence_logprobs(model, ids, mask, mask)
        assert "compiled layers off, running eagerly" in caplog.text
    assert torch.allclose(want, got, atol=1e-6)
    set_activation_checkpointing(causal_lm_of(model), False)
    assert all("forward" not in layer.__dict__ for layer in causal_lm_of(model).model.layers)

