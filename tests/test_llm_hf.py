"""HFChatClient on the tiny random backbone: batching invariance, seeds, log-probs, stopping, peft,
and constrained tool-call decoding."""

from __future__ import annotations

import math

import jsonschema
import numpy as np
import pytest
import torch

from tracekit.llm import make_client
from tracekit.llm.backbones import load_backbone
from tracekit.llm.base import ChatRequest
from tracekit.llm.constrained import ToolCallGrammar, structural_tag
from tracekit.llm.hf import HFChatClient, pick_token
from tracekit.llm.tools import parse_assistant_text
from tracekit.types import Message

SCHEMA_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_mode",
            "description": "Switch the mode",
            "parameters": {
                "type": "object",
                "properties": {
                    "mode": {"type": "string", "enum": ["fast", "slow"]},
                    "level": {"type": "integer", "minimum": 0, "maximum": 99},
                    "note": {"type": "string", "maxLength": 6},
                    "flag": {"type": "boolean"},
                },
                "required": ["mode", "level"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "book",
            "description": "Book seats",
            "parameters": {
                "$defs": {
                    "Pax": {
                        "type": "object",
                        "properties": {
                            "first": {"type": "string", "maxLength": 5},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        },
                        "required": ["first", "age"],
                    }
                },
                "type": "object",
                "properties": {
                    "pax": {"type": "array", "items": {"$ref": "#/$defs/Pax"}, "minItems": 1, "maxItems": 2},
                    "cabin": {"type": "string", "enum": ["economy", "business"]},
                },
                "required": ["pax", "cabin"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in SCHEMA_TOOLS}


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny")


def _requests(tools=None) -> list[ChatRequest]:
    """Mixed prompt lengths, decoding settings and lengths (so rows finish at different steps)."""
    settings = [(0.0, 1.0), (1.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.0, 1.0), (1.3, 0.95)]
    return [
        ChatRequest(
            messages=[Message(role="system", content="Be brief."), Message(role="user", content="hello " * (2 + 9 * i))],
            tools=tools if i % 2 else None,
            temperature=t,
            top_p=p,
            seed=100 + i,
            max_new_tokens=6 + 4 * i,
            return_tokens=True,
        )
        for i, (t, p) in enumerate(settings)
    ]


class FixedU:
    """Stands in for a numpy Generator: ``random()`` returns the given uniforms in turn."""

    def __init__(self, *us: float):
        self.us = list(us)

    def random(self) -> float:
        return self.us.pop(0)


def test_pick_token_hand_computed():
    logits = np.log(np.array([1.0, 2.0, 3.0, 4.0]))  # p = [.1, .2, .3, .4]
    assert pick_token(logits.copy(), 0.0, 1.0, None) == (3, pytest.approx(math.log(0.4)))
    # inverse CDF: cdf = [.1, .3, .6, 1.]; u = .35 falls in token 2's interval [.3, .6)
    assert pick_token(logits.copy(), 1.0, 1.0, FixedU(0.35)) == (2, pytest.approx(math.log(0.3)))
    assert pick_token(logits.copy(), 1.0, 1.0, FixedU(0.3))[0] == 2  # right-closed: u on a boundary goes up
    # T = 2: p ∝ sqrt([1, 2, 3, 4])
    z = np.sqrt([1.0, 2.0, 3.0, 4.0])
    assert pick_token(logits.copy(), 2.0, 1.0, FixedU(0.0)) == (0, pytest.approx(math.log(z[0] / z.sum())))
    # top_p = .5: keep {3, 2} (mass before 2 is .4 < .5), renormalised to [3/7, 4/7]
    assert pick_token(logits.copy(), 1.0, 0.5, FixedU(0.2)) == (2, pytest.approx(math.log(3 / 7)))
    assert pick_token(logits.copy(), 1.0, 0.5, FixedU(0.5)) == (3, pytest.approx(math.log(4 / 7)))
    assert pick_token(logits.copy(), 1.0, 0.3, FixedU(0.99)) == (3, pytest.approx(0.0))  # only the top token


def test_generation_with_tools_on_tiny(tiny):
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="qwen3")
    req = ChatRequest(
        messages=[Message(role="user", content="Set fast mode.")], tools=SCHEMA_TOOLS, max_new_tokens=12, return_tokens=True
    )
    (resp,) = client.chat([req])
    assert resp.message.role == "assistant"
    assert resp.finish_reason in ("stop", "length")
    assert resp.usage == {"prompt_tokens": len(resp.prompt_token_ids), "completion_tokens": len(resp.completion_token_ids)}
    assert client.count_tokens(req.messages, req.tools) == len(resp.prompt_token_ids)
    assert "set_mode" in tok.decode(resp.prompt_token_ids)  # the tool schema is in the prompt
    assert len(resp.completion_logprobs) == len(resp.completion_token_ids) <= 12
    if resp.finish_reason == "length":
        assert len(resp.completion_token_ids) == 12
    assert tok.decode(resp.completion_token_ids) == resp.text


@pytest.mark.parametrize("prefill_chunk", [1024, 48])
def test_batched_equals_unbatched(tiny, prefill_chunk):
    model, tok = tiny
    reqs = _requests(SCHEMA_TOOLS)
    one = HFChatClient(model, tok, max_batch_size=1, prefill_chunk=prefill_chunk).chat(reqs)
    many = HFChatClient(model, tok, max_batch_size=8, prefill_chunk=prefill_chunk).chat(reqs)
    pairs = HFChatClient(model, tok, max_batch_size=2).chat(list(reversed(reqs)))[::-1]
    for a, b, c, r in zip(one, many, pairs, reqs):
        assert a.completion_token_ids == b.completion_token_ids == c.completion_token_ids
        assert len(a.completion_token_ids) == r.max_new_tokens  # random weights: no EOS in so few steps
        np.testing.assert_allclose(a.completion_logprobs, b.completion_logprobs, atol=1e-5)
        assert a.text == b.text and a.message == b.message


def test_seeds_control_sampling(tiny):
    model, tok = tiny
    msgs = [Message(role="user", content="Tell me a story.")]
    client = HFChatClient(model, tok)
    out = client.chat([ChatRequest(messages=msgs, temperature=1.0, seed=s, max_new_tokens=10) for s in (1, 1, 2)])
    assert out[0].text == out[1].text != out[2].text
    # seed=None: derived from the client seed and a running request number
    unseeded = [ChatRequest(messages=msgs, temperature=1.0, max_new_tokens=10) for _ in range(2)]
    a = HFChatClient(model, tok, seed=5).chat(unseeded)
    b = HFChatClient(model, tok, seed=5).chat(unseeded)
    assert [r.text for r in a] == [r.text for r in b] and a[0].text != a[1].text


def _nucleus_logp(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    z = logits / (temperature if temperature > 0 else 1.0)
    logp = z - (z.max() + np.log(np.exp(z - z.max()).sum()))
    if temperature > 0 and top_p < 1:
        p = np.exp(logp)
        order = np.argsort(-p, kind="stable")
        keep = order[(np.cumsum(p[order]) - p[order]) < top_p]
        out = np.full_like(logp, -np.inf)
        out[keep] = logp[keep] - np.log(p[keep].sum())
        return out
    return logp


def test_logprobs_match_a_full_forward_rescoring(tiny):
    model, tok = tiny
    for resp, req in zip(HFChatClient(model, tok, max_batch_size=8).chat(_requests()), _requests()):
        ids = torch.tensor([resp.prompt_token_ids + resp.completion_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0].double().numpy()
        start = len(resp.prompt_token_ids) - 1
        expected = [
            _nucleus_logp(logits[start + k], req.temperature, req.top_p)[t] for k, t in enumerate(resp.completion_token_ids)
        ]
        np.testing.assert_allclose(resp.completion_logprobs, expected, atol=1e-4)
        if req.temperature == 0:  # greedy picked the argmax of the rescored logits
            assert resp.completion_token_ids == [int(np.argmax(logits[start + k])) for k in range(len(expected))]


def test_eos_ends_a_row_and_is_not_in_the_text(tiny):
    model, tok = tiny
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    def force_eos(module, inputs, output):
        output[..., eos] += 1e4
        return output

    handle = model.lm_head.register_forward_hook(force_eos)
    try:
        (resp,) = HFChatClient(model, tok).chat(
            [ChatRequest(messages=[Message(role="user", content="hi")], max_new_tokens=20, return_tokens=True)]
        )
    finally:
        handle.remove()
    assert resp.completion_token_ids == [eos] and resp.text == "" and resp.finish_reason == "stop"
    assert resp.message == Message(role="assistant", content=None)


def test_peft_model_generates_like_its_base_at_init(tiny):
    from peft import LoraConfig, get_peft_model

    model, tok = tiny
    base_out = HFChatClient(model, tok).chat(_requests()[:2])
    peft_model = get_peft_model(
        load_backbone("tiny")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )
    peft_model.train()
    lora_out = HFChatClient(peft_model, tok).chat(_requests()[:2])
    assert peft_model.training  # the client restores the caller's mode
    assert [r.completion_token_ids for r in lora_out] == [r.completion_token_ids for r in base_out]  # LoRA B = 0


def test_make_client_hf():
    client = make_client({"kind": "hf", "backbone": "tiny", "max_batch_size": 2, "constrained_tool_calls": False})
    assert isinstance(client, HFChatClient) and client.chat_format == "qwen3" and client.max_batch_size == 2
    with pytest.raises(KeyError, match="unknown keys"):
        make_client({"kind": "hf", "backbone": "tiny", "batch": 2})
    with pytest.raises(ValueError, match="kind must be"):
        make_client({"kind": "vllm"})


# -- constrained tool-call decoding -----------------------------------------------------------------


def _validate(call) -> None:
    assert call.name in SCHEMAS
    jsonschema.validate(call.arguments, SCHEMAS[call.name])


@pytest.mark.parametrize("chat_format", ["qwen3", "smollm2", "qwen3_xml"])
def test_constrained_required_calls_always_parse_and_validate(tiny, chat_format):
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format=chat_format, constrained_tool_calls=True, tool_choice="required")
    reqs = [
        ChatRequest(
            messages=[Message(role="user", content="Book two seats.")],
            tools=SCHEMA_TOOLS,
            temperature=1.0,
            seed=s,
            max_new_tokens=200,
            return_tokens=True,
        )
        for s in range(8)
    ]
    eos = set(client.stop_ids)
    names = set()
    for resp in client.chat(reqs):
        assert resp.finish_reason == "stop", resp.text
        assert resp.message.parse_error is None, resp.text
        (call,) = resp.message.tool_calls
        _validate(call)
        names.add(call.name)
        assert resp.text.endswith("</tool_call>") and resp.completion_token_ids[-1] not in eos  # stopped at the tag
    assert names == set(SCHEMAS)  # the grammar lets the model pick either tool


@pytest.mark.parametrize("chat_format", ["qwen3", "smollm2", "qwen3_xml"])
def test_constrained_auto_mode_after_trigger_is_valid(tiny, chat_format):
    """In ``auto`` mode text is free; once ``<tool_call>`` is written the call must complete validly."""
    _, tok = tiny
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    grammar = ToolCallGrammar(tok, len(tok), [eos])
    rng = np.random.default_rng(0)
    for trial in range(6):
        matcher = grammar.matcher(SCHEMA_TOOLS, chat_format, "auto")
        prefix = "Sure, one moment. <tool_call>"
        assert matcher.accept_string(prefix)
        tokens = []
        for _ in range(300):
            logits = rng.standard_normal(len(tok))
            grammar.mask_(matcher, logits)
            token, _ = pick_token(logits, 1.0, 1.0, rng)
            assert matcher.accept_token(token)
            if token == eos:
                break
            tokens.append(token)
        assert matcher.is_terminated()
        message = parse_assistant_text(prefix + tok.decode(tokens), chat_format, tools=SCHEMA_TOOLS)
        assert message.parse_error is None and message.content == "Sure, one moment."
        (call,) = message.tool_calls
        _validate(call)
    # plain text may end at EOS in auto mode, but not in required mode
    for choice, allowed in (("auto", True), ("required", False)):
        matcher = grammar.matcher(SCHEMA_TOOLS, "qwen3", choice)
        assert matcher.accept_string("Hello") is allowed
        if allowed:
            logits = np.zeros(len(tok))
            grammar.mask_(matcher, logits)
            assert np.isfinite(logits[eos])


def test_structural_tag_shapes_and_errors():
    tag = structural_tag(SCHEMA_TOOLS, "qwen3", "auto")["format"]
    assert tag["type"] == "triggered_tags" and tag["stop_after_first"]
    assert [t["begin"] for t in tag["tags"]] == [
        '<tool_call>\n{"name": "set_mode", "arguments": ',
        '<tool_call>\n{"name": "book", "arguments": ',
    ]
    req = structural_tag(SCHEMA_TOOLS[:1], "smollm2", "required")["format"]
    assert req["type"] == "tag" and req["end"] == "}]</tool_call>"
    assert structural_tag(SCHEMA_TOOLS, "qwen3_xml", "required")["format"]["elements"][0]["content"]["style"] == "qwen_xml"
    with pytest.raises(ValueError, match="at least one tool"):
        structural_tag([], "qwen3")
    with pytest.raises(ValueError, match="tool_choice"):
        structural_tag(SCHEMA_TOOLS, "qwen3", "any")


def test_response_format_json_schema_constrains_the_whole_output(tiny):
    import json

    model, tok = tiny
    schema = SCHEMAS["set_mode"]
    fmt = {"type": "json_schema", "json_schema": {"name": "mode", "schema": schema}}
    client = HFChatClient(model, tok)  # no tool constraints needed: response_format alone switches the grammar on
    reqs = [
        ChatRequest(messages=[Message(role="user", content="mode?")], temperature=1.0, seed=s, max_new_tokens=80, response_format=fmt)
        for s in range(4)
    ]
    for resp in client.chat(reqs):
        assert resp.finish_reason == "stop", resp.text
        jsonschema.validate(json.loads(resp.text), schema)
        assert resp.text.startswith('{"mode": ')  # canonical separators, no stray whitespace
    with pytest.raises(ValueError, match="json_object or json_schema"):
        client.chat([ChatRequest(messages=reqs[0].messages, response_format={"type": "yaml"})])


_SHRINK = {
    "vocab_size": 49152,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@pytest.mark.parametrize(
    "name,extra",
    [
        ("qwen3_30b_a3b", {"num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
        (
            "qwen3_6_27b",  # hybrid Gated-DeltaNet cache: rows cannot be pruned, the loop keeps them
            {
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
            },
        ),
    ],
)
def test_paper_architectures_shrunk_generate_batch_invariantly(tiny, name, extra):
    from tracekit.llm.backbones import build_model_from_arch, get_spec

    _, tok = tiny
    spec = get_spec({"name": name, "dtype": "float32", "arch": {**_SHRINK, **extra}})
    model = build_model_from_arch(spec, device="cpu", seed=0)
    reqs = _requests()[:4]
    one = HFChatClient(model, tok, max_batch_size=1).chat(reqs)
    many = HFChatClient(model, tok, max_batch_size=4).chat(reqs)
    assert [r.completion_token_ids for r in one] == [r.completion_token_ids for r in many]
    np.testing.assert_allclose(one[1].completion_logprobs, many[1].completion_logprobs, atol=1e-5)


def test_context_cap_ends_rows_with_length(tiny):
    model, tok = tiny
    client = HFChatClient(model, tok)
    assert client.max_context_tokens == model.config.max_position_embeddings  # default cap
    msgs = [Message(role="user", content="hello there")]
    n = client.count_tokens(msgs)
    capped = HFChatClient(model, tok, max_context_tokens=n + 3)
    full, none = capped.chat(
        [ChatRequest(messages=msgs, max_new_tokens=50, return_tokens=True), ChatRequest(messages=msgs * 3, max_new_tokens=50)]
    )
    assert full.finish_reason == "length" and len(full.completion_token_ids) == 3
    assert none.finish_reason == "length" and none.usage["completion_tokens"] == 0 and none.text == ""


# -- memory: the decoder's working copy, one model at a time ------------------------------------------


def test_refresh_and_release_after_a_weight_update_decode_the_new_weights(tiny):
    """``refresh`` (a GRPO client engine's sync) re-merges a working copy built inside ``chat``'s inference
    mode; ``release`` drops it and the next chat rebuilds it: both decode as a fresh client does."""
    from peft import LoraConfig, get_peft_model

    _, tok = tiny
    model = get_peft_model(load_backbone("tiny")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    client = HFChatClient(model, tok)
    client.chat(_requests()[:2])
    assert client._decoder is not None  # the fast path: a merged working copy
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    want = [r.completion_token_ids for r in HFChatClient(model, tok).chat(_requests()[:3])]
    client.refresh()
    assert [r.completion_token_ids for r in client.chat(_requests()[:3])] == want
    client.release()
    assert client._decoder is None
    assert [r.completion_token_ids for r in client.chat(_requests()[:3])] == want
    assert client._decoder is not None


def test_load_backbone_drops_registered_model_caches_first():
    from tracekit.llm import backbones

    calls = []
    backbones.register_model_cache("test", lambda: calls.append(1) or 1)
    try:
        load_backbone("tiny")
        assert calls == [1]
        with backbones.keeping_cached_models():  # a cache filling itself keeps its siblings
            load_backbone("tiny")
        assert calls == [1]
        load_backbone("tiny")
        assert calls == [1, 1]
    finally:
        backbones._MODEL_CACHES.pop("test")


def test_stage_clients_are_dropped_when_a_stage_loads_its_own_backbone(make_cfg):
    """The agent's cached client (the rollout stage's) leaves the cache when training loads its model;
    building a client never drops another role's."""
    from tracekit import wiring

    cfg = make_cfg("backbone=tiny", "backbone.device=cpu")
    wiring._CLIENTS.clear()
    try:
        agent = wiring.client_for(cfg, "agent")
        assert wiring.client_for(cfg, "agent") is agent and len(wiring._CLIENTS) == 1
        wiring._CLIENTS["remote"] = type("Remote", (), {"name": "openai"})()  # holds no model: kept
        load_backbone("tiny")  # e.g. the train stage's model
        assert list(wiring._CLIENTS) == ["remote"]
        assert wiring.client_for(cfg, "agent") is not agent  # built afresh when asked again
    finally:
        wiring._CLIENTS.clear()


def test_release_client_frees_one_role_and_keeps_the_others(make_cfg):
    """GEPA's reflection LM (llm=local: an in-process model beside the agent's) leaves the cache when its run ends."""
    import weakref

    from tracekit import wiring

    cfg = make_cfg("backbone=tiny", "backbone.device=cpu", "llm=local")
    wiring._CLIENTS.clear()
    try:
        agent = wiring.client_for(cfg, "agent")
        reflection = weakref.ref(wiring.client_for(cfg, "analysis").model)
        assert len(wiring._CLIENTS) == 2
        wiring.release_client(cfg, "analysis")
        assert list(wiring._CLIENTS.values()) == [agent] and reflection() is None  # its model is freed
        wiring.release_client(cfg, "analysis")  # not cached: nothing to do
    finally:
        wiring._CLIENTS.clear()
