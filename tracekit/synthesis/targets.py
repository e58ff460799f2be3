"""Reference interfaces of the target environments: tool schemas (OpenAI function format) and policy text.

tau^2 schemas come from the installed benchmark itself (``AirlineTools`` / ``RetailTools`` on an empty
database, ``Tool.openai_schema``), so a synthetic environment is interface-preserving iff its schemas are
equal to these. ToolSandbox's come from the real ToolSandbox (its own converter, ``convert_to_openai_tools``) as a
committed extract (ToolSandbox runs in its own environment: :mod:`tracekit.envs.toolsandbox`), and its system
prompt is the one its base scenario gives the agent.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

from tracekit.coding.interface import GENERIC_POLICY, TOOLS
from tracekit.envs.toolsandbox_interface import TOOLSANDBOX_SYSTEM_PROMPT, toolsandbox_tools
from tracekit.synthesis.micro_interface import MICRO_POLICY, micro_tools

TAU2_TARGETS = ("tau2_airline", "tau2_retail")
TARGETS = (*TAU2_TARGETS, "toolsandbox", "coding", "micro")  # coding: tracekit/coding/suite.py (bash, submit)

@functools.lru_cache(maxsize=None)
def _tau2_toolkit(target: str):
    # Imported lazily: tau2 costs ~1 s to import (pandas via deepdiff).
    if target == "tau2_airline":
        from tau2.domains.airline.data_model import FlightDB
        from tau2.domains.airline.tools import AirlineTools

        return AirlineTools(FlightDB(flights={}, users={}, reservations={}))
    if target == "tau2_retail":
        from tau2.domains.retail.data_model import RetailDB
        from tau2.domains.retail.tools import RetailTools

        return RetailTools(RetailDB(products={}, users={}, orders={}))
    raise ValueError(f"not a tau2 target: {target}")


@functools.lru_cache(maxsize=None)
def _target_tools(target: str) -> dict[str, dict[str, Any]]:
    if target in TAU2_TARGETS:
        return {name: tool.openai_schema for name, tool in _tau2_toolkit(target).get_tools().items()}
    if target == "toolsandbox":
        return toolsandbox_tools()
    if target == "coding":  # issue 20: the coding target's agent interface
        return {t["function"]["name"]: t for t in TOOLS}
    if target == "micro":  # issue 42: the micro world (find, read, write)
        return micro_tools()
    raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")


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
    if target in TAU2_TARGETS:
        from tau2.domains.airline.utils import AIRLINE_POLICY_PATH
        from tau2.domains.retail.utils import RETAIL_POLICY_PATH

        path = AIRLINE_POLICY_PATH if target == "tau2_airline" else RETAIL_POLICY_PATH
        return Path(path).read_text(encoding="utf-8")
    if target == "toolsandbox":
        return TOOLSANDBOX_SYSTEM_PROMPT
    if target == "coding":
        return GENERIC_POLICY
    if target == "micro":
        return MICRO_POLICY
    raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}")


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
