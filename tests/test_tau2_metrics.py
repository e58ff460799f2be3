"""Metric formulas against hand-computed values: per-domain, union (App. F), Student-t CI (App. G)."""

from __future__ import annotations

import json
import math

import pytest

from tracekit.evaluate import (
    Count,
    domain_counts,
    markdown_table,
    mean_ci,
    summarize,
    t_quantile,
    union_pass_rate,
    wandb_rows,
    write_results,
)
from tracekit.types import Task, Trajectory


def traj(env: str, i: int, ok: bool, sample: int = 0, reward: float | None = None) -> Trajectory:
    dom = env.removeprefix("tau2_")
    r = (1.0 if ok else 0.0) if reward is None else reward
    return Trajectory(task_id=f"{dom}/{i}", env=env, sample=sample, success=ok, reward=r, termination="user_stop")


def test_per_domain_and_union_pass_rates():
    # airline 2 of 5 solved, retail 3 of 4: domains 0.4 and 0.75; union (2+3)/(5+4) = 5/9, not the mean 0.575
    trajs = [traj("tau2_airline", i, i < 2) for i in range(5)] + [traj("tau2_retail", i, i < 3) for i in range(4)]
    counts = domain_counts(trajs)
    assert counts == {"tau2_airline": Count(2, 5, 2.0), "tau2_retail": Count(3, 4, 3.0)}
    assert counts["tau2_airline"].pass_rate == 0.4 and counts["tau2_retail"].pass_rate == 0.75
    assert union_pass_rate(counts.values()) == pytest.approx(5 / 9)
    # the paper's setting: S_air/50 and S_ret/114 -> (S_air + S_ret) / 164
    assert union_pass_rate([Count(11, 50), Count(42, 114)]) == pytest.approx(53 / 164)
    with pytest.raises(ValueError, match="two trajectories"):
        domain_counts(trajs + [traj("tau2_airline", 0, True)])


def test_t_quantiles_and_ci_hand_computed():
    assert t_quantile(0.975, 2) == pytest.approx(4.302652730, abs=1e-8)
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736, abs=1e-7)
    assert t_quantile(0.975, 10) == pytest.approx(2.228138852, abs=1e-8)
    assert t_quantile(0.5, 4) == pytest.approx(0.0, abs=1e-12) and t_quantile(0.025, 2) == pytest.approx(-4.302652730)
    # per-seed rates 20, 22, 22: mean 21.333, sd = sqrt(4/3), half = 4.30265 * sqrt(4/3) / sqrt(3) = 2.8684
    mean, half = mean_ci([20.0, 22.0, 22.0])
    assert mean == pytest.approx(64 / 3) and half == pytest.approx(4.302652730 * math.sqrt(4 / 3) / math.sqrt(3))
    assert (round(mean, 1), round(half, 1)) == (21.3, 2.9)  # paper Table 6, Base airline
    assert tuple(round(x, 1) for x in mean_ci([42.0, 44.0, 46.0])) == (44.0, 5.0)  # Table 6, TRACE airline
    assert mean_ci([0.3]) == (0.3, None)


def test_stochastic_summary_over_three_seed_runs(tmp_path):
    # seed k solves k+1 of 3 airline tasks and 2 of 2 retail tasks
    trajs = [traj("tau2_airline", i, i <= k, sample=k) for k in range(3) for i in range(3)]
    trajs += [traj("tau2_retail", i, True, sample=k) for k in range(3) for i in range(2)]
    tasks = [Task(id=f"airline/{i}", env="tau2_airline") for i in range(3)] + [Task(id=f"retail/{i}", env="tau2_retail") for i in range(2)]
    res = summarize(trajs, tasks, samples=3)
    st = res["stochastic"]
    assert st["tau2_airline"]["per_run"] == pytest.approx([1 / 3, 2 / 3, 1.0])
    # mean 2/3, sd 1/3, half = t(0.975, 2) * (1/3) / sqrt(3)
    assert st["tau2_airline"]["mean"] == pytest.approx(2 / 3)
    assert st["tau2_airline"]["ci"] == pytest.approx(4.302652730 / 3 / math.sqrt(3))
    assert st["tau2_retail"] == {"per_run": [1.0, 1.0, 1.0], "mean": 1.0, "ci": 0.0}
    # overall per run: (k+1+2)/5 -> 0.6, 0.8, 1.0
    assert st["overall"]["per_run"] == pytest.approx([0.6, 0.8, 1.0])
    assert res["overall"]["solved"] == 6 + 6 and res["overall"]["total"] == 15
    with pytest.raises(ValueError, match="have no trajectory"):
        summarize(trajs[:-1], tasks, samples=3)

    greedy = summarize([t for t in trajs if t.sample == 0])
    assert "stochastic" not in greedy and greedy["overall"]["pass_rate"] == pytest.approx(3 / 5)
    table = markdown_table({"Base": greedy, "Stochastic": res})
    assert table.splitlines()[0] == "| Approach | Airline (%) | Retail (%) | Overall (%) |"
    assert table.splitlines()[2] == "| Base | 33.3 | 100.0 | 60.0 |"
    assert table.splitlines()[3] == f"| Stochastic | 66.7 ± {100 * 4.302652730 / 3 / math.sqrt(3):.1f} | 100.0 ± 0.0 | 80.0 ± 49.7 |"
    cols, rows = wandb_rows({"Base": greedy})
    assert cols[:5] == ["approach", "domain", "solved", "total", "pass_rate"]
    assert rows[-1][:5] == ["Base", "overall", 3, 5, pytest.approx(0.6)]
    j, md = write_results(tmp_path, {"Base": greedy})
    assert json.loads(j.read_text())["Base"]["overall"]["solved"] == 3 and md.read_text() == markdown_table({"Base": greedy})
