"""Tool schemas in, tool calls out: chat-template rendering and tool-call parsing.

Three output formats cover our backbones (``chat_format``):

- ``qwen3`` (Qwen3 / Hermes): one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks (Qwen3-30B-A3B-Instruct-2507, Qwen3-8B/1.7B, the ``tiny`` backbone).
- ``smollm2``: one block holding a JSON list, ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``.
- ``qwen3_xml`` (Qwen3.5 / Qwen3.6 / Qwen3-Coder): ``<tool_call><function=NAME><parameter=KEY>VALUE
  </parameter>...</function></tool_call>``, string values raw, other values JSON.

The JSON formats are parsed leniently in one way only: a block may hold an object or a list of
objects in either format. Anything malformed (bad JSON, a missing name, arguments that are not an
object, an unclosed tag) yields a text assistant message with ``parse_error`` set, never an exception.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tracekit.types import Message, ToolCall

CHAT_FORMATS = ("qwen3", "smollm2", "qwen3_xml")
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_XML_FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class ToolCallParseError(ValueError):
    """Raised inside the parser only; surfaced as ``Message.parse_error``."""


def check_chat_format(chat_format: str) -> str:
    if chat_format not in CHAT_FORMATS:
        raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {chat_format!r}")
    return chat_format


def tool_call_id(turn: int, position: int) -> str:
    """Deterministic id of the ``position``-th call emitted in response to a prompt of ``turn`` messages."""
    return f"call_{turn}_{position}"


def to_chat_dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages as chat-template / OpenAI dicts."""
    return [m.to_chat() for m in messages]


def render_prompt(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text exactly as the tokenizer's chat template renders it (``tools=`` passed through)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat template")
    return tokenizer.apply_chat_template(
        to_chat_dicts(messages), tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def encode_prompt(
    tokenizer: Any,
    messages: list[Message],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the rendered prompt (the template writes every special token itself)."""
    text = render_prompt(tokenizer, messages, tools, add_generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tool_result_message(call: ToolCall | str, content: Any, name: str | None = None, error: bool = False) -> Message:
    """A tau^2-style tool result as a ``tool`` message answering ``call``.

    ``content`` that is not a string (a dict, list, pydantic model) is serialised as JSON, as tau^2
    does; the chat template then wraps it (``<tool_response>`` for Qwen3, a ``tool`` turn for SmolLM2).
    """
    if isinstance(call, ToolCall):
        call_id, name = call.id, name or call.name
    else:
        call_id = call
    if hasattr(content, "model_dump"):
        content = content.model_dump(mode="json")
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, default=str)
    return Message(role="tool", content=text, tool_call_id=call_id, name=name, error=error)


def strip_reasoning(text: str) -> str:
    """Drop ``<think>...</think>`` blocks (and a reasoning prefix whose ``<think>`` was in the prompt)."""
    text = _THINK.sub("", text)
    if "</think>" in text:
        text = text.split("</think>")[-1]
    return text


def parse_assistant_text(
    text: str,
    chat_format: str = "qwen3",
    turn: int = 0,
    tools: list[dict[str, Any]] | None = None,
) -> Message:
    """Parse generated text into an assistant message with tool calls.

    ``turn`` (the number of messages in the prompt) makes call ids deterministic:
    ``call_{turn}_{i}``. ``tools`` (OpenAI function schemas) is only used by ``qwen3_xml`` to type
    parameter values. Never raises on malformed model output.
    """
    check_chat_format(chat_format)
    visible = strip_reasoning(text)
    try:
        calls, content = _parse_calls(visible, chat_format, tools)
    except ToolCallParseError as e:
        return Message(role="assistant", content=visible.strip() or None, parse_error=str(e))
    return Message(
        role="assistant",
        content=content or None,
        tool_calls=[ToolCall(id=tool_call_id(turn, i), name=n, arguments=a) for i, (n, a) in enumerate(calls)],
    )


def _parse_calls(
    text: str, chat_format: str, tools: list[dict[str, Any]] | None
) -> tuple[list[tuple[str, dict[str, Any]]], str]:
    calls: list[tuple[str, dict[str, Any]]] = []
    for body in _BLOCK.findall(text):
        if chat_format == "qwen3_xml":
            calls.append(_parse_xml_call(body, tools))
        else:
            calls.extend(_parse_json_calls(body))
    rest = _BLOCK.sub("", text)
    if TOOL_CALL_OPEN in rest:
        raise ToolCallParseError("unclosed <tool_call> block (no </tool_call>)")
    if TOOL_CALL_CLOSE in rest:
        raise ToolCallParseError("</tool_call> without a matching <tool_call>")
    return calls, rest.strip()


def _parse_json_calls(body: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        obj = json.loads(body, strict=False)  # raw control characters inside strings are unambiguous
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"tool call is not valid JSON: {e.msg} at char {e.pos}") from None
    items = obj if isinstance(obj, list) else [obj]
    return [call_from_json(item) for item in items]


def call_from_json(item: Any) -> tuple[str, dict[str, Any]]:
    """``(name, arguments)`` of one decoded call object; raises ``ToolCallParseError`` if malformed.

    ``arguments`` may be an object or a JSON string of one (OpenAI style); missing means ``{}``.
    """
    if not isinstance(item, dict):
        raise ToolCallParseError(f"tool call must be a JSON object, got {type(item).__name__}")
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallParseError("tool call without a non-empty string 'name'")
    args = item.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string (OpenAI style)
        try:
            args = json.loads(args, strict=False)
        except json.JSONDecodeError:
            raise ToolCallParseError(f"arguments of {name!r} are a string that is not JSON") from None
    if not isinstance(args, dict):
        raise ToolCallParseError(f"arguments of {name!r} must be a JSON object, got {type(args).__name__}")
    return name.strip(), args


def _param_types(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function", tool)
        if fn.get("name") == name:
            return (fn.get("parameters") or {}).get("properties") or {}
    return {}


def _parse_xml_call(body: str, tools: list[dict[str, Any]] | None) -> tuple[str, dict[str, Any]]:
    m = _XML_FUNCTION.match(body)
    if not m:
        raise ToolCallParseError("tool call block without a closed <function=NAME>...</function>")
    name, inner = m.group(1).strip(), m.group(2)
    if not name:
        raise ToolCallParseError("tool call without a function name")
    props = _param_types(tools, name)
    args: dict[str, Any] = {}
    for key, raw in _XML_PARAM.findall(inner):
        # values sit on their own line; surrounding whitespace is layout, not part of the value
        args[key.strip()] = _xml_value(raw.strip(), props.get(key.strip(), {}))
    leftover = _XML_PARAM.sub("", inner).strip()
    if leftover:
        raise ToolCallParseError(f"unexpected text inside <function={name}>: {leftover[:60]!r}")
    return name, args


def _xml_value(value: str, schema: dict[str, Any]) -> Any:
    """A Qwen-XML parameter value: raw text for string parameters, JSON otherwise (raw text if not JSON)."""
    if schema.get("type") == "string":
        return value
    try:
        return json.loads(value, strict=False)
    except json.JSONDecodeError:
        return value
