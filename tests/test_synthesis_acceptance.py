"""The official TRACE calibration gate (synthesis.acceptance=official): its figures by hand, acceptance and refusal,
the package manifest, and the option reaching the synthesize stage through the config."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from tracekit.artifacts import Artifact, atomic_write_json
from tracekit.config import ConfigError
from tracekit.pipeline import StageContext, read_view
from tracekit.stages import build_pipeline
from tracekit.synthesis.agent import default_checks
from tracekit.synthesis.calibrate import (OfficialAcceptance, accept, acceptance_figures, acceptance_problems,
                                          all_success_rate, all_zero_rate, informative_rate, mean_pass_at_k,
                                          pass_at_k, reward_std)
from tracekit.synthesis.stage import SynthesisSettings, synthesize
from tracekit.synthesis.validate import ValidationConfig
from tracekit.validate import validate

CAPABILITY = {"name": "precondition_verification", "description": "check eligibility"}  # a tau2 library env


def test_pass_at_k_is_the_unbiased_formula_at_group_size_16():
    for c in range(17):
        for k in (1, 4, 8, 16):
            expected = 1.0 if 16 - c < k else 1 - math.comb(16 - c, k) / math.comb(16, k)
            assert pass_at_k(16, c, k) == pytest.approx(expected), (c, k)
    assert pass_at_k(16, 4, 4) == pytest.approx(1 - 495 / 1820)  # C(12,4) / C(16,4)
    assert pass_at_k(16, 2, 8) == pytest.approx(1 - 3003 / 12870)  # C(14,8) / C(16,8)


def test_each_figure_function_by_hand():
    assert reward_std([0.0, 1.0]) == 0.5 and reward_std([0.3]) == 0.0
    assert reward_std([0.0, 0.0, 1.0, 1.0, 0.5, 0.5]) == pytest.approx(math.sqrt(1 / 6))  # deviations .5,.5,.5,.5,0,0
    assert informative_rate([[1.0, 1.0], [0.0, 1.0], [0.5, 0.5 + 1e-10]]) == pytest.approx(1 / 3)  # 8 decimals
    assert all_success_rate([[True, True], [True, False], [False, False]]) == pytest.approx(1 / 3)
    assert all_zero_rate([[0.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]) == pytest.approx(2 / 3)  # <= 0, as theirs
    # pass@2 of [1,0,0,0] is 1 - C(3,2)/C(4,2) = 1/2; of [0,0,0,0] 0; the 1-sample group cannot estimate it
    assert mean_pass_at_k([[True, False, False, False], [False] * 4, [True]], 2) == pytest.approx(0.25)
    assert mean_pass_at_k([[True]], 2) is None


HAND_TABLE = {
    "seed-0": [1.0, 1.0, 1.0, 1.0],  # all success
    "seed-1": [0.0, 0.0, 0.0, 0.0],  # all zero
    "seed-2": [1.0, 0.0, 0.0, 0.0],
    "seed-3": [1.0, 1.0, 0.0, 0.0],
    "seed-4": [0.5, 0.5],  # short of G: in the rollout figures, not in the group rates
}


def test_acceptance_figures_of_a_hand_table():
    fig = acceptance_figures(HAND_TABLE, OfficialAcceptance(group_size=4))
    assert (fig.n_groups, fig.n_rollouts, fig.full_groups, fig.median_group_size) == (5, 18, 4, 4)
    assert fig.mean_reward == pytest.approx(8 / 18)
    assert fig.success_rate == pytest.approx(7 / 18)  # reward >= 1 (no success labels in the table)
    assert fig.std_reward == pytest.approx(math.sqrt((7 * (10 / 18) ** 2 + 9 * (8 / 18) ** 2 + 2 * (1 / 18) ** 2) / 18))
    assert (fig.informative_rate, fig.all_success_rate, fig.all_zero_rate) == (0.5, 0.25, 0.25)  # of the 4 full
    assert fig.pass_at_k == pytest.approx({1: (1 + 0 + 0.25 + 0.5 + 0) / 5, 4: (1 + 0 + 1 + 1) / 4})  # 8, 16 > n
    assert acceptance_problems(fig, OfficialAcceptance(group_size=4)) == [
        "all_success_group_rate=0.250 above maximum 0.200", "all_zero_group_rate=0.250 above maximum 0.200"]
    labelled = acceptance_figures({"a": [(0.9, True), (0.9, False)]}, OfficialAcceptance(group_size=2))
    assert labelled.success_rate == 0.5 and labelled.informative_rate == 0.0  # the env's own success label


class NamedSuite:
    name = "fake_env"


def groups_of(successes: int, g: int = 16, seeds: int = 10):
    def rollout_fn(suite, seed_list, k):
        assert k == g
        return {f"seed-{z}": [1.0] * successes + [0.0] * (k - successes) for z in seed_list}

    return rollout_fn


def test_an_environment_in_the_bands_is_accepted():
    report = accept(NamedSuite(), list(range(10)), groups_of(6))
    assert report.accepted and report.problems == []
    assert report.figures.mean_reward == pytest.approx(6 / 16) and report.figures.informative_rate == 1.0
    assert set(report.figures.pass_at_k) == {1, 4, 8, 16} and report.figures.pass_at_k[16] == 1.0


def test_an_environment_outside_the_bands_is_refused_in_one_line_with_its_numbers():
    report = accept(NamedSuite(), list(range(10)), groups_of(15))  # too easy: 15 of 16 succeed
    assert not report.accepted
    line = report.refusal()
    assert "\n" not in line and line.startswith("refused by the official acceptance rule: mean_reward=0.938 above "
                                                "maximum 0.600; success_rate=0.938 above maximum 0.600")
    assert "mean reward 0.938" in line and "pass@1 0.938" in line and "(10 groups, G=16)" in line
    hard = accept(NamedSuite(), list(range(10)), groups_of(0))
    assert hard.problems == ["mean_reward=0.000 below minimum 0.200", "success_rate=0.000 below minimum 0.200",
                             "std_reward=0.000 below minimum 0.050", "all_zero_group_rate=1.000 above maximum 0.200",
                             "informative_group_rate=0.000 below minimum 0.500"]
    short = acceptance_figures({z: [1.0, 0.0] * 4 for z in range(3)}, OfficialAcceptance())
    assert acceptance_problems(short) == ["median group size 8 below G=16"]


@pytest.mark.parametrize("kwargs,message", [
    ({"group_size": 1}, "G must be >= 2"),
    ({"mean_reward": (0.7, 0.3)}, "mean_reward must be"),
    ({"success_rate": (-0.1, 0.5)}, "success_rate must be"),
    ({"max_all_zero": 1.5}, "max_all_zero must be in"),
])
def test_the_rule_refuses_impossible_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OfficialAcceptance(**kwargs)


def test_synthesize_records_the_figures_and_skips_a_refused_package(tmp_path):
    settings = SynthesisSettings(checks=replace(default_checks(), validation=ValidationConfig(n_seeds=8)),
                                 acceptance=OfficialAcceptance(group_size=4))
    seen = []

    def rollout_fn(suite, seeds, k):
        seen.append((suite.name, seeds, k))
        return {f"seed-{z}": [1.0, 1.0, 0.0, 0.0] if z % 2 else [1.0, 0.0, 0.0, 0.0] for z in seeds}

    manifest = synthesize([CAPABILITY], "tau2", tmp_path / "ok", settings, acceptance_fn=rollout_fn)
    (entry,) = manifest["environments"]
    assert entry["status"] == "ready" and entry["acceptance"]["accepted"]
    assert entry["acceptance"]["mean_reward"] == pytest.approx(3 / 8) and seen[0][1:] == (list(range(8)), 4)
    saved = json.loads((tmp_path / "ok" / CAPABILITY["name"] / "acceptance.json").read_text())
    assert saved["accepted"] and saved["figures"]["group_size"] == 4 and saved["seeds"] == list(range(8))

    manifest = synthesize([CAPABILITY], "tau2", tmp_path / "easy", settings,
                          acceptance_fn=lambda suite, seeds, k: {z: [1.0] * k for z in seeds})
    (entry,) = manifest["environments"]
    assert (entry["status"], manifest["ready"]) == ("skipped", 0)
    assert entry["reason"].startswith("refused by the official acceptance rule: mean_reward=1.000 above maximum")
    assert entry["acceptance"]["accepted"] is False
    with pytest.raises(ValueError, match="needs a rollout function"):
        synthesize([CAPABILITY], "tau2", tmp_path / "none", settings)


@pytest.mark.parametrize("override,key", [
    ("synthesis.acceptance=strict", "synthesis.acceptance"),
    ("synthesis.acceptance_group_size=1", "synthesis.acceptance_group_size"),
    ("synthesis.max_all_zero=1.5", "synthesis.max_all_zero"),
    ("synthesis.min_reward_std=-0.1", "synthesis.min_reward_std"),
    ("synthesis.target_low=0.7", "synthesis.target_low"),  # the gate's band: lo <= hi
])
def test_the_config_range_checks_the_gate(make_cfg, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(make_cfg("synthesis.acceptance=official", override))


def test_the_option_reaches_the_synthesize_stage(make_cfg, tmp_path, monkeypatch):
    import tracekit.stages as stages

    cfg = make_cfg("experiment=embedded", "synthesis.acceptance=official", "synthesis.acceptance_group_size=4",
                   "synthesis.validation_seeds=8", "synthesis.max_all_success=0.5")  # a tau^2 library capability
    validate(cfg)
    pipe = build_pipeline()
    reads = pipe.reads(cfg, "synthesize")
    assert "backbone" in reads and "agent" in reads  # the gate samples the base policy
    assert "backbone" not in pipe.reads(make_cfg(), "synthesize")  # the default: no gate, no policy
    sampled = []

    def fake_rollout_fn(agent, folder, **kwargs):
        def rollout_fn(suite, seeds, k):
            sampled.append((Path(folder).name, seeds, k))
            return {f"seed-{z}": [1.0, 1.0, 1.0, 0.0] for z in seeds}  # 3 of 4 succeed: too easy

        return rollout_fn

    monkeypatch.setattr(stages, "llm_agent", lambda cfg, temperature: object())
    monkeypatch.setattr(stages, "make_rollout_fn", fake_rollout_fn)
    select_dir = tmp_path / "select"
    atomic_write_json(select_dir / "selected.json", {"selected": [CAPABILITY]})
    work = tmp_path / "work"
    work.mkdir()
    ctx = StageContext(read_view(cfg, reads), "synthesize", work,
                       {"select": Artifact("select", "k", select_dir, "c", hit=True)}, cache=None, record=None)
    stages.synthesize_stage(ctx)
    assert sampled == [("acceptance_rollouts", list(range(8)), 4)]
    (entry,) = json.loads((work / "environments.json").read_text())["environments"]
    assert entry["status"] == "skipped" and entry["acceptance"]["all_success_rate"] == 0.0
    assert "mean_reward=0.750 above maximum 0.600; success_rate=0.750 above maximum 0.600 [" in entry["reason"]
