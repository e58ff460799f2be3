"""ToolSandbox's agent interface, known without ToolSandbox's environment: its system prompt and its tools' OpenAI
schemas (a committed extract). Plain data and the standard library only: the synthesized ToolSandbox-family
environments read it inside the synthesis sandbox, where loading a native library is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOOLSANDBOX_SYSTEM_PROMPT = (  # the system prompt ToolSandbox's base scenarios give the agent
    "Don't make assumptions about what values to plug into functions. "
    "Ask for clarification if a user request is ambiguous."
)
TOOLSANDBOX_EXTRACT = Path(__file__).resolve().parent / "data" / "toolsandbox_tools.json"


def toolsandbox_tools() -> dict[str, dict[str, Any]]:
    """Every agent-visible ToolSandbox tool as ToolSandbox's own converter gives it (a fresh copy): a committed
    extract of the real ToolSandbox (``scripts/extract_toolsandbox_tools.py``; ``tests/test_toolsandbox.py`` holds
    it against the real one when ToolSandbox's environment is built), known without ToolSandbox's environment."""
    tools = json.loads(TOOLSANDBOX_EXTRACT.read_text(encoding="utf-8"))["tools"]
    return {t["function"]["name"]: t for t in tools}


def toolsandbox_policy() -> str:
    return TOOLSANDBOX_SYSTEM_PROMPT
