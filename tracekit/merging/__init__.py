"""Consolidating capability LoRA adapters into one adapter by weight merging (paper App. C, Table 4).

lora_io.py: peft adapter directories <-> per-module ``LoraFactors`` (A, B, scale).
merges.py: exact concatenation and full-dW merges (linear, TIES, DARE-TIES) re-factored by SVD.
core_space.py: Core Space merging and core-TSV (TIES sign resolution + TSV-M in core space).
"""

from tracekit.merging.core_space import core_space_merge, core_tsv_merge, polar_orthogonalize, tsv_merge
from tracekit.merging.lora_io import LoraFactors, read_adapter_config, read_lora_adapter, write_lora_adapter
from tracekit.merging.merges import (dare_drop, disjoint_merge, elect_sign, merge_cat, merge_dare_ties, merge_linear,
                                     merge_ties, svd_refactor, ties_merge, ties_trim)

__all__ = [
    "LoraFactors",
    "core_space_merge",
    "core_tsv_merge",
    "dare_drop",
    "disjoint_merge",
    "elect_sign",
    "merge_cat",
    "merge_dare_ties",
    "merge_linear",
    "merge_ties",
    "polar_orthogonalize",
    "read_adapter_config",
    "read_lora_adapter",
    "svd_refactor",
    "ties_merge",
    "ties_trim",
    "tsv_merge",
    "write_lora_adapter",
]
