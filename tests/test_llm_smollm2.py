"""The bundled SmolLM2-135M-Instruct through HFChatClient (slow: real weights, CPU)."""

from __future__ import annotations

import jsonschema
import pytest
import torch

from tracekit.llm.backbones import count_parameters, gguf_path, load_backbone
from tracekit.llm.base import ChatRequest
from tracekit.llm.hf import HFChatClient
from tracekit.types import Message

pytestmark = pytest.mark.slow

RETAIL_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "find_user_id_by_email",
            "description": "Find user id by email.",
            "parameters": {
                "type": "object",
                "properties": {"email": {"type": "string", "description": "The email of the user"}},
                "required": ["email"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_order_details",
            "description": "Get the status and details of an order.",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string", "description": "The order id, such as '#W0000000'."}},
                "required": ["order_id"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in RETAIL_TOOLS}


@pytest.fixture(scope="module")
def smol():
    return load_backbone("smollm2_135m")


def _ask(text: str, **kw) -> ChatRequest:
    system = "You are a retail customer service agent. Use the tools to look up users and orders."
    return ChatRequest(
        messages=[Message(role="system", content=system), Message(role="user", content=text)],
        tools=RETAIL_TOOLS,
        **kw,
    )


def test_export_is_exact_and_offline(smol):
    from transformers import AutoModelForCausalLM

    model, tok = smol
    assert type(model).__name__ == "LlamaForCausalLM" and count_parameters(model) == 134_515_008
    path = gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)  # dequantized once, saved losslessly


def test_generation_with_tools(smol):
    model, tok = smol
    client = HFChatClient(model, tok, chat_format="smollm2")
    (resp,) = client.chat([_ask("My email is ann@example.com, where is my order?", max_new_tokens=48, return_tokens=True)])
    assert resp.finish_reason in ("stop", "length") and resp.text.strip()
    assert resp.message.role == "assistant"
    assert resp.message.tool_calls or resp.message.content  # text, calls, or text with a recorded parse error
    assert client.count_tokens(_ask("x").messages, RETAIL_TOOLS) > 200


def test_batched_equals_unbatched_on_smollm2(smol):
    model, tok = smol
    reqs = [
        _ask("Where is order #W2378156?", max_new_tokens=16),
        _ask("Find me, my email is bob@x.com", max_new_tokens=16, temperature=1.0, seed=3),
        ChatRequest(messages=[Message(role="user", content="Say hello in French.")], max_new_tokens=12),
        ChatRequest(messages=[Message(role="user", content="Count to five.")], max_new_tokens=12, temperature=0.7, seed=9),
    ]
    one = HFChatClient(model, tok, chat_format="smollm2", max_batch_size=1).chat(reqs)
    many = HFChatClient(model, tok, chat_format="smollm2", max_batch_size=4).chat(reqs)
    assert [r.text for r in one] == [r.text for r in many]


def test_constrained_decoding_on_smollm2(smol):
    model, tok = smol
    prompts = ["My email is ann@example.com. Can you find my account?", "What is the status of order #W2378156?"]
    required = HFChatClient(model, tok, chat_format="smollm2", constrained_tool_calls=True, tool_choice="required")
    for resp in required.chat([_ask(p, max_new_tokens=64) for p in prompts]):
        assert resp.finish_reason == "stop" and resp.message.parse_error is None, resp.text
        (call,) = resp.message.tool_calls
        jsonschema.validate(call.arguments, SCHEMAS[call.name])
    auto = HFChatClient(model, tok, chat_format="smollm2", constrained_tool_calls=True, tool_choice="auto")
    for resp in auto.chat([_ask(p, max_new_tokens=64, temperature=1.0, seed=s) for s, p in enumerate(prompts * 2)]):
        assert resp.message.parse_error is None or resp.finish_reason == "length", resp.text
        for call in resp.message.tool_calls:
            jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_tau2_airline_prompt_fits_and_prefills(smol):
    from tracekit.llm.bench import tau2_agent_prompt

    model, tok = smol
    messages, tools = tau2_agent_prompt("airline")
    client = HFChatClient(model, tok, chat_format="smollm2")
    n = client.count_tokens(messages, tools)
    assert 3000 < n < model.config.max_position_embeddings
    (resp,) = client.chat([ChatRequest(messages=messages, tools=tools, max_new_tokens=2, return_tokens=True)])
    assert len(resp.prompt_token_ids) == n and len(resp.completion_token_ids) >= 1


def test_lora_moe_fast_decoding_equals_plain_on_smollm2(smol, tmp_path):
    """A LoRA-MoE over two random adapters (every projection) on SmolLM2: the fast decoder (gates and bank in the
    layer step, prefix reuse across turns) gives the plain hooked path's tokens, log-probs within float32 rounding."""
    from peft import LoraConfig, get_peft_model

    from tracekit.moe.model import MoEConfig, build_lora_moe

    _, tok = smol
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {}
    for i in range(2):
        model = get_peft_model(load_backbone("smollm2_135m")[0], LoraConfig(r=8, lora_alpha=16, target_modules=targets))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        model.save_pretrained(tmp_path / f"ad{i}")
        adapters[f"cap{i}"] = tmp_path / f"ad{i}"
    moe = build_lora_moe(load_backbone("smollm2_135m")[0], adapters, MoEConfig(gate_init_std=0.5, seed=1)).eval()
    fast = HFChatClient(moe, tok, chat_format="smollm2", fast="on", prefix_cache_mib=256)
    plain = HFChatClient(moe, tok, chat_format="smollm2", fast="off")
    first = [_ask("Where is order #W2378156?", max_new_tokens=16, return_tokens=True),
             _ask("Find me, my email is bob@x.com", max_new_tokens=16, temperature=1.0, seed=3, return_tokens=True)]
    for reqs in (first, [ChatRequest(messages=r.messages + [Message(role="assistant", content="Let me check."),
                                                             Message(role="user", content="Thanks.")],
                                     tools=RETAIL_TOOLS, max_new_tokens=12, return_tokens=True) for r in first]):
        a, b = fast.chat(reqs), plain.chat(reqs)
        assert [r.completion_token_ids for r in a] == [r.completion_token_ids for r in b]
        for x, y in zip(a, b):
            assert torch.allclose(torch.tensor(x.completion_logprobs), torch.tensor(y.completion_logprobs), atol=1e-4)
    counts = fast.clear_prefix_cache()
    assert counts["prefilled_tokens"] < counts["prompt_tokens"] / 2  # the shared system prompt and tools, the first turn
