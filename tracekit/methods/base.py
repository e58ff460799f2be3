"""What a method hands to evaluation: policies (the backbone plus at most one set of weights) and budgets.

Policies and budgets: :mod:`tracekit.policy`. A :class:`Method` is one row family of a paper table (``base``, ``single_capability``, ``trace``, ...).
It names the pipeline stages it needs (``inputs``), may add stages of its own (``stages``), and turns
their artifacts into :class:`PolicyRow`\\ s. Evaluation is one loop over those rows: one cached rollout
per distinct policy (see :func:`tracekit.stages.evaluate_stage`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tracekit.policy import PolicyRow

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from tracekit.pipeline import Stage, StageContext


class Method(ABC):
    """A row family of the paper's tables: one module under ``tracekit/methods/``, registered by name."""

    name: str  # the ``eval.methods`` entry and the ``method:`` of experiments/*.yaml rows
    settings: type | None = None  # its settings class (a dataclass declaring its RANGES / CHOICES), at baselines.<name>
    summary: str  # one line, for errors and docs
    stages: tuple[Stage, ...] = ()  # stages of its own, added to the pipeline

    @abstractmethod
    def inputs(self, cfg: DictConfig) -> tuple[str, ...]:
        """The pipeline stages whose artifacts :meth:`rows` reads."""

    def reads(self, cfg: DictConfig) -> tuple[str, ...]:
        """Config values its rows depend on beyond its inputs' content (added to evaluate's key)."""
        return ()

    def validate(self, cfg: DictConfig) -> None:
        """Refuse a configuration this method cannot run on (``ConfigError``, one line) before any work."""

    @abstractmethod
    def rows(self, ctx: StageContext) -> list[PolicyRow]:
        """The policies to evaluate, each with its label and budget."""

    def keep(self, results: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Which evaluated rows (label -> summary) the table shows; all by default."""
        return list(results)
