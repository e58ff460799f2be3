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
import torch

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
        # one thread: a row's fill costs microseconds, less than waking a pool (measured, issue 30)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def matcher(self, tools: list[dict[str, Any]], chat_format: str, tool_choice: str = "auto",
                copy_from: list[Any] | None = None) -> Any:
        """A fresh ``xgrammar.GrammarMatcher`` for one generation; ``copy_from``: the request's messages,
        to tighten the schemas with (:func:`tighten_tools`)."""
        return self.matchers([(tools, copy_from)], chat_format, tool_choice)[0]

    def matchers(self, requests: list[tuple[list[dict[str, Any]], list[Any] | None]], chat_format: str,
                 tool_choice: str = "auto", threads: int = 1) -> list[Any]:
        """Fresh matchers for many generations at once, ``requests`` being ``(tools, copy_from)`` pairs (as
        :meth:`matcher`'s arguments). The grammars not compiled yet are compiled on up to ``threads`` threads
        (xgrammar compiles without the GIL; with ``copy_ids`` nearly every request of a turn has its own grammar)."""
        keys, tags = [], {}
        for tools, copy_from in requests:
            if copy_from is not None:
                tools = tighten_tools(tools, identifier_candidates(copy_from))
            tag = structural_tag(tools, chat_format, tool_choice, self.max_whitespace)
            keys.append(stable_hash(tag))
            if keys[-1] not in self._compiled:
                tags.setdefault(keys[-1], tag)
        grammars = {k: self._compiled[k] for k in keys if k in self._compiled}  # before new ones push any out
        new = list(tags)
        if threads > 1 and len(new) > 1:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(threads, len(new))) as pool:
                grammars.update(zip(new, pool.map(self._compiler.compile_structural_tag, [tags[k] for k in new])))
        else:
            grammars.update((k, self._compiler.compile_structural_tag(tags[k])) for k in new)
        for key in keys:  # the cache's order as one matcher() call per request leaves it
            if key in self._compiled:
                self._compiled.move_to_end(key)
            else:
                self._remember(key, grammars[key])
        return [self._xgr.GrammarMatcher(grammars[k]) for k in keys]

    def clear(self) -> None:
        """Forget every compiled grammar, the compiler's own cache included (the next matchers compile anew)."""
        self._compiled.clear()
        self._compiler.clear_cache()

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
        self.mask_row_(logits, bitmask.numpy()[0])

    def mask_row_(self, logits: np.ndarray, bitmask: np.ndarray) -> None:
        """:meth:`mask_` with the row's bitmask (int32 [ceil(vocab / 32)], as :meth:`fill` writes it) already filled."""
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[: self.vocab_size]
        logits[: self.vocab_size][allowed == 0] = -np.inf

    def masked_row_(self, out: np.ndarray, row: np.ndarray, bitmask: np.ndarray) -> np.ndarray | None:
        """``out[:] = row`` (float32 -> float64: exact) with :meth:`mask_row_` applied: the same values, written
        the cheaper way round for the row's mask. Most constrained steps allow a handful of tokens (the grammar
        forces the call's fixed text): then ``out`` starts at -inf and takes the allowed logits, and the allowed
        indices are returned (where the row has no columns past the vocabulary); otherwise ``out`` takes every
        logit and the forbidden ones are set to -inf (-> None)."""
        V = self.vocab_size
        allowed = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:V].view(bool)  # bool: a fast nonzero
        if 4 * np.count_nonzero(allowed) < V:
            out[:V] = -np.inf
            idx = np.flatnonzero(allowed)
            out[idx] = row[idx]
            out[V:] = row[V:]
            return idx if out.size == V else None
        np.copyto(out, row)
        out[np.flatnonzero(~allowed)] = -np.inf
        return None

    def fill(self, matchers: list[Any]) -> np.ndarray:
        """The next-token bitmasks of ``matchers`` in one batched call: int32 [len(matchers), ceil(vocab / 32)]
        (numpy: no torch kernel, whose thread pool costs more than the fill on a small busy host), bit j of row i set
        where matcher i allows token j, each row as the matcher's own ``fill_next_token_bitmask`` writes it."""
        bitmask = np.full((len(matchers), -(-self.vocab_size // 32)), -1, dtype=np.int32)
        self._batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))
        return bitmask

    def mask_rows_(self, logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
        """Set every token that ``bitmask[i]`` (:meth:`fill`) forbids to -inf in row ``rows[i]`` of ``logits``
        [B, >= vocab] on the device, in place (columns from ``vocab`` on stay, as in :meth:`mask_`): the packed
        mask travels (1/32 of the logits' bytes) and is unpacked there."""
        if len(bitmask) != len(rows):
            raise ValueError(f"mask_rows_: {len(bitmask)} bitmask rows for {len(rows)} logit rows")
        if not rows:
            return
        V, dev = self.vocab_size, logits.device
        words = torch.from_numpy(bitmask).to(dev)
        bits = words[:, :, None] >> torch.arange(32, dtype=torch.int32, device=dev)
        forbid = (bits & 1).view(len(rows), -1)[:, :V] == 0
        if rows == list(range(logits.shape[0])):
            logits[:, :V].masked_fill_(forbid, float("-inf"))
        else:
            index = torch.tensor(rows, device=dev)
            logits[index, :V] = logits[index, :V].masked_fill_(forbid, float("-inf"))
