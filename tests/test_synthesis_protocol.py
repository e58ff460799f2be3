"""Protocol helpers: the communicate check, replay, the episode core's error handling, verdict bounds."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tracekit.synthesis.library import library_env
from tracekit.synthesis.protocol import (
    Call,
    EpisodeCore,
    Verdict,
    communicated,
    find_env_class,
    ground_truth_actions,
    mentions,
    replay,
    state_hash,
)
from tracekit.types import Message, ToolCall


def test_mentions_uses_word_boundaries_and_tau2_normalisation():
    assert mentions("It costs $1,274 in total.", "1274")  # commas dropped, as tau^2 does
    assert not mentions("There are 273 days left.", "27")  # no match inside a longer number
    assert mentions("Flight HAT042 it is", "hat042")
    assert mentions("I can\u2019t cancel it", "can't")
    assert not mentions("anything", "")


def test_communicated_needs_every_group_from_the_assistant():
    msgs = [Message(role="user", content="is it HAT001?"), Message(role="assistant", content="Yes: HAT001 for $99.")]
    assert communicated(msgs, [["HAT001"], ["99", "ninety-nine"]])
    assert not communicated(msgs, [["HAT001"], ["100"]])
    assert not communicated(msgs[:1], [["HAT001"]])  # the user saying it does not count
    assert communicated(msgs, [])


def test_replay_skips_failing_calls_and_core_reports_errors():
    env = library_env("toolsandbox_permission_error_recovery")(0)
    inst = next(env.generate(z) for z in range(20) if env.generate(z).params["blocked"])
    wanted = inst.params["wanted"][0]
    # the failing first call is skipped, as tau^2 skips failing gold actions
    final = replay(env, inst, inst.solution)
    assert final["settings"][wanted] and not final["settings"]["low_battery_mode"]
    assert state_hash(final) == state_hash(replay(env, inst, inst.solution[1:]))
    core = EpisodeCore(env, inst)
    bad_args = core.execute(ToolCall(id="1", name="set_wifi_status", arguments={"wrong": 1}))
    assert bad_args.error and bad_args.content.startswith("TypeError:")
    hidden = core.execute(ToolCall(id="2", name="get_current_location", arguments={}))  # not exposed at level 0
    assert hidden.error and "Tool 'get_current_location' not found" in hidden.content
    assert inst.state["settings"]["low_battery_mode"]  # the instance itself is never mutated
    core.execute(ToolCall(id="3", name="set_low_battery_mode_status", arguments={"on": False}))
    assert inst.state["settings"]["low_battery_mode"]


def test_verdict_bounds_and_ground_truth_shape():
    with pytest.raises(ValidationError):
        Verdict(reward=1.5, success=True)
    with pytest.raises(ValidationError):
        Verdict(reward=float("nan"), success=False)
    inst = library_env("tau2_structured_data_reasoning")(1).generate(0)
    acts = ground_truth_actions(inst)
    assert [a.tool_calls[0].name for a in acts[:-1]] == [c.name for c in inst.solution]
    assert acts[-1].content == f"{inst.params['answer']} {inst.params['total']}"
    assert Call(name="x").arguments == {}


def test_find_env_class_rules():
    import types

    from tracekit.targets.toolsandbox.library.datetime_reasoning import DatetimeReasoning

    module = types.ModuleType("m")
    with pytest.raises(TypeError, match="exactly one concrete SyntheticEnv subclass \\(found: none\\)"):
        find_env_class(module)
    module.ENV_CLASS = DatetimeReasoning
    assert find_env_class(module) is DatetimeReasoning
    module.ENV_CLASS = int
    with pytest.raises(TypeError, match="not a SyntheticEnv subclass"):
        find_env_class(module)
