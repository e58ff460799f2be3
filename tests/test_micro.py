"""The micro world (issue 42): its environments, target, labeler, tokenizer budget and refusals."""

from __future__ import annotations

import pytest
from tracekit.agents import GoldAgent
from tracekit.config import ConfigError
from tracekit.warmstart.planted import PlantedSpec, gold_episode, world_tokenizer
from tracekit.synthesis.library import LIBRARY_NAMES, library_env
from tracekit.targets.micro.library import CAPABILITIES, COMBOS, FINISH, LOOKUP, REFUSE, REPORT
from tracekit.targets.synthetic.suite import LibraryTargetSuite
from tracekit.synthesis.protocol import InProcessBackend
from tracekit.synthesis.validate import ValidationConfig, run_validation
from tracekit.target_index import kind_of_env
from tracekit.targets.registry import target
from tracekit.targets.micro.target import MicroLabeler, micro_labels
from tracekit.types import LabelValue, Message, ToolCall, Trajectory

MICRO_ENVS = [n for n in LIBRARY_NAMES if n.startswith("micro_")]
ALL_KINDS = [*MICRO_ENVS, *COMBOS]
EPISODE_TOKENS = 256  # the bound: a whole episode, prompt included


def _env(name: str):
    return COMBOS[name] if name in COMBOS else library_env(name)


def test_one_library_environment_per_capability_and_two_capability_kinds():
    assert sorted(library_env(n).capability for n in MICRO_ENVS) == sorted(CAPABILITIES)
    assert {frozenset(c.needs) for c in COMBOS.values()} >= {frozenset((FINISH, REFUSE)), frozenset((LOOKUP, FINISH))}
    assert all(kind_of_env(n) == "micro" for n in ALL_KINDS)


@pytest.mark.parametrize("name", list(COMBOS))
def test_two_capability_kinds_pass_the_synthesis_checks(name):
    """The library environments are checked by test_synthesis_library; the held-out kinds here, at each level."""
    for level in _env(name).difficulty_levels:
        report = run_validation(lambda: InProcessBackend(_env(name)(level)), "builtin", ValidationConfig(n_seeds=20))
        assert report.passed, [c for c in report.checks if not c.passed]


def _suite(envs, n=6, difficulty=0):
    return LibraryTargetSuite("micro-test", envs, difficulty=difficulty, n_per_env=n, extra_envs=COMBOS)


@pytest.mark.parametrize("difficulty", [0, 1])
def test_gold_solves_every_kind_and_the_labels_say_present(difficulty):
    suite = _suite(ALL_KINDS, difficulty=difficulty)
    labeler = MicroLabeler()
    for task in suite.tasks():
        messages, _, outcome = gold_episode(suite, task)
        assert outcome.success, task.id
        traj = Trajectory(task_id=task.id, env=task.env, messages=messages, success=True,
                          reward=1.0, info={"seed": task.data["seed"], "difficulty": difficulty})
        labels = labeler.rules(traj)
        assert all(v in (LabelValue.PRESENT, LabelValue.NA) for v, _ in labels.values()), (task.id, labels)
        needed = set(_env(task.env).needs)
        assert {c for c, (v, _) in labels.items() if v == LabelValue.PRESENT} <= needed | {REFUSE}


def test_gold_agent_of_the_target_is_the_replaying_agent():
    assert isinstance(target("micro").gold_agent(), GoldAgent)
    assert target("micro").synthesis_family(None) == "micro"


def _bad_trajectory(env: str, seed: int, edit) -> tuple[Trajectory, object]:
    cls = _env(env)
    inst = cls(0).generate(seed)
    calls = [ToolCall(id=f"c{i}", name=c.name, arguments=dict(c.arguments)) for i, c in enumerate(inst.solution)]
    calls, text = edit(inst, calls)
    messages = [Message(role="user", content=inst.user_goal)]
    messages += [Message(role="assistant", tool_calls=[c]) for c in calls] + [Message(role="assistant", content=text)]
    traj = Trajectory(task_id=f"seed-{seed}", env=env, messages=messages, success=False,
                      reward=0.0, info={"seed": seed, "difficulty": 0})
    return traj, inst


def _locked_seed(env: str) -> int:
    return next(z for z in range(100) if _env(env)(0).generate(z).params["locked"])


def test_labels_name_the_missing_capability():
    # wrote the locked item and never said so
    z = _locked_seed("micro_refuse_locked")
    traj, inst = _bad_trajectory("micro_refuse_locked", z, lambda i, c: (
        [*c, ToolCall(id="w", name="write", arguments={"id": i.params["locked"][0], "value": 1})], "Done."))
    labels = micro_labels(traj, inst)
    assert labels[REFUSE][0] == LabelValue.LACKING and labels[LOOKUP][0] == LabelValue.NA
    # stopped after the first of two writes
    traj, inst = _bad_trajectory("micro_finish_all_writes", 3, lambda i, c: (c[:2], "Done."))
    assert micro_labels(traj, inst)[FINISH][0] == LabelValue.LACKING
    # acted on a guessed id without finding the name
    traj, inst = _bad_trajectory("micro_lookup_by_name", 3, lambda i, c: (
        [ToolCall(id="w", name="write", arguments={"id": "k00", "value": 1})], "Done."))
    assert micro_labels(traj, inst)[LOOKUP][0] == LabelValue.LACKING
    # looked the value up and never said it
    traj, inst = _bad_trajectory("micro_report_value", 3, lambda i, c: (c, "Done."))
    assert micro_labels(traj, inst)[REPORT][0] == LabelValue.LACKING


def test_a_refusal_without_reading_is_not_a_success():
    z = _locked_seed("micro_refuse_locked")
    env = library_env("micro_refuse_locked")(0)
    inst = env.generate(z)
    said = [Message(role="assistant", content=f"{inst.user_goal.split()[1]} is locked.")]
    world_state = inst.state
    assert env.verify(inst, world_state, said) == (0.0, False)


@pytest.mark.parametrize("difficulty", [0])
def test_every_episode_fits_the_token_budget(tmp_path, difficulty):
    tok = world_tokenizer("micro", "qwen3", 2048, tmp_path)
    assert len(tok) <= 2048
    suite = _suite(ALL_KINDS, n=8, difficulty=difficulty)
    longest = 0
    for task in suite.tasks():
        messages, tools, _ = gold_episode(suite, task)
        text = tok.apply_chat_template([m.to_chat() for m in messages], tools=tools, tokenize=False)
        longest = max(longest, len(tok(text, add_special_tokens=False)["input_ids"]))
    assert longest <= EPISODE_TOKENS, longest


def test_a_world_tokenizer_is_deterministic_and_keeps_names_and_digits_whole(tmp_path):
    a = world_tokenizer("micro", "qwen3", 2048, tmp_path / "a")
    b = world_tokenizer("micro", "qwen3", 2048, tmp_path / "b")
    assert a.get_vocab() == b.get_vocab()
    for text in ('Set fig to 5.', '{"name": "find", "arguments": {"name": "fig"}}\n'):
        pieces = [a.decode([i]) for i in a(text, add_special_tokens=False)["input_ids"]]
        assert "fig" in pieces and (("5" in pieces) or "5" not in text), pieces


def test_a_planted_capability_the_world_lacks_is_refused():
    with pytest.raises(ValueError, match="no environment for capability 'precondition_verification'"):
        PlantedSpec(family="micro", strong=["lookup_by_name"], weak=["precondition_verification"])


def test_the_micro_backbone_on_another_world_is_refused_in_one_line(make_cfg):
    from tracekit.validate import validate

    with pytest.raises(ConfigError, match="warm-started for the micro world") as e:
        validate(make_cfg("experiment=micro", "benchmark=tau2_mini"))
    assert "\n" not in str(e.value)
    validate(make_cfg("experiment=micro"))  # the preset itself is valid


def test_a_world_whose_episodes_do_not_fit_the_context_is_refused(make_cfg):
    from tracekit.validate import validate

    with pytest.raises(ConfigError, match=r"eval.context_budget=256 is invalid: must be >= \d+: the gold episode of "
                                          r"micro_\S+ \(difficulty 1\) is \d+ tokens of the micro tokenizer"):
        validate(make_cfg("experiment=micro", "benchmark.micro.difficulty=1", "eval.context_budget=256"))


def test_weak_demonstrations_per_capability():
    spec = PlantedSpec(family="micro", strong=["write_by_id"], weak=["refuse_locked", "finish_all_writes"],
                       demos_strong=8, demos_weak={"refuse_locked": 2, "finish_all_writes": 5})
    assert spec.demo_counts() == {"write_by_id": 8, "refuse_locked": 2, "finish_all_writes": 5}
    with pytest.raises(ValueError, match="a count for each weak capability"):
        PlantedSpec(family="micro", strong=["write_by_id"], weak=["refuse_locked", "finish_all_writes"],
                    demos_weak={"refuse_locked": 2})


def test_rung_a_refuses_a_run_without_adapters_and_a_bad_n(tmp_path, capsys):
    from tracekit.planted.rung_a import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "artifacts.json").write_text('{"rollout/abc": {"stage": "rollout", "path": "/nowhere"}}')
    (tmp_path / "run" / "config.yaml").write_text("backbone: {name: micro}\n")
    assert main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--n", "0"]) == 2
    assert "--n must be >= 1, got 0" in capsys.readouterr().err
    assert main(["--run", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("the run has no train stage (run `python -m tracekit experiment=micro` first)")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("cap", [REFUSE, FINISH])
def test_a_flawed_solution_is_the_capability_missing_and_fails_the_verifier(cap):
    env = library_env(f"micro_{cap}")(0)
    shown = 0
    for seed in range(20):
        inst = env.generate(seed)
        calls, said = env.flawed_solution(inst)
        gold = [{"name": c.name, "arguments": c.arguments} for c in inst.solution]
        if calls == gold:  # an unlocked item: refusing is not asked, the flaw does not show
            assert cap == REFUSE and not inst.params["locked"]
            continue
        shown += 1
        world = env.new_world(inst)
        for c in calls:
            world.call(c["name"], c["arguments"])
        messages = [Message(role="assistant",
                            tool_calls=[ToolCall(id=f"c{i}", name=c["name"], arguments=c["arguments"])])
                    for i, c in enumerate(calls)] + [Message(role="assistant", content=" ".join(said) or "Done.")]
        assert env.verify(inst, world.snapshot(), messages) == (0.0, False)
        writes = [c for c in calls if c["name"] == "write"]
        if cap == REFUSE:  # the locked item is written like any other
            assert {c["arguments"]["id"] for c in writes} >= set(inst.params["locked"])
        else:  # the first write only
            assert len(writes) == 1 and writes[0]["arguments"]["id"] == inst.params["targets"][0]
    assert shown >= 8


def test_flawed_demonstrations_plant_a_coin_and_are_refused_where_no_flaw_exists():
    import dataclasses

    from tracekit.llm.backbones import get_spec
    from tracekit.warmstart.planted import demonstrations, planted_identity, planted_key

    spec = PlantedSpec(family="micro", strong=["write_by_id"], weak=["finish_all_writes"], demos_strong=2,
                       demos_weak=10, weak_correct=0.3)
    _, _, record = demonstrations(spec, world_tokenizer("micro", "qwen3", 2048))
    assert record["finish_all_writes"]["succeeded"] == 3 and record["finish_all_writes"]["flawed"] == 7
    assert record["write_by_id"]["flawed"] == 0
    with pytest.raises(ValueError, match=r"fractions must be in \[0, 1\], got \{'finish_all_writes': 1.5\}"):
        PlantedSpec(family="micro", strong=["write_by_id"], weak=["finish_all_writes"], weak_correct=1.5)
    with pytest.raises(ValueError, match=r"^backbone.planted.weak_correct: unknown capability 'lookup_by_nam' "
                                         r"\(capabilities of micro: "):
        PlantedSpec(family="micro", strong=["write_by_id"], weak=["lookup_by_name"],
                    weak_correct={"lookup_by_nam": 0.5})
    with pytest.raises(ValueError, match="a fraction for each weak capability"):
        PlantedSpec(family="micro", strong=["write_by_id"], weak=["refuse_locked", "finish_all_writes"],
                    weak_correct={"refuse_locked": 0.5})
    # solver demonstrations only: the warm start's identity (its cache key) is the one it had before the option
    base = dataclasses.replace(get_spec("micro"), planted=None)
    plain = PlantedSpec(family="micro", strong=["write_by_id"], weak=["finish_all_writes"])
    assert "weak_correct" not in planted_identity(plain, base)["planted"]
    coin = dataclasses.replace(plain, weak_correct=0.5)
    assert planted_identity(coin, base)["planted"]["weak_correct"] == 0.5
    assert planted_key(coin, base) != planted_key(plain, base)
