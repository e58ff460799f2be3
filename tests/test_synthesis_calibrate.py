"""Calibration statistics on hand-built reward tables (values computed by hand) and the difficulty walk."""

from __future__ import annotations

import math

import pytest

from tracekit.envs.base import Outcome
from tracekit.synthesis.calibrate import (
    CalibrationTargets,
    calibrate_difficulty,
    calibration_markdown,
    distance,
    group_stats,
    judge,
    pass_at_k,
    write_calibration,
)


def test_pass_at_k_unbiased_estimator_hand_values():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(16, 4, 1) == pytest.approx(4 / 16)
    assert pass_at_k(16, 4, 4) == pytest.approx(1 - 495 / 1820)  # C(12,4)=495, C(16,4)=1820
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(16, 1, 16) == 1.0
    assert pass_at_k(8, 0, 4) == 0.0
    assert pass_at_k(8, 6, 3) == 1.0  # n - c < k: every k-subset holds a success
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_group_stats_hand_built_table():
    table = {
        "seed-0": [1.0, 1.0, 1.0, 1.0],  # all success
        "seed-1": [0.0, 0.0, 0.0, 0.0],  # all zero
        "seed-2": [1.0, 0.0, 0.0, 0.0],  # informative
        "seed-3": [0.5, 0.5, 0.5, 0.5],  # constant partial credit: uninformative, not all-zero
    }
    s = group_stats(table, CalibrationTargets(pass_ks=(1, 2, 4, 8)))
    assert (s.n_groups, s.n_rollouts, s.group_size_min) == (4, 16, 4)
    assert s.mean_reward == pytest.approx(7 / 16)
    assert s.std_reward == pytest.approx(math.sqrt(sum((r - 7 / 16) ** 2 for g in table.values() for r in g) / 16))
    assert s.success_rate == pytest.approx(5 / 16)  # reward >= 1.0
    assert s.informative_rate == pytest.approx(1 / 4)
    assert s.all_success_rate == pytest.approx(1 / 4)
    assert s.all_zero_rate == pytest.approx(1 / 4)
    assert s.pass_at_k[1] == pytest.approx((1 + 0 + 1 / 4 + 0) / 4)
    assert s.pass_at_k[2] == pytest.approx((1 + 0 + (1 - 3 / 6) + 0) / 4)  # C(3,2)/C(4,2) = 3/6
    assert s.pass_at_k[4] == pytest.approx((1 + 0 + 1 + 0) / 4)
    assert 8 not in s.pass_at_k  # k larger than the groups: not estimable


def test_success_labels_override_the_threshold():
    # partial rewards with explicit success labels (ToolSandbox-style similarity) and Outcome objects
    table = {"a": [(0.9, True), (0.2, False)], "b": [Outcome(reward=0.7, success=True), Outcome(reward=0.7, success=False)]}
    s = group_stats(table, CalibrationTargets(pass_ks=(1,)))
    assert s.success_rate == 0.5
    assert s.informative_rate == 0.5  # group b has equal rewards despite different labels
    assert s.mean_reward == pytest.approx((0.9 + 0.2 + 0.7 + 0.7) / 4)


def test_judge_directions_and_distance():
    t = CalibrationTargets()
    ok = group_stats({i: [1, 0, 0, 1, 0] for i in range(4)}, t)  # mean 0.4, informative 1
    assert judge(ok, t) == ("ok", [])
    assert distance(ok, t) == 0.0
    easy = group_stats({i: [1, 1, 1, 1, 0] for i in range(4)}, t)  # mean 0.8
    verdict, problems = judge(easy, t)
    assert verdict == "too_easy" and "mean_reward=0.800 outside [0.2, 0.6]" in problems
    assert distance(easy, t) == pytest.approx(0.2 + 0.2)
    hard = group_stats({0: [1, 0, 0, 0, 0], 1: [0] * 5, 2: [0] * 5, 3: [0] * 5}, t)  # mean 0.05, informative .25
    verdict, problems = judge(hard, t)
    assert verdict == "too_hard" and len(problems) == 3
    assert distance(hard, t) == pytest.approx(0.15 + 0.15 + 0.25)
    with pytest.raises(ValueError, match="empty"):
        group_stats({}, t)


class FakeSuite:
    """Stands for an EnvSuite at one difficulty; the fake rollout reads its success probability."""

    def __init__(self, level: int):
        self.level = level
        self.closed = False


def fake_rollouts(rates: dict[int, float], made: list[FakeSuite]):
    def rollout_fn(suite, seeds, k):
        made.append(suite)
        # deterministic table: in every group the first round(rate*k) rollouts succeed
        n = round(rates[suite.level] * k)
        return {f"seed-{z}": [1.0] * n + [0.0] * (k - n) for z in seeds}

    return rollout_fn


@pytest.mark.parametrize("start,expected_path", [(0, [0, 1, 2]), (3, [3, 2]), (None, [2])])
def test_difficulty_walk_reaches_the_target(start, expected_path, tmp_path):
    made: list[FakeSuite] = []
    rates = {0: 1.0, 1: 0.75, 2: 0.375, 3: 0.0}
    report = calibrate_difficulty(FakeSuite, [0, 1, 2, 3], fake_rollouts(rates, made), list(range(4)), k=16,
                                  start=start, name="fake")
    assert [t.difficulty for t in report.tried] == expected_path
    assert report.passed and report.chosen_difficulty == 2
    assert report.tried[-1].stats.pass_at_k[1] == pytest.approx(0.375)
    write_calibration(report, tmp_path)
    assert "| 2 | 0.375 | 0.375 | 1.000 |" in (tmp_path / "calibration.md").read_text()


def test_difficulty_walk_keeps_the_closest_level_when_none_fits():
    made: list[FakeSuite] = []
    rates = {0: 1.0, 1: 0.9, 2: 0.8}
    report = calibrate_difficulty(FakeSuite, [0, 1, 2], fake_rollouts(rates, made), [0, 1], k=10, start=0)
    assert [t.difficulty for t in report.tried] == [0, 1, 2]  # walked to the hardest, still too easy
    assert not report.passed and report.chosen_difficulty == 2
    assert all(t.verdict == "too_easy" for t in report.tried)
    assert "closest" in calibration_markdown(report)


def test_make_rollout_fn_runs_the_rollout_runner(tmp_path):
    from tracekit.agents import Agent
    from tracekit.synthesis.suite import SyntheticSuite
    from tracekit.llm.base import ChatResponse
    from tracekit.synthesis.calibrate import make_rollout_fn
    from tracekit.synthesis.library import library_env
    from tracekit.synthesis.protocol import ground_truth_actions
    from tracekit.types import Message

    env = library_env("toolsandbox_permission_error_recovery")(0)
    suite = SyntheticSuite.from_env(env, range(3), user="none")

    class HalfGold(Agent):
        """Plays the ground truth when the episode seed is even, else answers without acting."""

        name = "half_gold"
        temperature = 1.0  # sampled: every (task, sample) gets its own episode seed

        def act(self, states):
            out = []
            for s in states:
                gt = ground_truth_actions(suite.instances([s.task.data["seed"]])[0])
                msg = gt[s.turn] if s.seed % 2 == 0 else Message(role="assistant", content="OK.")
                out.append(ChatResponse(message=msg, text=msg.content or ""))
            return out

    rollout_fn = make_rollout_fn(HalfGold(), tmp_path, progress=False, max_steps=10)
    table = rollout_fn(suite, [0, 2], 6)
    assert sorted(table) == ["seed-0", "seed-2"] and all(len(g) == 6 for g in table.values())
    assert all((r == 1.0) == s for g in table.values() for r, s in g)
    stats = group_stats(table, CalibrationTargets(pass_ks=(1, 4)))
    assert 0.0 < stats.mean_reward < 1.0 and stats.informative_rate > 0
    assert (tmp_path / env.name / "difficulty-0" / "trajectories.jsonl").exists()
