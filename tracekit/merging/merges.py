"""Merging LoRA adapters on their full updates dW_i = s_i B_i A_i (float32), per module.

- :func:`merge_cat` is exact: the factors are concatenated (rank = sum of ranks); adapters may
  differ in rank and in target modules.
- :func:`merge_linear`, :func:`merge_ties`, :func:`merge_dare_ties` combine the full dW_i and
  re-factor the result by truncated SVD (:func:`svd_refactor`) to ``rank`` (default: the sum of
  the input ranks, capped at min(m, n)). That default is lossless for ``merge_linear`` (rank of a
  sum <= sum of ranks); TIES / DARE mask entries, which makes dW full-rank in general, so any rank
  below min(m, n) truncates: the worst relative residual is logged.
  These need equal target modules and equal factor shapes (ranks) in every adapter.

TIES convention (Yadav et al. 2023, as peft's ``ties``): weights scale each task first, each task
keeps its top-``density`` entries by |value|, the sign per entry is elected from the sum
(``majority_sign="total"``; ``"frequency"``: from the count of signs; a zero sum elects +), and the
entries that agree with it are averaged over the tasks that kept them (disjoint mean, not a sum).

An adapter set is ``{name: {module: LoraFactors}}`` (names appear in errors) or a sequence of
adapters (named ``adapter 0``, ...). Every merge returns ``{module: LoraFactors}`` with scale 1.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Literal, get_args

import torch

from tracekit.merging.lora_io import Adapter, LoraFactors

log = logging.getLogger(__name__)

Adapters = Mapping[str, Adapter] | Sequence[Adapter]
MajoritySign = Literal["total", "frequency"]
MAJORITY_SIGNS = get_args(MajoritySign)


def named_adapters(adapters: Adapters) -> dict[str, Adapter]:
    """``{name: adapter}``; a sequence is named by position. At least one adapter."""
    if isinstance(adapters, Mapping):
        named = dict(adapters)
    else:
        named = {f"adapter {i}": a for i, a in enumerate(adapters)}
    if not named:
        raise ValueError("no adapters to merge")
    for name, adapter in named.items():
        if not isinstance(adapter, Mapping) or not all(isinstance(f, LoraFactors) for f in adapter.values()):
            raise ValueError(f"adapter {name!r} is not a {{module: LoraFactors}} mapping")
    return named


def check_aligned(adapters: Mapping[str, Adapter], method: str) -> None:
    """Refuse (one line naming both adapters) unless all adapters have the same modules and factor shapes."""
    (ref_name, ref), *others = adapters.items()
    for name, adapter in others:
        for module in [*ref, *(m for m in adapter if m not in ref)]:
            if module not in adapter or module not in ref:
                has, lacks = (ref_name, name) if module in ref else (name, ref_name)
                raise ValueError(f"{method}: adapter {has!r} adapts {module} but adapter {lacks!r} does not "
                                 "(merge_cat merges differing modules)")  # fmt: skip
            a, b = ref[module], adapter[module]
            if a.A.shape != b.A.shape or a.B.shape != b.B.shape:
                raise ValueError(f"{method}: module {module} is {_shape(a)} in adapter {ref_name!r} but {_shape(b)} "
                                 f"in adapter {name!r} (merge_cat merges differing ranks)")  # fmt: skip


def _shape(f: LoraFactors) -> str:
    return f"rank {f.rank} (B {tuple(f.B.shape)}, A {tuple(f.A.shape)})"


def _modules_in_order(adapters: Mapping[str, Adapter]) -> list[str]:
    return list(dict.fromkeys(m for adapter in adapters.values() for m in adapter))


def _weights(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} adapters")
    return [float(w) for w in weights]


# ---------------------------------------------------------------------------------------------
# exact concatenation


def merge_cat(adapters: Adapters) -> dict[str, LoraFactors]:
    """Exact sum of the dW_i: A = [A_1; ...; A_T], B = [s_1 B_1 ... s_T B_T] (scales folded into B).

    A module only some adapters adapt gets only their factors; ranks may differ.
    """
    named = named_adapters(adapters)
    merged = {}
    for module in _modules_in_order(named):
        having = {name: a[module] for name, a in named.items() if module in a}
        (ref_name, ref), *rest = having.items()
        for name, f in rest:
            if f.A.shape[1] != ref.A.shape[1] or f.B.shape[0] != ref.B.shape[0]:
                raise ValueError(f"merge_cat: module {module} is {ref.B.shape[0]}x{ref.A.shape[1]} in adapter "
                                 f"{ref_name!r} but {f.B.shape[0]}x{f.A.shape[1]} in adapter {name!r}")  # fmt: skip
        A = torch.cat([f.A.float() for f in having.values()], dim=0)
        B = torch.cat([f.scale * f.B.float() for f in having.values()], dim=1)
        merged[module] = LoraFactors(A, B, 1.0)
    return merged


# ---------------------------------------------------------------------------------------------
# entry-wise helpers (TIES, DARE) and the SVD re-factorisation


def ties_trim(x: torch.Tensor, density: float) -> torch.Tensor:
    """Keep the round(density * numel) entries of largest |value|, zero the rest (exact count: no threshold ties)."""
    if not 0.0 <= density <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    k = round(density * x.numel())
    if k == x.numel():
        return x.clone()
    keep = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
    keep[torch.topk(x.abs().flatten(), k).indices] = True
    return torch.where(keep.view_as(x), x, torch.zeros_like(x))


def elect_sign(stacked: torch.Tensor, majority_sign: MajoritySign = "total") -> torch.Tensor:
    """Per-entry sign (+1/-1) over the task axis 0: of the sum ("total") or of the sign count ("frequency")."""
    if majority_sign == "total":
        votes = stacked.sum(dim=0)
    elif majority_sign == "frequency":
        votes = stacked.sign().sum(dim=0)
    else:
        raise ValueError(f"majority_sign must be 'total' or 'frequency', got {majority_sign!r}")
    return torch.where(votes >= 0, 1.0, -1.0).to(stacked.dtype)


def disjoint_merge(stacked: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """Mean, per entry, over the tasks whose (nonzero) entry has the elected sign; 0 where none does."""
    agree = stacked.sign() == sign
    return (stacked * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def ties_merge(stacked: torch.Tensor, density: float, majority_sign: MajoritySign = "total") -> torch.Tensor:
    """TIES on task tensors stacked on axis 0: trim, elect sign, disjoint mean."""
    trimmed = torch.stack([ties_trim(t, density) for t in stacked])
    return disjoint_merge(trimmed, elect_sign(trimmed, majority_sign))


def dare_drop(x: torch.Tensor, drop_p: float, generator: torch.Generator) -> torch.Tensor:
    """DARE: drop each entry with probability ``drop_p``, rescale the kept ones by 1 / (1 - drop_p) (unbiased)."""
    if not 0.0 <= drop_p < 1.0:
        raise ValueError(f"drop_p must be in [0, 1), got {drop_p}")
    keep = torch.rand(x.shape, generator=generator, device=generator.device).to(x.device) >= drop_p
    return torch.where(keep, x / (1.0 - drop_p), torch.zeros_like(x))


def svd_refactor(dW: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-``rank`` factors (A [k, n], B [m, k]) of dW, k = min(rank, m, n); sqrt(S) on each side."""
    U, S, Vh = torch.linalg.svd(dW.float(), full_matrices=False)
    k = min(rank, S.numel())
    root = S[:k].sqrt()  # balanced factors: neither dominates if training resumes from the merge
    return root[:, None] * Vh[:k], U[:, :k] * root


def _refactor_all(
    deltas: Mapping[str, torch.Tensor], ranks: Mapping[str, int], method: str
) -> dict[str, LoraFactors]:
    merged, worst = {}, (0.0, "")
    for module, dW in deltas.items():
        A, B = svd_refactor(dW, ranks[module])
        residual = float(torch.linalg.norm(dW - B @ A) / torch.linalg.norm(dW).clamp(min=1e-30))
        worst = max(worst, (residual, module))
        merged[module] = LoraFactors(A, B, 1.0)
    log.info("%s: worst relative SVD truncation residual %.3g (%s)", method, *worst)
    return merged


def _full_merge(
    adapters: Adapters,
    method: str,
    weights: Sequence[float] | None,
    rank: int | None,
    combine: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, LoraFactors]:
    """Per module: ``combine`` the stacked w_i dW_i, re-factor to ``rank`` (default: sum of input ranks)."""
    named = named_adapters(adapters)
    check_aligned(named, method)
    w = _weights(weights, len(named))
    deltas, ranks = {}, {}
    for module in _modules_in_order(named):
        factors = [a[module] for a in named.values()]
        deltas[module] = combine(torch.stack([w_i * f.delta() for w_i, f in zip(w, factors)]))
        ranks[module] = rank if rank is not None else sum(f.rank for f in factors)
    return _refactor_all(deltas, ranks, method)


# ---------------------------------------------------------------------------------------------
# full-dW merges


def merge_linear(
    adapters: Adapters, weights: Sequence[float] | None = None, rank: int | None = None
) -> dict[str, LoraFactors]:
    """Task arithmetic: sum_i w_i dW_i (weights default to 1: a sum; pass 1/T each for the mean)."""
    return _full_merge(adapters, "merge_linear", weights, rank, lambda dWs: dWs.sum(dim=0))


def merge_ties(
    adapters: Adapters,
    density: float,
    weights: Sequence[float] | None = None,
    majority_sign: MajoritySign = "total",
    rank: int | None = None,
) -> dict[str, LoraFactors]:
    """TIES on the weighted w_i dW_i: trim each to ``density``, elect signs, disjoint mean."""
    return _full_merge(adapters, "merge_ties", weights, rank, lambda dWs: ties_merge(dWs, density, majority_sign))


def merge_dare_ties(
    adapters: Adapters,
    density: float,
    weights: Sequence[float] | None = None,
    seed: int = 0,
    majority_sign: MajoritySign = "total",
    rank: int | None = None,
) -> dict[str, LoraFactors]:
    """DARE-TIES (as peft's ``dare_ties``): DARE with keep probability ``density`` (drop p = 1 - density,
    rescale 1 / density) replaces TIES's magnitude trim, then sign election and disjoint mean.

    One generator seeded with ``seed`` draws the masks in module order, then adapter order: reproducible.
    """
    g = torch.Generator().manual_seed(seed)

    def combine(dWs: torch.Tensor) -> torch.Tensor:
        dropped = torch.stack([dare_drop(dW, 1.0 - density, g) for dW in dWs])
        return disjoint_merge(dropped, elect_sign(dropped, majority_sign))

    return _full_merge(adapters, "merge_dare_ties", weights, rank, combine)
