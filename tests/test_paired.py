"""Paired comparisons (tracekit.paired) against hand-computed answers, their results.json / results.md round trip
through write_results, and the planted gain report's paired line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.test_tau2_metrics import traj
from tracekit.evaluate import markdown_table, summarize, write_results
from tracekit.paired import (
    mcnemar_exact,
    outcome_map,
    paired_bootstrap_ci,
    paired_outcomes,
    paired_summary,
    required_n,
    task_of,
)


def test_mcnemar_exact_hand_computed():
    assert mcnemar_exact(10, 0) == 2 / 1024 == 0.001953125
    assert mcnemar_exact(0, 10) == 0.001953125  # two-sided: symmetric
    assert mcnemar_exact(0, 0) == 1.0  # no discordant pair: no evidence
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(1, 0) == 1.0  # capped at 1
    assert mcnemar_exact(3, 0) == 0.25
    # n = 10, k = 3: 2 * (1 + 10 + 45 + 120) / 1024
    assert mcnemar_exact(7, 3) == mcnemar_exact(3, 7) == 352 / 1024
    assert 0 < mcnemar_exact(2000, 1000) < 1e-70  # big n stays exact (integer sums) instead of overflowing
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_exact(-1, 2)


def test_bootstrap_of_equal_differences_is_a_point():
    assert paired_bootstrap_ci([1] * 20) == (1.0, 1.0)
    assert paired_bootstrap_ci([0] * 7, clusters=list("aabbccd")) == (0.0, 0.0)
    assert paired_bootstrap_ci([-1] * 5, n_boot=3) == (-1.0, -1.0)


def test_bootstrap_excludes_or_includes_zero_and_is_deterministic():
    lo, hi = paired_bootstrap_ci([1] * 40 + [0] * 10)  # mean 0.8 on 50 episodes
    assert 0 < lo < 0.8 < hi <= 1
    lo, hi = paired_bootstrap_ci([1] * 5 + [-1] * 5 + [0] * 10)  # mean 0: gains and losses cancel
    assert lo < 0 < hi
    d = [1, 0, 0, -1, 1, 1, 0, 1]
    assert paired_bootstrap_ci(d, seed=3) == paired_bootstrap_ci(d, seed=3)
    # few replicates: the interpolated quantiles show the draws (with 10,000 they sit on the same k/8 grid points)
    assert paired_bootstrap_ci(d, seed=3, n_boot=21) != paired_bootstrap_ci(d, seed=4, n_boot=21)
    lo90, hi90 = paired_bootstrap_ci(d, level=0.9)
    lo95, hi95 = paired_bootstrap_ci(d, level=0.95)
    assert lo95 <= lo90 and hi90 <= hi95
    for bad, match in (([], "non-empty"), ([[1, 0]], "1-d")):
        with pytest.raises(ValueError, match=match):
            paired_bootstrap_ci(bad)
    with pytest.raises(ValueError, match="level"):
        paired_bootstrap_ci(d, level=1.0)
    with pytest.raises(ValueError, match="3 cluster labels for 8"):
        paired_bootstrap_ci(d, clusters=["a", "b", "c"])


def test_cluster_bootstrap_keeps_a_tasks_seeds_together():
    # 10 tasks x 5 seeds, the seeds of a task agree (perfectly correlated): 6 tasks gain on every seed, 4 never
    d = np.repeat([1] * 6 + [0] * 4, 5)
    tasks = np.repeat([f"t{i}" for i in range(10)], 5)
    lo_e, hi_e = paired_bootstrap_ci(d)
    lo_c, hi_c = paired_bootstrap_ci(d, clusters=tasks)
    # 50 "independent" episodes understate the spread of 10 independent tasks: sd/sqrt(50) vs sd/sqrt(10)
    assert hi_c - lo_c > 1.8 * (hi_e - lo_e)
    assert lo_c <= 0.6 <= hi_c
    # every resample is a whole number of tasks: its mean is a multiple of 1/10, never of 1/50 alone
    assert round(10 * lo_c, 9) == round(10 * lo_c) and round(10 * hi_c, 9) == round(10 * hi_c)
    # singleton clusters (labels in episode order) are the unclustered bootstrap, draw for draw
    assert paired_bootstrap_ci(d, clusters=[f"{i:03d}" for i in range(50)]) == (lo_e, hi_e)


def test_required_n():
    assert required_n(0.5, 0.05) == 385  # (1.959964 * 0.5 / 0.05)^2 = 384.15
    assert required_n(1.0, 0.1) == 385 and required_n(0.0, 0.05) == 0
    assert required_n(0.3, 0.05) == math.ceil((1.959964 * 6) ** 2)
    with pytest.raises(ValueError, match="half_width"):
        required_n(0.5, 0.0)
    with pytest.raises(ValueError, match="sd_diff"):
        required_n(-0.1, 0.05)


def runs(solved: set[tuple[int, int]], tasks: int = 4, samples: int = 2) -> list:
    """tau2_airline tasks 0..tasks-1 over seeds 0..samples-1, solved where (task, seed) is in ``solved``."""
    return [traj("tau2_airline", i, (i, k) in solved, sample=k) for k in range(samples) for i in range(tasks)]


# Base solves task 0 on both seeds and task 1 on seed 0; Other also task 1 on seed 1 and task 2 on both:
# 3 fixed, 0 broken, d = (b - a) is 1 on 3 of 8 episodes.
BASE = {(0, 0), (0, 1), (1, 0)}
OTHER = BASE | {(1, 1), (2, 0), (2, 1)}


def test_paired_outcomes_align_by_env_task_and_seed():
    keys, a, b = paired_outcomes(runs(BASE), reversed(runs(OTHER)))  # order does not matter, keys do
    assert keys[:2] == ["tau2_airline/airline/0/0", "tau2_airline/airline/0/1"] and len(keys) == 8
    assert a.tolist() == [1, 1, 1, 0, 0, 0, 0, 0] and b.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert task_of("tau2_airline/airline/3/1") == "tau2_airline/airline/3"
    with pytest.raises(ValueError, match="not env/task_id/sample"):
        task_of("no-sample")
    with pytest.raises(ValueError, match=r"1 episodes only in a \(e.g. tau2_airline/airline/3/1\)"):
        paired_outcomes(runs(BASE), runs(OTHER)[:-1])  # a method missing an episode is not compared on fewer
    with pytest.raises(ValueError, match="2 episodes only in b"):
        paired_outcomes(runs(BASE), runs(OTHER, samples=3)[:10])
    with pytest.raises(ValueError, match="two trajectories of episode"):
        outcome_map(runs(BASE) + runs(BASE)[:1])
    with pytest.raises(ValueError, match="no episodes"):
        paired_outcomes([], [])


def expected_summary() -> dict:
    d = [0, 0, 0, 1, 1, 1, 0, 0]  # sorted keys: task 0 s0 s1, task 1 s0 s1, task 2 s0 s1, task 3 s0 s1
    sd = math.sqrt((3 * (5 / 8) ** 2 + 5 * (3 / 8) ** 2) / 7)
    ci = paired_bootstrap_ci(d, clusters=["t0", "t0", "t1", "t1", "t2", "t2", "t3", "t3"])
    return {"n_episodes": 8, "n_tasks": 4, "mean_a": 3 / 8, "mean_b": 6 / 8, "diff": 3 / 8, "ci": list(ci),
            "level": 0.95, "n_boot": 10000, "seed": 0, "fixed": 3, "broken": 0, "mcnemar_p": 0.25,
            "excludes_zero": False, "sd_diff": pytest.approx(sd),
            "normal_ci": pytest.approx([3 / 8 - 1.959964 * sd / math.sqrt(8), 3 / 8 + 1.959964 * sd / math.sqrt(8)])}


def test_paired_summary_hand_computed():
    s = paired_summary(runs(BASE), runs(OTHER))
    assert s == expected_summary()
    # the bootstrap resamples the 4 tasks: drawing only tasks 0 and 3 (chance 1/16 > 2.5%) gives 0
    assert s["ci"][0] == 0.0 and 3 / 8 < s["ci"][1] <= 1.0
    assert paired_summary(runs(OTHER), runs(BASE))["diff"] == -3 / 8
    same = paired_summary(runs(BASE), runs(BASE))
    assert (same["diff"], same["ci"], same["mcnemar_p"], same["sd_diff"]) == (0.0, [0.0, 0.0], 1.0, 0.0)
    one = paired_summary(runs(BASE, tasks=1, samples=1), runs(set(), tasks=1, samples=1))
    assert (one["broken"], one["sd_diff"], one["normal_ci"]) == (1, None, None)


def test_write_results_pairs_every_row_with_base(tmp_path):
    results = {"Base": {**summarize(runs(BASE)), "method": "base"},
               "Other": {**summarize(runs(OTHER)), "method": "trace"}}
    assert results["Base"]["outcomes"] == {t.uid: int(t.success) for t in runs(BASE)}
    j, md = write_results(tmp_path, results)
    rows = json.loads(j.read_text())
    assert "paired_vs_base" not in rows["Base"] and rows["Other"]["paired_vs_base"] == expected_summary()
    assert rows["Other"]["overall"] == results["Other"]["overall"] and rows["Other"]["episodes"] == 8  # kept as is
    assert "paired_vs_base" not in results["Other"]  # the caller's rows are not mutated
    text = md.read_text()
    assert text.startswith(markdown_table(results))
    hi = 100 * expected_summary()["ci"][1]
    assert text.splitlines()[-1] == (f"- Other: +37.5 points [+0.0, {hi:+.1f}], fixed 3 / broken 0, McNemar p = 0.25 "
                                     "(8 episodes, 4 tasks)")
    # no base row among the methods: nothing is added
    j, md = write_results(tmp_path / "nobase", {"Other": results["Other"]})
    assert "paired_vs_base" not in json.loads(j.read_text())["Other"]
    assert md.read_text() == markdown_table({"Other": results["Other"]})
    # a row missing an episode is an error naming the row, not a comparison on fewer tasks
    short = {"Base": results["Base"], "Other": {**summarize(runs(OTHER)[:-1]), "method": "trace"}}
    with pytest.raises(ValueError, match="row 'Other' against 'Base': .*1 episodes only in a"):
        write_results(tmp_path / "short", short)


def test_results_json_stays_small(tmp_path):
    # the planted preset's size: 40 tasks x 3 seeds = 120 episodes per row, three rows
    trajs = [traj("tau2_precondition_verification", 10_000_000 + i, i % 3 == k, sample=k)
             for k in range(3) for i in range(40)]
    res = {"Base": {**summarize(trajs), "method": "base"}, "TRACE": {**summarize(trajs), "method": "trace"}}
    j, _ = write_results(tmp_path, res)
    assert j.stat().st_size < 64_000


def gain_variant(make_cfg, tmp_path, results: dict) -> dict:
    return {"cfg": make_cfg("experiment=planted"), "results": results, "artifacts": {}, "seconds": 1.0,
            "run_dir": str(tmp_path / "run")}


def test_gain_report_renders_the_paired_comparison(make_cfg, tmp_path, monkeypatch):
    from tracekit.planted.gain import report

    monkeypatch.setenv("TRACEKIT_CACHE", str(tmp_path / "cache"))  # no planted warm start is built: none recorded
    results = {"Base": {**summarize(runs(BASE)), "method": "base"},
               "TRACE": {**summarize(runs(OTHER)), "method": "trace"}}
    j, _ = write_results(tmp_path, results)
    stored = json.loads(j.read_text())
    table = report({"preset": gain_variant(make_cfg, tmp_path, stored)}, tmp_path / "out")
    pair = table["preset"]["rows"]["TRACE"]["paired_vs_base"]
    assert pair == expected_summary() and "paired_vs_base" not in table["preset"]["rows"]["Base"]
    verdict = table["preset"]["verdict"]
    assert verdict["paired_excludes_zero"] is False and verdict["gain"] == pytest.approx(3 / 8)
    sd = pair["sd_diff"]
    assert verdict["power"] == {"sd_diff": sd, "n_episodes": 8,
                                "half_width_normal": pytest.approx(1.959964 * sd / math.sqrt(8)),
                                "half_width_bootstrap": pytest.approx((pair["ci"][1] - pair["ci"][0]) / 2),
                                "target_half_width": 0.05, "required_n": required_n(sd, 0.05)}
    written = json.loads((tmp_path / "out" / "planted_gain.json").read_text())
    assert written["preset"]["rows"]["TRACE"]["paired_vs_base"] == pair
    md = (tmp_path / "out" / "planted_gain.md").read_text()
    assert (f"| TRACE | +37.5 | +0.0 to {100 * pair['ci'][1]:+.1f} | 3 / 0 | 0.25 | no | 8 (4) |") in md
    assert "paired 95% CI includes 0." in md
    assert f"± 5 points needs {required_n(sd, 0.05)} episodes" in md

    # rows without the stored comparison: recomputed from their outcomes, the same numbers
    plain = {label: {k: v for k, v in r.items() if k != "paired_vs_base"} for label, r in stored.items()}
    again = report({"preset": gain_variant(make_cfg, tmp_path, plain)}, tmp_path / "again")
    assert again["preset"]["rows"]["TRACE"]["paired_vs_base"] == pair
    # rows evaluated before outcomes were kept: the unpaired intervals only, the paired verdict n/a
    old = {label: {k: v for k, v in r.items() if k != "outcomes"} for label, r in plain.items()}
    old_table = report({"preset": gain_variant(make_cfg, tmp_path, old)}, tmp_path / "old")
    old_verdict = old_table["preset"]["verdict"]
    assert old_verdict["paired_excludes_zero"] is None and old_verdict["power"] is None
    assert "paired 95% CI n/a (no per-episode outcomes)" in (tmp_path / "old" / "planted_gain.md").read_text()


def test_gain_report_pairs_every_row_with_trace_and_tabulates_training_seeds(make_cfg, tmp_path, monkeypatch):
    from tracekit.planted.gain import report

    monkeypatch.setenv("TRACEKIT_CACHE", str(tmp_path / "cache"))
    # seed 0: TRACE = OTHER (3 fixed of 8 episodes), Single = BASE; seed 1: TRACE = BASE (no gain)
    by_seed = {0: (OTHER, BASE), 1: (BASE, BASE | {(3, 0)})}
    variants = {}
    for seed, (trace, single) in by_seed.items():
        results = {"Base": {**summarize(runs(BASE)), "method": "base"},
                   f"Single Capability GRPO (cap{seed})": {**summarize(runs(single)), "method": "single_capability"},
                   "TRACE": {**summarize(runs(trace)), "method": "trace"}}
        j, _ = write_results(tmp_path / f"s{seed}", results)
        variants[f"preset seed={seed}"] = gain_variant(make_cfg, tmp_path, json.loads(j.read_text()))
    # while the search runs, the seeds not yet measured are left out (one measured seed: no seed table yet)
    partial = report({"preset seed=0": variants["preset seed=0"]}, tmp_path / "partial",
                     {"preset seed=0": 0, "preset seed=1": 1, "preset seed=2": 2})
    assert "training_seeds" not in partial
    table = report(variants, tmp_path / "out", {"preset seed=0": 0, "preset seed=1": 1, "preset seed=2": 2})

    vs_trace = table["preset seed=0"]["rows"]["Base"]["paired_vs_trace"]
    assert vs_trace["diff"] == pytest.approx(-3 / 8) and (vs_trace["fixed"], vs_trace["broken"]) == (0, 3)
    assert "paired_vs_trace" not in table["preset seed=0"]["rows"]["TRACE"]
    seeds = table["training_seeds"]
    trace = seeds["trace"]
    assert trace["per_seed"][0]["vs_base"] == pytest.approx(3 / 8) and trace["per_seed"][1]["vs_base"] == 0
    assert trace["vs_base"]["mean"] == pytest.approx(3 / 16)
    assert trace["vs_base"]["sd"] == pytest.approx(math.sqrt(2 * (3 / 16) ** 2))
    assert (trace["vs_base"]["min"], trace["vs_base"]["max"]) == (0, pytest.approx(3 / 8))
    # Single's label names a different capability per seed: one row by method, the labels kept
    assert seeds["single_capability"]["labels"] == {0: "Single Capability GRPO (cap0)",
                                                     1: "Single Capability GRPO (cap1)"}
    assert seeds["base"]["per_seed"][0]["vs_base"] is None
    md = (tmp_path / "out" / "planted_gain.md").read_text()
    assert "| approach | paired vs TRACE (points) |" in md and "## Training seeds" in md and "backbone.planted.init_seed" in md
    assert "| trace | 75.0 / +37.5 [+0.0, " in md and "| +18.8 (26.5, +0.0 to +37.5) |" in md
