"""ToolSandbox C1, permission error recovery (paper Appendix J.2), on a ToolSandbox-shaped settings world.

The user asks to turn a service on (wifi, cellular, location service) or for their location. In low battery
mode the setter raises ``PermissionError: Wifi cannot be turned on in low battery mode``; the agent must
diagnose the blocker (``get_low_battery_mode_status``), disable it, retry, and report. Reward: the final
settings equal the ground-truth replay's (nothing else switched) AND requested values (the coordinates) were
communicated.

Difficulty: 0 one service, always blocked; 1 one or two services; 2 plus "where am I" (location needs location
service, which needs low battery mode off); 3 plus instances where nothing is blocked (do not touch low
battery mode). The prompt is ToolSandbox's system prompt and only the settings tools.
"""

from __future__ import annotations

import random
from datetime import datetime
from typing import Any

from tracekit.targets.toolsandbox.library.common import ToolSandboxEnv, initial_state
from tracekit.synthesis.protocol import Call, Instance, communicated, db_match
from tracekit.types import Message

SETTERS = {"wifi": "set_wifi_status", "cellular": "set_cellular_service_status",
           "location_service": "set_location_service_status"}
PHRASES = {"wifi": ["wifi", "Wi-Fi", "the wifi"], "cellular": ["cellular data", "cellular service", "mobile data"],
           "location_service": ["location services", "location service", "GPS location service"]}
ASKS = ["Turn on {}.", "Please enable {}.", "Can you switch on {}?", "I need {} on."]


class PermissionErrorRecovery(ToolSandboxEnv):
    name = "toolsandbox_permission_error_recovery"
    capability = "permission_error_recovery"
    description = ("When a tool call fails with a PermissionError caused by a device setting, diagnose the "
                   "blocking setting, resolve it, retry the original action and report success.")
    difficulty_levels = (0, 1, 2, 3)
    default_difficulty = 1
    max_turns = 10
    _tools = ["set_wifi_status", "get_wifi_status", "set_cellular_service_status", "get_cellular_service_status",
              "set_location_service_status", "get_location_service_status", "set_low_battery_mode_status",
              "get_low_battery_mode_status"]
    tool_names_by_level = {0: _tools, 1: _tools, 2: [*_tools, "get_current_location"],
                           3: [*_tools, "get_current_location"]}

    def generate(self, seed: int) -> Instance:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        level = self.difficulty
        blocked = not (level == 3 and rng.random() < 0.3)
        kind = "location" if level >= 2 and rng.random() < 0.4 else "services"
        if kind == "location":
            wanted = ["location_service"]
        else:
            wanted = rng.sample(sorted(SETTERS), 2 if level >= 1 and rng.random() < 0.5 else 1)
        settings: dict[str, Any] = {"low_battery_mode": blocked, "latitude": round(rng.uniform(-60, 60), 4),
                                    "longitude": round(rng.uniform(-170, 170), 4)}
        for s in SETTERS:  # low battery mode forces dependents off; otherwise the requested ones start off
            settings[s] = False if blocked or s in wanted else rng.random() < 0.5
        now = datetime(rng.randint(2025, 2027), rng.randint(1, 12), rng.randint(1, 28), rng.randint(0, 23),
                       rng.randint(0, 59), rng.randint(0, 59))
        state = initial_state(now, settings)

        solution: list[Call] = []
        if blocked:  # the failing call, the diagnosis, the fix, then the retry (paper's example)
            solution += [Call(name=SETTERS[wanted[0]], arguments={"on": True}),
                         Call(name="get_low_battery_mode_status"),
                         Call(name="set_low_battery_mode_status", arguments={"on": False})]
            solution += [Call(name=SETTERS[w], arguments={"on": True}) for w in wanted]
        else:
            solution += [Call(name=SETTERS[w], arguments={"on": True}) for w in wanted]
        expected: list[list[str]] = []
        if kind == "location":
            solution.append(Call(name="get_current_location"))
            goal = rng.choice(["Where am I right now? Tell me my latitude and longitude.",
                               "What are my current coordinates?"])
            expected = [[str(settings["latitude"])], [str(settings["longitude"])]]
        else:
            names = [rng.choice(PHRASES[w]) for w in wanted]
            goal = rng.choice(ASKS).format(" and ".join(names))
        return Instance(seed=seed, system_prompt=self.policy, user_goal=goal, state=state,
                        params={"wanted": wanted, "blocked": blocked, "kind": kind},
                        solution=solution, expected_outputs=expected)

    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        ok = db_match(self, instance, final_state) and communicated(messages, instance.expected_outputs)
        return (1.0 if ok else 0.0), ok
