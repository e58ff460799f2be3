"""Paired comparison of two methods evaluated on the same episodes (issue 29, "Power").

Every method of an evaluation runs the same tasks with the same seeds, so method B is compared with method A
episode by episode: an episode is keyed by ``env/task_id/sample`` (:attr:`tracekit.types.Trajectory.uid`;
``sample`` is the seed index of a stochastic evaluation, the key :func:`tracekit.evaluate.split_runs` splits on),
its outcome is 0/1 success, and the statistic is the mean of the per-episode differences ``d_i = b_i - a_i``.

- Interval: percentile bootstrap of ``mean(d)``, resampling tasks (with all their seeds) rather than episodes,
  since one task's episodes across seeds are correlated; with one seed per task the two are the same.
- Test: exact two-sided McNemar test on the discordant pairs (``fixed``: B solved, A not; ``broken``: A solved,
  B not); the concordant pairs carry no information on the difference.
- Power: ``required_n`` episodes for a 95% interval of +- h given the per-episode sd of ``d``.

Pairing removes the between-task variance that the unpaired intervals (Student-t over per-seed rates in
:mod:`tracekit.evaluate`, Wilson in :mod:`tracekit.planted.gain`) carry, so a real gain shows with fewer episodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tracekit.types import Trajectory

Z95 = 1.959964  # the normal 0.975 quantile
N_BOOT = 10_000
BOOT_CHUNK = 1_000  # bootstrap replicates drawn at once: bounds memory at BOOT_CHUNK x clusters indices
BASE_METHOD = "base"  # the ``method`` of the row every other row is paired against
def interval_text(reference: str = "Base") -> str:
    """How a paired row is computed, against ``reference`` (the row every other one is paired with)."""
    return (f"mean of the per-episode success differences (row - {reference}) on the same env/task/seed episodes; "
            f"95% percentile bootstrap resampling tasks with their seeds; fixed = row solved, {reference} not; "
            "broken = the reverse; exact two-sided McNemar p on those")


INTERVAL = interval_text()


def outcome_map(trajectories: Iterable[Trajectory]) -> dict[str, int]:
    """``{env/task_id/sample: 1 if success else 0}``; two trajectories of one episode are an error."""
    out: dict[str, int] = {}
    for t in trajectories:
        if t.uid in out:
            raise ValueError(f"two trajectories of episode {t.uid}")
        out[t.uid] = int(t.success)
    return out


def task_of(episode: str) -> str:
    """The task cluster ``env/task_id`` of an episode key ``env/task_id/sample`` (task ids may hold '/')."""
    task, _, sample = episode.rpartition("/")
    if not task or not sample.isdigit():
        raise ValueError(f"episode key {episode!r} is not env/task_id/sample")
    return task


def align_outcomes(a: Mapping[str, int], b: Mapping[str, int]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """The sorted shared episode keys and the aligned 0/1 vectors ``(keys, a_i, b_i)``.

    The key sets must be equal: a method missing episodes would otherwise be compared on fewer tasks.
    """
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        parts = [f"{len(x)} episodes only in {side} (e.g. {', '.join(x[:3])})"
                 for side, x in (("a", only_a), ("b", only_b)) if x]
        raise ValueError(f"paired comparison needs the same episodes: {'; '.join(parts)}")
    if not a:
        raise ValueError("paired comparison of no episodes")
    keys = sorted(a)
    for side, m in (("a", a), ("b", b)):
        bad = [k for k in keys if m[k] not in (0, 1)]
        if bad:
            raise ValueError(f"outcomes of {side} must be 0/1, got {m[bad[0]]!r} for {bad[0]}")
    return keys, np.array([a[k] for k in keys], dtype=np.int64), np.array([b[k] for k in keys], dtype=np.int64)


def paired_outcomes(a: Iterable[Trajectory], b: Iterable[Trajectory]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Aligned success vectors of two methods' trajectories over their episodes (env, task_id, sample):
    ``(keys, a_i, b_i)`` with ``a_i, b_i`` in {0, 1}; ValueError naming the mismatch if the episode sets differ."""
    return align_outcomes(outcome_map(a), outcome_map(b))


def paired_bootstrap_ci(diff: Sequence[float] | np.ndarray, *, n_boot: int = N_BOOT, seed: int = 0,
                        level: float = 0.95, clusters: Sequence[Any] | None = None) -> tuple[float, float]:
    """Percentile bootstrap CI ``[q_{(1-level)/2}, q_{(1+level)/2}]`` of ``mean(d)`` over ``n_boot`` resamples.

    Unclustered: each resample draws n episodes with replacement, statistic ``mean(d*)``. With ``clusters``
    (one label per episode, e.g. its task): each resample draws the C clusters with replacement, keeping a
    cluster's episodes together, statistic ``sum_{c in draw} S_c / sum_{c in draw} m_c`` (S_c the cluster's sum
    of d, m_c its size: the mean over the resampled episodes). Quantiles are numpy's linear interpolation;
    deterministic given ``seed`` (``numpy.random.default_rng``).
    """
    d = np.asarray(diff, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError(f"bootstrap needs a non-empty 1-d difference vector, got shape {d.shape}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if clusters is None:
        sums, sizes = d, np.ones_like(d)
    else:
        if len(clusters) != d.size:
            raise ValueError(f"{len(clusters)} cluster labels for {d.size} differences")
        _, index = np.unique(np.asarray([str(c) for c in clusters]), return_inverse=True)
        sums, sizes = np.bincount(index, weights=d), np.bincount(index).astype(np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    for start in range(0, n_boot, BOOT_CHUNK):
        draw = rng.integers(0, sums.size, size=(min(BOOT_CHUNK, n_boot - start), sums.size))
        means[start:start + draw.shape[0]] = sums[draw].sum(axis=1) / sizes[draw].sum(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def mcnemar_exact(b_only: int, a_only: int) -> float:
    """Exact two-sided McNemar p-value on the discordant pairs: with n = b_only + a_only and k = min of the two,
    under H0 each discordant pair goes either way with p = 1/2, so ``p = min(1, 2 * sum_{i<=k} C(n, i) / 2^n)``
    (1 when n = 0)."""
    if b_only < 0 or a_only < 0:
        raise ValueError(f"discordant counts must be >= 0, got {b_only}, {a_only}")
    n, k = b_only + a_only, min(b_only, a_only)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)  # exact integers, one rounding


def required_n(sd_diff: float, half_width: float, z: float = Z95) -> int:
    """Episodes for a 95% interval of +- ``half_width`` on the mean difference, given the per-episode sd of the
    difference: ``n = ceil((z * sd / h)^2)`` with z = 1.96 (independent episodes; correlated seeds need more)."""
    if half_width <= 0:
        raise ValueError(f"half_width must be > 0, got {half_width}")
    if sd_diff < 0:
        raise ValueError(f"sd_diff must be >= 0, got {sd_diff}")
    return math.ceil((z * sd_diff / half_width) ** 2)


def summary_of_outcomes(a: Mapping[str, int], b: Mapping[str, int], *, n_boot: int = N_BOOT, seed: int = 0,
                        level: float = 0.95) -> dict[str, Any]:
    """:func:`paired_summary` of two outcome maps ``{env/task_id/sample: 0|1}`` (a: the reference)."""
    keys, va, vb = align_outcomes(a, b)
    d = vb - va
    n = d.size
    tasks = [task_of(k) for k in keys]
    lo, hi = paired_bootstrap_ci(d, n_boot=n_boot, seed=seed, level=level, clusters=tasks)
    fixed, broken = int(np.sum(d > 0)), int(np.sum(d < 0))
    mean = float(d.mean())
    sd = float(d.std(ddof=1)) if n >= 2 else None
    normal = None if sd is None else [mean - Z95 * sd / math.sqrt(n), mean + Z95 * sd / math.sqrt(n)]
    return {"n_episodes": int(n), "n_tasks": len(set(tasks)), "mean_a": float(va.mean()), "mean_b": float(vb.mean()),
            "diff": mean, "ci": [lo, hi], "level": level, "n_boot": n_boot, "seed": seed,
            "fixed": fixed, "broken": broken, "mcnemar_p": mcnemar_exact(fixed, broken),
            "excludes_zero": bool(lo > 0 or hi < 0), "sd_diff": sd, "normal_ci": normal}


def paired_summary(a_trajs: Iterable[Trajectory], b_trajs: Iterable[Trajectory], *, n_boot: int = N_BOOT,
                   seed: int = 0, level: float = 0.95) -> dict[str, Any]:
    """B against A on the same episodes: ``n_episodes``, ``n_tasks``, ``mean_a``, ``mean_b``, ``diff`` =
    mean(b_i - a_i), ``ci`` = task-cluster percentile bootstrap [lo, hi] of diff, ``fixed`` = #(b=1, a=0),
    ``broken`` = #(a=1, b=0), ``mcnemar_p`` (exact), ``excludes_zero`` (lo > 0 or hi < 0), ``sd_diff`` =
    sd(b_i - a_i, ddof=1) and ``normal_ci`` = diff +- 1.96 sd / sqrt(n) (None with one episode)."""
    return summary_of_outcomes(outcome_map(a_trajs), outcome_map(b_trajs), n_boot=n_boot, seed=seed, level=level)


def base_label(results: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The label of the results row of method ``base`` (None when Base was not evaluated)."""
    return next((label for label, r in results.items() if r.get("method") == BASE_METHOD), None)


def paired_vs_base(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{label: summary_of_outcomes(Base, row)}`` for every non-base row, from the rows' ``outcomes`` maps;
    empty without a base row. Rows without ``outcomes`` (results written before they were kept) are left out."""
    base = base_label(results)
    if base is None or "outcomes" not in results[base]:
        return {}
    out = {}
    for label, r in results.items():
        if label == base or "outcomes" not in r:
            continue
        try:
            out[label] = summary_of_outcomes(results[base]["outcomes"], r["outcomes"])
        except ValueError as e:
            raise ValueError(f"row {label!r} against {base!r}: {e}") from None
    return out


def paired_line(label: str, s: Mapping[str, Any]) -> str:
    """One markdown line: ``- TRACE: +6.7 points [-1.1, +14.4], fixed 5 / broken 1, McNemar p = 0.219``."""
    lo, hi = s["ci"]
    return (f"- {label}: {100 * s['diff']:+.1f} points [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            f"{' (excludes 0)' if s['excludes_zero'] else ''}, fixed {s['fixed']} / broken {s['broken']}, "
            f"McNemar p = {s['mcnemar_p']:.3g} ({s['n_episodes']} episodes, {s['n_tasks']} tasks)")
