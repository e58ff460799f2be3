"""The micro target's interface (issue 42) as plain data: its tool schemas and policy text. Every environment of
the micro family keeps them (:mod:`tracekit.targets.micro.library`); :mod:`tracekit.synthesis.targets` serves them
as the ``micro`` target's."""

from __future__ import annotations

from typing import Any

MICRO_POLICY = """You manage a store of items. Items have an id, a name and a value.
Before you write an item, read it. Never write a locked item: tell the user it is locked.
If the user names an item, find its id first. Answer questions with the value you read."""

_TOOLS: dict[str, dict[str, Any]] = {
    "find": {"type": "function", "function": {
        "name": "find", "description": "Get the id of the item with this name.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}},
    "read": {"type": "function", "function": {
        "name": "read", "description": "Read an item's value and lock.",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}}},
    "write": {"type": "function", "function": {
        "name": "write", "description": "Set an item's value.",
        "parameters": {"type": "object", "properties": {"id": {"type": "string"}, "value": {"type": "integer"}},
                       "required": ["id", "value"]}}},
}
TOOL_NAMES = tuple(_TOOLS)


def micro_tools() -> dict[str, dict[str, Any]]:
    """The micro target's tool schemas by name (the interface every environment of the family keeps)."""
    return _TOOLS


def micro_policy() -> str:
    return MICRO_POLICY
