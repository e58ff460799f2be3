"""Constrained tool-call decoding with xgrammar (works on CPU; ``pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi``).

The grammar lets the model either answer in free text or emit ONE tool call whose name is one of
the offered tools and whose arguments are JSON (or Qwen-XML parameters) valid for that tool's schema,
written exactly as the backbone's chat template writes calls:

- ``qwen3``:     ``<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>``
- ``smollm2``:   ``<tool_call>[{"name": "NAME", "arguments": ARGS}]</tool_call>``
- ``qwen3_xml``: ``<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...\\n</function>\\n</tool_call>``

``tool_choice="auto"``: free text, and once ``<tool_call>`` appears the call must complete validly;
``"required"``: the output must be exactly one call.

Schema tightening (``copy_ids``, for small models; off by default): a grammar, not the prompt, narrows
(a) every identifier argument (a string, or array of strings, named ``*_id``, ``*_ids`` or ``email``) to the
identifiers seen so far in the conversation's user and tool messages (:func:`identifier_candidates`), and
(b) every free string argument whose description lists its values ("either 'a' or 'b'", "one of 'a', 'b'")
to those values. The model still chooses which id and which tool; it can no longer invent an id.

The same machinery serves a request's ``response_format`` (OpenAI shapes ``{"type": "json_object"}``
and ``{"type": "json_schema", "json_schema": {"schema": ...}}``): the whole output is then JSON
(valid for the schema), written with ``", "`` / ``": "`` separators and no other whitespace.
"""

from __future__ import annotations

from typing import Any

import copy
import re
from collections import OrderedDict

import numpy as np

from tracekit.llm.tools import check_chat_format
from tracekit.types import stable_hash

TOOL_CHOICES = ("auto", "required")

# an identifier: a token with a digit (order ids, item ids, user ids, emails) or a 6-character code of capitals
_IDENTIFIER = re.compile(r"#?[A-Za-z0-9_.@+-]*[0-9][A-Za-z0-9_.@+-]*|\b[A-Z0-9]{6}\b")
_LISTED_VALUES = re.compile(r"\b(?:either|one of)\b(.*)", re.IGNORECASE | re.DOTALL)
_QUOTED = re.compile(r"'([^']+)'")

_BEGIN_END = {
    "qwen3": ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "smollm2": ('<tool_call>[{{"name": "{name}", "arguments": ', "}]</tool_call>"),
    "qwen3_xml": ("<tool_call>\n<function={name}>\n", "\n</function>\n</tool_call>"),
}


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as e:
        raise ImportError(
            "constrained_tool_calls needs xgrammar: pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi"
        ) from e
    return xgrammar


def _parameters(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    fn = tool.get("function", tool)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool schema without a name: {str(tool)[:80]}")
    return name, fn.get("parameters") or {"type": "object", "properties": {}}


def identifier_candidates(messages: list[Any], min_length: int = 5) -> list[str]:
    """Identifier-like tokens of the user and tool messages, in order of first appearance (no system text:
    its example ids are not the user's)."""
    seen: dict[str, None] = {}
    for m in messages:
        if m.role not in ("user", "tool"):
            continue
        for token in _IDENTIFIER.findall(m.content or ""):
            token = token.strip(".,;:-+")
            if len(token) >= min_length:
                seen.setdefault(token, None)
    return list(seen)


def _listed_values(description: str) -> list[str]:
    match = _LISTED_VALUES.search(description or "")
    values = _QUOTED.findall(match.group(1)) if match else []
    return values if len(values) >= 2 else []


def tighten_tools(tools: list[dict[str, Any]], identifiers: list[str]) -> list[dict[str, Any]]:
    """Copies of ``tools`` with identifier arguments narrowed to ``identifiers`` (when there are any) and
    documented value lists turned into enums (see the module doc)."""
    out = copy.deepcopy(tools)
    for tool in out:
        params = tool.get("function", tool).get("parameters") or {}
        for name, schema in (params.get("properties") or {}).items():
            if not isinstance(schema, dict) or "enum" in schema:
                continue
            is_id = name.endswith(("_id", "_ids")) or name == "email"
            if schema.get("type") == "string":
                values = identifiers if is_id else _listed_values(schema.get("description", ""))
                if values:
                    schema["enum"] = list(values)
            elif schema.get("type") == "array" and is_id and identifiers and isinstance(schema.get("items"), dict) \
                    and schema["items"].get("type") == "string":
                schema["items"]["enum"] = list(identifiers)
    return out


def structural_tag(
    tools: list[dict[str, Any]], chat_format: str, tool_choice: str = "auto", max_whitespace: int | None = 1
) -> dict[str, Any]:
    """The xgrammar structural tag (as a plain dict) for one call among ``tools`` or, if ``auto``, text."""
    check_chat_format(chat_format)
    if tool_choice not in TOOL_CHOICES:
        raise ValueError(f"tool_choice must be one of {TOOL_CHOICES}, got {tool_choice!r}")
    if not tools:
        raise ValueError("constrained tool-call decoding needs at least one tool")
    begin, end = _BEGIN_END[chat_format]
    tags = []
    for tool in tools:
        name, params = _parameters(tool)
        content: dict[str, Any] = {"type": "json_schema", "json_schema": params, "max_whitespace_cnt": max_whitespace}
        if chat_format == "qwen3_xml":
            content["style"] = "qwen_xml"
        tags.append({"type": "tag", "begin": begin.format(name=name), "content": content, "end": end})
    if tool_choice == "required":
        fmt = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    else:
        fmt = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags, "stop_after_first": True}
    return {"type": "structural_tag", "format": fmt}


class ToolCallGrammar:
    """Compiles tool-call / JSON grammars for one tokenizer (cached per tool set or format) and masks logits."""

    MAX_COMPILED = 256  # compiled grammars kept (least recently used dropped)

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_whitespace: int | None = 1):
        xgr = _xgrammar()
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.max_whitespace = max_whitespace
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        # bounded: with copy_ids every new set of seen identifiers is a new grammar
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, tools: list[dict[str, Any]], chat_format: str, tool_choice: str = "auto",
                copy_from: list[Any] | None = None) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` for one generation; ``copy_from``: the request's messages,
        to tighten the schemas with (:func:`tighten_tools`)."""
        if copy_from is not None:
            tools = tighten_tools(tools, identifier_candidates(copy_from))
        tag = structural_tag(tools, chat_format, tool_choice, self.max_whitespace)
        key = stable_hash(tag)
        if key not in self._compiled:
            self._remember(key, self._compiler.compile_structural_tag(tag))
        self._compiled.move_to_end(key)
        return self._xgr.GrammarMatcher(self._compiled[key])

    def _remember(self, key: str, grammar: Any) -> None:
        self._compiled[key] = grammar
        while len(self._compiled) > self.MAX_COMPILED:
            self._compiled.popitem(last=False)

    def json_matcher(self, response_format: dict[str, Any]) -> Any:
        """A fresh matcher forcing the output to be JSON (``json_object``) or JSON valid for a schema."""
        kind = response_format.get("type")
        key = stable_hash(response_format)
        if key not in self._compiled:
            if kind == "json_object":
                self._remember(key, self._compiler.compile_builtin_json_grammar())
            elif kind == "json_schema":
                spec = response_format.get("json_schema") or {}
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format json_schema needs {'json_schema': {'schema': {...}}}")
                self._remember(key, self._compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": ")))
            else:
                raise ValueError(f"response_format type must be json_object or json_schema, got {kind!r}")
        self._compiled.move_to_end(key)
        return self._xgr.GrammarMatcher(self._compiled[key])

    def mask_(self, matcher: Any, logits: np.ndarray) -> None:
        """Set the logits (1-D numpy, vocab) of every token the grammar forbids next to -inf, in place."""
        bitmask = self._xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.vocab_size]
        logits[: self.vocab_size][allowed == 0] = -np.inf
