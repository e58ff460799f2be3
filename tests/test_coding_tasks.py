"""Local coding tasks (tracekit/coding): generation with swesmith's modifiers, the test-based reward, the agent
interface and the SWE-bench prediction record, on a small generated set (one modifier, one task)."""

from __future__ import annotations

import json

import pytest

from tests import procs
from tracekit.targets.coding import reward as rw
from tracekit.coding.sandbox import CommandLimits
from tracekit.targets.coding.interface import TOOLS
from tracekit.targets.coding.suite import REMINDER, CodingSuite, gold_actions
from tracekit.targets.coding.tasks import (
    CodingTask,
    TaskGenConfig,
    assign_splits,
    load_or_generate,
    splice,
)
from tracekit.types import Message, ToolCall

GEN = TaskGenConfig(modifiers=("func_pm_remove_cond",), max_per_modifier=1, max_candidates_per_modifier=4)
LIMITS = CommandLimits(cpu_seconds=60, wall_seconds=60)


@pytest.fixture(scope="module")
def taskset(tmp_path_factory):
    return load_or_generate(GEN, tmp_path_factory.mktemp("cache"))


def _call(name, **arguments):
    return Message(role="assistant", tool_calls=[ToolCall(id=f"c-{name}", name=name, arguments=arguments)])


def test_generation_reports_candidates_and_keeps_a_valid_task(taskset):
    rep = taskset.report
    counts = rep["per_modifier"]["func_pm_remove_cond"]
    assert counts["applicable"] > 0 and counts["tried"] >= counts["valid"] == 1
    assert counts["tried"] == sum(counts[k] for k in counts if k not in ("applicable", "tried"))
    assert rep["valid"] == len(taskset.tasks) == 1 and rep["package"].startswith("toolz==")
    t = taskset.tasks[0]
    assert t.FAIL_TO_PASS and t.PASS_TO_PASS and not set(t.FAIL_TO_PASS) & set(t.PASS_TO_PASS)
    assert t.patch.startswith("diff --git a/") and t.bug_patch.startswith("diff --git a/") and t.split in ("train", "test")
    assert t.FAIL_TO_PASS[0] in t.problem_statement
    path = t.entity.split("::")[0]
    assert set(t.buggy_files) == {path} and t.buggy_files[path] != taskset.pristine[path]


def test_cache_is_hit_and_keyed_on_the_seed(taskset, tmp_path_factory):
    again = load_or_generate(GEN, taskset.root.parent.parent)
    assert again.root == taskset.root and [t.instance_id for t in again.tasks] == [t.instance_id for t in taskset.tasks]
    from tracekit.targets.coding.tasks import cache_key

    v = taskset.report["package"].split("==")[1]
    other = TaskGenConfig(**{**GEN.__dict__, "seed": 1})
    assert cache_key(other, v, taskset.pristine) != cache_key(GEN, v, taskset.pristine)


def test_empty_and_malformed_patches_score_zero(taskset):
    # (the gold patch scoring 1 is part of generation: counts["valid"] above; and end to end through the interface
    # in the gold-agent test below)
    t = taskset.tasks[0]
    tree = taskset.buggy_tree(t)
    assert taskset.report["per_modifier"]["func_pm_remove_cond"]["gold_failed"] == 0
    assert rw.evaluate_patch(t, tree, "", LIMITS).status == "empty_patch"
    bad = rw.evaluate_patch(t, tree, "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-nope\n+yes\n", LIMITS)
    assert (bad.reward, bad.status) == (0.0, "malformed_patch") and bad.detail


@pytest.mark.slow
def test_hanging_tests_are_killed_at_the_limit(taskset):
    t = taskset.tasks[0]
    path = t.entity.split("::")[0]
    from tracekit.targets.coding.tasks import _diff

    text = taskset.buggy_tree(t)[path]
    hang = _diff(taskset.buggy_tree(t), {path: text + "\nimport time\nwhile True:\n    time.sleep(1)\n"})
    v = rw.evaluate_patch(t, taskset.buggy_tree(t), hang, CommandLimits(cpu_seconds=5, wall_seconds=3))
    assert (v.reward, v.status) == (0.0, "tests_timeout")


def test_gold_agent_through_the_interface_and_the_prediction_record(taskset):
    suite = CodingSuite("coding_toolz", taskset, split=taskset.tasks[0].split, model_name="m")
    task = suite.tasks()[0]
    ep = suite.episode(task)
    obs = ep.reset()
    assert obs.tools == TOOLS and obs.messages[1].content == taskset.tasks[0].problem_statement
    assert ep.step(Message(role="assistant", content="thinking")).messages[0].content == REMINDER
    assert "not found" in ep.step(_call("python", code="1")).messages[0].content
    for a in task.data["actions"]:
        step = ep.step(_call(a["name"], **a["arguments"]))
    assert step.done and step.termination == "submitted"
    o = ep.outcome()
    assert (o.reward, o.success, o.info["status"]) == (1.0, True, "resolved")
    pred = o.info["prediction"]
    assert set(pred) == {"instance_id", "model_name_or_path", "model_patch"}
    assert pred["instance_id"] == task.id and pred["model_name_or_path"] == "m" and "+++ b/" in pred["model_patch"]
    assert o.info["format_errors"] == 2 and len(o.info["commands"]) == 2
    json.dumps(o.info)


def test_empty_submit_and_escapes_score_zero_and_are_recorded(taskset):
    suite = CodingSuite("coding_toolz", taskset, split=taskset.tasks[0].split,
                        limits=CommandLimits(cpu_seconds=1, wall_seconds=2))
    ep = suite.episode(suite.tasks()[0])
    ep.reset()
    r = ep.step(_call("bash", command="sleep 100"))
    assert "wall-time limit" in r.messages[0].content and not r.done
    ep.step(_call("submit"))
    o = ep.outcome()
    assert (o.reward, o.success, o.info["status"]) == (0.0, False, "empty_patch")
    assert o.info["sandbox_events"] == {"wall_time": 1} and o.info["prediction"]["model_patch"] == ""


def test_r1_and_r2_through_an_episode_score_zero_as_tampering_with_the_conftest_dropped(taskset):
    """Issue 49's two forgeries, made by the agent's bash calls in its copy: a new conftest.py whose makereport
    hook marks every test passed (dropped, recorded), and an atexit hook in the package that rewrites
    $TRACEKIT_REPORT to all-passed (the run is tampering, recorded). The bug stays: reward 0."""
    suite = CodingSuite("coding_toolz", taskset, split=taskset.tasks[0].split)
    ep = suite.episode(suite.tasks()[0])
    ep.reset()
    conftest = ("import pytest\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
                "    r = (yield).get_result()\n    r.outcome = 'passed'\n")
    atexit = ("import atexit, os, json\natexit.register(lambda: open(os.environ['TRACEKIT_REPORT'], 'w')"
              ".write(json.dumps({'tests': {}})))\n")
    ep.step(_call("bash", command=f"cat > conftest.py <<'EOF'\n{conftest}EOF\ncat >> toolz/__init__.py <<'EOF'\n"
                                   f"{atexit}EOF\n"))
    ep.step(_call("submit"))
    o = ep.outcome()
    assert (o.reward, o.success, o.info["status"]) == (0.0, False, "tampering"), o.info["tests"]
    assert o.info["tests"]["dropped"] == ["conftest.py: a new file"], o.info["tests"]
    assert any("TRACEKIT_REPORT" in t for t in o.info["tests"]["tampering"]), o.info["tests"]
    assert "+++ b/conftest.py" in o.info["prediction"]["model_patch"]  # the prediction is the agent's whole patch


def test_swe_rl_reward_in_the_suite(taskset):
    suite = CodingSuite("coding_toolz", taskset, split=taskset.tasks[0].split, reward="swe_rl")
    task = suite.tasks()[0]
    ep = suite.episode(task)
    ep.reset()
    ep.step(_call("submit"))
    assert ep.outcome().reward == -1.0  # nothing changed: SWE-RL's format error


def test_splits_follow_entities_and_gold_actions_shape():
    def task(i, entity):
        return CodingTask(f"t{i}", "r", "c", "p", "b", ["f"], ["p"], "s", {}, "m", entity, "")

    tasks = assign_splits([task(i, f"e{i % 4}") for i in range(8)], GEN)
    by_entity = {}
    for t in tasks:
        by_entity.setdefault(t.entity, set()).add(t.split)
    assert all(len(s) == 1 for s in by_entity.values()) and {t.split for t in tasks} == {"train", "test"}
    acts = gold_actions(task(0, "e"))
    assert [a["name"] for a in acts] == ["bash", "bash", "submit"]


def test_splice_keeps_indentation():
    class E:
        indent_level, indent_size, line_start, line_end = 1, 4, 2, 3

    text = "class A:\n    def f(self):\n        return 1\nX = 2\n"
    assert splice(text, E, "def f(self):\n    return 2") == "class A:\n    def f(self):\n        return 2\nX = 2\n"


def test_unknown_modifier_is_one_line():
    from tracekit.targets.coding.tasks import python_modifiers

    with pytest.raises(ValueError, match="unknown swesmith modifier.*func_pm_nope.*known: func_pm"):
        python_modifiers(("func_pm_nope",))


def test_config_validates_and_refuses_bad_values_in_one_line(make_cfg):
    from tracekit.config import ConfigError
    from tracekit.validate import validate

    validate(make_cfg("benchmark=coding_toolz", "experiment=smoke", "eval.methods=[base,swe_rl]"))
    with pytest.raises(ConfigError, match="benchmark.coding.modifiers='nope' is invalid: must be one of func_pm"):
        validate(make_cfg("benchmark=coding_toolz", "benchmark.coding.modifiers=[nope]"))
    with pytest.raises(ConfigError, match="swe_rl trains with SWE-RL's patch-similarity reward"):
        validate(make_cfg("experiment=smoke", "eval.methods=[base,swe_rl]"))


@pytest.mark.slow
def test_table2_runs_on_the_coding_target_at_embedded_scale():
    from tracekit.reproduce.spec import find_spec, load_spec, plan

    p = plan(load_spec(find_spec("table2")), ["scale=embedded"])
    by_label = {r.row.label: r for r in p.rows}
    assert by_label["SWE-RL"].problem is None and "benchmark=coding_toolz" in by_label["SWE-RL"].overrides
    assert by_label["SWE-RL"].cfg.benchmark.kind == "coding"


def test_swebench_target_without_docker_is_one_line(make_cfg):
    from tracekit.targets.swebench import suite as sb
    from tracekit.targets.registry import target

    if sb.docker_problem() is None:
        pytest.skip("Docker is available")
    cfg = make_cfg("benchmark=swebench_verified", "experiment=smoke")
    with pytest.raises(RuntimeError, match="SWE-bench Verified is evaluated by the official harness") as e:
        target("swebench").build_suite(cfg, None, None)
    assert "\n" not in str(e.value) and "scale=embedded" in str(e.value)


@pytest.mark.slow
def test_default_generation_gold_scores_one_and_empty_zero_on_every_task(tmp_path):
    """The benchmark's own settings (conf/benchmark/coding_toolz.yaml): every modifier reported, every kept task
    resolved by its gold patch and not by the empty one; both splits non-empty and disjoint by function."""
    import yaml

    from tracekit.targets.coding.tasks import python_modifiers

    c = yaml.safe_load(open("conf/benchmark/coding_toolz.yaml"))["coding"]
    cfg = TaskGenConfig(max_per_modifier=c["max_per_modifier"], max_candidates_per_modifier=c["max_candidates_per_modifier"])
    ts = load_or_generate(cfg, tmp_path)
    assert set(ts.report["per_modifier"]) == {pm.name for pm in python_modifiers()}
    assert ts.split("train") and ts.split("test")
    assert not {t.entity for t in ts.split("train")} & {t.entity for t in ts.split("test")}
    for t in ts.tasks:
        tree = ts.buggy_tree(t)
        v = rw.evaluate_patch(t, tree, t.patch, LIMITS)
        assert (v.reward, v.status, v.dropped, v.tampering) == (1.0, "resolved", [], []), (t.instance_id, v)
        assert rw.evaluate_patch(t, tree, "", LIMITS).reward == 0.0


@pytest.mark.slow
def test_full_pipeline_on_the_coding_target_at_smoke_budgets(tmp_path):
    import os
    import sys

    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache")}
    r = procs.run([sys.executable, "-m", "tracekit", "benchmark=coding_toolz", "experiment=smoke",
                   "logger=none", "benchmark.coding.max_per_modifier=1", "benchmark.limit=2",
                   "benchmark.coding.modifiers=[func_pm_op_change,func_pm_remove_cond,func_pm_ctrl_invert_if]"],
                       capture_output=True, text=True, env=env, timeout=3000)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "coding_toolz" in r.stdout
