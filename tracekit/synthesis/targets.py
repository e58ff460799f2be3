"""Reference interfaces of the target environments: tool schemas (OpenAI function format) and policy text, by the
interface's name (:data:`tracekit.target_index.INTERFACES`; each world's ``interface`` module gives them: tau^2's
from the installed benchmark, ToolSandbox's from a committed extract of the real one). A synthetic environment is
interface-preserving iff its schemas are equal to these. Generated environments call :func:`tool_schemas` inside the
synthesis sandbox: everything here is plain data and the standard library.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

from tracekit.target_index import FAMILIES, INTERFACES, Interface, resolve

TARGETS = tuple(INTERFACES)


def interface(target: str) -> Interface:
    """The index's interface ``target`` (a ValueError names the known ones)."""
    try:
        return INTERFACES[target]
    except KeyError:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}") from None


def target_family(target: str) -> str:
    """The capability library family of ``target``'s environments (a name not in the index is its own family)."""
    entry = INTERFACES.get(target)
    return entry.family if entry is not None else target


def sandbox_preload(target: str | None) -> tuple[str, ...]:
    """The modules a sandbox imports before a generated environment of ``target``'s family (none for an unknown one)."""
    family = FAMILIES.get(target_family(target)) if target is not None else None
    return family.preload if family is not None else ()


@functools.lru_cache(maxsize=None)
def _target_tools(target: str) -> dict[str, dict[str, Any]]:
    return resolve(interface(target).tools)()


def target_tools(target: str) -> dict[str, dict[str, Any]]:
    """name -> OpenAI function schema of every tool the target exposes to the agent (a fresh copy)."""
    return copy.deepcopy(_target_tools(target))


def tool_schemas(target: str, names: list[str]) -> list[dict[str, Any]]:
    """The target's schemas for ``names``, in that order (a KeyError names a tool the target lacks)."""
    tools = _target_tools(target)
    missing = [n for n in names if n not in tools]
    if missing:
        raise KeyError(f"target {target} has no tool(s) {missing}")
    return [copy.deepcopy(tools[n]) for n in names]


def target_policy(target: str) -> str:
    """The target's full policy / system prompt."""
    return resolve(interface(target).policy)()


def schema_mismatch(schema: dict[str, Any], reference: dict[str, Any], path: str = "") -> str | None:
    """The first path at which ``schema`` differs from ``reference`` (None when equal)."""
    if isinstance(reference, dict) and isinstance(schema, dict):
        for k in sorted(set(reference) | set(schema)):
            if k not in schema:
                return f"{path}/{k}: missing"
            if k not in reference:
                return f"{path}/{k}: not in the target's schema"
            diff = schema_mismatch(schema[k], reference[k], f"{path}/{k}")
            if diff:
                return diff
        return None
    if isinstance(reference, list) and isinstance(schema, list):
        if len(reference) != len(schema):
            return f"{path}: {len(schema)} entries, target has {len(reference)}"
        for i, (a, b) in enumerate(zip(schema, reference)):
            diff = schema_mismatch(a, b, f"{path}[{i}]")
            if diff:
                return diff
        return None
    return None if schema == reference else f"{path}: {schema!r} != target {reference!r}"
