"""Difficulty calibration of a synthetic environment against the current policy (as the official TRACE does).

The policy is rolled out K times per seed (default 16) by a caller-supplied ``rollout_fn(suite, seeds, k)``
returning a reward table ``{task_or_seed: [reward | (reward, success) | outcome-like, ...]}``; every statistic
below is a pure function of that table:

- mean reward, success rate (success = the env's label, or reward >= ``success_threshold`` when absent);
- informative-group rate: groups whose K rewards are not all equal (GRPO drops the others: zero advantage);
- all-success and all-zero group rates;
- pass@k, the unbiased estimator of Chen et al. (2021): ``pass@k = 1 - C(n - c, k) / C(n, k)`` per group with
  n samples and c successes, averaged over groups (only for k <= n).

Targets (configurable): mean reward and success rate in [0.2, 0.6], informative groups >= 0.5. The built-in
library turns its difficulty knob (:func:`calibrate_difficulty` walks the levels toward the target); a generated
environment that is too easy / too hard is sent back to the generation agent for a mutation round instead.

The official acceptance rule (``synthesis.acceptance=official``; :class:`OfficialAcceptance`, :func:`accept`) is the
gate of the official TRACE code's ``pipeline/calibrate_environment.py``, run on the finished environment: the base
policy samples G (16) rollouts on each validation seed, and the environment is kept only if mean reward and success
rate are in [0.2, 0.6], the reward std >= 0.05, all-success and all-zero groups <= 20% each and informative groups
>= 50%; pass@{1,4,8,16} is reported. As there, the group rates are over the groups of at least G samples, a group is
informative when its rewards differ (rounded to 8 decimals), all-zero when every reward is <= 0, and a median group
below G is refused. Unlike there, a sample's success is the environment's own label where the table carries one
(reward >= 1 otherwise), and pass@k is the unbiased estimator (theirs: a success among each group's first k samples).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tracekit.artifacts import atomic_write_json, atomic_write_text
from tracekit.envs.base import EnvSuite
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.synthesis.settings import SynthesisConfig

log = logging.getLogger(__name__)

Verdict = Literal["ok", "too_easy", "too_hard"]
RolloutFn = Callable[[EnvSuite, list[int], int], Mapping[Any, Sequence[Any]]]
BAND = (SynthesisConfig.target_low, SynthesisConfig.target_high)  # mean reward and success rate: the default band


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one group: 1 - C(n-c, k) / C(n, k) (n samples, c successes, k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _entry(x: Any, success_threshold: float) -> tuple[float, bool]:
    if isinstance(x, (tuple, list)):
        reward, success = float(x[0]), bool(x[1])
    elif hasattr(x, "reward"):
        reward = float(x.reward)
        success = bool(x.success) if getattr(x, "success", None) is not None else reward >= success_threshold
    else:
        reward = float(x)
        success = reward >= success_threshold
    if math.isnan(reward):
        raise ValueError("reward table holds NaN")
    return reward, success


@dataclass(frozen=True)
class CalibrationTargets:
    """The band calibration aims at; the knobs' defaults are the ``synthesis`` group's (:class:`SynthesisConfig`)."""

    mean_reward: tuple[float, float] = BAND
    success_rate: tuple[float, float] = BAND
    min_informative: float = SynthesisConfig.min_informative
    max_all_success: float | None = None  # the official script's stricter options (0.2 there), off by default
    max_all_zero: float | None = None
    success_threshold: float = 1.0  # success = reward >= this when the table carries no success labels
    pass_ks: tuple[int, ...] = (1, 4, 8, 16)


class RewardFigures(BaseModel):
    """The group figures calibration and the official gate both report on an environment's reward groups."""

    n_groups: int
    n_rollouts: int
    mean_reward: float
    std_reward: float
    success_rate: float
    informative_rate: float
    all_success_rate: float
    all_zero_rate: float
    pass_at_k: dict[int, float] = Field(default_factory=dict)


class CalibrationStats(RewardFigures):
    group_size_min: int
    group_size_max: int


def group_stats(table: Mapping[Any, Sequence[Any]], targets: CalibrationTargets = CalibrationTargets()) -> CalibrationStats:
    """Statistics of a reward table (one group of K rollouts per seed)."""
    groups = [[_entry(x, targets.success_threshold) for x in g] for g in table.values()]
    groups = [g for g in groups if g]
    if not groups:
        raise ValueError("empty reward table")
    rewards = [r for g in groups for r, _ in g]
    successes = [s for g in groups for _, s in g]
    sizes = [len(g) for g in groups]
    pk: dict[int, float] = {}
    for k in targets.pass_ks:
        if k <= min(sizes):
            pk[k] = statistics.fmean(pass_at_k(len(g), sum(s for _, s in g), k) for g in groups)
    return CalibrationStats(
        n_groups=len(groups),
        n_rollouts=len(rewards),
        group_size_min=min(sizes),
        group_size_max=max(sizes),
        mean_reward=statistics.fmean(rewards),
        std_reward=statistics.pstdev(rewards),
        success_rate=sum(successes) / len(successes),
        informative_rate=sum(len({r for r, _ in g}) > 1 for g in groups) / len(groups),
        all_success_rate=sum(all(s for _, s in g) for g in groups) / len(groups),
        all_zero_rate=sum(all(r == 0.0 for r, _ in g) for g in groups) / len(groups),
        pass_at_k=pk,
    )


def _signed_violation(value: float, band: tuple[float, float]) -> float:
    lo, hi = band
    return value - hi if value > hi else (value - lo if value < lo else 0.0)


def judge(stats: CalibrationStats, targets: CalibrationTargets = CalibrationTargets()) -> tuple[Verdict, list[str]]:
    """("ok" | "too_easy" | "too_hard", the violated targets)."""
    problems = []
    for name, band in (("mean_reward", targets.mean_reward), ("success_rate", targets.success_rate)):
        v = getattr(stats, name)
        if _signed_violation(v, band):
            problems.append(f"{name}={v:.3f} outside [{band[0]}, {band[1]}]")
    if stats.informative_rate < targets.min_informative:
        problems.append(f"informative_rate={stats.informative_rate:.3f} below {targets.min_informative}")
    if targets.max_all_success is not None and stats.all_success_rate > targets.max_all_success:
        problems.append(f"all_success_rate={stats.all_success_rate:.3f} above {targets.max_all_success}")
    if targets.max_all_zero is not None and stats.all_zero_rate > targets.max_all_zero:
        problems.append(f"all_zero_rate={stats.all_zero_rate:.3f} above {targets.max_all_zero}")
    if not problems:
        return "ok", []
    direction = (_signed_violation(stats.mean_reward, targets.mean_reward)
                 + _signed_violation(stats.success_rate, targets.success_rate))
    if direction == 0.0:  # in band but uninformative: whichever constant groups dominate
        direction = stats.all_success_rate - stats.all_zero_rate
    return ("too_easy" if direction > 0 else "too_hard"), problems


def distance(stats: CalibrationStats, targets: CalibrationTargets = CalibrationTargets()) -> float:
    """How far from the targets (0 = inside): summed absolute violations."""
    return (abs(_signed_violation(stats.mean_reward, targets.mean_reward))
            + abs(_signed_violation(stats.success_rate, targets.success_rate))
            + max(0.0, targets.min_informative - stats.informative_rate))


class LevelResult(BaseModel):
    difficulty: int
    stats: CalibrationStats
    verdict: str
    problems: list[str]


class CalibrationReport(BaseModel):
    env: str
    k: int
    seeds: list[int]
    tried: list[LevelResult] = Field(default_factory=list)
    chosen_difficulty: int | None = None
    passed: bool = False


def calibrate_difficulty(make_suite: Callable[[int], EnvSuite], levels: Sequence[int], rollout_fn: RolloutFn,
                         seeds: list[int], k: int = 16, targets: CalibrationTargets = CalibrationTargets(),
                         start: int | None = None, name: str = "") -> CalibrationReport:
    """Walk the difficulty levels from ``start`` toward the targets (harder when too easy, easier when too hard).

    Stops at the first level within the targets, at the end of the scale, or when the walk turns back; the
    chosen level is the passing one, else the one closest to the targets.
    """
    levels = sorted(levels)
    level = levels[len(levels) // 2] if start is None else start
    if level not in levels:
        raise ValueError(f"start difficulty {level} not in {levels}")
    report = CalibrationReport(env=name, k=k, seeds=list(seeds))
    seen: set[int] = set()
    while level not in seen:
        seen.add(level)
        suite = make_suite(level)
        try:
            table = rollout_fn(suite, list(seeds), k)
        finally:
            close = getattr(suite, "close", None)
            if close:
                close()
        stats = group_stats(table, targets)
        verdict, problems = judge(stats, targets)
        report.tried.append(LevelResult(difficulty=level, stats=stats, verdict=verdict, problems=problems))
        log.info("calibration %s difficulty %d: mean %.3f success %.3f informative %.3f -> %s", name, level,
                 stats.mean_reward, stats.success_rate, stats.informative_rate, verdict)
        if verdict == "ok":
            break
        i = levels.index(level) + (1 if verdict == "too_easy" else -1)
        if not 0 <= i < len(levels):
            break
        level = levels[i]
    passing = [t for t in report.tried if t.verdict == "ok"]
    best = passing[0] if passing else min(report.tried, key=lambda t: distance(t.stats, targets))
    report.chosen_difficulty, report.passed = best.difficulty, bool(passing)
    return report


def make_rollout_fn(agent: Any, work_dir: str | Path, **rollout_kwargs: Any) -> RolloutFn:
    """A ``rollout_fn`` running :func:`tracekit.rollout.run_rollouts` (K samples per seed) with ``agent``.

    Each (env, difficulty) gets its own resumable directory ``work_dir/<env>/difficulty-<d>``; the table maps
    task id -> [(reward, success), ...].
    """
    def rollout_fn(suite: EnvSuite, seeds: list[int], k: int) -> dict[str, list[tuple[float, bool]]]:
        wanted = set(seeds)
        tasks = [t for t in suite.tasks() if t.data.get("seed") in wanted]
        info = getattr(suite, "info", None)
        out = Path(work_dir) / suite.name / f"difficulty-{info.difficulty if info is not None else 'na'}"
        run_rollouts(suite, agent, out, samples=k, tasks=tasks, **rollout_kwargs)
        ids = {t.id for t in tasks}
        table: dict[str, list[tuple[float, bool]]] = {}
        for traj in read_trajectories(out):
            if traj.task_id in ids:
                table.setdefault(traj.task_id, []).append((traj.reward, traj.success))
        return table

    return rollout_fn


def calibration_markdown(report: CalibrationReport) -> str:
    ks = sorted({k for t in report.tried for k in t.stats.pass_at_k})
    head = "| difficulty | mean reward | success | informative | all-success | all-zero | " + " | ".join(
        f"pass@{k}" for k in ks) + " | verdict |"
    lines = [f"# Calibration of `{report.env}`", "",
             f"- K = {report.k} rollouts per seed, {len(report.seeds)} seeds",
             f"- chosen difficulty: {report.chosen_difficulty} ({'within targets' if report.passed else 'closest'})",
             "", head, "|" + "---|" * (7 + len(ks))]
    for t in report.tried:
        s = t.stats
        lines.append(f"| {t.difficulty} | {s.mean_reward:.3f} | {s.success_rate:.3f} | {s.informative_rate:.3f} | "
                     f"{s.all_success_rate:.3f} | {s.all_zero_rate:.3f} | "
                     + " | ".join(f"{s.pass_at_k[k]:.3f}" if k in s.pass_at_k else "-" for k in ks) + f" | {t.verdict} |")
    return "\n".join(lines) + "\n"


def write_calibration(report: CalibrationReport, out_dir: str | Path, stem: str = "calibration") -> None:
    out = Path(out_dir)
    atomic_write_json(out / f"{stem}.json", report.model_dump(mode="json"))
    atomic_write_text(out / f"{stem}.md", calibration_markdown(report))


# --------------------------------------------------------------------------------------------
# the official acceptance rule (pipeline/calibrate_environment.py of the official TRACE code)


@dataclass(frozen=True)
class OfficialAcceptance:
    """The official calibration gate: G samples per seed, the bands and bounds an environment must meet to be trained
    on. Its knobs' defaults are the ``synthesis`` group's (:class:`SynthesisConfig`; a composed config's values:
    :func:`tracekit.synthesis.stage.official_acceptance`)."""

    group_size: int = SynthesisConfig.acceptance_group_size
    mean_reward: tuple[float, float] = BAND
    success_rate: tuple[float, float] = BAND
    min_reward_std: float = SynthesisConfig.min_reward_std
    max_all_success: float = SynthesisConfig.max_all_success
    max_all_zero: float = SynthesisConfig.max_all_zero
    min_informative: float = SynthesisConfig.min_informative
    success_threshold: float = 1.0  # success = reward >= this where the table carries no success label
    pass_ks: tuple[int, ...] = (1, 4, 8, 16)

    def __post_init__(self) -> None:
        if self.group_size < 2:  # one sample per seed has no variance to learn from
            raise ValueError(f"acceptance group size G must be >= 2, got {self.group_size}")
        for name in ("mean_reward", "success_rate"):
            lo, hi = getattr(self, name)
            if not 0.0 <= lo <= hi <= 1.0:
                raise ValueError(f"acceptance band {name} must be [lo, hi] with 0 <= lo <= hi <= 1, got [{lo}, {hi}]")
        for name in ("min_reward_std", "max_all_success", "max_all_zero", "min_informative"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"acceptance {name} must be in [0, 1], got {getattr(self, name)}")


class AcceptanceFigures(RewardFigures):
    """What the official gate measures on one environment (group rates over the groups of at least G samples)."""

    group_size: int
    full_groups: int
    median_group_size: float


def reward_std(rewards: Sequence[float]) -> float:
    """Population standard deviation of every rollout's reward (0 for fewer than two)."""
    return statistics.pstdev(rewards) if len(rewards) > 1 else 0.0


def informative_rate(groups: Sequence[Sequence[float]]) -> float:
    """Share of groups whose rewards are not all equal (to 8 decimals): GRPO's advantage is zero in the others."""
    return sum(len({round(r, 8) for r in g}) > 1 for g in groups) / len(groups)


def all_success_rate(groups: Sequence[Sequence[bool]]) -> float:
    """Share of groups in which every sample succeeded."""
    return sum(all(g) for g in groups) / len(groups)


def all_zero_rate(groups: Sequence[Sequence[float]]) -> float:
    """Share of groups in which every reward is <= 0."""
    return sum(all(r <= 0.0 for r in g) for g in groups) / len(groups)


def mean_pass_at_k(groups: Sequence[Sequence[bool]], k: int) -> float | None:
    """The unbiased pass@k (:func:`pass_at_k`) averaged over the groups of at least k samples; None when none is."""
    usable = [g for g in groups if len(g) >= k]
    return statistics.fmean(pass_at_k(len(g), sum(g), k) for g in usable) if usable else None


def acceptance_figures(table: Mapping[Any, Sequence[Any]],
                       rule: OfficialAcceptance = OfficialAcceptance()) -> AcceptanceFigures:
    """The official gate's figures of a reward table ``{seed or task: [reward | (reward, success) | outcome, ...]}``."""
    groups = [[_entry(x, rule.success_threshold) for x in g] for g in table.values()]
    groups = [g for g in groups if g]
    if not groups:
        raise ValueError("empty reward table")
    full = [g for g in groups if len(g) >= rule.group_size]
    rated = full or groups  # as the official script: the full groups when there are any
    rewards = [r for g in groups for r, _ in g]
    pass_k = {k: mean_pass_at_k([[s for _, s in g] for g in groups], k) for k in rule.pass_ks}
    return AcceptanceFigures(
        group_size=rule.group_size,
        n_groups=len(groups),
        n_rollouts=len(rewards),
        full_groups=len(full),
        median_group_size=statistics.median(len(g) for g in groups),
        mean_reward=statistics.fmean(rewards),
        std_reward=reward_std(rewards),
        success_rate=sum(s for g in groups for _, s in g) / len(rewards),
        informative_rate=informative_rate([[r for r, _ in g] for g in rated]),
        all_success_rate=all_success_rate([[s for _, s in g] for g in rated]),
        all_zero_rate=all_zero_rate([[r for r, _ in g] for g in rated]),
        pass_at_k={k: v for k, v in pass_k.items() if v is not None},
    )


def acceptance_problems(fig: AcceptanceFigures, rule: OfficialAcceptance = OfficialAcceptance()) -> list[str]:
    """Every bound the figures miss, in the official script's words (empty: accepted)."""
    problems = []
    if fig.median_group_size < rule.group_size:
        problems.append(f"median group size {fig.median_group_size:g} below G={rule.group_size}")
    bounds = [("mean_reward", fig.mean_reward, *rule.mean_reward),
              ("success_rate", fig.success_rate, *rule.success_rate),
              ("std_reward", fig.std_reward, rule.min_reward_std, None),
              ("all_success_group_rate", fig.all_success_rate, None, rule.max_all_success),
              ("all_zero_group_rate", fig.all_zero_rate, None, rule.max_all_zero),
              ("informative_group_rate", fig.informative_rate, rule.min_informative, None)]
    for name, value, lo, hi in bounds:
        if lo is not None and value < lo:
            problems.append(f"{name}={value:.3f} below minimum {lo:.3f}")
        if hi is not None and value > hi:
            problems.append(f"{name}={value:.3f} above maximum {hi:.3f}")
    return problems


def figures_line(fig: AcceptanceFigures) -> str:
    """The figures on one line (what a refusal and the report show)."""
    pk = ", ".join(f"pass@{k} {v:.3f}" for k, v in sorted(fig.pass_at_k.items()))
    return (f"mean reward {fig.mean_reward:.3f}, success {fig.success_rate:.3f}, reward std {fig.std_reward:.3f}, "
            f"all-success groups {fig.all_success_rate:.3f}, all-zero groups {fig.all_zero_rate:.3f}, "
            f"informative groups {fig.informative_rate:.3f}" + (f", {pk}" if pk else "")
            + f" ({fig.n_groups} groups, G={fig.group_size})")


class AcceptanceReport(BaseModel):
    env: str
    seeds: list[int]
    rule: dict[str, Any]
    figures: AcceptanceFigures
    problems: list[str]
    accepted: bool

    def refusal(self) -> str:
        """One line: why the environment is refused, with its numbers."""
        return (f"refused by the official acceptance rule: {'; '.join(self.problems)} "
                f"[{figures_line(self.figures)}]")


def accept(suite: EnvSuite, seeds: list[int], rollout_fn: RolloutFn,
           rule: OfficialAcceptance = OfficialAcceptance()) -> AcceptanceReport:
    """Sample G rollouts per seed of ``suite`` with ``rollout_fn`` and judge them by the official gate."""
    table = rollout_fn(suite, list(seeds), rule.group_size)
    figures = acceptance_figures(table, rule)
    problems = acceptance_problems(figures, rule)
    log.info("acceptance %s: %s -> %s", suite.name, figures_line(figures), "refused" if problems else "accepted")
    return AcceptanceReport(env=suite.name, seeds=list(seeds), rule=asdict(rule), figures=figures,
                            problems=problems, accepted=not problems)
