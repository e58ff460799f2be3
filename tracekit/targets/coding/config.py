"""The coding target's settings (``benchmark.coding``: :class:`CodingSettings`) and
its suites.

``benchmark.kind=coding``: local SWE-smith-style tasks (:mod:`tracekit.targets.coding.tasks`), split ``train`` | ``test``.
``benchmark.kind=swebench``: SWE-bench Verified instances (:mod:`tracekit.targets.swebench.suite`), evaluated by the
official harness in Docker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tracekit.coding.sandbox import CommandLimits, jail_problem, require_jail
from tracekit.targets.coding.suite import CodingSuite
from tracekit.targets.coding.tasks import TaskGenConfig, load_or_generate, python_modifiers
from tracekit.ranges import Choice

SPLITS = ("train", "test")


def modifier_names() -> tuple[str, ...]:
    """swesmith's Python procedural modifier names (``benchmark.coding.modifiers`` choices)."""
    return tuple(pm.name for pm in python_modifiers())


@dataclass
class CodingSettings:
    """``benchmark.coding`` (kind coding and swebench share it)."""

    package: str = "toolz"  # an installed pure-Python distribution that ships its tests
    seed: int = 0  # the tasks' seed (bug choice, split); the benchmark does not move with the master seed
    modifiers: list[str] = field(default_factory=list)  # swesmith modifier names; empty: all 13 Python ones
    max_per_modifier: int = 3
    max_candidates_per_modifier: int = 8
    heldout_fraction: float = 0.5
    test_wall_seconds: float = 60.0
    test_cpu_seconds: int = 60
    command_wall_seconds: float = 30.0  # the agent's bash tool, per command
    command_cpu_seconds: int = 30
    command_memory_mb: int = 2048
    command_processes: int = 128
    output_chars: int = 4000
    model_name: str = "tracekit"  # model_name_or_path of the exported SWE-bench predictions
    # the local reward's protocol (tracekit.targets.coding.reward, issue 49): fix_only takes only the package's own source
    # files from a patch and reads the outcome from a signed channel. A value of every coding stage's key, so a
    # cache scored under the older, forgeable reward is never reused (kind=swebench: the harness scores instead)
    reward: str = "fix_only"
    # kind=swebench
    dataset: str = "princeton-nlp/SWE-bench_Verified"  # hub dataset id, or a local .jsonl path
    repos_dir: str | None = None  # local clones <repos_dir>/<owner>__<name> (the agent's checkouts)
    max_workers: int = 4  # the harness's parallel containers

    RANGES: ClassVar[dict[str, str]] = {
        "seed": ">= 0", "max_per_modifier": ">= 1", "max_candidates_per_modifier": ">= 1",
        "heldout_fraction": "(0, 1)", "test_wall_seconds": ">= 1", "test_cpu_seconds": ">= 1",
        "command_wall_seconds": ">= 1", "command_cpu_seconds": ">= 1", "command_memory_mb": ">= 64",
        "command_processes": ">= 8", "output_chars": ">= 200", "max_workers": ">= 1"}  # fmt: skip
    CHOICES: ClassVar[dict[str, Choice]] = {"modifiers": modifier_names, "reward": ("fix_only",)}


def check(bench: Any) -> list[tuple[str, Any, str]]:
    """(key, value, what it must be) for each invalid cross-field setting of a coding target's benchmark (kind
    coding or swebench: the coding targets' ``validate()`` raises on the first; the per-value ranges and choices
    are :class:`CodingSettings`' own)."""
    if bench.split not in SPLITS:
        return [("benchmark.split", bench.split, f"one of {', '.join(SPLITS)} with benchmark.kind={bench.kind}")]
    problem = jail_problem()  # the agent's commands run only in the jail, never uncontained
    if problem:
        return [("benchmark.kind", bench.kind, f"a target whose sandbox can start on this machine ({problem})")]
    return []


def gen_config(bench: Any):
    c = bench.coding
    return TaskGenConfig(package=c.package, seed=int(c.seed), modifiers=tuple(c.modifiers),
                         max_per_modifier=int(c.max_per_modifier),
                         max_candidates_per_modifier=int(c.max_candidates_per_modifier),
                         heldout_fraction=float(c.heldout_fraction), test_wall_seconds=float(c.test_wall_seconds),
                         test_cpu_seconds=int(c.test_cpu_seconds))


def command_limits(bench: Any):
    c = bench.coding
    return CommandLimits(cpu_seconds=int(c.command_cpu_seconds), wall_seconds=float(c.command_wall_seconds),
                         memory_bytes=int(c.command_memory_mb) << 20, processes=int(c.command_processes),
                         output_chars=int(c.output_chars))


def build_suite(bench: Any, cache_dir: str | Path, split: str | None = None, reward: str = "tests",
                limit: Any = "config") -> Any:
    """The EnvSuite of a ``benchmark`` node of kind coding (tasks generated once into ``cache_dir``; SWE-bench
    Verified's: :class:`tracekit.targets.coding.target.SweBenchTarget`). Refuses (JailUnavailable, one line) where the
    sandbox cannot start, before any work."""
    require_jail()
    taskset = load_or_generate(gen_config(bench), Path(cache_dir))
    eval_limits = CommandLimits(cpu_seconds=int(bench.coding.test_cpu_seconds),
                                wall_seconds=float(bench.coding.test_wall_seconds))
    return CodingSuite(bench.name if split in (None, bench.get("split")) else f"{bench.name}-{split}", taskset,
                       split=split or bench.split, limit=bench.limit if limit == "config" else limit,
                       task_ids=list(bench.task_ids) if bench.get("task_ids") else None,
                       limits=command_limits(bench), eval_limits=eval_limits, reward=reward,
                       model_name=bench.coding.model_name)
