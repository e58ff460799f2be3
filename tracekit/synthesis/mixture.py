"""Several capability environments as one suite (multi-capability GRPO, on-policy distillation).

Every environment contributes the same number of tasks (the same seeds), so a task drawn uniformly is an
environment drawn uniformly, and a GRPO group (K rollouts of one task) comes from one environment. A task
names its environment (``Task.env``), which is how an episode, and a distillation teacher, is chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracekit.envs.base import EnvSuite, Episode
from tracekit.synthesis.stage import open_package
from tracekit.types import Task


class MixtureSuite(EnvSuite):
    def __init__(self, suites: list[EnvSuite]):
        if not suites:
            raise ValueError("a mixture needs at least one environment")
        self.suites = {s.name: s for s in suites}
        if len(self.suites) != len(suites):
            raise ValueError(f"mixture: environment names repeat: {[s.name for s in suites]}")
        counts = {s.name: len(s.tasks()) for s in suites}
        if len(set(counts.values())) != 1:
            raise ValueError(f"mixture: environments have different task counts {counts}; a uniform draw needs equal")
        self.name = "mixture(" + ",".join(self.suites) + ")"

    def tasks(self) -> list[Task]:
        return [t for s in self.suites.values() for t in s.tasks()]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        if task.env not in self.suites:
            raise ValueError(f"{self.name}: task {task.id} is of environment {task.env!r}, not in the mixture")
        return self.suites[task.env].episode(task, seed)

    def interface(self) -> dict[str, Any]:
        return {name: s.interface() for name, s in self.suites.items()}


def open_mixture(pkg_dirs: list[str | Path], seeds: list[int] | range, **kwargs: Any) -> MixtureSuite:
    """The mixture of environment packages (as :func:`tracekit.synthesis.stage.open_package` opens each)."""
    return MixtureSuite([open_package(p, seeds, **kwargs) for p in pkg_dirs])
