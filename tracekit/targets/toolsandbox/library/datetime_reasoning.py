"""ToolSandbox C2, datetime reasoning (paper Appendix J.2), on a ToolSandbox-shaped clock/holiday/reminder world.

The clock is a random moment in 2025-2027, so the year cannot be guessed from training data: the agent must
read ``get_current_timestamp`` and decode it with ``timestamp_to_datetime_info`` instead of decoding the raw
number mentally, then compute with ``datetime_info_to_timestamp`` / ``search_holiday`` / ``timestamp_diff``.
Reward: for reminder requests, exactly one new reminder at the requested moment whose content has the
requested words, existing reminders untouched; for "how many days until" questions, no reminder changed and
the right day count communicated (either the floored ``timestamp_diff`` days or the calendar-day difference).

Difficulty: 0 "tomorrow at H"; 1 plus "in N days at H"; 2 plus "this coming <weekday>" and days until a
holiday later this year; 3 plus reminders on a holiday and holidays already past (next year's). The prompt is
ToolSandbox's system prompt plus the time zone, and only the time and reminder tools plus distractors.
"""

from __future__ import annotations

import random
import re
from datetime import datetime, timedelta
from typing import Any

from tracekit.targets.toolsandbox.interface import TOOLSANDBOX_SYSTEM_PROMPT
from tracekit.targets.toolsandbox.library.common import ToolSandboxEnv, initial_state, to_ts, us_holidays, utc
from tracekit.synthesis.protocol import Call, Instance, communicated
from tracekit.types import Message

CONTENTS = ["buy chocolate milk", "call the dentist", "pick up the dry cleaning", "submit the expense report",
            "pay the rent", "water the plants", "renew my passport", "book a haircut", "send mom a card",
            "take out the recycling", "feed the cat", "return the library books"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
KINDS = {0: ["tomorrow"], 1: ["tomorrow", "in_days"], 2: ["tomorrow", "in_days", "weekday", "holiday_days"],
         3: ["in_days", "weekday", "holiday_days", "holiday_reminder"]}
STOPWORDS = {"the", "my", "a", "to"}


def clock(hour: int, minute: int) -> str:
    suffix = "AM" if hour < 12 else "PM"
    return f"{hour % 12 or 12}{':%02d' % minute if minute else ''} {suffix}"


def content_words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9]+", text.lower()) if w not in STOPWORDS}


class DatetimeReasoning(ToolSandboxEnv):
    name = "toolsandbox_datetime_reasoning"
    capability = "datetime_reasoning"
    description = ("Decode timestamps with the datetime tools instead of guessing, and compute relative dates "
                   "(tomorrow, in N days, next weekday, holidays in the current year) correctly.")
    policy = TOOLSANDBOX_SYSTEM_PROMPT + " All dates and times are UTC."
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 10
    _base = ["get_current_timestamp", "timestamp_to_datetime_info", "datetime_info_to_timestamp", "shift_timestamp",
             "add_reminder", "search_reminder"]
    tool_names_by_level = {0: _base, 1: _base, 2: [*_base, "search_holiday", "timestamp_diff", "remove_reminder"],
                           3: [*_base, "search_holiday", "timestamp_diff", "remove_reminder"]}

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        now = datetime(rng.randint(2025, 2027), rng.randint(1, 12), rng.randint(1, 28), rng.randint(7, 21),
                       rng.randint(0, 59), rng.randint(0, 59))
        now_ts = to_ts(now)
        existing = [{"reminder_id": f"reminder-{i + 1:04d}", "content": c, "creation_timestamp": now_ts - 86400 * (i + 1),
                     "reminder_timestamp": now_ts + rng.randint(-3, 14) * 86400 + rng.randint(0, 86399),
                     "latitude": None, "longitude": None}
                    for i, c in enumerate(rng.sample(CONTENTS, rng.randint(1, 3)))]
        state = initial_state(now, reminders=existing)
        kind = rng.choice(KINDS[self.difficulty])
        content = rng.choice([c for c in CONTENTS if c not in {r["content"] for r in existing}])
        hour = rng.choice([8, 9, 10, 12, 14, 15, 17, 18, 20])
        minute = rng.choice([0, 0, 30]) if self.difficulty else 0
        info = {"year": now.year, "month": now.month, "day": now.day, "hour": now.hour, "minute": now.minute,
                "second": now.second, "isoweekday": now.isoweekday()}
        solution = [Call(name="get_current_timestamp"),
                    Call(name="timestamp_to_datetime_info", arguments={"timestamp": now_ts})]
        expected: list[list[str]] = []
        params: dict[str, Any] = {"kind": kind, "now": info}

        if kind in ("holiday_days", "holiday_reminder"):
            upcoming = [(n, d) for n, d in us_holidays(now.year).items() if d > now.date()]
            passed = [(n, d) for n, d in us_holidays(now.year).items() if d <= now.date()]
            pool = upcoming if self.difficulty < 3 or not passed or rng.random() < 0.5 else passed
            if not pool:
                pool = passed
            holiday, day = rng.choice(pool)
            year = now.year if day > now.date() else now.year + 1
            day = us_holidays(year)[holiday]
            holiday_ts = to_ts(datetime(day.year, day.month, day.day))
            solution.append(Call(name="search_holiday", arguments={"holiday_name": holiday, "year": year}))
            params["holiday"] = holiday
        if kind == "holiday_days":
            solution.append(Call(name="timestamp_diff", arguments={"timestamp_0": now_ts, "timestamp_1": holiday_ts}))
            floored = (utc(holiday_ts) - utc(now_ts)).days
            calendar_days = (day - now.date()).days
            expected = [sorted({str(floored), str(calendar_days)})]
            goal = rng.choice([f"How many days until {holiday}?", f"How many days are left until {holiday}?"])
            params["days"] = floored
            return Instance(seed=seed, system_prompt=self.policy, user_goal=goal, state=state, params=params,
                            solution=solution, expected_outputs=expected)

        if kind == "tomorrow":
            target, when = now.date() + timedelta(days=1), "tomorrow"
        elif kind == "in_days":
            n = rng.randint(2, 9)
            target, when = now.date() + timedelta(days=n), f"in {n} days"
        elif kind == "weekday":
            weekday = rng.randint(1, 7)
            ahead = (weekday - now.isoweekday()) % 7 or 7
            target, when = now.date() + timedelta(days=ahead), f"this coming {WEEKDAYS[weekday - 1]}"
        else:
            target, when = day, f"on {holiday}"
        moment = datetime(target.year, target.month, target.day, hour, minute, 0)
        solution += [
            Call(name="datetime_info_to_timestamp", arguments={"year": moment.year, "month": moment.month,
                                                               "day": moment.day, "hour": hour, "minute": minute,
                                                               "second": 0}),
            Call(name="add_reminder", arguments={"content": content, "reminder_timestamp": to_ts(moment)}),
        ]
        goal = f"Remind me to {content} {when} at {clock(hour, minute)}."
        params.update(content=content, target_timestamp=to_ts(moment))
        return Instance(seed=seed, system_prompt=self.policy, user_goal=goal, state=state, params=params,
                        solution=solution, expected_outputs=expected)

    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        initial = {r["reminder_id"]: r for r in instance.state["reminders"]}
        final = final_state["reminders"]
        untouched = all(any(r == old for r in final) for old in initial.values())
        new = [r for r in final if r["reminder_id"] not in initial]
        if instance.params["kind"] == "holiday_days":
            ok = untouched and not new and communicated(messages, instance.expected_outputs)
        else:
            ok = (untouched and len(new) == 1
                  and abs(float(new[0]["reminder_timestamp"]) - instance.params["target_timestamp"]) < 1.0
                  and content_words(instance.params["content"]) <= content_words(str(new[0]["content"])))
        return (1.0 if ok else 0.0), ok
