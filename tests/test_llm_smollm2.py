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
