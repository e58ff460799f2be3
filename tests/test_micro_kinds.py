"""The micro world's kinds and planted flaws beyond issue 42 (issue 53): every capability has a flawed form (any subset
can be planted), every multi-capability kind the world builds is solved by its own solver, the sparse target
``benchmark=micro_hard`` holds only such kinds, and a kind the world cannot build is refused in one line."""

from __future__ import annotations

import pytest
from tracekit.config import ConfigError
from tracekit.warmstart.planted import PlantedSpec, demonstrations, gold_episode, world_tokenizer
from tracekit.synthesis.library import library_env
from tracekit.targets.micro.library import (CAPABILITIES, COMBOS, FINISH, HARD_KINDS, KINDS, LOOKUP, REFUSE, REPORT,
                                              WRITE, kind_problem)
from tracekit.targets.synthetic.suite import LibraryTargetSuite
from tracekit.synthesis.protocol import InProcessBackend
from tracekit.synthesis.validate import ValidationConfig, run_validation
from tracekit.targets.micro.target import MicroLabeler
from tracekit.types import LabelValue, Message, ToolCall, Trajectory


def _replay(env, inst, calls, said):
    world = env.new_world(inst)
    for c in calls:
        try:
            world.call(c["name"], c["arguments"])
        except (KeyError, TypeError):  # a flaw may call a tool wrongly: the agent would see the error
            pass
    messages = [Message(role="assistant", tool_calls=[ToolCall(id=f"c{i}", name=c["name"], arguments=c["arguments"])])
                for i, c in enumerate(calls)] + [Message(role="assistant", content=" ".join(said) or "Done.")]
    return env.verify(inst, world.snapshot(), messages)


@pytest.mark.parametrize("cap", CAPABILITIES)
def test_every_capability_has_a_flawed_form_the_verifier_rejects(cap):
    env = library_env(f"micro_{cap}")(0)
    shown = 0
    for seed in range(20):
        inst = env.generate(seed)
        calls, said = env.flawed_solution(inst)
        gold = [c.model_dump(mode="json") for c in inst.solution]
        expected = [g[0] for g in inst.expected_outputs]
        if (calls, said) == (gold, expected):  # the capability does not show (an unlocked item)
            assert cap == REFUSE and not inst.params["locked"]
            continue
        shown += 1
        assert _replay(env, inst, calls, said) == (0.0, False), (cap, seed)
        names = [c["name"] for c in calls]
        if cap == LOOKUP:  # no find, the name where the id belongs
            assert "find" not in names and calls[0]["arguments"]["id"] == inst.state["items"][
                inst.params["targets"][0]]["name"]
        elif cap == REPORT:  # read, said nothing
            assert calls == gold and said == []
        elif cap == WRITE:
            assert names == ["read"]
    assert shown >= 8


def test_any_subset_can_be_planted_and_the_flaws_are_demonstrated():
    spec = PlantedSpec(family="micro", strong=["refuse_locked", "finish_all_writes", "write_by_id"],
                       weak=["lookup_by_name", "report_value"], demos_strong=1, demos_weak=10,
                       weak_correct={"lookup_by_name": 0.3, "report_value": 0.3})
    _, demos, record = demonstrations(spec, world_tokenizer("micro", "qwen3", 2048))
    for cap in ("lookup_by_name", "report_value"):
        assert (record[cap]["succeeded"], record[cap]["flawed"]) == (3, 7), record[cap]
    said = [m["content"] for d in demos if d["capability"] == "report_value" for m in d["messages"]
            if m["role"] == "assistant" and m.get("content")]
    assert sum(" is " in t for t in said) == 3  # only the solver's demonstrations say the value
    for weak in ([c] for c in CAPABILITIES):
        PlantedSpec(family="micro", strong=[c for c in CAPABILITIES if c not in weak], weak=weak, weak_correct=0.3)


def test_a_weak_correct_naming_an_unknown_capability_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^backbone.planted.weak_correct: unknown capability 'refuse_lockd'") as e:
        PlantedSpec(family="micro", strong=["write_by_id"], weak=["refuse_locked"], weak_correct={"refuse_lockd": 0.3})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", list(KINDS))
def test_every_kind_the_world_builds_is_solved_by_its_solver_and_passes_the_checks(name):
    cls = KINDS[name]
    assert 2 <= len(cls.needs) <= 3 and kind_problem(cls.needs) is None
    for level in cls.difficulty_levels:
        report = run_validation(lambda: InProcessBackend(cls(level)), "builtin", ValidationConfig(n_seeds=10))
        assert report.passed, [c for c in report.checks if not c.passed]
        suite = LibraryTargetSuite("kinds", [name], difficulty=level, n_per_env=12, extra_envs=KINDS)
        for task in suite.tasks():
            messages, _, outcome = gold_episode(suite, task)
            assert outcome.success, task.id
            traj = Trajectory(task_id=task.id, env=name, messages=messages, success=True, reward=1.0,
                              info={"seed": task.data["seed"], "difficulty": level})
            labels = MicroLabeler().rules(traj)
            present = {c for c, (v, _) in labels.items() if v == LabelValue.PRESENT}
            assert set(cls.needs) - {REFUSE} <= present <= set(cls.needs), (task.id, labels)  # refuse: if locked
            if level == 0:
                assert sum(m.role == "assistant" for m in messages) <= 8


def test_a_kind_needing_a_capability_shows_it_missing_when_only_that_part_fails():
    cls = KINDS["micro_combo_refuse_locked__finish_all_writes__report_value"]
    inst = cls(0).generate(5)
    calls = [c.model_dump(mode="json") for c in inst.solution]
    answer = inst.expected_outputs[-1][0]
    verdict = _replay(cls(0), inst, calls, [answer])  # the value said, the refusal not
    assert verdict == (0.0, False)
    traj = Trajectory(task_id="t", env=cls.name, success=False, reward=0.0, info={"seed": 5, "difficulty": 0},
                      messages=[Message(role="assistant", content=answer)])
    labels = MicroLabeler().rules(traj)
    assert labels[REPORT][0] == LabelValue.PRESENT and labels[REFUSE][0] == LabelValue.LACKING


def test_kinds_the_world_cannot_build_say_why():
    assert "9 assistant turns" in kind_problem((LOOKUP, FINISH, REPORT))
    assert "composes with no other" in kind_problem((WRITE, REPORT))
    assert "two or three distinct" in kind_problem((LOOKUP, REFUSE, FINISH, REPORT))
    assert "unknown capabilities" in kind_problem(("lookup", REPORT))


def test_the_issue_42_kinds_are_unchanged_and_micro_hard_holds_only_multi_capability_kinds(make_cfg):
    from tracekit.validate import validate

    assert set(COMBOS) == {"micro_combo_lookup_by_name__finish_all_writes", "micro_combo_lookup_by_name__refuse_locked",
                           "micro_combo_lookup_by_name__report_value",
                           "micro_combo_finish_all_writes__refuse_locked"}
    cfg = make_cfg("experiment=micro", "benchmark=micro_hard")
    validate(cfg)
    envs = list(cfg.benchmark.micro.envs)
    assert envs and all(e in KINDS and len(KINDS[e].needs) >= 2 for e in envs)
    assert "micro_combo_finish_all_writes__report_value" in envs and set(envs) & set(HARD_KINDS)
    assert all(set(KINDS[e].needs) & {REFUSE, FINISH} and set(KINDS[e].needs) & {REFUSE, REPORT} for e in envs)


def test_a_sparse_target_whose_kinds_the_world_cannot_build_is_refused_in_one_line(make_cfg):
    from tracekit.validate import validate

    with pytest.raises(ConfigError, match="micro_combo_lookup_by_name__finish_all_writes__report_value") as e:
        validate(make_cfg("experiment=micro", "benchmark=micro_hard",
                          "benchmark.micro.envs=[micro_combo_lookup_by_name__finish_all_writes__report_value]"))
    assert "\n" not in str(e.value)
