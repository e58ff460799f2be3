"""The SWE-bench Verified target (``benchmark.kind=swebench``; paper Table 2): its instances in local clones, scored by
the official harness in Docker; everything else (settings at ``benchmark.coding``, the jail, the training split, the
reference analysis) is the coding target's (:mod:`tracekit.targets.coding.target`)."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from tracekit.coding.sandbox import require_jail
from tracekit.targets.base import ClientFor
from tracekit.targets.coding.config import command_limits
from tracekit.targets.coding.target import CodingTarget
from tracekit.targets.swebench.suite import SweBenchSuite


class SweBenchTarget(CodingTarget):
    kind = "swebench"
    summary = "SWE-bench Verified (its instances; the official swebench harness in Docker scores the predictions)"
    paper_tasks = "SWE-bench Verified: 500 instances"

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        """SWE-bench Verified's instances (its training tasks: the local coding split, :meth:`train_spec`).
        Refuses (JailUnavailable, one line) where the sandbox cannot start, before any work."""
        require_jail()
        return SweBenchSuite.from_config(cfg.benchmark, command_limits(cfg.benchmark))

    def is_paper_tasks(self, b: DictConfig) -> bool:
        return True  # every instance (a cut: limit / task_ids)
