"""A consolidation strategy turns the per-capability GRPO adapters into one policy (paper Table 4).

Each strategy is one module here with a :class:`Strategy` subclass and one ``conf/consolidation/<name>.yaml``.
The ``compose`` stage runs the configured one; it writes its weights under the stage's work dir and
returns a :class:`Consolidated` (policy kind, where its weights are, the budget it consumed in total,
notes for the table), which the stage records in ``consolidated.json``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.policy import Budget, Policy, PolicyKind, PolicyRow, budget_sum, grpo_budget


@dataclass
class ConsolidationBudgetConfig:
    episodes: int | None = None  # training episodes of strategies that train; None: the capability runs' summed

    RANGES: ClassVar[dict[str, str]] = {"episodes": ">= 1"}


@dataclass
class ConsolidationSettings:
    """The ``consolidation`` fields every strategy shares; each strategy's own settings are its
    :attr:`Strategy.settings`, mounted at ``consolidation.<Strategy.mount>``
    (:func:`tracekit.methods.consolidate.consolidation_schema` assembles the group)."""

    method: str = "moe"  # a name of STRATEGIES (conf/consolidation/<name>.yaml)
    budget: ConsolidationBudgetConfig = field(default_factory=ConsolidationBudgetConfig)


if TYPE_CHECKING:
    from omegaconf import DictConfig

    from tracekit.pipeline import StageContext

CONSOLIDATED = "consolidated.json"


@dataclass(frozen=True)
class Consolidated:
    kind: PolicyKind  # adapter (one peft adapter) | moe (a LoRA-MoE directory)
    subdir: str  # where its weights are: in the compose artifact, or in ``weights``
    budget: Budget  # everything it consumed, the capability adapters' training included where it uses them
    weights: Artifact | None = None  # a sub-artifact holding the weights (None: the compose artifact itself)
    notes: tuple[str, ...] = ()


class Strategy(ABC):
    name: str  # consolidation.method
    label: str  # its row in results tables
    settings: type | None = None  # its settings class (declaring its RANGES / CHOICES), at consolidation.<mount>
    mount: str = ""  # where ("": its name; strategies sharing settings share a mount: the merges)
    inputs: tuple[str, ...] = ()  # pipeline stages it reads beyond ``train``

    def reads(self, cfg: DictConfig) -> tuple[str, ...]:
        """Config values its result depends on, beyond consolidation.method/budget, backbone and seed."""
        return ()

    def row_label(self, cfg: DictConfig) -> str:
        """Its row's label under ``cfg`` (a variant of the strategy names itself: jobs of a sweep stay apart)."""
        return self.label

    def stage_inputs(self, cfg: DictConfig) -> tuple[str, ...]:
        """The pipeline stages it reads beyond ``train`` under ``cfg`` (default: :attr:`inputs`)."""
        return self.inputs

    @abstractmethod
    def consolidate(self, ctx: StageContext, adapters: dict[str, Artifact]) -> Consolidated:
        """Write the consolidated weights under ``ctx.work_dir`` and say what they are."""

    def report(self, art: Artifact, ctx: StageContext) -> None:
        """The run summary's section on the consolidation (runs on cache hits too)."""
        c = read_json(art.path / CONSOLIDATED)
        b = c["budget"]
        notes = "".join(f"\n- {n}" for n in c["notes"])
        ctx.record.section(f"Consolidation: {c['label']}", (
            f"`consolidation={c['strategy']}` -> one {c['kind']} policy; budget: {b['episodes']:,} episodes, "
            f"{b['generated_tokens']:,} generated tokens, {b['optimizer_steps']:,} optimizer steps.{notes}"))


def adapters_budget(adapters: dict[str, Artifact]) -> Budget:
    """The per-capability GRPO runs' budgets, summed (what consolidations that reuse them consumed)."""
    return budget_sum(grpo_budget(a) for a in adapters.values())


def write_consolidated(work_dir, strategy: Strategy, result: Consolidated, cfg: DictConfig) -> None:
    atomic_write_json(work_dir / CONSOLIDATED, {
        "strategy": strategy.name, "label": strategy.row_label(cfg), "kind": result.kind, "subdir": result.subdir,
        "weights": result.weights.ref() if result.weights else None, "budget": result.budget.to_dict(),
        "notes": list(result.notes)})


def read_consolidated(compose: Artifact) -> PolicyRow:
    c = read_json(compose.path / CONSOLIDATED)
    weights = compose.resolve(c["weights"]) if c["weights"] else compose
    return PolicyRow(c["label"], Policy(c["kind"], weights, c["subdir"]), Budget.from_dict(c["budget"]), tuple(c["notes"]))
