"""Helpers shared by the LLM analysis calls: versioned prompt files, JSON extraction, schemas."""

from __future__ import annotations

import hashlib
import json
import re
from functools import cache
from pathlib import Path
from string import Template
from typing import Any

from tracekit.llm.base import ChatResponse

PROMPT_DIR = Path(__file__).parent / "prompts"
_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.DOTALL)


@cache
def load_prompt(name: str) -> tuple[Template, str]:
    """The prompt template ``prompts/<name>.txt`` ($-placeholders) and its sha256 (first 12 hex)."""
    path = PROMPT_DIR / f"{name}.txt"
    if not path.exists():
        raise FileNotFoundError(f"analysis prompt {name!r} not found at {path}")
    text = path.read_text(encoding="utf-8")
    return Template(text), hashlib.sha256(text.encode()).hexdigest()[:12]


def extract_json(text: str) -> Any:
    """The first JSON object in a model reply (inside a ``` fence if there is one).

    Raises ``ValueError`` with a short reason when there is none: the reason is fed back to the
    model on retry.
    """
    m = _FENCE.search(text)
    body = m.group(1) if m else text
    start = body.find("{")
    if start < 0:
        raise ValueError("the reply contains no JSON object (expected one starting with '{')")
    try:
        obj, _ = json.JSONDecoder().raw_decode(body[start:])
    except json.JSONDecodeError as e:
        raise ValueError(f"the reply is not valid JSON: {e.msg} at char {e.pos}") from None
    return obj


def reply_text(resp: ChatResponse) -> str:
    """A reply's answer text: the client's parsed content (reasoning blocks stripped) if any, else the raw text."""
    return resp.message.content if resp.message.content is not None else resp.text


def response_format(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """OpenAI-style ``response_format`` for a JSON schema (vLLM, OpenAI and the hf client's grammar enforce it)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def strict_object(properties: dict[str, Any]) -> dict[str, Any]:
    """A JSON-schema object with every property required and no others (what strict decoders accept)."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def short_error(e: object, limit: int = 600) -> str:
    """An error (or any object) as a compact one-line message for the retry prompt and the report."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
