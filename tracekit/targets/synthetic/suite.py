"""A target made of built-in synthetic environments' held-out instances (``benchmark.kind=synthetic``).

The embedded default target: a small agent (SmolLM2-135M) solves no real tau^2 retail task that needs a tool
call, so on real tau^2 every trajectory lacks every capability and the contrastive analysis has nothing to
contrast. This target keeps tau^2's tools, data models and database-hash reward, but each task is one
capability-focused instance of a library environment (:mod:`tracekit.synthesis.library`) at an easy difficulty,
so the base agent solves some and fails others, and failures differ by capability.

Tasks are ``<env>/seed-<z>`` with seeds from ``seed_offset`` on: disjoint from the seeds that validation
(``0..n``) and GRPO training (``tracekit.runs.TRAIN_SEED_OFFSET`` on) draw, so evaluation is on held-out
instances. Each trajectory's ``env`` is its library environment, the evaluation's per-column unit.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from tracekit.envs.base import EnvSuite, Episode, Observation, StepResult
from tracekit.synthesis.library import LIBRARY_NAMES, library_env
from tracekit.synthesis.protocol import SyntheticEnv
from tracekit.synthesis.suite import SyntheticSuite, UserKind
from tracekit.types import Message, Task

TARGET_SEED_OFFSET = 10_000_000


class LibraryTargetSuite(EnvSuite):
    """The union of ``n_per_env`` held-out instances of each named library environment."""

    def __init__(self, name: str, envs: list[str], difficulty: int = 0, n_per_env: int = 4,
                 seed_offset: int = TARGET_SEED_OFFSET, user: UserKind = "scripted",
                 extra_envs: Mapping[str, type[SyntheticEnv]] | None = None, **suite_kwargs: Any):
        """``extra_envs``: environments beyond the library a target evaluates on (the micro target's held-out task
        kinds that need two capabilities at once), by name."""
        if not envs:
            raise ValueError("a synthetic target needs at least one library environment (benchmark.<kind>.envs)")
        extra = dict(extra_envs or {})
        unknown = [e for e in envs if e not in LIBRARY_NAMES and e not in extra]
        if unknown:
            known = ", ".join([*LIBRARY_NAMES, *extra])
            raise ValueError(f"benchmark.<kind>.envs: unknown library environment(s) {unknown}; known: {known}")
        if n_per_env < 1:
            raise ValueError(f"benchmark.limit (instances per environment) must be >= 1, got {n_per_env}")
        self.name = name
        seeds = range(seed_offset, seed_offset + n_per_env)
        self.suites: dict[str, SyntheticSuite] = {}
        for env in envs:
            cls = extra[env] if env in extra else library_env(env)
            if difficulty not in cls.difficulty_levels:
                raise ValueError(f"benchmark.<kind>.difficulty={difficulty} is not a level of {env} "
                                 f"(levels {list(cls.difficulty_levels)})")
            self.suites[env] = SyntheticSuite.from_env(cls(difficulty), seeds, user=user, **suite_kwargs)

    def tasks(self) -> list[Task]:
        """One task per (environment, seed); ``data`` also holds the instance's ground-truth calls and the
        first wording of each expected output, the gold agent's script."""
        out = []
        for env, suite in self.suites.items():
            for t, inst in zip(suite.tasks(), suite.instances(suite.seeds), strict=True):
                gold = {"actions": [{"name": c.name, "arguments": c.arguments} for c in inst.solution],
                        "communicate_info": [group[0] for group in inst.expected_outputs if group]}
                out.append(Task(id=f"{env}/{t.id}", env=env, instruction=t.instruction, data={**t.data, **gold}))
        return out

    def episode(self, task: Task, seed: int = 0) -> Episode:
        if task.env not in self.suites:
            raise KeyError(f"task {task.id!r} names environment {task.env!r}, not one of {list(self.suites)}")
        return self.suites[task.env].episode(task, seed)

    def _by_suite(self, episodes: list[Episode]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, ep in enumerate(episodes):
            groups[ep.suite.name].append(i)
        return groups

    def reset_batch(self, episodes: list[Episode]) -> list[Observation | Exception]:
        out: list[Any] = [None] * len(episodes)
        for env, idx in self._by_suite(episodes).items():
            for i, r in zip(idx, self.suites[env].reset_batch([episodes[i] for i in idx]), strict=True):
                out[i] = r
        return out

    def step_batch(self, episodes: list[Episode], actions: list[Message]) -> list[StepResult | Exception]:
        out: list[Any] = [None] * len(episodes)
        for env, idx in self._by_suite(episodes).items():
            results = self.suites[env].step_batch([episodes[i] for i in idx], [actions[i] for i in idx])
            for i, r in zip(idx, results, strict=True):
                out[i] = r
        return out

    def interface(self) -> dict[str, Any]:
        return {env: suite.interface() for env, suite in self.suites.items()}

    def close(self) -> None:
        for suite in self.suites.values():
            suite.close()
