"""The built-in reference environments: validation (50 seeds), the target's interface, and verifiers that
reward the capability and nothing else."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tracekit.synthesis.library import LIBRARY_NAMES, find_library_env, library_env, library_source
from tracekit.synthesis.protocol import ground_truth_actions, noop_actions, score_actions
from tracekit.synthesis.targets import target_tools
from tracekit.synthesis.validate import ValidationConfig, validate_env
from tracekit.types import Message, ToolCall


def call(name: str, i: int = 0, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(id=f"t{i}", name=name, arguments=arguments)])


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


# the coding environments run real sandboxed subprocesses per call (~1.5 s an instance): validated in
# tests/test_coding_library.py on fewer seeds (every difficulty there is slow)
IN_PROCESS = [n for n in LIBRARY_NAMES if not n.startswith("coding_")]


@pytest.mark.parametrize("name", IN_PROCESS)
def test_builtin_env_passes_validation(name):
    report = validate_env(library_env(name), cfg=ValidationConfig(n_seeds=50))
    assert report.passed, report.reason
    assert report.stats["distinct_instances"] == 50
    assert report.sample["prompt_chars"] < 8000  # short prompts for the small default backbone


@pytest.mark.slow
@pytest.mark.parametrize("name", IN_PROCESS)
def test_builtin_env_passes_validation_at_every_difficulty(name):
    cls = library_env(name)
    for level in cls.difficulty_levels:
        report = validate_env(cls, level, ValidationConfig(n_seeds=200))
        assert report.passed, f"difficulty {level}: {report.reason}"


@pytest.mark.parametrize("name", [n for n in LIBRARY_NAMES if n.startswith("tau2")])
def test_tau2_envs_expose_the_real_tau2_schemas(name):
    cls = library_env(name)
    reference = target_tools(cls.target)
    for level in cls.difficulty_levels:
        for tool in cls(level).tools():
            assert tool == reference[tool["function"]["name"]]


def test_registry_lookup_and_sources():
    assert find_library_env("structured data reasoning", "tau2_airline").name == "tau2_structured_data_reasoning"
    assert find_library_env("datetime_reasoning", "toolsandbox").target == "toolsandbox"
    assert find_library_env("datetime_reasoning", "tau2_retail") is None
    assert find_library_env("no_such_capability") is None
    assert "class PreconditionVerification" in library_source("tau2_precondition_verification")
    with pytest.raises(KeyError, match="no built-in synthetic environment"):
        library_env("nope")


def test_difficulty_must_be_a_declared_level():
    with pytest.raises(ValueError, match="difficulty 9 not in"):
        library_env("tau2_multi_step_task_completion")(9)


# ------------------------------------------------------------------ verifiers reward the capability


def _instances(name: str, level: int, n: int = 40):
    env = library_env(name)(level)
    return env, [env.generate(z) for z in range(n)]


def test_structured_data_reasoning_wrong_flight_or_price_scores_zero():
    env, instances = _instances("tau2_structured_data_reasoning", 1, 10)
    for inst in instances:
        flight, total = inst.params["answer"], inst.params["total"]
        search = call("search_direct_flight", **inst.solution[0].arguments)
        assert score_actions(env, inst, [search, say(f"Take {flight}; it costs ${total}.")]).reward == 1.0
        assert score_actions(env, inst, [search, say(f"Take {flight}; it costs ${total + 1}.")]).reward == 0.0
        others = [n for n in inst.state["flights"] if n != flight]
        assert score_actions(env, inst, [search, say(f"Take {others[0]}; it costs ${total}.")]).reward == 0.0


def test_precondition_verification_requires_lookup_and_policy():
    env, instances = _instances("tau2_precondition_verification", 2)
    eligible = [i for i in instances if i.params["eligible"]]
    ineligible = [i for i in instances if not i.params["eligible"]]
    assert eligible and ineligible  # both kinds occur
    for inst in eligible:
        rid = inst.params["reservation_id"]
        # cancelling blindly (no lookup first) is not rewarded even though the state is right
        assert score_actions(env, inst, [call("cancel_reservation", reservation_id=rid), say("Done.")]).reward == 0.0
        assert score_actions(env, inst, ground_truth_actions(inst)).reward == 1.0
    for inst in ineligible:
        rid = inst.params["reservation_id"]
        lookup = call("get_reservation_details", reservation_id=rid)
        # the API does not enforce the policy: cancelling anyway changes the database -> 0
        assert score_actions(env, inst, [lookup, call("cancel_reservation", 1, reservation_id=rid), say("Done.")]
                             ).reward == 0.0
        assert score_actions(env, inst, [lookup, say("Sorry, this reservation cannot be cancelled.")]).reward == 1.0
        assert score_actions(env, inst, [say("Sorry, this reservation cannot be cancelled.")]).reward == 0.0


def test_tool_calling_precision_wrong_argument_scores_zero():
    env, instances = _instances("tau2_tool_calling_precision", 1)
    checked = set()
    for inst in instances:
        write = inst.solution[-1]
        args = dict(write.arguments)
        if write.name == "return_delivered_order_items":
            pms = next(iter(inst.state["users"].values()))["payment_methods"]
            args["payment_method_id"] = next(p for p in pms if p != args["payment_method_id"])
        elif write.name == "cancel_pending_order":
            args["reason"] = "no longer needed" if args["reason"] != "no longer needed" else "ordered by mistake"
        else:
            args["order_id"] = args["order_id"].lstrip("#")
        checked.add(write.name)
        bad = [*ground_truth_actions(inst)[:-2], call(write.name, 9, **args), say("Done.")]
        assert score_actions(env, inst, bad).reward == 0.0, write.name
    assert checked == {"return_delivered_order_items", "cancel_pending_order", "modify_pending_order_payment"}


def test_multi_step_stopping_after_the_first_operation_scores_zero():
    env, instances = _instances("tau2_multi_step_task_completion", 2, 10)
    for inst in instances:
        gt = ground_truth_actions(inst)
        assert score_actions(env, inst, gt[:3] + [say("Your first request is done. Anything else?")]).reward == 0.0
        assert score_actions(env, inst, gt).reward == 1.0


def test_permission_error_recovery_matches_the_paper_example():
    env, instances = _instances("toolsandbox_permission_error_recovery", 0, 40)
    inst = next(i for i in instances if i.params["wanted"] == ["wifi"])
    from tracekit.synthesis.protocol import EpisodeCore

    core = EpisodeCore(env, inst)
    first = core.execute(ToolCall(id="a", name="set_wifi_status", arguments={"on": True}))
    assert first.error and first.content == "PermissionError: Wifi cannot be turned on in low battery mode"
    assert core.execute(ToolCall(id="b", name="get_low_battery_mode_status", arguments={})).content == "True"
    # giving up after the error scores 0; recovering scores 1; switching on more than asked scores 0
    assert score_actions(env, inst, [call("set_wifi_status", on=True), say("Sorry, wifi cannot be turned on.")]
                         ).reward == 0.0
    assert score_actions(env, inst, ground_truth_actions(inst)).reward == 1.0
    over = [*ground_truth_actions(inst)[:-1], call("set_cellular_service_status", 9, on=True), say("Done.")]
    assert score_actions(env, inst, over).reward == 0.0


def test_datetime_reasoning_rewards_decoding_the_clock():
    env, instances = _instances("toolsandbox_datetime_reasoning", 2, 60)
    reminder = next(i for i in instances if i.params["kind"] == "tomorrow")
    target = reminder.params["target_timestamp"]
    content = reminder.params["content"]
    for wrong in (target - 86400, target + 86400, target - 365 * 86400):  # off by a day, wrong year
        acts = [call("add_reminder", content=content, reminder_timestamp=wrong), say("Done.")]
        assert score_actions(env, reminder, acts).reward == 0.0
    acts = [call("add_reminder", content=content.capitalize(), reminder_timestamp=target), say("Done.")]
    assert score_actions(env, reminder, acts).reward == 1.0
    holiday = next(i for i in instances if i.params["kind"] == "holiday_days")
    days = holiday.params["days"]
    assert score_actions(env, holiday, [say(f"There are {days} days left.")]).reward == 1.0
    assert score_actions(env, holiday, [say(f"There are {days + 7} days left.")]).reward == 0.0


def test_datetime_tools_are_utc_and_match_toolsandbox_semantics():
    from tracekit.targets.toolsandbox.library.common import ToolSandboxWorld, initial_state, us_holidays

    world = ToolSandboxWorld(initial_state(datetime(2026, 3, 26, 10, 17, 53)))
    ts = world.call("get_current_timestamp", {})
    assert ts == datetime(2026, 3, 26, 10, 17, 53, tzinfo=timezone.utc).timestamp()
    info = world.call("timestamp_to_datetime_info", {"timestamp": ts})
    assert info == {"year": 2026, "month": 3, "day": 26, "hour": 10, "minute": 17, "second": 53, "isoweekday": 4}
    xmas = world.call("search_holiday", {"holiday_name": "christmas", "year": 2026})
    assert world.call("timestamp_diff", {"timestamp_0": ts, "timestamp_1": xmas}) == {"days": 273, "seconds": 49327}
    assert us_holidays(2026)["Thanksgiving"].isoformat() == "2026-11-26"  # 4th Thursday of November
    assert us_holidays(2026)["Memorial Day"].isoformat() == "2026-05-25"  # last Monday of May
    with pytest.raises(TypeError, match="should be of type bool"):
        world.call("set_wifi_status", {"on": "true"})


def test_noop_is_never_rewarded_on_any_level():
    for name in LIBRARY_NAMES:
        cls = library_env(name)
        for level in cls.difficulty_levels:
            env = cls(level)
            for z in range(5):
                assert score_actions(env, env.generate(z), noop_actions()).reward == 0.0, (name, level)
