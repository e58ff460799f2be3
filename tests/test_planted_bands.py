"""The planted bands use the official calibration gate (issue 39): a planted capability is in band when the official
rule accepts its reward groups, at the group size measured, as the composed ``synthesis`` group sets the rule
(issue 51); the bands' rollouts are cached episodes of the target's validation split."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tracekit.artifacts import StageCache
from tracekit.cli import compose_config
from tracekit.pipeline import plain
from tracekit.planted.bands import band_problems, measure_mixes
from tracekit.runs import read_trajectories_dir
from tracekit.synthesis.calibrate import OfficialAcceptance, acceptance_figures
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.stage import official_acceptance

COIN = [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]] * 8  # 3 of 8 in every group: 0.375, every group informative


def _weak(groups: list[list[float]], rule: OfficialAcceptance | None = None) -> dict:
    rule = rule or OfficialAcceptance(group_size=len(groups[0]))
    table = {i: [(r, r >= 1.0) for r in g] for i, g in enumerate(groups)}
    official = acceptance_figures(table, rule).model_dump()
    return {"role": "weak", "success_rate": official["success_rate"], "official": official,
            "official_rule": dataclasses.asdict(rule)}


def test_a_planted_capability_is_in_band_when_the_official_gate_accepts_it():
    assert band_problems({"finish": _weak(COIN)}) == []
    half_solved = [[1.0] * 8] * 3 + [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 5  # 3 of 8 groups all-success
    (problem,) = band_problems({"refuse": _weak(half_solved)})
    assert problem.startswith("planted refuse: ") and "all_success_group_rate" in problem
    assert band_problems({"lookup": {"role": "strong", "success_rate": 0.5}}) == ["strong lookup: success 0.50 (>= 0.8)"]


def test_the_band_rule_is_the_composed_synthesis_groups(tmp_path):
    """synthesis.target_low=0.4 moves the gate's band, and so the planted band: a coin of 0.375 falls out of it."""
    def rule(*overrides: str) -> OfficialAcceptance:
        cfg = compose_config(["experiment=micro", f"paths.root_dir={tmp_path}", *overrides])
        return official_acceptance(SynthesisConfig(**plain(cfg.synthesis)), group_size=8)

    assert band_problems({"finish": _weak(COIN, rule())}) == []
    (problem,) = band_problems({"finish": _weak(COIN, rule("synthesis.target_low=0.4"))})
    assert problem.startswith("planted finish: ") and "below minimum 0.400" in problem


def test_the_bands_refuse_a_backbone_without_a_warm_start_in_one_line(tmp_path, capsys):
    from tracekit.planted.bands import main

    assert main(["--out", str(tmp_path / "out"), "experiment=micro", "backbone=tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("tracekit.planted.bands: error: the bands measure a planted warm start: backbone.planted is unset "
                   "(experiment=micro or experiment=planted)")


@pytest.mark.slow
def test_the_bands_roll_out_through_the_stage_cache(tmp_path, monkeypatch):
    """The bands are cached rollouts of the target's validation split (seeds 0..n): a second call computes
    nothing and measures the same bands (the tiny random backbone solves nothing: the numbers are plumbing)."""
    monkeypatch.setenv("TRACEKIT_CACHE", str(tmp_path / "warmstarts"))
    cfg = compose_config(["experiment=planted", "backbone=tiny", "backbone.planted.demos_strong=1",
                          "backbone.planted.demos_weak=1", "backbone.planted.sft.epochs=1", "agent.max_new_tokens=16",
                          "agent.batch_size=8", "grpo.max_steps=2", f"paths.root_dir={tmp_path}",
                          f"paths.run_dir={tmp_path}/run", f"paths.cache_dir={tmp_path}/cache"])
    first = measure_mixes(cfg, [], [], seeds=2, k=2, out=tmp_path / "out")
    computed = json.loads((tmp_path / "run" / "artifacts.json").read_text())
    assert len(computed) == 4 and not any(a["cache_hit"] for a in computed.values())
    assert measure_mixes(cfg, [], [], seeds=2, k=2) == first
    again = json.loads((tmp_path / "run" / "artifacts.json").read_text())
    assert set(again) == set(computed) and all(a["cache_hit"] for a in again.values())
    (bands,) = first.values()
    assert {(b["n_groups"], b["n_rollouts"]) for b in bands.values()} == {(2, 4)}  # 2 seeds x k=2
    tasks = {t.task_id for a in computed.values()
             for t in read_trajectories_dir(StageCache(tmp_path / "cache").lookup("episodes", a["key"]))}
    assert {t.rsplit("/", 1)[1] for t in tasks} == {"seed-0", "seed-1"}  # validation instances, not held-out ones
    assert json.loads((tmp_path / "out" / "bands.json").read_text()) == json.loads(json.dumps(first))
