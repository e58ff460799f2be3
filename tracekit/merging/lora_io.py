"""peft LoRA adapter directories <-> per-module factors.

A directory as peft's ``save_pretrained`` writes it (adapter_config.json + adapter_model.safetensors)
reads into ``{module: LoraFactors(A [r, n], B [m, r], scale)}`` with ``dW = scale * B @ A`` and
scale = alpha / r (alpha / sqrt(r) with rsLoRA; per-module r / alpha from ``rank_pattern`` /
``alpha_pattern``). Module names are peft's module keys (``model.layers.0.self_attn.q_proj``).

A merged adapter is written back as a plain peft LoRA directory: the scale is folded into B and
each module's alpha equals its rank (scale 1); modules whose rank differs from the most common one
are listed in ``rank_pattern`` / ``alpha_pattern``; ``target_modules`` lists the exact module keys,
so a module only some of the merged adapters had is adapted and nothing else is.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file, save_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
# adapter_config fields under which dW is not scale * B @ A of a Linear (or that add non-LoRA weights)
_UNSUPPORTED = (
    "use_dora", "lora_bias", "target_parameters", "modules_to_save", "trainable_token_indices",
    "alora_invocation_tokens", "arrow_config", "use_qalora", "kasa_config", "velora_config",
    "monteclora_config", "use_bdlora",
)  # fmt: skip
# fields a merged adapter inherits from the first input's config; everything else is plain-LoRA defaults
_INHERITED = ("base_model_name_or_path", "revision", "task_type", "fan_in_fan_out", "lora_dropout", "layer_replication")


class LoraFactors(NamedTuple):
    """One module's LoRA update dW = scale * B @ A."""

    A: torch.Tensor  # [r, n]
    B: torch.Tensor  # [m, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    def delta(self) -> torch.Tensor:
        """The full update [m, n] in float32."""
        return self.scale * (self.B.float() @ self.A.float())


Adapter = Mapping[str, LoraFactors]  # module key -> factors


def read_adapter_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise ValueError(f"{path}: not a peft LoRA adapter directory (missing {CONFIG_FILE})")
    return json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))


def read_lora_adapter(path: str | Path) -> dict[str, LoraFactors]:
    """Read a peft LoRA adapter directory into per-module factors (tensors as stored, on CPU)."""
    from peft.utils.other import get_pattern_key  # peft's own r/alpha pattern matching, so scales agree with peft

    path = Path(path)
    cfg = read_adapter_config(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise ValueError(f"{path}: not a peft LoRA adapter directory (missing {WEIGHTS_FILE})")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    bad = [k for k in _UNSUPPORTED if cfg.get(k) not in (None, False, [], {})]
    if cfg.get("bias", "none") != "none":
        bad.append(f"bias={cfg['bias']!r}")
    if bad:
        raise ValueError(f"{path}: cannot merge LoRA with {', '.join(bad)} (dW is not scale * B @ A)")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / WEIGHTS_FILE)).items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"{path}: unsupported tensor {key} (only Linear lora_A/lora_B weights merge)")
        parts.setdefault(m["module"], {})[m["which"]] = tensor
    if not parts:
        raise ValueError(f"{path}: adapter holds no LoRA weights")
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    factors = {}
    for module, ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: module {module} has lora_{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
        A, B = ab["A"], ab["B"]
        if A.dim() != 2 or B.dim() != 2 or B.shape[1] != A.shape[0]:
            raise ValueError(f"{path}: module {module}: lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} "
                             "are not LoRA factors")  # fmt: skip
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), cfg["r"])
        if A.shape[0] != r:
            raise ValueError(f"{path}: module {module}: rank {A.shape[0]} in the weights, {r} in {CONFIG_FILE}")
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), cfg["lora_alpha"])
        factors[module] = LoraFactors(A, B, alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r)
    return factors


def merged_adapter_config(factors: Adapter, base_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """adapter_config.json fields for ``factors`` stored with scale 1 (alpha = rank per module)."""
    ranks = {module: f.rank for module, f in factors.items()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    # peft matches pattern keys as regexes against module keys: escape so each key names one module
    pattern = {re.escape(module): rank for module, rank in ranks.items() if rank != r}
    inherited = {k: base_config[k] for k in _INHERITED if base_config and k in base_config}
    return {**inherited, "peft_type": "LORA", "r": r, "lora_alpha": r, "rank_pattern": pattern,
            "alpha_pattern": dict(pattern), "use_rslora": False, "target_modules": sorted(ranks),
            "init_lora_weights": True, "inference_mode": True}  # fmt: skip


def write_lora_adapter(
    path: str | Path,
    factors: Adapter,
    base_config: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write ``factors`` as a peft LoRA directory ``PeftModel.from_pretrained`` loads; atomic.

    ``base_config``: an input adapter's config, for the base model reference, task type and the
    few fields listed in ``_INHERITED``. The directory is written next to ``path`` and renamed in,
    so ``path`` is never half-written (an existing ``path`` is replaced).
    """
    from peft import LoraConfig

    if not factors:
        raise ValueError(f"{path}: no modules to write")
    path = Path(path)
    config = LoraConfig(**merged_adapter_config(factors, base_config))  # peft validates the fields
    tensors = {}
    for module, f in factors.items():
        tensors[f"{_PREFIX}{module}.lora_A.weight"] = f.A.to(dtype).contiguous()
        tensors[f"{_PREFIX}{module}.lora_B.weight"] = (f.scale * f.B.float()).to(dtype).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        config.save_pretrained(str(tmp))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _replace_dir(src: Path, dst: Path) -> None:
    """Rename ``src`` to ``dst``; an existing ``dst`` is moved aside first (a directory rename cannot overwrite)."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(dst, old)
    os.replace(src, dst)
    shutil.rmtree(old, ignore_errors=True)
