"""A small self-contained generated-style environment (ToolSandbox target): turn wifi on when low battery
mode blocks it. Used by the sandbox, validation and generation-agent tests; the HOOK comments are where the
tests splice in hostile code."""

import random

from tracekit.synthesis.protocol import Call, Instance, SyntheticEnv, World, db_match
from tracekit.synthesis.targets import tool_schemas

# HOOK:module


class WifiWorld(World):
    def __init__(self, state):
        self.state = state

    def call(self, name, arguments):
        s = self.state
        if name.startswith("get_"):
            return s["low_battery_mode"] if "battery" in name else s["wifi"]
        on = arguments["on"]
        if name == "set_wifi_status":
            if on and s["low_battery_mode"]:
                raise PermissionError("Wifi cannot be turned on in low battery mode")
            s["wifi"] = on
        else:
            s["low_battery_mode"] = on
            if on:
                s["wifi"] = False
        return None

    def snapshot(self):
        return self.state


class WifiEnv(SyntheticEnv):
    name = "wifi_recovery"
    capability = "permission_error_recovery"
    target = "toolsandbox"
    policy = "Don't make assumptions about what values to plug into functions."
    difficulty_levels = (0, 1)
    default_difficulty = 0

    def generate(self, seed):
        rng = random.Random(f"wifi:{self.difficulty}:{seed}")
        # HOOK:generate
        device = f"phone-{rng.randint(10000, 99999)}"
        blocked = rng.random() < 0.8 + 0.2 * self.difficulty
        state = {"device": device, "low_battery_mode": blocked, "wifi": False}
        solution = [Call(name="set_low_battery_mode_status", arguments={"on": False})] if blocked else []
        solution.append(Call(name="set_wifi_status", arguments={"on": True}))
        return Instance(seed=seed, system_prompt=self.policy, user_goal=f"Turn on wifi on my {device}.",
                        state=state, solution=solution)

    def tools(self):
        return tool_schemas(self.target, ["set_wifi_status", "get_wifi_status", "set_low_battery_mode_status",
                                          "get_low_battery_mode_status"])

    def new_world(self, instance):
        return WifiWorld(instance.state)

    def verify(self, instance, final_state, messages):
        # HOOK:verify
        ok = db_match(self, instance, final_state)
        return (1.0 if ok else 0.0), ok
