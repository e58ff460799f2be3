"""The planted bands use the official calibration gate (issue 39): a planted capability is in band when the official
rule accepts its reward groups, at the group size measured."""

from __future__ import annotations

from tracekit.planted.bands import band_problems
from tracekit.synthesis.calibrate import OfficialAcceptance, acceptance_figures


def _weak(groups: list[list[float]]) -> dict:
    table = {i: [(r, r >= 1.0) for r in g] for i, g in enumerate(groups)}
    official = acceptance_figures(table, OfficialAcceptance(group_size=len(groups[0]))).model_dump()
    return {"role": "weak", "success_rate": official["success_rate"], "official": official}


def test_a_planted_capability_is_in_band_when_the_official_gate_accepts_it():
    coin = [[1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0]] * 8  # 3 of 8 in every group: 0.375, every group informative
    assert band_problems({"finish": _weak(coin)}) == []
    half_solved = [[1.0] * 8] * 3 + [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]] * 5  # 3 of 8 groups all-success
    (problem,) = band_problems({"refuse": _weak(half_solved)})
    assert problem.startswith("planted refuse: ") and "all_success_group_rate" in problem
    assert band_problems({"lookup": {"role": "strong", "success_rate": 0.5}}) == ["strong lookup: success 0.50 (>= 0.8)"]
