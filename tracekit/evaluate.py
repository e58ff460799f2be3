"""Evaluation metrics: pass rates per domain and overall, stochastic-decoding summaries with CIs.

- Per domain: ``PassRate_d = S_d / N_d`` (S solved tasks, N tasks; an errored or missing-reward
  episode counts as unsolved).
- Overall (paper Appendix F): ``PassRate_overall = (S_Airline + S_Retail) / (N_Airline + N_Retail)``,
  i.e. the union of the domains' tasks, not the mean of the domain rates.
- Stochastic decoding (paper Appendix G: T=0.7, 3 seeds): each seed ``k`` is one full run over the
  tasks, giving one pass rate ``p_k`` per column; we report ``mean(p) +- t_{0.975, n-1} * s / sqrt(n)``
  with ``s`` the sample standard deviation (ddof=1) of the ``n`` per-seed rates.

Why the Student-t interval on per-seed rates: the seeds are the independent replicates (tasks are
fixed across seeds, so pooling episodes as if independent would understate the variance), and
with n=3 the variance itself is estimated from 3 numbers: the normal quantile (1.96) would make
the interval 2.2x too narrow (t_{0.975,2} = 4.303). It also matches the paper's Table 6: per-seed
airline rates 20/22/22 % give 21.3 +- 2.9, and 42/44/46 % give 44.0 +- 5.0, exactly as reported.
With one seed there is no interval (``ci95 = None``).

Paired comparisons: every method runs the same episodes (env, task, seed), so each summary keeps its per-episode
outcomes and :func:`write_results` pairs every row with the Base row episode by episode (:mod:`tracekit.paired`:
task-cluster bootstrap CI of the mean difference, exact McNemar on fixed/broken episodes).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_json, atomic_write_text
from tracekit.paired import outcome_map, paired_line, paired_vs_base
from tracekit.paired import INTERVAL as PAIRED_INTERVAL
from tracekit.types import Task, Trajectory

RESULTS = "results.json"
SCORED_ROWS = "scored_rows.json"  # the evaluate artifact's every scored row, with whether its method keeps it
TABLE = "results.md"
INTERVAL = "Student-t 95% CI on per-seed pass rates: mean +- t_{0.975,n-1} * sd(ddof=1) / sqrt(n)"


@dataclass(frozen=True)
class Count:
    """Solved tasks ``solved`` out of ``total`` (and the sum of rewards, for mean reward)."""

    solved: int
    total: int
    reward_sum: float = 0.0

    @property
    def pass_rate(self) -> float:
        """S / N."""
        if self.total <= 0:
            raise ValueError("pass rate of zero tasks")
        return self.solved / self.total

    @property
    def mean_reward(self) -> float:
        if self.total <= 0:
            raise ValueError("mean reward of zero tasks")
        return self.reward_sum / self.total


def union_count(counts: Iterable[Count]) -> Count:
    """The union of domains: (sum S, sum N); its pass rate is Appendix F's overall pass rate."""
    counts = list(counts)
    return Count(sum(c.solved for c in counts), sum(c.total for c in counts), sum(c.reward_sum for c in counts))


def union_pass_rate(counts: Iterable[Count]) -> float:
    """``(S_1 + ... + S_k) / (N_1 + ... + N_k)`` (paper Appendix F with k = 2 domains)."""
    return union_count(counts).pass_rate


def domain_counts(trajectories: Iterable[Trajectory]) -> dict[str, Count]:
    """Per-domain (``Trajectory.env``) counts over one trajectory per task."""
    solved: Counter[str] = Counter()
    total: Counter[str] = Counter()
    rewards: defaultdict[str, float] = defaultdict(float)
    seen: set[tuple[str, str]] = set()
    for t in trajectories:
        if (t.env, t.task_id) in seen:
            raise ValueError(f"two trajectories of task {t.task_id} in one run: split runs by sample first")
        seen.add((t.env, t.task_id))
        total[t.env] += 1
        solved[t.env] += int(t.success)
        rewards[t.env] += t.reward
    return {env: Count(solved[env], total[env], rewards[env]) for env in sorted(total)}


def t_quantile(p: float, df: int) -> float:
    """Inverse CDF of Student's t with ``df`` degrees of freedom (bisection on the exact CDF)."""
    if not 0 < p < 1:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2


def t_cdf(t: float, df: int) -> float:
    """CDF of Student's t: ``1 - I_{df/(df+t^2)}(df/2, 1/2) / 2`` for t >= 0 (symmetric for t < 0)."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2, 0.5, x)
    return 1 - tail if t >= 0 else tail


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta ``I_x(a, b)`` (continued fraction, modified Lentz)."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):  # the continued fraction converges fast below this point
        return 1.0 - _betainc(b, a, 1 - x)
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    f = d
    for m in range(1, 500):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            f *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return math.exp(log_front) * f / a


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float | None]:
    """``(mean, half_width)`` with half_width = ``t_{(1+c)/2, n-1} * sd(ddof=1) / sqrt(n)``; None if n < 2."""
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci of no values")
    mean = sum(values) / n
    if n < 2:
        return mean, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile((1 + confidence) / 2, n - 1) * sd / math.sqrt(n)


def split_runs(trajectories: Iterable[Trajectory]) -> dict[int, list[Trajectory]]:
    """Trajectories grouped by ``sample`` (sample k = seed run k of a stochastic evaluation)."""
    runs: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajectories:
        runs[t.sample].append(t)
    return dict(sorted(runs.items()))


def _check_complete(trajectories: list[Trajectory], tasks: Sequence[Task], samples: int) -> None:
    have = {(t.task_id, t.sample) for t in trajectories}
    missing = [(t.id, s) for t in tasks for s in range(samples) if (t.id, s) not in have]
    if missing:
        raise ValueError(f"{len(missing)} (task, sample) episodes have no trajectory, e.g. {missing[:5]}")


def _count_json(c: Count) -> dict[str, Any]:
    return {"solved": c.solved, "total": c.total, "pass_rate": c.pass_rate, "mean_reward": c.mean_reward}


def summarize(
    trajectories: Iterable[Trajectory],
    tasks: Sequence[Task] | None = None,
    samples: int | None = None,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """The ``results.json`` content for one rollout.

    ``runs[k]``: per-domain and overall counts of sample k; ``domains`` / ``overall``: pooled over
    runs (with equal task sets, the mean of the runs); ``stochastic`` (>= 2 runs): per column the
    per-run pass rates, their mean and the CI half-width (see module docstring); ``outcomes``: each
    episode's success, ``{env/task_id/sample: 0|1}``. With ``tasks`` given, every (task, sample) must
    have a trajectory.
    """
    trajs = list(trajectories)
    if not trajs:
        raise ValueError("no trajectories to evaluate")
    if tasks is not None:
        _check_complete(trajs, tasks, samples or 1)
    runs = split_runs(trajs)
    per_run = {k: domain_counts(v) for k, v in runs.items()}
    columns = sorted({env for c in per_run.values() for env in c})
    pooled = {env: union_count(c[env] for c in per_run.values() if env in c) for env in columns}
    out: dict[str, Any] = {
        "domains": {env: _count_json(c) for env, c in pooled.items()},
        "overall": _count_json(union_count(pooled.values())),
        "runs": {
            str(k): {"domains": {env: _count_json(c) for env, c in cs.items()}, "overall": _count_json(union_count(cs.values()))}
            for k, cs in per_run.items()
        },
        "terminations": dict(Counter(t.termination for t in trajs)),
        "errors": sum(t.error is not None for t in trajs),
        "episodes": len(trajs),
        # per-episode success {env/task_id/sample: 0|1}: what the paired comparisons (tracekit.paired) align on
        "outcomes": outcome_map(trajs),
    }
    if len(per_run) >= 2:
        stoch: dict[str, Any] = {"interval": INTERVAL, "confidence": confidence, "runs": len(per_run)}
        for col in [*columns, "overall"]:
            rates = [
                (union_count(cs.values()) if col == "overall" else cs[col]).pass_rate
                for cs in per_run.values()
                if col == "overall" or col in cs
            ]
            mean, half = mean_ci(rates, confidence)
            stoch[col] = {"per_run": rates, "mean": mean, "ci": half}
        out["stochastic"] = stoch
    return out


def column_label(env: str) -> str:
    """``tau2_airline`` -> ``Airline``."""
    return env.removeprefix("tau2_").replace("_", " ").title()


def _cell(mean: float, half: float | None) -> str:
    return f"{100 * mean:.1f}" if half is None else f"{100 * mean:.1f} ± {100 * half:.1f}"


BUDGET_COLUMNS = {"episodes": "Episodes", "generated_tokens": "Gen. tokens", "optimizer_steps": "Opt. steps"}


def table_rows(results: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """Pass-rate table: one row per approach (``results``: approach -> summarize() output), columns
    the domains (%) then Overall (%); stochastic results show mean ± CI; then each row's training budget
    (episodes, generated tokens, optimizer steps) where rows carry one."""
    envs = sorted({env for r in results.values() for env in r["domains"]})
    budgets = any("budget" in r for r in results.values())
    header = ["Approach", *[f"{column_label(e)} (%)" for e in envs], "Overall (%)",
              *(BUDGET_COLUMNS.values() if budgets else ())]
    rows = []
    for name, r in results.items():
        row = [name]
        for col in [*envs, "overall"]:
            if "stochastic" in r and col in r["stochastic"]:
                row.append(_cell(r["stochastic"][col]["mean"], r["stochastic"][col]["ci"]))
            elif col == "overall":
                row.append(_cell(r["overall"]["pass_rate"], None))
            elif col in r["domains"]:
                row.append(_cell(r["domains"][col]["pass_rate"], None))
            else:
                row.append("–")
        if budgets:
            row += [f"{r['budget'][k]:,}" if "budget" in r else "–" for k in BUDGET_COLUMNS]
        rows.append(row)
    return header, rows


def markdown_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    header, rows = table_rows(results)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def wandb_rows(results: Mapping[str, Mapping[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """Columns and rows for ``wandb.Table(columns=..., data=...)``: one row per (approach, column)
    with solved / total / pass rate (pooled) and, for stochastic runs, the mean and CI half-width."""
    columns = ["approach", "domain", "solved", "total", "pass_rate", "mean_reward", "stochastic_mean", "ci95",
               *BUDGET_COLUMNS]
    rows: list[list[Any]] = []
    for name, r in results.items():
        budget = r.get("budget", {})
        for col, c in [*r["domains"].items(), ("overall", r["overall"])]:
            st = r.get("stochastic", {}).get(col)
            rows.append([
                name, col, c["solved"], c["total"], c["pass_rate"], c["mean_reward"],
                st["mean"] if st else None, st["ci"] if st else None, *(budget.get(k) for k in BUDGET_COLUMNS),
            ])
    return columns, rows


def paired_table(paired: Mapping[str, Mapping[str, Any]]) -> str:
    """The "paired vs Base" lines under the pass-rate table (``paired``: label -> paired summary); "" when none."""
    if not paired:
        return ""
    return "\n".join(["", f"Paired vs Base ({PAIRED_INTERVAL}):",
                      *(paired_line(label, s) for label, s in paired.items())]) + "\n"


def write_results(run_dir: str | Path, results: Mapping[str, Mapping[str, Any]],
                  table: str | None = None) -> tuple[Path, Path]:
    """Write ``results.json`` (approach -> summary) and ``results.md`` (``table``, by default the pass-rate table)
    atomically. With a row of method ``base`` among them, every other row gets ``paired_vs_base``
    (:func:`tracekit.paired.paired_vs_base` on the rows' ``outcomes``) and ``results.md`` a "paired vs Base"
    line per row under the table."""
    run_dir = Path(run_dir)
    paired = paired_vs_base(results)
    rows = {label: {**r, "paired_vs_base": paired[label]} if label in paired else r for label, r in results.items()}
    atomic_write_json(run_dir / RESULTS, rows, sort_keys=False)  # rows in table order
    atomic_write_text(run_dir / TABLE, (markdown_table(results) if table is None else table) + paired_table(paired))
    return run_dir / RESULTS, run_dir / TABLE
