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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.coding.interface import GENERIC_POLICY, TOOLS
from tracekit.envs.toolsandbox_interface import TOOLSANDBOX_SYSTEM_PROMPT, toolsandbox_tools
from tracekit.synthesis.micro_interface import MICRO_POLICY, micro_tools


@dataclass(frozen=True)
class TargetInterface:
    """One target's interface to synthesized environments: the library family its environments belong to, and
    how to get its tool schemas and its policy (functions: tau^2's are read from the installed benchmark only
    when asked for, since tau2 costs ~1 s to import: pandas via deepdiff)."""

    family: str  # the capability library family (synthesis/library: ``LIBRARY`` entries' ``family``)
    tools: Callable[[], dict[str, dict[str, Any]]]  # name -> OpenAI function schema
    policy: Callable[[], str]  # the full policy / system prompt


def _schemas(toolkit: Any) -> dict[str, dict[str, Any]]:
    return {name: tool.openai_schema for name, tool in toolkit.get_tools().items()}


def _airline_tools() -> dict[str, dict[str, Any]]:
    from tau2.domains.airline.data_model import FlightDB
    from tau2.domains.airline.tools import AirlineTools

    return _schemas(AirlineTools(FlightDB(flights={}, users={}, reservations={})))


def _retail_tools() -> dict[str, dict[str, Any]]:
    from tau2.domains.retail.data_model import RetailDB
    from tau2.domains.retail.tools import RetailTools

    return _schemas(RetailTools(RetailDB(products={}, users={}, orders={})))


def _airline_policy() -> str:
    from tau2.domains.airline.utils import AIRLINE_POLICY_PATH

    return Path(AIRLINE_POLICY_PATH).read_text(encoding="utf-8")


def _retail_policy() -> str:
    from tau2.domains.retail.utils import RETAIL_POLICY_PATH

    return Path(RETAIL_POLICY_PATH).read_text(encoding="utf-8")


INTERFACES: dict[str, TargetInterface] = {
    "tau2_airline": TargetInterface("tau2", _airline_tools, _airline_policy),
    "tau2_retail": TargetInterface("tau2", _retail_tools, _retail_policy),
    "toolsandbox": TargetInterface("toolsandbox", toolsandbox_tools, lambda: TOOLSANDBOX_SYSTEM_PROMPT),
    # issue 20: the coding target's agent interface (tracekit/coding/suite.py: bash, submit)
    "coding": TargetInterface("coding", lambda: {t["function"]["name"]: t for t in TOOLS}, lambda: GENERIC_POLICY),
    "micro": TargetInterface("micro", micro_tools, lambda: MICRO_POLICY),  # issue 42: the micro world (find, read, write)
}
TARGETS = tuple(INTERFACES)
TAU2_TARGETS = tuple(t for t, i in INTERFACES.items() if i.family == "tau2")


def interface(target: str) -> TargetInterface:
    """The table's entry of ``target`` (a ValueError names the known ones)."""
    try:
        return INTERFACES[target]
    except KeyError:
        raise ValueError(f"unknown target {target!r}; known: {', '.join(TARGETS)}") from None


def target_family(target: str) -> str:
    """The capability library family of ``target``'s environments (a name not in the table is its own family)."""
    entry = INTERFACES.get(target)
    return entry.family if entry is not None else target


@functools.lru_cache(maxsize=None)
def _target_tools(target: str) -> dict[str, dict[str, Any]]:
    return interface(target).tools()


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
    return interface(target).policy()


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
