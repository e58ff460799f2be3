"""Core Space merging of LoRA adapters (Panariello et al., NeurIPS 2025) and core-TSV (paper Table 4).

Per module, with the scales folded into B (B_i' = s_i B_i, so the bases and cores see each task's
actual update):

- A_hat = [A_1; ...; A_T] (R x n, R = sum of ranks), B_hat = [B_1' ... B_T'] (m x R);
  V_ref = right singular vectors of A_hat, U_ref = left singular vectors of B_hat (reduced, <= R).
- core of task i: M_i = (U_ref^T B_i')(A_i V_ref), never forming dW_i. Lossless:
  U_ref M_i V_ref^T = dW_i, since B_i' lies in span(U_ref) and A_i's rows in span(V_ref).
- the cores are merged (``sum``, ``ties``, ``tsv``, ``ties_tsv``), optionally truncated and
  isotropized, scaled by a global ``lam`` and mapped back as LoRA factors from the SVD of the
  small merged core M = P S Q^T: B = lam U_ref P S^(1/2), A = S^(1/2) Q^T V_ref^T (no m x n matrix).

TSV-M (Gargiulo et al., CVPR 2025) on the cores: per task SVD, keep the top k = floor(c / T)
components (c = core size, k = r when T r <= min(m, n); exact, since rank M_i <= r), concatenate U,
Sigma, V across tasks, replace the concatenated U and V by their polar factors (nearest matrices
with orthonormal columns) and rebuild U_perp Sigma V_perp^T.

Core-TSV (:func:`core_tsv_merge`, ``core_merge="ties_tsv"``): TIES sign resolution enters on the
per-task cores, before TSV-M: each core is trimmed to ``density`` (default 1: no trimming), a sign
is elected per core entry across tasks, and each task's disagreeing entries are zeroed; TSV-M then
merges those cores. Defaults follow the reference core-TSV config (lam 0.2, no isotropize).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch

from tracekit.merging.lora_io import LoraFactors
from tracekit.merging.merges import (Adapters, MajoritySign, check_aligned, elect_sign, named_adapters, ties_merge,
                                     ties_trim)

CoreMerge = Literal["sum", "ties", "tsv", "ties_tsv"]
RankPolicy = Literal["full", "truncate"]
_CORE_MERGES = ("sum", "ties", "tsv", "ties_tsv")
RANK_POLICIES = get_args(RankPolicy)


def core_bases(factors: Sequence[LoraFactors]) -> tuple[torch.Tensor, torch.Tensor]:
    """(U_ref [m, c_m], V_ref [n, c_n]): orthonormal bases of the stacked B' columns and A rows."""
    A_hat = torch.cat([f.A.float() for f in factors], dim=0)
    B_hat = torch.cat([f.scale * f.B.float() for f in factors], dim=1)
    U_ref = torch.linalg.svd(B_hat, full_matrices=False)[0]
    V_ref = torch.linalg.svd(A_hat, full_matrices=False)[2].T
    return U_ref, V_ref


def task_core(f: LoraFactors, U_ref: torch.Tensor, V_ref: torch.Tensor) -> torch.Tensor:
    """M_i = U_ref^T (s_i B_i A_i) V_ref as (U_ref^T s_i B_i)(A_i V_ref): two thin products, no dW."""
    return (U_ref.T @ (f.scale * f.B.float())) @ (f.A.float() @ V_ref)


def polar_orthogonalize(X: torch.Tensor) -> torch.Tensor:
    """Polar factor P Q^T of X = P S Q^T: the matrix with orthonormal columns nearest to X."""
    P, _, Qh = torch.linalg.svd(X, full_matrices=False)
    return P @ Qh


def tsv_merge(cores: Sequence[torch.Tensor], k: int) -> torch.Tensor:
    """TSV-M: top-k SVD of each task matrix, concatenated, U and V polar-orthogonalized, recombined."""
    Us, Ss, Vs = [], [], []
    for M in cores:
        U, S, Vh = torch.linalg.svd(M, full_matrices=False)
        Us.append(U[:, :k])
        Ss.append(S[:k])
        Vs.append(Vh[:k].T)
    U_perp, V_perp = polar_orthogonalize(torch.cat(Us, dim=1)), polar_orthogonalize(torch.cat(Vs, dim=1))
    return (U_perp * torch.cat(Ss)) @ V_perp.T


def ties_resolve(stacked: torch.Tensor, density: float, majority_sign: MajoritySign = "total") -> torch.Tensor:
    """TIES trim + sign election, per task kept: each task's trimmed tensor with its disagreeing entries zeroed."""
    trimmed = torch.stack([ties_trim(t, density) for t in stacked])
    return trimmed * (trimmed.sign() == elect_sign(trimmed, majority_sign))


def combine_cores(
    cores: torch.Tensor, core_merge: CoreMerge, density: float, majority_sign: MajoritySign
) -> torch.Tensor:
    """Merge the task cores stacked on axis 0 into one core."""
    k = min(cores.shape[1:]) // cores.shape[0]  # TSV: T tasks share the core's c directions
    if core_merge == "sum":
        return cores.sum(dim=0)
    if core_merge == "ties":
        return ties_merge(cores, density, majority_sign)
    if core_merge == "tsv":
        return tsv_merge(cores, k)
    if core_merge == "ties_tsv":
        return tsv_merge(ties_resolve(cores, density, majority_sign), k)
    raise ValueError(f"core_merge must be one of {_CORE_MERGES}, got {core_merge!r}")


def core_to_lora(
    M: torch.Tensor,
    U_ref: torch.Tensor,
    V_ref: torch.Tensor,
    rank: int | None = None,
    isotropize: bool = False,
    lam: float = 1.0,
) -> LoraFactors:
    """LoRA factors of lam * U_ref M V_ref^T from the SVD of the small core M.

    ``rank``: keep the top ``rank`` directions (None: all). ``isotropize``: the kept singular values
    are replaced by their mean, after truncation (truncating an isotropic spectrum would keep an
    arbitrary subspace).
    """
    P, S, Qh = torch.linalg.svd(M, full_matrices=False)
    k = S.numel() if rank is None else min(rank, S.numel())
    S = S[:k]
    if isotropize:
        S = S.mean().expand_as(S)
    root = S.sqrt()
    return LoraFactors((root[:, None] * Qh[:k]) @ V_ref.T, lam * (U_ref @ (P[:, :k] * root)), 1.0)


def core_space_merge(
    adapters: Adapters,
    core_merge: CoreMerge = "sum",
    *,
    lam: float = 1.0,
    density: float = 1.0,
    majority_sign: MajoritySign = "total",
    isotropize: bool = False,
    rank_policy: RankPolicy = "full",
) -> dict[str, LoraFactors]:
    """Merge aligned adapters (same modules and ranks) in core space; returns scale-1 factors.

    ``core_merge``: ``sum`` (task arithmetic: with lam 1 and no isotropize this is exactly
    sum_i dW_i), ``ties`` (TIES on the cores: trim to ``density``, elect, disjoint mean), ``tsv``
    (TSV-M), ``ties_tsv`` (TIES trim + sign election on the cores, then TSV-M).
    ``rank_policy``: ``full`` (default) keeps every direction of the merged core (rank T r, as
    merge_cat): the stored adapter is exactly lam * U_ref M V_ref^T, the method's own output, and
    isotropize acts on the whole spectrum as in the reference. ``truncate`` keeps the top r
    (one input adapter's rank) directions, before isotropizing, for a single-adapter-sized result.
    """
    if core_merge not in _CORE_MERGES:
        raise ValueError(f"core_merge must be one of {_CORE_MERGES}, got {core_merge!r}")
    if rank_policy not in RANK_POLICIES:
        raise ValueError(f"rank_policy must be one of {RANK_POLICIES}, got {rank_policy!r}")
    named = named_adapters(adapters)
    check_aligned(named, "core_space_merge")
    merged = {}
    for module in next(iter(named.values())):
        factors = [a[module] for a in named.values()]
        U_ref, V_ref = core_bases(factors)
        cores = torch.stack([task_core(f, U_ref, V_ref) for f in factors])
        M = combine_cores(cores, core_merge, density, majority_sign)
        rank = None if rank_policy == "full" else factors[0].rank
        merged[module] = core_to_lora(M, U_ref, V_ref, rank, isotropize, lam)
    return merged


def core_tsv_merge(
    adapters: Adapters,
    *,
    lam: float = 0.2,
    density: float = 1.0,
    majority_sign: MajoritySign = "total",
    isotropize: bool = False,
    rank_policy: RankPolicy = "full",
) -> dict[str, LoraFactors]:
    """Core-TSV (paper Table 4): Core Space + TIES sign resolution on the cores + TSV-M, global ``lam``.

    Defaults: the reference core-TSV config (apanariello4/core-space-merging ``vitB_r16_core_tsv``:
    scaling 0.2, isotropize off); density 1 = sign election without trimming.
    """
    return core_space_merge(adapters, "ties_tsv", lam=lam, density=density, majority_sign=majority_sign,
                            isotropize=isotropize, rank_policy=rank_policy)  # fmt: skip
