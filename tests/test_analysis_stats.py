"""ER+/ER-/Delta/Cov and K-of-N selection on hand-built label tables (paper section 3.3)."""

from __future__ import annotations

import json

import pytest

from tracekit.analysis.select import Thresholds, select, selected_names
from tracekit.analysis.stats import (
    capability_run_stats,
    contrastive_gap,
    coverage,
    error_rate,
    passes,
    stats_table,
)
from tracekit.analysis.stages import select_stage
from tracekit.types import Capability, Label, LabelValue

V = {"N": LabelValue.NA, "P": LabelValue.PRESENT, "L": LabelValue.LACKING, None: None}


def lab(traj: str, cap: str, run: int, v: str | None, success: bool) -> Label:
    return Label(trajectory=traj, capability=cap, run=run, value=V[v], rationale="", success=success)


def table(cap: str, run: int, wins: str, fails: str) -> list[Label]:
    """Labels from two strings, one char per trajectory: N/P/L, '-' = missing (value None)."""
    out = [lab(f"s{i}", cap, run, None if ch == "-" else ch, True) for i, ch in enumerate(wins)]
    out += [lab(f"f{i}", cap, run, None if ch == "-" else ch, False) for i, ch in enumerate(fails)]
    return out


def caps(*names: str) -> list[Capability]:
    return [Capability(name=n, description=f"desc of {n}") for n in names]


# ---------------------------------------------------------------- pure formulas


def test_formulas_by_hand():
    assert error_rate(1, 3) == pytest.approx(1 / 3)
    assert error_rate(0, 0) is None
    assert contrastive_gap(0.75, 1 / 3) == pytest.approx(0.75 - 1 / 3)
    assert contrastive_gap(None, 0.2) is None
    assert contrastive_gap(0.6, None, "zero") == pytest.approx(0.6)
    assert contrastive_gap(0.6, None, "unselectable") is None
    assert coverage(3, 5) == pytest.approx(0.6)
    assert coverage(0, 0) is None


def test_run_stats_hand_computed():
    # successes: L P N P -> ER+ = 1 lacking / 3 applicable (NA excluded)
    # failures:  L L P N L -> ER- = 3/4 ; Cov = 3 lacking / 5 failed (NA counts in |D-|)
    s = stats_table(table("a", 0, "LPNP", "LLPNL"), ["a"])[0]
    assert (s.lacking_success, s.applicable_success, s.n_success) == (1, 3, 4)
    assert (s.lacking_failed, s.applicable_failed, s.n_failed) == (3, 4, 5)
    assert s.er_pos == pytest.approx(1 / 3)
    assert s.er_neg == pytest.approx(3 / 4)
    assert s.delta == pytest.approx(0.75 - 1 / 3)  # 0.41667
    assert s.cov == pytest.approx(0.6)
    assert s.missing == 0 and s.er_pos_defined


def test_missing_labels_leave_numerator_and_denominator():
    # f4 (a LACKING) becomes missing: ER- = 2/3, Cov = 2/4 ; success s0 missing: ER+ = 0/2
    s = stats_table(table("a", 0, "-PNP", "LLPN-"), ["a"])[0]
    assert s.missing == 2
    assert s.er_pos == pytest.approx(0.0)
    assert s.er_neg == pytest.approx(2 / 3)
    assert s.cov == pytest.approx(0.5)
    assert s.n_failed == 4


def test_no_successes_er_pos_undefined_zero_or_unselectable():
    vals = [(LabelValue.LACKING, False), (LabelValue.PRESENT, False)]
    s = capability_run_stats(0, "a", vals, "zero")
    assert s.er_pos is None and not s.er_pos_defined
    assert s.delta == pytest.approx(0.5)  # ER- = 1/2, ER+ treated as 0
    assert s.cov == pytest.approx(0.5)
    s2 = capability_run_stats(0, "a", vals, "unselectable")
    assert s2.delta is None
    assert not passes(s2.delta, s2.cov, 0.2, 0.1)


def test_na_on_all_successes_is_also_undefined_er_pos():
    s = stats_table(table("a", 0, "NN", "LP"), ["a"])[0]
    assert s.er_pos is None and s.delta == pytest.approx(0.5)


def test_no_failures_is_not_selectable():
    s = stats_table(table("a", 0, "LPL", ""), ["a"])[0]
    assert s.er_neg is None and s.cov is None and s.delta is None
    assert not passes(s.delta, s.cov, -1.0, 0.0)


def test_na_everywhere_is_not_selectable():
    s = stats_table(table("a", 0, "NNN", "NN"), ["a"])[0]
    assert s.er_pos is None and s.er_neg is None and s.delta is None
    assert s.cov == 0.0  # failures exist, none lacking
    assert not passes(s.delta, s.cov, -1.0, 0.0)


def test_threshold_is_inclusive_despite_float_rounding():
    # ER- = 1/1, ER+ = 4/5: 1.0 - 0.8 == 0.19999999999999996 in floating point
    s = stats_table(table("a", 0, "LLLLP", "L"), ["a"])[0]
    assert s.delta < 0.2
    assert passes(s.delta, s.cov, 0.2, 0.5)
    assert not passes(s.delta, s.cov, 0.2 + 1e-6, 0.5)


# ---------------------------------------------------------------- K of N


def ten_runs(passing_runs: set[int], cap: str) -> list[Label]:
    """10 runs; in passing runs the cap has ER- = 1/2, ER+ = 0: Delta = 0.5, Cov = 0.5; else 0, 0."""
    out = []
    for r in range(10):
        out += table(cap, r, "PP", "LP" if r in passing_runs else "PP")
    return out


def test_k_of_n_keeps_8_of_10_drops_7_of_10():
    labels = ten_runs(set(range(8)), "eight") + ten_runs(set(range(7)), "seven")
    sel = select(labels, caps("eight", "seven"), Thresholds())
    by = {c["name"]: c for c in sel["candidates"]}
    assert by["eight"]["selection_count"] == 8 and by["eight"]["selected"]
    assert by["seven"]["selection_count"] == 7 and not by["seven"]["selected"]
    assert [c["name"] for c in sel["selected"]] == ["eight"]
    assert by["eight"]["selected_runs"] == list(range(8))
    assert by["eight"]["deltas"] == [0.5] * 8 + [0.0] * 2
    assert by["eight"]["mean_delta"] == pytest.approx(0.4)
    assert by["eight"]["covs"] == [0.5] * 8 + [0.0] * 2
    assert by["eight"]["median_cov"] == pytest.approx(0.5)
    assert by["eight"]["cov_iqr"] == pytest.approx([0.5, 0.5])
    assert by["eight"]["example_failed_trajectories"] == ["f0"]


def test_rho_gate_and_rank_by_mean_delta():
    # "big": ER- = 10/10, ER+ = 0 -> Delta 1, Cov = 10/20 ; "small": ER- = 1/4 -> Delta 0.25,
    # Cov = 1/4 (16 missing) ; "rare": Delta = 1/1 (one applicable failure), Cov = 1/20 < rho
    labels = []
    for r in range(10):
        labels += table("big", r, "PPPP", "L" * 10 + "N" * 10)
        labels += table("small", r, "PPPP", "LPPP" + "-" * 16)
        labels += table("rare", r, "PPPP", "L" + "N" * 19)
    sel = select(labels, caps("small", "rare", "big"), Thresholds())
    assert [c["name"] for c in sel["selected"]] == ["big", "small"]
    assert [c["name"] for c in sel["candidates"]] == ["big", "rare", "small"]  # by mean Delta: 1, 1, 0.25
    rare = next(c for c in sel["candidates"] if c["name"] == "rare")
    assert rare["mean_delta"] == pytest.approx(1.0) and rare["mean_cov"] == pytest.approx(0.05)
    assert rare["selection_count"] == 0
    small = next(c for c in sel["candidates"] if c["name"] == "small")
    assert small["mean_cov"] == pytest.approx(0.25)  # the 16 missing labels are out of |D-|
    assert sel["missing_labels"]["by_capability"]["small"] == 160


def test_absent_cells_count_as_missing_and_flags():
    # run 1 lacks the label of f1 entirely (not even a None row)
    labels = table("a", 0, "P", "LL") + table("a", 1, "P", "L")
    sel = select(labels, caps("a"), Thresholds(k=1, n=2))
    assert sel["missing_labels"]["total"] == 1
    assert [s["missing"] for s in sel["stats"]] == [0, 1]
    # no successes anywhere -> flag
    sel2 = select(table("a", 0, "", "LL"), caps("a"), Thresholds(k=1, n=1))
    assert any("ER+ undefined" in f for f in sel2["flags"])
    assert sel2["selected"][0]["name"] == "a"


def test_bad_tables_raise_clear_errors():
    with pytest.raises(ValueError, match="runs"):
        select(table("a", 0, "P", "L"), caps("a"), Thresholds())  # 1 run, n=10
    with pytest.raises(ValueError, match="not in the dictionary"):
        select(table("zzz", 0, "P", "L"), caps("a"), Thresholds(k=1, n=1))
    with pytest.raises(ValueError, match="conflicting success"):
        select([lab("t", "a", 0, "L", True), lab("t", "a", 1, "L", False)], caps("a"), Thresholds(k=1, n=2))
    with pytest.raises(ValueError, match="duplicate"):
        select(table("a", 0, "P", "L") * 2, caps("a"), Thresholds(k=1, n=1))
    with pytest.raises(ValueError, match=r"^thresholds\.k=11 is invalid: must be in \[1, thresholds\.n=10\]$"):
        Thresholds(k=11, n=10)
    with pytest.raises(ValueError, match="rho"):
        Thresholds(rho=1.5)


def test_stage_writes_files_and_identity_is_threshold_independent(tmp_path):
    labels = ten_runs(set(range(10)), "strong") + ten_runs(set(range(9)), "ok") + ten_runs(set(), "none")
    d = caps("strong", "ok", "none")
    sel_a, paths_a = select_stage(labels, d, Thresholds(delta=0.2, rho=0.1), tmp_path / "a")
    sel_b, paths_b = select_stage(labels, d, Thresholds(delta=0.5, rho=0.3), tmp_path / "b")
    assert [c["name"] for c in sel_a["selected"]] == ["strong", "ok"]  # mean Delta 0.5, 0.45
    assert [c["name"] for c in sel_b["selected"]] == ["strong", "ok"]
    assert paths_a["selected_names"].read_bytes() == paths_b["selected_names"].read_bytes()
    assert json.loads(paths_a["selected_names"].read_text()) == [
        {"name": "ok", "description": "desc of ok"},
        {"name": "strong", "description": "desc of strong"},
    ]
    assert paths_a["selected"].read_bytes() != paths_b["selected"].read_bytes()  # thresholds differ
    full = json.loads(paths_a["selected"].read_text())
    assert len(full["stats"]) == 30 and {"er_pos", "er_neg", "delta", "cov"} <= set(full["stats"][0])
    for key in ("selection_frequency", "failure_coverage"):
        assert paths_a[key].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert selected_names(sel_a) == json.loads(paths_a["selected_names"].read_text())
