"""Merges of the capability adapters into one peft adapter (paper Table 4; math in :mod:`tracekit.merging`).

- ``merge_cat``: exact: factors concatenated (rank = sum of ranks), so dW = sum_i dW_i; ranks and target
  modules may differ.
- ``merge_linear`` / ``merge_ties`` / ``merge_dare_ties``: combined on the full dW_i (never on A and B
  separately, which drops the cross terms), then re-factored by truncated SVD to ``merge.rank``.
- ``merge_core_tsv``: Core Space merging with TSV-M and TIES sign resolution in the core, on the factors.

Every merge scales the merged update by ``lam``. One adapter: the merge is that adapter, unchanged (noted
in the table). The equal-shape merges refuse adapters whose ranks or target modules differ, in one line
naming both.

``consolidation.lam_search`` (issue 53) chooses ``lam`` on validation data instead: each value merges the adapters
at that scale, the merged adapter is rolled out greedily on the validation seeds ``0..validation_seeds-1`` of every
ready capability environment (never the training seeds nor the held-out target's instances; each a cached
``merge_validation`` sub-artifact), and the value of the highest mean reward over the environments wins (ties: the
first listed, so list the merge's usual scale first). The chosen value is in the row's label (``Merge: linear (lam 0.5 on validation)``) and its notes
(every value's mean reward); the merge's own ``lam`` is not used. The search rolls episodes out: they count in the
row's budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import OmegaConf

from tracekit.artifacts import Artifact, file_sha256
from tracekit.config import _check
from tracekit.merging.core_space import RANK_POLICIES, core_tsv_merge
from tracekit.merging.lora_io import LoraFactors, read_adapter_config, read_lora_adapter, write_lora_adapter
from tracekit.merging.merges import MAJORITY_SIGNS, merge_cat, merge_dare_ties, merge_linear, merge_ties
from tracekit.methods.consolidate.base import Consolidated, Strategy, adapters_budget, search_scales
from tracekit.methods.consolidate.gate_objectives import MEASURE_READS, rollout_reward
from tracekit.policy import Budget
from tracekit.runs import ready_capabilities
from tracekit.ranges import Choice


@dataclass
class MergeConfig:
    """merge_cat | merge_linear | merge_ties | merge_dare_ties (on the full dW, SVD re-factored)."""

    # per capability, sorted by name; None: 1/T each (linear: the mean of the updates) or 1 each (TIES)
    weights: list[float] | None = None
    density: float = 0.2  # TIES: fraction of entries kept; DARE: keep probability
    majority_sign: str = "total"  # total (sign of the sum) | frequency (sign of the count)
    # SVD rank of the merged adapter; None: the sum of the ranks (lossless for a linear merge; TIES' masks make dW
    # full-rank, so there it truncates, logged)
    rank: int | None = None
    lam: float = 1.0  # global scale of the merged update

    RANGES: ClassVar[dict[str, str]] = {"weights": "[-10, 10]", "density": "(0, 1]", "rank": ">= 1", "lam": "> 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"majority_sign": MAJORITY_SIGNS}


@dataclass
class CoreTSVConfig:
    """merge_core_tsv: Core Space + TIES sign resolution + TSV-M in the core."""

    lam: float = 0.2  # the reference core-TSV config (apanariello4/core-space-merging)
    density: float = 1.0  # TIES trim of each core; 1.0: sign election only
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
        if search_scales(cfg) is None:  # the merge's own lam: the keys as before issue 53
            return (f"consolidation.{self.mount}",)
        return (f"consolidation.{self.mount}", "consolidation.lam_search", *MEASURE_READS)

    def stage_inputs(self, cfg):
        # a scale search rolls the merged adapters out in the capability environments
        return () if search_scales(cfg) is None else ("synthesize",)

    def validate(self, cfg) -> None:
        s = cfg.consolidation.lam_search
        if s.scales is not None:
            _check(len(s.scales) >= 1, "consolidation.lam_search.scales", list(s.scales), "a non-empty list or null")
            _check(s.validation_seeds is not None, "consolidation.lam_search.validation_seeds", s.validation_seeds,
                   ">= 1 with consolidation.lam_search.scales (each scale is scored on the capability environments' "
                   "validation seeds, never on the held-out tasks)")

    def consolidate(self, ctx, adapters: dict[str, Artifact]) -> Consolidated:
        budget = adapters_budget(adapters)  # a merge consumes nothing beyond the adapters' GRPO runs
        out = ctx.work_dir / SUBDIR
        if len(adapters) == 1:
            (cap, art), = adapters.items()
            return Consolidated("adapter", "adapter", budget, weights=art,
                                notes=(f"one capability adapter ({cap}): the merge is that adapter, unchanged",))
        factors = {cap: read_lora_adapter(a.path / "adapter") for cap, a in adapters.items()}
        settings = ctx.cfg.consolidation[self.mount]
        base_config = read_adapter_config(next(iter(adapters.values())).path / "adapter")
        scales = search_scales(ctx.cfg)
        label, notes = None, []
        if scales is None:
            merged = self._merge(factors, settings, ctx.seed)
            write_lora_adapter(out, merged, base_config=base_config)
        else:
            search = ctx.cfg.consolidation.lam_search
            lam, scores, episodes = self._search(ctx, factors, settings, base_config, [float(v) for v in search.scales],
                                                 int(search.validation_seeds))
            merged = self._merge(factors, _with_lam(settings, lam), ctx.seed)
            write_lora_adapter(out, merged, base_config=base_config)
            budget += Budget(episodes=episodes)
            label = f"{self.label} (lam {lam:g} on validation)"
            notes.append(f"lam {lam:g} chosen on {search.validation_seeds} validation seeds per capability environment "
                         "(mean reward: " + ", ".join(f"lam {v:g}: {r:.3f}" for v, r in scores.items()) + ")")
        ranks = sorted({f.rank for f in merged.values()})
        notes.insert(0, f"{self.summary}; merged rank {'/'.join(map(str, ranks))} over {len(adapters)} adapters")
        return Consolidated("adapter", SUBDIR, budget, notes=tuple(notes), label=label)

    def _search(self, ctx, factors: dict, settings: Any, base_config: dict, values: list[float], n: int
                ) -> tuple[float, dict[float, float], int]:
        """(the chosen lam, each value's mean reward over the ready capability environments, episodes rolled out)."""
        syn = ctx.inputs["synthesize"]
        pkgs = {cap: syn.path / cap for cap in ready_capabilities(syn)}
        if not pkgs:
            raise RuntimeError("compose: no ready capability environment to choose the merge scale on")
        seeds = list(range(n))  # the environments' validation seeds (training starts at 100,000, the target at 10^7)
        scores: dict[float, float] = {}
        for lam in values:
            where = ctx.work_dir / "lam_search" / f"lam_{lam:g}"
            write_lora_adapter(where, self._merge(factors, _with_lam(settings, lam), ctx.seed), base_config=base_config)
            identity = file_sha256(where / "adapter_model.safetensors")
            rewards = [rollout_reward(ctx, "merge_validation", identity, where, pkg, seeds,
                                      {"strategy": self.name, "lam": lam, "env": cap}) for cap, pkg in sorted(pkgs.items())]
            scores[lam] = sum(rewards) / len(rewards)
        best = max(values, key=lambda v: (scores[v], -values.index(v)))
        return best, scores, len(values) * len(pkgs) * n


def _with_lam(settings: Any, lam: float) -> Any:
    """The merge's settings with ``lam`` replaced (a copy; the config is not touched)."""
    copy = OmegaConf.create(OmegaConf.to_container(settings, resolve=True))
    copy.lam = lam
    return copy


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
