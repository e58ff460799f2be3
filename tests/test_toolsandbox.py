"""The ToolSandbox target: the registry entry, its checks, metric and labeler (fast), and the real ToolSandbox behind
its environment server (skipped, with the reason, where its virtual environment is not built: scripts/install.sh
with TOOLSANDBOX_SRC)."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.targets.toolsandbox.suite import INSTALL_STEP, missing_environment
from tracekit.target_index import kind_of_env
from tracekit.targets.registry import (
    kinds,
    target,
    target_of,
    target_of_trajectories,
)
from tracekit.types import Message, ToolCall, Trajectory

CONF = Path(__file__).resolve().parent.parent / "conf" / "benchmark"
NO_VENV = missing_environment()
needs_venv = pytest.mark.skipif(NO_VENV is not None, reason=str(NO_VENV))


# ---------------------------------------------------------------------------------------------- fast


def test_every_registered_target_has_a_benchmark_config_and_answers_to_its_kind():
    import yaml

    conf_kinds = {yaml.safe_load(p.read_text())["kind"] for p in CONF.glob("*.yaml")}
    for kind in kinds():
        assert kind in conf_kinds, f"target {kind} has no conf/benchmark/*.yaml"
        assert target(kind).kind == kind
    assert target("toolsandbox").metric == "similarity" and target("tau2").metric == "pass_rate"


def test_targets_give_their_synthesis_family(make_cfg):
    assert target_of(make_cfg("experiment=embedded", "benchmark=tau2_airline")).synthesis_family(make_cfg("experiment=embedded", "benchmark=tau2_airline")) == "tau2_airline"
    assert target("tau2").synthesis_family(make_cfg("experiment=embedded", "benchmark=tau2")) == "tau2_retail"
    assert target("toolsandbox").synthesis_family(make_cfg("experiment=embedded", "benchmark=toolsandbox")) == "toolsandbox"
    assert kind_of_env("toolsandbox") == kind_of_env("toolsandbox_all_tools") == "toolsandbox"
    assert kind_of_env("toolsandbox_datetime_reasoning") == "toolsandbox"  # a library environment: its family's analysis
    assert kind_of_env("tau2_retail") == "tau2"


def test_without_its_environment_toolsandbox_is_refused_in_one_line_naming_the_install_step(make_cfg, monkeypatch):
    monkeypatch.setenv("TOOLSANDBOX_VENV", "/nonexistent/toolsandbox-venv")
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=embedded", "benchmark=toolsandbox", "experiment=smoke"))
    assert INSTALL_STEP in str(e.value) and "\n" not in str(e.value)


def test_toolsandbox_domains_and_split_are_checked(make_cfg, monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")  # only its presence is checked here
    monkeypatch.setenv("TOOLSANDBOX_VENV", str(tmp_path))
    validate(make_cfg("experiment=embedded", "benchmark=toolsandbox", "benchmark.domains=[base,all_tools]"))
    with pytest.raises(ConfigError, match="benchmark.domains"):
        validate(make_cfg("experiment=embedded", "benchmark=toolsandbox", "benchmark.domains=[airline]"))
    with pytest.raises(ConfigError, match="benchmark.domains"):
        validate(make_cfg("experiment=embedded", "benchmark=tau2_retail", "benchmark.domains=[base]"))
    with pytest.raises(ConfigError, match="benchmark.split"):
        validate(make_cfg("experiment=embedded", "benchmark=toolsandbox", "benchmark.split=test"))


def test_eval_benchmark_evaluates_on_another_target(make_cfg, monkeypatch, tmp_path):
    """Table 8: trained on one target, every policy rolled out on another (its contents in the evaluate key)."""
    from tracekit.targets.registry import evaluation_config
    from tracekit.stages import build_pipeline

    cfg = make_cfg("experiment=embedded", "benchmark=tau2_mini", "eval.benchmark=toolsandbox")
    on = evaluation_config(cfg)
    assert on.benchmark.kind == "toolsandbox" and cfg.benchmark.kind == "synthetic"
    pipe = build_pipeline()
    assert "eval.benchmark" in pipe.reads(cfg, "evaluate")
    assert "eval.benchmark" not in pipe.reads(make_cfg("experiment=embedded", "benchmark=tau2_mini"), "evaluate")  # unset: keys as before
    monkeypatch.setenv("TOOLSANDBOX_VENV", "/nonexistent/toolsandbox-venv")
    with pytest.raises(ConfigError, match="install.sh"):  # the evaluation target's own checks, before any work
        validate(cfg)
    with pytest.raises(ConfigError, match="eval.benchmark"):
        validate(make_cfg("experiment=embedded", "eval.benchmark=no_such_benchmark"))


def _traj(task, reward, categories, messages=(), sample=0, env="toolsandbox", **info):
    return Trajectory(task_id=task, env=env, sample=sample, reward=reward, success=reward >= 1.0,
                      messages=list(messages), info={"categories": categories, **info})


def test_similarity_summary_counts_perfect_and_breaks_down_by_category():
    t = target("toolsandbox")
    trajs = [_traj("a", 1.0, ["SINGLE_TOOL_CALL"]), _traj("b", 0.5, ["SINGLE_TOOL_CALL", "STATE_DEPENDENCY"]),
             _traj("c", 0.0, ["STATE_DEPENDENCY"])]
    s = t.summarize(trajs)["similarity"]
    assert (s["scenarios"], s["perfect"]) == (3, 1) and s["mean_similarity"] == pytest.approx(0.5)
    assert s["categories"]["STATE_DEPENDENCY"] == {"scenarios": 2, "mean_similarity": 0.25, "perfect": 0, "perfect_rate": 0.0}
    table = t.markdown_table({"Base": t.summarize(trajs)})
    assert "| Base | 3 | 1 | 33.3 | 0.500 |" in table and "| STATE_DEPENDENCY | 0.250 (0/2) |" in table
    runs = [_traj(x, r, ["SINGLE_TOOL_CALL"], sample=k) for k, rs in enumerate([(1.0, 0.0), (1.0, 1.0), (0.0, 0.0)])
            for x, r in zip("ab", rs)]
    st = t.summarize(runs)["similarity"]
    assert st["perfect_rate_ci"]["mean"] == pytest.approx(0.5) and st["perfect_rate_ci"]["ci"] > 0


def _call(i, name, args=None):
    return Message(role="assistant", tool_calls=[ToolCall(id=f"c{i}", name=name, arguments=args or {})])


def _result(i, name, text, error=False):
    return Message(role="tool", tool_call_id=f"c{i}", name=name, content=text, error=error)


def test_reference_labeler_rules():
    from tracekit.targets.toolsandbox.labels import toolsandbox_labels

    blocked = [_call(0, "set_wifi_status", {"on": True}),
               _result(0, "set_wifi_status", "PermissionError: Wifi cannot be turned on in low battery mode", True)]
    unrecovered = toolsandbox_labels(_traj("x", 0.2, ["STATE_DEPENDENCY"], blocked, allowed_tools=["set_wifi_status"]))
    assert unrecovered["permission_error_recovery"][0].value == "LACKING"
    assert unrecovered["datetime_reasoning"][0].value == "NA"
    fixed = blocked + [_call(1, "set_low_battery_mode_status", {"on": False}), _result(1, "set_low_battery_mode_status", "None"),
                       _call(2, "set_wifi_status", {"on": True}), _result(2, "set_wifi_status", "None")]
    assert toolsandbox_labels(_traj("x", 1.0, ["STATE_DEPENDENCY"], fixed))["permission_error_recovery"][0].value == "PRESENT"
    time_tools = ["get_current_timestamp", "shift_timestamp"]
    none_called = toolsandbox_labels(_traj("y", 0.0, [], [Message(role="assistant", content="Sure.")],
                                           allowed_tools=time_tools, milestone_tools=["get_current_timestamp"]))
    assert none_called["datetime_reasoning"][0].value == "LACKING"
    assert none_called["permission_error_recovery"][0].value == "NA"
    used = [_call(0, "get_current_timestamp"), _result(0, "get_current_timestamp", "1700000000.0")]
    assert toolsandbox_labels(_traj("y", 1.0, [], used, allowed_tools=time_tools,
                                    milestone_tools=["get_current_timestamp"]))["datetime_reasoning"][0].value == "PRESENT"
    assert target_of_trajectories([_traj("y", 1.0, [])]).kind == "toolsandbox"


# ---------------------------------------------------------------------------------------------- the real ToolSandbox


@pytest.fixture(scope="module")
def suite():
    from tracekit.targets.toolsandbox.suite import ToolSandboxSuite

    s = ToolSandboxSuite(task_ids=["get_cellular", "cellular_off", "search_message_with_recency_latest",
                                   "turn_on_wifi_low_battery_mode", "find_days_till_holiday"])
    yield s
    s.close()


def _run(suite, agent, out, **kw):
    from tracekit.rollout import read_trajectories, run_rollouts

    summary = run_rollouts(suite, agent, out, max_steps=12, batch_size=kw.pop("batch_size", 8), progress=False, **kw)
    return summary, {t.task_id: t for t in read_trajectories(out)}


@needs_venv
def test_real_scenarios_tools_and_prompt(suite):
    from tracekit.synthesis.library import LIBRARY_NAMES, library_env
    from tracekit.targets.toolsandbox.interface import TOOLSANDBOX_SYSTEM_PROMPT
    from tracekit.synthesis.targets import schema_mismatch, target_tools

    rows = suite.server.request("scenarios", variants=[])
    assert len(rows) == 129 and all(r["base"] for r in rows)
    real = {t["function"]["name"]: t for t in suite.all_tools()}
    assert real == target_tools("toolsandbox")  # the committed extract is what the real converter gives
    for name in LIBRARY_NAMES:  # the capability library keeps ToolSandbox's real names and schemas
        cls = library_env(name)
        if cls.target != "toolsandbox":
            continue
        for level in cls.difficulty_levels:
            for tool in cls(level).tools():
                assert schema_mismatch(tool, real[tool["function"]["name"]]) is None, (name, level, tool["function"]["name"])
    obs = suite.episode(suite.tasks()[0]).reset()
    assert obs.messages[0].role == "system" and obs.messages[0].content == TOOLSANDBOX_SYSTEM_PROMPT


@needs_venv
def test_oracle_and_unhelpful_scores_equal_toolsandboxs_own_play(suite, tmp_path):
    from tracekit.targets.toolsandbox.suite import (
        ToolSandboxOracle,
        UnhelpfulAgent,
        replay_inputs,
    )

    _, oracle = _run(suite, ToolSandboxOracle(), tmp_path / "oracle")
    assert oracle["get_cellular"].reward == 1.0 and oracle["get_cellular"].success  # fully defined by its milestones
    assert oracle["cellular_off"].reward == pytest.approx(0.5)  # its first milestone is a state, no call named
    _, unhelpful = _run(suite, UnhelpfulAgent(), tmp_path / "unhelpful")
    assert all(t.reward < 1.0 for t in unhelpful.values())
    for t in [*oracle.values(), *unhelpful.values()]:
        assert 0.0 <= t.reward <= 1.0 and t.error is None
        played = suite.play(t.task_id, *replay_inputs(t))
        assert played["similarity"] == pytest.approx(t.reward, abs=1e-9), t.task_id
        assert played["milestone_mapping"] == t.info["milestone_mapping"]


@needs_venv
def test_server_death_mid_episode_is_run_again_and_the_run_goes_on(suite, tmp_path):
    from tracekit.targets.toolsandbox.suite import ToolSandboxOracle, replay_inputs

    class Killer(ToolSandboxOracle):
        """The oracle, that kills the server once, after its first batched action (every episode live): the
        server is frozen, so the next request goes out to it, and killed a second later, while it waits."""

        killed = False

        def act(self, states):
            out = super().act(states)
            if not self.killed and all(s.turn == 1 for s in states):
                Killer.killed, Killer.live = True, len(states)
                pid = suite.server.pid
                os.kill(pid, signal.SIGSTOP)
                threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
            return out

    restarts, restored = suite.server.restarts, suite.restored
    summary, trajs = _run(suite, Killer(), tmp_path / "killed")
    assert Killer.killed and suite.server.restarts == restarts + 1
    # the episode in flight ended with an EnvironmentServerError (an infrastructure failure): run again, not recorded
    assert summary.retried == 1 and summary.errors == 0 and all(t.error is None for t in trajs.values())
    assert "EnvironmentServerError" in summary.infra_errors[0] and "died" in summary.infra_errors[0]
    assert Killer.live >= 2 and suite.restored == restored + Killer.live - 1  # the other live ones: rebuilt
    for t in trajs.values():  # the restored and the retried episodes score what ToolSandbox's own play gives them
        assert suite.play(t.task_id, *replay_inputs(t))["similarity"] == pytest.approx(t.reward, abs=1e-9)


@needs_venv
def test_a_killed_run_resumes_with_one_result_per_scenario_and_sample(suite, tmp_path):
    from tracekit.targets.toolsandbox.suite import ToolSandboxOracle
    from tracekit.rollout import TRAJECTORIES, load_done

    tasks = suite.tasks()
    _run(suite, ToolSandboxOracle(), tmp_path, tasks=tasks[:2])
    with open(tmp_path / TRAJECTORIES, "a") as f:
        f.write('{"task_id": "torn')  # the kill's torn last line
    summary, _ = _run(suite, ToolSandboxOracle(), tmp_path, tasks=tasks)
    assert (summary.resumed, summary.ran, summary.total) == (2, len(tasks) - 2, len(tasks))
    done = load_done(tmp_path / TRAJECTORIES)
    assert sorted(done) == sorted((t.id, 0) for t in tasks)


@needs_venv
def test_a_scenario_that_raises_inside_toolsandbox_is_recorded_and_counted_and_the_run_goes_on(suite, tmp_path):
    """ToolSandbox's own user simulator raising (its endpoint unreachable) inside the scenario's play: that episode
    is recorded with ToolSandbox's error and counted; the server keeps serving the next one."""
    from tracekit.targets.toolsandbox.suite import ToolSandboxSuite, UnhelpfulAgent

    dead_user = {"kind": "llm", "base_url": "http://127.0.0.1:9/v1", "model": "none", "timeout_s": 2, "max_retries": 0}
    broken = ToolSandboxSuite(task_ids=["get_cellular", "cellular_off"], user=dead_user, server=suite.server)
    summary, trajs = _run(broken, UnhelpfulAgent(), tmp_path / "broken", batch_size=1)
    assert summary.errors == 2 and summary.terminations == {"error": 2}
    assert all(t.error.startswith("ScenarioError") and "APIConnectionError" in t.error for t in trajs.values())
    _, ok = _run(suite, UnhelpfulAgent(), tmp_path / "after")  # the same server goes on
    assert ok and all(t.error is None for t in ok.values())


@needs_venv
def test_toolsandboxs_own_user_simulator_drives_the_conversation_through_the_configured_endpoint(suite, tmp_path):
    """ToolSandbox's OpenAIAPIUser, pointed at an OpenAI-compatible endpoint (a local stand-in here): it gets the
    scenario's user instruction and the end_conversation tool, its text reaches the agent, its tool call ends the
    episode, and ToolSandbox's own play of the recorded turns scores the same."""
    from tests.openai_stub import Reply, StubOpenAIServer
    from tracekit.targets.toolsandbox.suite import (
        ToolSandboxSuite,
        UnhelpfulAgent,
        replay_inputs,
    )

    replies = ["Just check whether my cellular service is on, please.",
               Reply(tool_calls=[{"name": "end_conversation", "arguments": {}}])]
    with StubOpenAIServer(responses=replies, model="user-model") as srv:
        user = {"kind": "llm", "base_url": srv.url, "model": "user-model", "timeout_s": 10, "max_retries": 0}
        llm = ToolSandboxSuite(task_ids=["get_cellular"], user=user, server=suite.server)
        summary, trajs = _run(llm, UnhelpfulAgent(), tmp_path / "llm")
        requests = srv.chat_requests
    t = trajs["get_cellular"]
    assert t.error is None and t.termination == "user_stop" and summary.errors == 0
    assert [m.content for m in t.messages if m.role == "user"][-1] == replies[0]
    assert len(requests) == 2 and requests[0]["model"] == "user-model"
    assert requests[0]["messages"][0]["role"] == "system" and "User A" in requests[0]["messages"][0]["content"]
    assert [tool["function"]["name"] for tool in requests[0]["tools"]] == ["end_conversation"]
    assert t.info["user_turns"] == [{"say": replies[0]}, {"end": True}]
    assert suite.play(t.task_id, *replay_inputs(t))["similarity"] == pytest.approx(t.reward, abs=1e-9)
