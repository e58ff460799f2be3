"""A stateful ToolSandbox-shaped world: device settings, POSIX-time utilities, holidays and reminders.

Tool names, arguments, return values and error types follow ToolSandbox's tools (``setting.py``,
``utilities.py``, ``reminder.py``): e.g. ``set_wifi_status(on=True)`` in low battery mode raises
``PermissionError: Wifi cannot be turned on in low battery mode``; turning low battery mode on switches wifi,
cellular and location service off. Deviations, for determinism: all datetimes are UTC (ToolSandbox uses the
machine's local zone), reminder ids are a counter instead of uuid4, the clock is the instance's fixed
``current_timestamp``, and holidays come from a small built-in US federal holiday table.
"""

from __future__ import annotations

import calendar
import re
from datetime import date, datetime, timedelta, timezone
from typing import Any, ClassVar

from tracekit.targets.toolsandbox.interface import TOOLSANDBOX_SYSTEM_PROMPT
from tracekit.synthesis.protocol import Instance, SyntheticEnv, World
from tracekit.synthesis.targets import tool_schemas

SETTINGS = ("low_battery_mode", "wifi", "cellular", "location_service")
DEPENDENT = {"wifi": "Wifi", "cellular": "Cellular service", "location_service": "Location service"}


def _nth_weekday(year: int, month: int, weekday: int, n: int) -> date:
    """The n-th (1-based; -1 = last) given weekday (Mon=0) of a month."""
    days = [d for d in calendar.Calendar().itermonthdates(year, month) if d.month == month and d.weekday() == weekday]
    return days[n - 1] if n > 0 else days[-1]


def us_holidays(year: int) -> dict[str, date]:
    """US federal holidays of ``year`` under the names the ``holidays`` package (used by ToolSandbox) gives them."""
    return {
        "New Year's Day": date(year, 1, 1),
        "Martin Luther King Jr. Day": _nth_weekday(year, 1, 0, 3),
        "Washington's Birthday": _nth_weekday(year, 2, 0, 3),
        "Memorial Day": _nth_weekday(year, 5, 0, -1),
        "Juneteenth National Independence Day": date(year, 6, 19),
        "Independence Day": date(year, 7, 4),
        "Labor Day": _nth_weekday(year, 9, 0, 1),
        "Columbus Day": _nth_weekday(year, 10, 0, 2),
        "Veterans Day": date(year, 11, 11),
        "Thanksgiving": _nth_weekday(year, 11, 3, 4),
        "Christmas Day": date(year, 12, 25),
    }


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9 ]", "", text.lower()).strip()


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def to_ts(dt: datetime) -> float:
    return dt.replace(tzinfo=timezone.utc).timestamp()


def _check(value: Any, name: str, kinds: tuple[type, ...]) -> None:
    # ToolSandbox's validate_type: bools are not numbers here, and a string is not a bool
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise TypeError(f"Parameter {name} should be of type {'/'.join(k.__name__ for k in kinds)}, got {value!r}")


class ToolSandboxWorld(World):
    """state = {"settings": {...}, "current_timestamp": float, "reminders": [...], "next_reminder": int}."""

    def __init__(self, state: dict[str, Any]):
        self.state = state

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        fn = getattr(self, f"t_{name}", None)
        if fn is None:
            raise ValueError(f"Tool '{name}' not found.")
        return fn(**arguments)

    def snapshot(self) -> dict[str, Any]:
        return self.state

    # -- settings
    def _set(self, setting: str, on: Any) -> None:
        _check(on, "on", (bool,))
        if self.state["settings"][setting] == on:
            raise ValueError(f"{setting} already {('disabled', 'enabled')[int(on)]}")
        self.state["settings"][setting] = on

    def _set_dependent(self, setting: str, on: Any) -> None:
        _check(on, "on", (bool,))
        if on and self.state["settings"]["low_battery_mode"]:
            raise PermissionError(f"{DEPENDENT[setting]} cannot be turned on in low battery mode")
        self._set(setting, on)

    def t_set_low_battery_mode_status(self, on: Any) -> None:
        self._set("low_battery_mode", on)
        if on:
            for dependent in DEPENDENT:
                self.state["settings"][dependent] = False

    def t_get_low_battery_mode_status(self) -> bool:
        return self.state["settings"]["low_battery_mode"]

    def t_set_wifi_status(self, on: Any) -> None:
        self._set_dependent("wifi", on)

    def t_get_wifi_status(self) -> bool:
        return self.state["settings"]["wifi"]

    def t_set_cellular_service_status(self, on: Any) -> None:
        self._set_dependent("cellular", on)

    def t_get_cellular_service_status(self) -> bool:
        return self.state["settings"]["cellular"]

    def t_set_location_service_status(self, on: Any) -> None:
        self._set_dependent("location_service", on)

    def t_get_location_service_status(self) -> bool:
        return self.state["settings"]["location_service"]

    def t_get_current_location(self) -> dict[str, float]:
        if not self.state["settings"]["location_service"]:
            raise PermissionError("Location service is not enabled.")
        return {"latitude": self.state["settings"]["latitude"], "longitude": self.state["settings"]["longitude"]}

    # -- time
    def t_get_current_timestamp(self) -> float:
        return float(self.state["current_timestamp"])

    def t_timestamp_to_datetime_info(self, timestamp: Any) -> dict[str, int]:
        _check(timestamp, "timestamp", (int, float))
        d = utc(float(timestamp))
        return {"year": d.year, "month": d.month, "day": d.day, "hour": d.hour, "minute": d.minute,
                "second": d.second, "isoweekday": d.isoweekday()}

    def t_datetime_info_to_timestamp(self, year: Any, month: Any, day: Any, hour: Any, minute: Any, second: Any) -> float:
        for k, v in dict(year=year, month=month, day=day, hour=hour, minute=minute, second=second).items():
            _check(v, k, (int,))
        return to_ts(datetime(year, month, day, hour, minute, second))

    def t_shift_timestamp(self, timestamp: Any, weeks: int = 0, days: int = 0, hours: int = 0, minutes: int = 0,
                          seconds: int = 0) -> float:
        _check(timestamp, "timestamp", (int, float))
        delta = timedelta(weeks=weeks, days=days, hours=hours, minutes=minutes, seconds=seconds)
        return (utc(float(timestamp)) + delta).timestamp()

    def t_timestamp_diff(self, timestamp_0: Any, timestamp_1: Any) -> dict[str, int]:
        _check(timestamp_0, "timestamp_0", (int, float))
        _check(timestamp_1, "timestamp_1", (int, float))
        delta = utc(float(timestamp_1)) - utc(float(timestamp_0))
        return {"days": delta.days, "seconds": delta.seconds}

    def t_search_holiday(self, holiday_name: Any, year: Any = None) -> float | None:
        _check(holiday_name, "holiday_name", (str,))
        if year is None:
            year = utc(self.state["current_timestamp"]).year
        _check(year, "year", (int,))
        query = _norm(holiday_name)
        for name, day in us_holidays(year).items():
            if query and (query in _norm(name) or _norm(name) in query):
                return to_ts(datetime(day.year, day.month, day.day))
        return None

    # -- reminders
    def t_add_reminder(self, content: Any, reminder_timestamp: Any, latitude: Any = None, longitude: Any = None) -> str:
        _check(content, "content", (str,))
        _check(reminder_timestamp, "reminder_timestamp", (int, float))
        self.state["next_reminder"] += 1
        rid = f"reminder-{self.state['next_reminder']:04d}"
        self.state["reminders"].append({
            "reminder_id": rid, "content": content, "creation_timestamp": float(self.state["current_timestamp"]),
            "reminder_timestamp": float(reminder_timestamp), "latitude": latitude, "longitude": longitude})
        return rid

    def t_search_reminder(self, reminder_id: Any = None, content: Any = None, creation_timestamp_lowerbound: Any = None,
                          creation_timestamp_upperbound: Any = None, reminder_timestamp_lowerbound: Any = None,
                          reminder_timestamp_upperbound: Any = None, latitude: Any = None,
                          longitude: Any = None) -> list[dict[str, Any]]:
        given = {k: v for k, v in locals().items() if k != "self" and v is not None}
        if not given:
            raise ValueError("No search criteria given")

        def keep(r: dict[str, Any]) -> bool:
            checks = [
                reminder_id is None or r["reminder_id"] == reminder_id,
                content is None or _norm(str(content)) in _norm(r["content"]) or _norm(r["content"]) in _norm(str(content)),
                creation_timestamp_lowerbound is None or r["creation_timestamp"] >= creation_timestamp_lowerbound,
                creation_timestamp_upperbound is None or r["creation_timestamp"] <= creation_timestamp_upperbound,
                reminder_timestamp_lowerbound is None or r["reminder_timestamp"] >= reminder_timestamp_lowerbound,
                reminder_timestamp_upperbound is None or r["reminder_timestamp"] <= reminder_timestamp_upperbound,
                latitude is None or r["latitude"] == latitude,
                longitude is None or r["longitude"] == longitude,
            ]
            return all(checks)

        return [dict(r) for r in self.state["reminders"] if keep(r)]

    def t_remove_reminder(self, reminder_id: Any) -> None:
        before = len(self.state["reminders"])
        self.state["reminders"] = [r for r in self.state["reminders"] if r["reminder_id"] != reminder_id]
        if len(self.state["reminders"]) == before:
            raise ValueError(f"No db entry matching reminder_id={reminder_id!r} found")


def initial_state(current: datetime, settings: dict[str, Any] | None = None,
                  reminders: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    base = {"low_battery_mode": False, "wifi": True, "cellular": True, "location_service": True,
            "latitude": 37.3349, "longitude": -122.009}
    return {"settings": {**base, **(settings or {})}, "current_timestamp": to_ts(current),
            "reminders": reminders or [], "next_reminder": len(reminders or [])}


class ToolSandboxEnv(SyntheticEnv):
    """A ToolSandbox-target environment: ToolSandbox's schemas, system prompt and result/error formatting."""

    target = "toolsandbox"
    policy = TOOLSANDBOX_SYSTEM_PROMPT
    tool_names_by_level: ClassVar[dict[int, list[str]]]

    def tools(self) -> list[dict[str, Any]]:
        return tool_schemas(self.target, self.tool_names_by_level[self.difficulty])

    def new_world(self, instance: Instance) -> World:
        return ToolSandboxWorld(instance.state)

    def format_result(self, value: Any) -> str:
        return value if isinstance(value, str) else repr(value)  # ToolSandbox shows Python reprs (None, True)

    def format_error(self, exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}"

