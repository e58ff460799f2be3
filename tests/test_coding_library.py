"""The coding capability library environments (tracekit/targets/coding/library/*.py) and the coding reference labeler."""

from __future__ import annotations

import pytest

from tracekit.targets.coding.reference import (
    CodingReferenceLabeler,
    coding_labels,
    reference_dictionary,
)
from tracekit.synthesis.library import find_library_env, library_env
from tracekit.targets.coding.library.common import BANK, build_package
from tracekit.synthesis.protocol import (
    ground_truth_actions,
    noop_actions,
    score_actions,
)
from tracekit.types import LabelValue, Message, ToolCall, Trajectory

ENVS = ("coding_fault_localization", "coding_minimal_edit", "coding_test_before_submit")


def _run_asserts(source: str, tests: tuple[str, ...]) -> bool:
    ns: dict = {}
    exec(source, ns)  # our own bank (trusted), not agent code
    try:
        for t in tests:
            if not eval(t, ns):
                return False
    except Exception:  # noqa: BLE001 - a crashing buggy function fails its test
        return False
    return True


def test_every_bank_bug_is_caught_by_its_tests_and_the_correct_source_passes():
    for fn in BANK:
        assert _run_asserts(fn.source, fn.tests), fn.name
        for old, new in fn.bugs:
            assert old in fn.source, (fn.name, old)
            assert not _run_asserts(fn.source.replace(old, new, 1), fn.tests), (fn.name, old, new)


def test_packages_are_seeded_and_hide_the_function_in_the_test_name():
    import random

    a, b = build_package(random.Random(3), 6, 2), build_package(random.Random(3), 6, 2)
    assert a == b and a.buggy not in a.test_id and a.test_id.split("::")[0] in a.files
    lo, hi = a.line_range
    assert f"def {a.buggy}(" in a.files[a.module_path].splitlines()[lo - 1] and hi >= lo


@pytest.mark.parametrize("name", ENVS)
def test_ground_truth_scores_one_and_doing_nothing_zero(name):
    env = library_env(name)(0)
    inst = env.generate(7)
    assert inst.key() == env.generate(7).key() and inst.key() != env.generate(8).key()
    assert env.info().target == "coding" and [t["function"]["name"] for t in env.tools()] == ["bash", "submit"]
    assert score_actions(env, inst, ground_truth_actions(inst)).reward == 1.0
    assert score_actions(env, inst, noop_actions()).reward == 0.0
    assert find_library_env(env.capability, "coding") is type(env)


def _act(*calls):
    return [Message(role="assistant", tool_calls=[ToolCall(id=f"c{i}", name=n, arguments=a)]) for i, (n, a) in
            enumerate(calls)]


def test_verifiers_score_the_capability_not_just_the_outcome():
    tbs = library_env("coding_test_before_submit")(0)
    inst = tbs.generate(1)
    fix = inst.solution[0].arguments
    untested = score_actions(tbs, inst, _act(("bash", fix), ("submit", {})))
    assert untested.reward == 0.0  # a correct fix submitted without running the tests
    me = library_env("coding_minimal_edit")(0)
    inst = me.generate(2)
    rewrite = {"command": f"cat > {inst.params['module_path']} <<'EOF'\n{inst.params['fixed_module']}\n\nX = 1\nEOF"}
    assert score_actions(me, inst, _act(("bash", rewrite), ("submit", {}))).reward == 0.0  # fixed, not minimal
    fl = library_env("coding_fault_localization")(0)
    inst = fl.generate(3)
    others = sorted(f.name for f in BANK if f.name != inst.params["buggy"])
    assert score_actions(fl, inst, _act(("submit", {"answer": f"{inst.params['buggy']} or {others[0]}"}))).reward == 0.0
    assert score_actions(fl, inst, _act(("submit", {"answer": f"`{inst.params['buggy']}`"}))).reward == 1.0


def _traj(commands, patch, submitted=True, status="tests_failed", entity="toolz/itertoolz.py::partition"):
    return Trajectory(task_id="t", env="coding_toolz", info={
        "commands": [{"command": c} for c in commands], "prediction": {"model_patch": patch}, "status": status,
        "submitted": submitted, "entity": entity, "gold_patch_lines": 2})


PATCH = "diff --git a/toolz/itertoolz.py b/toolz/itertoolz.py\n--- a/toolz/itertoolz.py\n+++ b/toolz/itertoolz.py\n" \
        "@@ -1 +1 @@\n-a\n+b\n"


def test_reference_labels():
    good = coding_labels(_traj(["grep -n partition toolz/itertoolz.py", "sed -i 's/a/b/' toolz/itertoolz.py",
                                "python -m pytest -q toolz/tests/test_itertoolz.py"], PATCH, status="resolved"))
    assert {k: v[0] for k, v in good.items()} == {"fault_localization": LabelValue.PRESENT,
                                                  "minimal_edit": LabelValue.PRESENT,
                                                  "test_before_submit": LabelValue.PRESENT}
    nothing = coding_labels(_traj(["ls"], ""))
    assert {k: v[0] for k, v in nothing.items()} == {"fault_localization": LabelValue.LACKING,
                                                     "minimal_edit": LabelValue.NA, "test_before_submit": LabelValue.NA}
    sloppy = coding_labels(_traj(["python -m pytest -q", "sed -i 's/a/b/' toolz/tests/test_x.py"],
                                 PATCH.replace("itertoolz.py", "tests/test_x.py")))
    assert sloppy["minimal_edit"][0] == LabelValue.LACKING and sloppy["test_before_submit"][0] == LabelValue.LACKING


def test_reference_labeler_runs_and_refuses_unknown_capabilities(tmp_path):
    labeler = CodingReferenceLabeler()
    res = labeler.label_runs([_traj([], "")], reference_dictionary(), [0, 1], 0, tmp_path)
    assert len(res.labels) == 6
    from tracekit.types import Capability

    with pytest.raises(ValueError, match="rules only for"):
        labeler.label_runs([], [Capability(name="other", description="x")], [0], 0, tmp_path)


@pytest.mark.slow
def test_validation_passes_on_a_few_seeds():
    from tracekit.synthesis.validate import ValidationConfig, validate_env

    report = validate_env(library_env("coding_fault_localization"), 0, ValidationConfig(n_seeds=4, random_trials=1))
    assert report.passed, report.reason


@pytest.mark.slow
@pytest.mark.parametrize("name", ENVS)
def test_validation_at_every_difficulty(name):
    from tracekit.synthesis.validate import ValidationConfig, validate_env

    cls = library_env(name)
    for level in cls.difficulty_levels:
        report = validate_env(cls, level, ValidationConfig(n_seeds=30))
        assert report.passed, f"difficulty {level}: {report.reason}"
        assert report.stats["distinct_instances"] >= 27
