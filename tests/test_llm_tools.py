"""Tool-call parsing (all three formats, well-formed and malformed) and chat-template rendering."""

from __future__ import annotations

import json

import pytest

from tracekit.llm.tools import (
    encode_prompt,
    parse_assistant_text,
    render_prompt,
    strip_reasoning,
    tool_call_id,
    tool_result_message,
)
from tracekit.types import Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "description": "Look up an order",
            "parameters": {
                "type": "object",
                "properties": {"order_id": {"type": "string"}, "count": {"type": "integer"}, "ok": {"type": "boolean"}},
                "required": ["order_id"],
            },
        },
    }
]


# -- qwen3 / hermes -------------------------------------------------------------------------------


def test_qwen3_single_call_with_text_and_deterministic_id():
    text = 'Let me look.\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call>'
    m = parse_assistant_text(text, "qwen3", turn=5)
    assert m.parse_error is None
    assert m.content == "Let me look."
    assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [("call_5_0", "get_order", {"order_id": "#W1"})]
    assert parse_assistant_text(text, "qwen3", turn=5) == m  # same text, same ids


def test_qwen3_several_blocks_and_string_arguments():
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>'
    )
    m = parse_assistant_text(text, "qwen3", turn=2)
    assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [
        ("call_2_0", "a", {"x": 1}),
        ("call_2_1", "b", {"y": [1, 2]}),
    ]
    assert m.content is None


def test_raw_control_characters_in_strings_are_accepted():
    m = parse_assistant_text('<tool_call>{"name": "note", "arguments": {"text": "line1\nline2\tx"}}</tool_call>', "qwen3")
    assert m.parse_error is None and m.tool_calls[0].arguments == {"text": "line1\nline2\tx"}


def test_missing_arguments_means_empty_object():
    m = parse_assistant_text('<tool_call>{"name": "list_all_airports"}</tool_call>', "qwen3")
    assert m.tool_calls[0].arguments == {} and m.parse_error is None


def test_plain_text_has_no_calls_and_no_error():
    m = parse_assistant_text("Your order has shipped.", "qwen3")
    assert m == Message(role="assistant", content="Your order has shipped.")


def test_reasoning_is_stripped():
    text = '<think>check policy <tool_call>nonsense</think>\n<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    m = parse_assistant_text(text, "qwen3")
    assert m.parse_error is None and [c.name for c in m.tool_calls] == ["a"]
    # the prompt opened <think>: only the closing tag is generated
    assert strip_reasoning("thinking...</think>Hello") == "Hello"


# -- smollm2 --------------------------------------------------------------------------------------


def test_smollm2_list_of_calls():
    text = '<tool_call>[{"name": "a", "arguments": {"x": "1"}}, {"name": "b", "arguments": {}}]</tool_call>'
    m = parse_assistant_text(text, "smollm2", turn=3)
    assert [(c.id, c.name, c.arguments) for c in m.tool_calls] == [("call_3_0", "a", {"x": "1"}), ("call_3_1", "b", {})]


def test_smollm2_empty_list_is_no_call():
    m = parse_assistant_text("<tool_call>[]</tool_call>", "smollm2")
    assert m.tool_calls == [] and m.parse_error is None


# -- malformed -> text + parse_error, never an exception -----------------------------------------


@pytest.mark.parametrize(
    "fmt,text,needle",
    [
        ("qwen3", '<tool_call>{"name": "a", "arguments": {"x": 1}</tool_call>', "not valid JSON"),
        ("qwen3", '<tool_call>{"arguments": {"x": 1}}</tool_call>', "'name'"),
        ("qwen3", '<tool_call>{"name": "", "arguments": {}}</tool_call>', "'name'"),
        ("qwen3", '<tool_call>{"name": "a", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ("qwen3", '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>', "not JSON"),
        ("qwen3", '<tool_call>{"name": "a", "arguments": {"x": 1}}', "unclosed"),
        ("qwen3", 'ok</tool_call>', "without a matching"),
        ("smollm2", '<tool_call>[{"name": "a"}, 3]</tool_call>', "must be a JSON object"),
        ("smollm2", '<tool_call>[{"name": "a", "arguments": {}}', "unclosed"),
        ("qwen3_xml", "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</tool_call>", "<function=NAME>"),
        ("qwen3_xml", "<tool_call>\n<function=a>\nstray\n</function>\n</tool_call>", "unexpected text"),
    ],
)
def test_malformed_calls_become_text_with_parse_error(fmt, text, needle):
    m = parse_assistant_text(text, fmt, turn=1)
    assert m.role == "assistant"
    assert m.tool_calls == []
    assert m.content == text.strip()
    assert m.parse_error is not None and needle in m.parse_error


def test_one_bad_block_poisons_the_turn():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{bad}</tool_call>'
    m = parse_assistant_text(text, "qwen3")
    assert m.tool_calls == [] and "not valid JSON" in m.parse_error


def test_unknown_chat_format_is_a_clear_error():
    with pytest.raises(ValueError, match="chat_format must be one of"):
        parse_assistant_text("hi", "llama3")


# -- qwen3 xml (Qwen3.5 / Qwen3.6) ----------------------------------------------------------------


def test_qwen3_xml_typed_by_schema():
    text = (
        "I'll check.\n<tool_call>\n<function=get_order>\n<parameter=order_id>\n007\n</parameter>\n"
        "<parameter=count>\n3\n</parameter>\n<parameter=ok>\ntrue\n</parameter>\n</function>\n</tool_call>"
    )
    m = parse_assistant_text(text, "qwen3_xml", turn=4, tools=TOOLS)
    assert m.content == "I'll check."
    # order_id is a string parameter: "007" stays text; the others are JSON
    assert m.tool_calls == [ToolCall(id="call_4_0", name="get_order", arguments={"order_id": "007", "count": 3, "ok": True})]


def test_qwen3_xml_without_schema_reads_json_then_text():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n[1, 2]\n</parameter>\n<parameter=b>\nhello world\n</parameter>\n</function>\n</tool_call>"
    m = parse_assistant_text(text, "qwen3_xml")
    assert m.tool_calls[0].arguments == {"a": [1, 2], "b": "hello world"}


# -- tool results and rendering -------------------------------------------------------------------


def test_tool_result_message_serialises_like_tau2():
    call = ToolCall(id="call_3_0", name="get_order", arguments={"order_id": "#W1"})
    m = tool_result_message(call, {"status": "delivered", "items": [1]})
    assert m.role == "tool" and m.tool_call_id == "call_3_0" and m.name == "get_order" and not m.error
    assert json.loads(m.content) == {"status": "delivered", "items": [1]}
    err = tool_result_message("call_3_1", "Error: order not found", name="get_order", error=True)
    assert err.content == "Error: order not found" and err.error


@pytest.fixture(scope="module")
def tokenizers():
    from tracekit.llm.backbones import bundled_tokenizer

    return {fmt: bundled_tokenizer(fmt) for fmt in ("qwen3", "smollm2")}


def _conversation() -> list[Message]:
    call = ToolCall(id=tool_call_id(2, 0), name="get_order", arguments={"order_id": "#W1"})
    return [
        Message(role="system", content="Follow the policy."),
        Message(role="user", content="Where is #W1?"),
        Message(role="assistant", tool_calls=[call]),
        tool_result_message(call, {"status": "delivered"}),
    ]


def test_qwen3_template_renders_tools_calls_and_results(tokenizers):
    text = render_prompt(tokenizers["qwen3"], _conversation(), TOOLS)
    assert text.startswith("<|im_start|>system\nFollow the policy.\n\n# Tools\n")
    assert json.dumps(TOOLS[0]) in text  # the schema verbatim, one per line inside <tools>
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W1"}}\n</tool_call><|im_end|>' in text
    assert '<|im_start|>user\n<tool_response>\n{"status": "delivered"}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")
    # the rendered call parses back to the same call
    block = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_assistant_text(block, "qwen3", turn=2).tool_calls == _conversation()[2].tool_calls


def test_smollm2_template_renders_tools_calls_and_results(tokenizers):
    text = render_prompt(tokenizers["smollm2"], _conversation(), TOOLS)
    assert "<tools>[" + json.dumps(TOOLS[0]["function"]) + "]</tools>" in text
    assert '<tool_call>[{"name": "get_order", "arguments": {"order_id": "#W1"}}]</tool_call><|im_end|>' in text
    assert '<|im_start|>tool\n{"status": "delivered"}<|im_end|>' in text
    without = render_prompt(tokenizers["smollm2"], [Message(role="user", content="hi")])
    assert without.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM") and "<tools>" not in without
    block = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert parse_assistant_text(block, "smollm2", turn=2).tool_calls == _conversation()[2].tool_calls


def test_encode_prompt_matches_the_rendered_text(tokenizers):
    tok = tokenizers["qwen3"]
    ids = encode_prompt(tok, _conversation(), TOOLS)
    assert tok.decode(ids) == render_prompt(tok, _conversation(), TOOLS)
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")  # no BOS added on top of the template
