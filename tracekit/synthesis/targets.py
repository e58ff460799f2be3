"""Reference interfaces of the target environments: tool schemas (OpenAI function format) and policy text.

tau^2 schemas come from the installed benchmark itself (``AirlineTools`` / ``RetailTools`` on an empty
database, ``Tool.openai_schema``), so a synthetic environment is interface-preserving iff its schemas are
equal to these. ToolSandbox is not installable here; its schemas are transcribed from its tool signatures and
docstrings in the form ToolSandbox's own converter produces (``{"type": ..., "description": ...}`` per
argument, required = arguments without a default), and its system prompt is ToolSandbox's default one.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

TAU2_TARGETS = ("tau2_airline", "tau2_retail")
TARGETS = (*TAU2_TARGETS, "toolsandbox")

TOOLSANDBOX_SYSTEM_PROMPT = (
    "Don't make assumptions about what values to plug into functions. "
    "Ask for clarification if a user request is ambiguous."
)


def _ts_tool(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": t, "description": d} for k, (t, d) in params.items()},
                "required": required,
            },
        },
    }


def _toolsandbox_tools() -> dict[str, dict[str, Any]]:
    shift = "Number of {} to add or subtract"
    tools = [
        _ts_tool("set_low_battery_mode_status", "Enable / Disable low battery mode",
                 {"on": ("boolean", "If we want to turn on low battery mode")}, ["on"]),
        _ts_tool("get_low_battery_mode_status", "Request low battery mode status", {}, []),
        _ts_tool("set_location_service_status", "Enable / Disable location service",
                 {"on": ("boolean", "If we want to turn on location service")}, ["on"]),
        _ts_tool("get_location_service_status", "Request location service status", {}, []),
        _ts_tool("set_cellular_service_status", "Enable / Disable cellular service",
                 {"on": ("boolean", "If we want to turn on cellular service")}, ["on"]),
        _ts_tool("get_cellular_service_status", "Request cellular service status", {}, []),
        _ts_tool("set_wifi_status", "Enable / Disable wifi", {"on": ("boolean", "If we want to turn on wifi")}, ["on"]),
        _ts_tool("get_wifi_status", "Request wifi status", {}, []),
        _ts_tool("get_current_location", "Request current location latitude and longitude", {}, []),
        _ts_tool("get_current_timestamp", "Get current POSIX timestamp", {}, []),
        _ts_tool(
            "timestamp_to_datetime_info",
            "Convert POSIX timestamp to a dictionary of date time information, including\n"
            '    ["year", "month", "day", "hour", "minute", "second", "isoweekday"]\n'
            "    isoweekday ranges from [1, 7]",
            {"timestamp": ("number", "Float representing POSIX timestamp")},
            ["timestamp"],
        ),
        _ts_tool(
            "datetime_info_to_timestamp",
            "Convert  date time information to POSIX timestamp",
            {
                "year": ("integer", "Year of timestamp"),
                "month": ("integer", "Month of timestamp"),
                "day": ("integer", "Day of timestamp"),
                "hour": ("integer", "Hour of timestamp in 24hr format"),
                "minute": ("integer", "Minute of timestamp"),
                "second": ("integer", "Second of timestamp"),
            },
            ["year", "month", "day", "hour", "minute", "second"],
        ),
        _ts_tool(
            "shift_timestamp",
            "Shifts a POSIX timestamp by provided deltas. Delta can be positive or negative.",
            {
                "timestamp": ("number", "POSIX timestamp to be shifted"),
                **{u: ("integer", shift.format(u)) for u in ("weeks", "days", "hours", "minutes", "seconds")},
            },
            ["timestamp"],
        ),
        _ts_tool(
            "timestamp_diff",
            "Calculates the difference between two timestamps, timestamp_1 - timestamp_0, return the difference\n"
            "represented in days and seconds",
            {"timestamp_0": ("number", "Timestamp to subtract"), "timestamp_1": ("number", "Timestamp to subtract from")},
            ["timestamp_0", "timestamp_1"],
        ),
        _ts_tool(
            "search_holiday",
            "Search for a holiday by name in the US. Canonicalize return value into corresponding POSIX timestamp.",
            {
                "holiday_name": ("string", "Name of the holiday in surface form string"),
                "year": ("integer", "Optional. Year to search the holiday in. When not provided defaults to current year."),
            },
            ["holiday_name"],
        ),
        _ts_tool(
            "add_reminder",
            "Add a reminder",
            {
                "content": ("string", "Content of the reminder"),
                "reminder_timestamp": ("number", "When the user wants to be reminded. Expressed in POSIX timestamp"),
                "latitude": ("number", "Optional. Latitude of the location associated with this reminder"),
                "longitude": ("number", "Optional. Longitude of the location associated with this reminder"),
            },
            ["content", "reminder_timestamp"],
        ),
        _ts_tool(
            "search_reminder",
            "Search for a reminder based on provided arguments Each field has a search criteria of either\n"
            "1. Exact value matching\n2. Fuzzy string matching with a predefined threshold\n"
            "3. Range matching timestamp with upperbound or lowerbound\n"
            "Search results contains all reminder entries that matched all criteria",
            {
                "reminder_id": ("string", "String format unique identifier for the reminder person, will be exact matched"),
                "content": ("string", "Content of the reminder, will be fuzzy matched"),
                "creation_timestamp_lowerbound": (
                    "number", "Lowerbound of the POSIX timestamp of the time the reminder is created."),
                "creation_timestamp_upperbound": (
                    "number", "Upperbound of the POSIX timestamp of the time the reminder is created."),
                "reminder_timestamp_lowerbound": (
                    "number", "Lowerbound of the POSIX timestamp of the time the reminder should be reminded."),
                "reminder_timestamp_upperbound": (
                    "number", "Upperbound of the POSIX timestamp of the time the reminder should be reminded."),
                "latitude": ("number", "Latitude of the location associated with the reminder. Will be exact matched."),
                "longitude": (
                    "number", "Longitude of the location associated with the reminder. Will be exact matched."),
            },
            [],
        ),
        _ts_tool(
            "remove_reminder",
            "Remove a reminder given its unique identifier",
            {"reminder_id": ("string", "String format unique identifier of the reminder to be removed")},
            ["reminder_id"],
        ),
    ]
    return {t["function"]["name"]: t for t in tools}


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
        return _toolsandbox_tools()
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
