"""Merges of the capability adapters into one peft adapter (paper Table 4; math in :mod:`tracekit.merging`).

- ``merge_cat``: exact: factors concatenated (rank = sum of ranks), so dW = sum_i dW_i; ranks and target
  modules may differ.
- ``merge_linear`` / ``merge_ties`` / ``merge_dare_ties``: combined on the full dW_i (never on A and B
  separately, which drops the cross terms), then re-factored by truncated SVD to ``merge.rank``.
- ``merge_core_tsv``: Core Space merging with TSV-M and TIES sign resolution in the core, on the factors.

Every merge scales the merged update by ``lam``. One adapter: the merge is that adapter, unchanged (noted
in the table). The equal-shape merges refuse adapters whose ranks or target modules differ, in one line
naming both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from tracekit.artifacts import Artifact
from tracekit.merging.core_space import RANK_POLICIES, core_tsv_merge
from tracekit.merging.lora_io import LoraFactors, read_adapter_config, read_lora_adapter, write_lora_adapter
from tracekit.merging.merges import MAJORITY_SIGNS, merge_cat, merge_dare_ties, merge_linear, merge_ties
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget
from tracekit.ranges import Choice


@dataclass
class MergeConfig:
    """merge_cat | merge_linear | merge_ties | merge_dare_ties (on the full dW, SVD re-factored)."""

    weights: list[float] | None = None  # per capability, sorted by name; None: 1/T (linear) or 1 (TIES)
    density: float = 0.2  # TIES: fraction of entries kept; DARE: keep probability
    majority_sign: str = "total"  # total | frequency
    rank: int | None = None  # SVD rank of the merged adapter; None: the sum of the ranks
    lam: float = 1.0  # global scale of the merged update

    RANGES: ClassVar[dict[str, str]] = {"weights": "[-10, 10]", "density": "(0, 1]", "rank": ">= 1", "lam": "> 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"majority_sign": MAJORITY_SIGNS}


@dataclass
class CoreTSVConfig:
    """merge_core_tsv: Core Space + TIES sign resolution + TSV-M in the core."""

    lam: float = 0.2
    density: float = 1.0
    majority_sign: str = "total"
    isotropize: bool = False
    rank_policy: str = "full"  # full (all T*r core directions) | truncate (top r, before isotropizing)

    RANGES: ClassVar[dict[str, str]] = {"lam": "> 0", "density": "(0, 1]"}
    CHOICES: ClassVar[dict[str, Choice]] = {"majority_sign": MAJORITY_SIGNS, "rank_policy": RANK_POLICIES}


SUBDIR = "adapter"


def _scaled(factors: dict[str, Any], lam: float) -> dict[str, Any]:
    return {m: LoraFactors(f.A, f.B * lam, f.scale) for m, f in factors.items()} if lam != 1.0 else factors


class Merge(Strategy):
    """One merge, as ``merge(adapters: {capability: {module: LoraFactors}}, settings, seed)``."""

    def __init__(self, name: str, label: str, settings: type, merge: Callable[[dict, Any, int], dict], summary: str):
        self.name, self.label, self.settings, self._merge, self.summary = name, label, settings, merge, summary
        self.mount = "merge" if settings is MergeConfig else "core_tsv"

    def reads(self, cfg):
        return (f"consolidation.{self.mount}",)

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        budget = adapters_budget(adapters)  # a merge consumes nothing beyond the adapters' GRPO runs
        out = ctx.work_dir / SUBDIR
        if len(adapters) == 1:
            (cap, art), = adapters.items()
            return Consolidated("adapter", "adapter", budget, weights=art,
                                notes=(f"one capability adapter ({cap}): the merge is that adapter, unchanged",))
        factors = {cap: read_lora_adapter(a.path / "adapter") for cap, a in adapters.items()}
        settings = ctx.cfg.consolidation[self.mount]
        merged = self._merge(factors, settings, ctx.seed)
        first = next(iter(adapters.values()))
        write_lora_adapter(out, merged, base_config=read_adapter_config(first.path / "adapter"))
        ranks = sorted({f.rank for f in merged.values()})
        return Consolidated("adapter", SUBDIR, budget, notes=(f"{self.summary}; merged rank {'/'.join(map(str, ranks))} "
                                                        f"over {len(adapters)} adapters",))


def _weights(settings: Any, n: int, default: float) -> list[float]:
    return list(settings.weights) if settings.weights is not None else [default] * n


def _cat(factors, s, seed):
    return _scaled(merge_cat(factors), s.lam)


def _linear(factors, s, seed):
    return _scaled(merge_linear(factors, _weights(s, len(factors), 1.0 / len(factors)), rank=s.rank), s.lam)


def _ties(factors, s, seed):
    return _scaled(merge_ties(factors, s.density, _weights(s, len(factors), 1.0), s.majority_sign, rank=s.rank),
                   s.lam)


def _dare_ties(factors, s, seed):
    return _scaled(merge_dare_ties(factors, s.density, _weights(s, len(factors), 1.0), seed=seed,
                                   majority_sign=s.majority_sign, rank=s.rank), s.lam)


def _core_tsv(factors, s, seed):
    return core_tsv_merge(factors, lam=s.lam, density=s.density, majority_sign=s.majority_sign,
                          isotropize=s.isotropize, rank_policy=s.rank_policy)


MERGES = (
    Merge("merge_cat", "Merge: concatenation", MergeConfig, _cat, "exact concatenation of the factors (sum of dW)"),
    Merge("merge_linear", "Merge: linear", MergeConfig, _linear, "weighted sum of dW, SVD re-factored"),
    Merge("merge_ties", "Merge: TIES", MergeConfig, _ties, "TIES (trim, elect sign, disjoint mean) on dW"),
    Merge("merge_dare_ties", "Merge: DARE-TIES", MergeConfig, _dare_ties, "DARE drop + TIES on dW (seeded)"),
    Merge("merge_core_tsv", "CORE-TSV", CoreTSVConfig, _core_tsv,
          "Core Space merge, TIES sign resolution and TSV-M in the core"),
)
