"""Agent Data Protocol (ADP; Song et al. 2026, neulab/agent-data-protocol) trajectories -> exact SFT token rows.

ADP's standardized schema (``schema/trajectory.py`` and friends; versions 1.x): one trajectory per record,

    {"schema_version": "1.2.0", "id": "...", "content": [item, ...], "details": {...}}

where each ``content`` item is tagged by ``class_``: actions ``api_action`` (``function``, ``kwargs``,
``description``), ``code_action`` (``language``, ``content``, ``description``), ``message_action``
(``content``, ``description``), each with optional ``reasoning_content`` / ``reward`` / ``tool_call_id``;
observations ``text_observation`` (``content``, ``source``: user | agent | environment, or in later
versions system | user | assistant; optional ``name``), ``web_observation`` (``html`` / ``axtree`` / ``url`` /
``viewport_size`` / ``image_observation``) and ``image_observation``, each with optional
``tool_call_id`` / ``reward``. Extra keys are refused (ADP's models forbid them).

A record that does not fit (bad JSON, a missing or mistyped field, an unknown ``class_`` or key, an action
whose ``tool_call_id`` no observation answers) is counted with its file and line number and left out; the rest
are used. Records holding images are skipped (counted): the backbones here are text-only.

Conversion to the backbone's chat format (what a tool-calling agent of tracekit sees): user / environment text
before any action -> user messages; an action -> an assistant message (consecutive actions: one message with
several calls; ``api_action`` -> a tool call of ``function`` with ``kwargs``; ``code_action`` -> OpenHands'
names: ``execute_bash`` {command}, ``execute_ipython_cell`` {code}, else ``execute_<language>`` {code};
``description`` -> the message text; ``reasoning_content`` is dropped); an observation answering a call ->
a ``tool`` message; ``message_action`` -> assistant text. Tool schemas are inferred from the calls (names,
argument names and JSON types); ADP keeps the real ones in each dataset's ``api.py``, which the standardized
files do not carry.

Token bookkeeping is RL's (:mod:`tracekit.rl.tokens`): each assistant message is one :class:`Turn` whose
prompt is the chat template's rendering of everything before it (with the generation prompt) and whose
completion is the template's own rendering of that message through its end-of-turn token; ``build_rows``
merges turns into the fewest exact rows, ``loss_mask`` = 1 on the assistant's tokens only.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.llm.tools import render_prompt
from tracekit.rl.tokens import Turn, build_rows
from tracekit.types import Message, ToolCall

log = logging.getLogger(__name__)

_COMMON_ACTION = {"class_", "reasoning_content", "reward", "tool_call_id", "description"}
_COMMON_OBS = {"class_", "reward", "tool_call_id"}
_ITEMS: dict[str, tuple[dict[str, tuple[type, ...]], set[str]]] = {
    # class_: (required fields and their types, optional fields)
    "api_action": ({"function": (str,), "kwargs": (dict,)}, _COMMON_ACTION),
    "code_action": ({"language": (str,), "content": (str,)}, _COMMON_ACTION),
    "message_action": ({"content": (str,)}, _COMMON_ACTION),
    "text_observation": ({"content": (str,), "source": (str,)}, _COMMON_OBS | {"name"}),
    "web_observation": ({}, _COMMON_OBS | {"html", "axtree", "url", "image_observation", "viewport_size"}),
    "image_observation": ({}, _COMMON_OBS | {"content", "source", "annotations", "path", "image", "name"}),
}
ACTIONS = ("api_action", "code_action", "message_action")
SOURCES = ("user", "agent", "environment", "system", "assistant")
TOP_LEVEL = {"schema_version", "id", "content", "details", "available_apis", "available_custom_tools",
             "available_code_languages"}
HUB_PREFIX = "hf://"
HUB_DEFAULT_FILE = "full_std.jsonl"  # neulab/agent-data-collection: <subset>/full_std.jsonl


class Unsupported(ValueError):
    """A well-formed record this conversion cannot use (images)."""


@dataclass
class AdpReport:
    """What loading ADP data found: used records, malformed ones (source, line, reason), skips, rows."""

    records: int = 0
    used: int = 0
    malformed: list[dict[str, Any]] = field(default_factory=list)
    unsupported: list[dict[str, Any]] = field(default_factory=list)
    dropped: Counter = field(default_factory=Counter)  # reasons items/turns/rows were left out
    rows: int = 0
    assistant_tokens: int = 0
    truncated_rows: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"records": self.records, "used": self.used, "malformed": self.malformed,
                "unsupported": self.unsupported, "dropped": dict(self.dropped), "rows": self.rows,
                "assistant_tokens": self.assistant_tokens, "truncated_rows": self.truncated_rows}

    def summary(self, limit: int = 5) -> str:
        text = f"{self.used} of {self.records} ADP records used ({self.rows} rows, {self.assistant_tokens:,} assistant tokens)"
        if self.malformed:
            where = ", ".join(f"{Path(m['source']).name}:{m['line']}" for m in self.malformed[:limit])
            more = f" and {len(self.malformed) - limit} more" if len(self.malformed) > limit else ""
            text += f"; {len(self.malformed)} malformed record(s) left out ({where}{more})"
        if self.unsupported:
            text += f"; {len(self.unsupported)} record(s) with images skipped (text-only backbone)"
        return text


# --------------------------------------------------------------------------------------------
# reading and checking


def resolve_source(source: str) -> Path:
    """A local file, or ``hf://<owner>/<dataset>/<subset>[/<file>]`` downloaded from the hub (for users with
    network access; default file ``<subset>/full_std.jsonl``, the layout of neulab/agent-data-collection)."""
    if not source.startswith(HUB_PREFIX):
        return Path(source).expanduser()
    parts = source[len(HUB_PREFIX):].strip("/").split("/")
    if len(parts) < 3:
        raise ValueError(f"{source}: a hub source is hf://<owner>/<dataset>/<subset>[/<file>]")
    repo, rest = "/".join(parts[:2]), parts[2:]
    filename = "/".join(rest) if rest[-1].endswith((".json", ".jsonl")) else "/".join([*rest, HUB_DEFAULT_FILE])
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(repo_id=repo, filename=filename, repo_type="dataset"))


def iter_records(path: Path):
    """(line number, parsed record or the JSON error) of a .jsonl file, or (index + 1, record) of a .json list."""
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            yield e.lineno, e
            return
        for i, rec in enumerate(data if isinstance(data, list) else [data], start=1):
            yield i, rec
        return
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                yield n, e


def check_record(rec: Any) -> None:
    """Raise ValueError naming what does not fit ADP's standardized schema."""
    if not isinstance(rec, dict):
        raise ValueError(f"a trajectory is a JSON object, got {type(rec).__name__}")
    extra = set(rec) - TOP_LEVEL
    if extra:
        raise ValueError(f"unknown top-level key(s) {sorted(extra)}")
    if not isinstance(rec.get("id"), str):
        raise ValueError("'id' (a string) is required")
    version = rec.get("schema_version", "1.0.0")
    if not (isinstance(version, str) and version.split(".")[0] == "1"):
        raise ValueError(f"schema_version {version!r} is not a 1.x ADP schema")
    content = rec.get("content")
    if not isinstance(content, list) or not content:
        raise ValueError("'content' (a non-empty list of actions and observations) is required")
    if not isinstance(rec.get("details", {}), dict):
        raise ValueError("'details' must be an object")
    open_ids: dict[str, int] = {}
    for i, item in enumerate(content):
        if not isinstance(item, dict) or "class_" not in item:
            raise ValueError(f"content[{i}] has no 'class_'")
        kind = item["class_"]
        if kind not in _ITEMS:
            raise ValueError(f"content[{i}]: unknown class_ {kind!r}")
        required, optional = _ITEMS[kind]
        for key, types in required.items():
            if not isinstance(item.get(key), types):
                raise ValueError(f"content[{i}] ({kind}): '{key}' ({types[0].__name__}) is required")
        extra = set(item) - set(required) - optional
        if extra:
            raise ValueError(f"content[{i}] ({kind}): unknown key(s) {sorted(extra)}")
        if kind == "text_observation" and item["source"] not in SOURCES:
            raise ValueError(f"content[{i}]: source {item['source']!r} is not one of {', '.join(SOURCES)}")
        call_id = item.get("tool_call_id")
        if call_id is not None:
            if kind in ("api_action", "code_action"):
                open_ids[call_id] = i
            elif kind == "message_action":
                raise ValueError(f"content[{i}]: a message_action takes no tool_call_id")
            elif call_id not in open_ids:
                raise ValueError(f"content[{i}]: tool_call_id {call_id!r} answers no preceding action")
            else:
                open_ids.pop(call_id)
    if open_ids:
        cid, i = next(iter(open_ids.items()))
        raise ValueError(f"content[{i}]: tool_call_id {cid!r} has no observation answering it")
    if not any(item["class_"] in ACTIONS for item in content):
        raise ValueError("no action: nothing for the agent to learn")


def load_adp(sources: list[str], max_records: int | None = None, report: AdpReport | None = None) -> tuple[list[dict[str, Any]], AdpReport]:
    """The well-formed ADP trajectories of ``sources`` (in order, at most ``max_records``) and the report."""
    report = report or AdpReport()
    out: list[dict[str, Any]] = []
    for source in sources:
        path = resolve_source(source)
        if not path.is_file():
            raise FileNotFoundError(f"ADP source {source}: no such file {path}")
        for line, rec in iter_records(path):
            if max_records is not None and len(out) >= max_records:
                return out, report
            report.records += 1
            try:
                if isinstance(rec, Exception):
                    raise ValueError(f"not JSON ({rec})")
                check_record(rec)
                if any(item["class_"] == "image_observation" or item.get("image_observation")
                       for item in rec["content"]):
                    raise Unsupported("image observation")
            except Unsupported as e:
                report.unsupported.append({"source": str(source), "line": line, "reason": str(e)})
                continue
            except ValueError as e:
                report.malformed.append({"source": str(source), "line": line, "reason": str(e)})
                log.warning("ADP %s:%d: malformed record left out: %s", source, line, e)
                continue
            out.append(rec)
    return out, report


# --------------------------------------------------------------------------------------------
# ADP -> chat messages -> exact token rows


def _code_call(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    lang = item["language"].lower()
    if lang in ("bash", "shell", "sh"):
        return "execute_bash", {"command": item["content"]}
    if lang in ("python", "ipython"):
        return "execute_ipython_cell", {"code": item["content"]}
    return f"execute_{lang}", {"code": item["content"]}


def _web_text(item: dict[str, Any]) -> str:
    parts = [f"URL: {item['url']}" if item.get("url") else "", item.get("axtree") or item.get("html") or ""]
    return "\n".join(p for p in parts if p)


def to_messages(rec: dict[str, Any], report: AdpReport | None = None) -> tuple[list[Message], list[dict[str, Any]]]:
    """One ADP trajectory as chat messages in tracekit's types, and the tool schemas its calls imply."""
    messages: list[Message] = []
    pending: list[ToolCall] = []  # calls of the last assistant message still unanswered
    schemas: dict[str, dict[str, Any]] = {}
    n_call = 0

    def assistant() -> Message:
        if not messages or messages[-1].role != "assistant":
            messages.append(Message(role="assistant"))
        return messages[-1]

    for item in rec["content"]:
        kind = item["class_"]
        if item.get("reasoning_content") and report is not None:
            report.dropped["reasoning_content"] += 1
        if kind in ("api_action", "code_action"):
            name, args = (item["function"], dict(item["kwargs"])) if kind == "api_action" else _code_call(item)
            call = ToolCall(id=item.get("tool_call_id") or f"call_{n_call}", name=name, arguments=args)
            n_call += 1
            msg = assistant()
            text = (item.get("description") or "").strip()
            msg.content = "\n".join(t for t in (msg.content, text) if t) or None
            msg.tool_calls = [*msg.tool_calls, call]
            pending.append(call)
            props = schemas.setdefault(name, {})
            for k, v in args.items():
                props.setdefault(k, _json_type(v))
        elif kind == "message_action":
            msg = assistant() if not (messages and messages[-1].tool_calls) else None
            if msg is None:
                messages.append(Message(role="assistant", content=item["content"]))
            else:
                msg.content = "\n".join(t for t in (msg.content, item["content"]) if t)
        else:
            text = item.get("content") if kind == "text_observation" else _web_text(item)
            source = item.get("source", "environment")
            if pending and source not in ("user", "system", "agent", "assistant"):
                call = next((c for c in pending if c.id == item.get("tool_call_id")), pending[0])
                pending.remove(call)
                messages.append(Message(role="tool", content=text, tool_call_id=call.id, name=call.name))
                continue
            if pending and report is not None:  # the user spoke before the calls were answered
                report.dropped["unanswered_calls"] += len(pending)
            pending = []
            if source in ("agent", "assistant"):
                messages.append(Message(role="assistant", content=text))
            elif source == "system" and not messages:
                messages.append(Message(role="system", content=text))
            else:
                messages.append(Message(role="user", content=text))
    tools = [{"type": "function", "function": {"name": n, "description": "",
                                               "parameters": {"type": "object", "properties": p,
                                                              "required": sorted(p)}}}
             for n, p in schemas.items()]
    return messages, tools


def _json_type(v: Any) -> dict[str, str]:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object")):
        if isinstance(v, t):
            return {"type": name}
    return {}


def _end_of_turn(tokenizer: Any) -> list[str]:
    marks = ["<|im_end|>"]
    if tokenizer.eos_token and tokenizer.eos_token not in marks:
        marks.append(tokenizer.eos_token)
    return marks


def assistant_turns(messages: list[Message], tools: list[dict[str, Any]], tokenizer: Any,
                    report: AdpReport | None = None) -> list[Turn]:
    """One :class:`Turn` per assistant message: the prompt the template renders before it (generation prompt
    included) and the template's own rendering of the message, through its end-of-turn token."""
    turns = []
    marks = _end_of_turn(tokenizer)
    for k, m in enumerate(messages):
        if m.role != "assistant" or k == 0:
            continue
        prompt = render_prompt(tokenizer, messages[:k], tools, add_generation_prompt=True)
        full = render_prompt(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        if not full.startswith(prompt):  # the template renders this turn's history differently: no exact split
            if report is not None:
                report.dropped["template_mismatch"] += 1
            continue
        completion = full[len(prompt):]
        cut = min((completion.find(mk) + len(mk) for mk in marks if mk in completion), default=len(completion))
        completion = completion[:cut]
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        completion_ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if completion_ids:
            turns.append(Turn(prompt_ids, completion_ids, [0.0] * len(completion_ids)))
    return turns


def sft_rows(records: list[dict[str, Any]], tokenizer: Any, max_tokens: int,
             report: AdpReport) -> list[tuple[list[int], list[int]]]:
    """``(token_ids, loss_mask)`` rows of the trajectories (``loss_mask`` 1 on assistant tokens only); a row
    longer than ``max_tokens`` keeps its first ``max_tokens`` tokens."""
    out = []
    for rec in records:
        messages, tools = to_messages(rec, report)
        rows = build_rows(assistant_turns(messages, tools, tokenizer, report))
        if not rows:
            report.dropped["no_assistant_turn"] += 1
            continue
        report.used += 1
        for r in rows:
            ids, mask = r.token_ids, r.loss_mask
            if len(ids) > max_tokens:
                ids, mask = ids[:max_tokens], mask[:max_tokens]
                report.truncated_rows += 1
            if not any(mask):
                report.dropped["row_without_assistant_tokens_after_cut"] += 1
                continue
            out.append((ids, mask))
            report.rows += 1
            report.assistant_tokens += sum(mask)
    return out
