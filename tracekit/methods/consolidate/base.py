"""A consolidation strategy turns the per-capability GRPO adapters into one policy (paper Table 4).

Each strategy is one module here with a :class:`Strategy` subclass and one ``conf/consolidation/<name>.yaml``.
The ``compose`` stage runs the configured one; it writes its weights under the stage's work dir and
returns a :class:`Consolidated` (policy kind, where its weights are, the budget it consumed in total,
notes for the table), which the stage records in ``consolidated.json``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from omegaconf import DictConfig

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.config import _check, owner_settings, read_pinned_dictionary
from tracekit.policy import Budget, Policy, PolicyKind, PolicyRow, budget_sum, grpo_budget
from tracekit.targets.registry import target_of


@dataclass
class ConsolidationBudgetConfig:
    # training episodes of strategies that train; None: the capability runs' summed (iterations x T)
    episodes: int | None = None

    RANGES: ClassVar[dict[str, str]] = {"episodes": ">= 1"}


@dataclass
class LamSearchConfig:
    """The merges' scale chosen on validation data (issue 53): each value of ``scales`` merges the adapters at that
    ``lam``, the merged adapter is rolled out greedily on the capability environments' validation seeds
    ``0..validation_seeds-1`` (never the training seeds, 100,000 on, nor the held-out target's), and the value of the
    highest mean reward is kept. None: no search, the merge's own ``lam``."""

    scales: list[float] | None = None
    validation_seeds: int | None = None  # instances of each capability environment every value is scored on

    RANGES: ClassVar[dict[str, str]] = {"scales": "> 0", "validation_seeds": ">= 1"}


@dataclass
class ConsolidationSettings:
    """The ``consolidation`` fields every strategy shares; each strategy's own settings are its
    :attr:`Strategy.settings`, mounted at ``consolidation.<Strategy.mount>``
    (:func:`tracekit.methods.consolidate.consolidation_schema` assembles the group)."""

    method: str = "moe"  # a name of STRATEGIES (conf/consolidation/<name>.yaml)
    budget: ConsolidationBudgetConfig = field(default_factory=ConsolidationBudgetConfig)
    lam_search: LamSearchConfig = field(default_factory=LamSearchConfig)  # the merges' scale on validation seeds


if TYPE_CHECKING:
    from tracekit.pipeline import StageContext

CONSOLIDATED = "consolidated.json"


@dataclass(frozen=True)
class Consolidated:
    kind: PolicyKind  # adapter (one peft adapter) | moe (a LoRA-MoE directory)
    subdir: str  # where its weights are: in the compose artifact, or in ``weights``
    budget: Budget  # everything it consumed, the capability adapters' training included where it uses them
    weights: Artifact | None = None  # a sub-artifact holding the weights (None: the compose artifact itself)
    notes: tuple[str, ...] = ()
    label: str | None = None  # its row's label when the result names a value it chose (None: the strategy's row_label)


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

    def validate(self, cfg: DictConfig) -> None:
        """Refuse settings this strategy cannot run with (``ConfigError``, one line) before any work: its settings'
        own rules (:attr:`settings` built from ``consolidation.<mount>``) and, in an override, its cross-field rules.
        Every strategy but the merges refuses a merge-scale search (it has no scale)."""
        if self.settings is not None:
            owner_settings(cfg, f"consolidation.{self.mount or self.name}", self.settings)
        scales = search_scales(cfg)
        _check(scales is None, "consolidation.lam_search.scales", None if scales is None else list(scales),
               f"null with consolidation={self.name} (only the merges take a scale)")

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


def search_scales(cfg: DictConfig) -> list[float] | None:
    """``consolidation.lam_search.scales``; None where the compose stage's view masks the group (it reads it only while
    the scales are set). One level at a time: a masked group reads as a string, not a node."""
    node: Any = cfg
    for part in ("consolidation", "lam_search", "scales"):
        if not isinstance(node, DictConfig):
            return None
        node = node.get(part)
    return None if node is None else [float(v) for v in node]


def dictionary_size(cfg: DictConfig) -> int | None:
    """How many capabilities the run's dictionary holds where that is known before any work (the target's reference
    dictionary, a pinned file); None where discovery makes it."""
    a = cfg.analysis
    if a.discovery == "reference":
        try:
            return len(target_of(cfg).analysis_target(cfg).reference_dictionary())
        except NotImplementedError:  # a target without one: refused by the analysis checks, not here
            return None
    if a.discovery == "pinned":
        return len(read_pinned_dictionary(cfg))
    return None


def check_top_k(k: int | None, slots: int, key: str) -> None:
    """Refuse (one line, before a compose does any work) a top-k over more slots than the composed model has."""
    _check(k is None or k <= slots, key, k, f"<= {slots}, the composed model's gate slots (the selected adapters, and the base slot)")


def adapters_budget(adapters: dict[str, Artifact]) -> Budget:
    """The per-capability GRPO runs' budgets, summed (what consolidations that reuse them consumed)."""
    return budget_sum(grpo_budget(a) for a in adapters.values())


def write_consolidated(work_dir, strategy: Strategy, result: Consolidated, cfg: DictConfig) -> None:
    atomic_write_json(work_dir / CONSOLIDATED, {
        "strategy": strategy.name, "label": result.label or strategy.row_label(cfg), "kind": result.kind,
        "subdir": result.subdir,
        "weights": result.weights.ref() if result.weights else None, "budget": result.budget.to_dict(),
        "notes": list(result.notes)})


def read_consolidated(compose: Artifact) -> PolicyRow:
    c = read_json(compose.path / CONSOLIDATED)
    weights = compose.resolve(c["weights"]) if c["weights"] else compose
    return PolicyRow(c["label"], Policy(c["kind"], weights, c["subdir"]), Budget.from_dict(c["budget"]), tuple(c["notes"]))
