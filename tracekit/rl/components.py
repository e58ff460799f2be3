"""Training components the three recipes share: GRPO (:mod:`tracekit.rl.trainer`), SFT
(:mod:`tracekit.rl.sft`) and on-policy distillation (:mod:`tracekit.rl.distill`).

- :func:`place_model` and :func:`seed_everything`: the device, dtype and global RNGs of a fresh run;
- :class:`LocalBackend`: AdamW on the trainable (adapter) parameters, gradient clipping in ``step``
  (``tracekit.rl.launch`` provides the DeepSpeed backend with the same interface);
- :func:`save_checkpoint` / :func:`load_checkpoint`: adapter, optimizer, every RNG and the last completed
  index, written atomically under ``root/iter_<index>`` with ``root/latest.json``, so a killed run resumes
  to the same numbers (rank-aware: under ZeRO every rank saves its optimizer shard and RNG state);
- :class:`MetricsCSV`: a per-iteration metrics file, rewritten atomically, trimmed on resume;
- :func:`save_peft_adapter` and :func:`atomic_dir`: peft adapters that are never half-written.

The model-side components (peft build, sequence log-probs, checkpointed layers) live beside the GRPO
update in :mod:`tracekit.rl.trainer`, and token bookkeeping in :mod:`tracekit.rl.tokens`.
"""

from __future__ import annotations

import csv
import io
import logging
import os
import random
import shutil
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracekit.artifacts import atomic_write_json, atomic_write_text, full_disk_named, read_json

log = logging.getLogger(__name__)


def place_model(model: torch.nn.Module, device: str | torch.device | None, dtype: str) -> tuple[torch.nn.Module, torch.device]:
    """Move ``model`` to ``device`` (default: cuda if available) in ``dtype`` (auto: bf16 on GPU, fp32 on CPU)."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    auto = torch.bfloat16 if dev.type == "cuda" else torch.float32
    dt = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    return model.to(device=dev, dtype=dt), dev


def seed_everything(seed: int, rank: int = 0) -> None:
    """Python's, numpy's and torch's global RNGs of a fresh run (LoRA dropout draws from torch's; each
    data-parallel rank its own stream)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed + rank)


class LocalBackend:
    """AdamW on the adapter's parameters in this process (torch's fused multi-tensor kernel when they are all
    on CUDA: a few launches instead of a dozen per tensor group, the optimizer's host time off the step).
    ``s`` has ``lr``, ``betas``, ``weight_decay`` and ``max_grad_norm`` (the GRPO, SFT and distillation settings)."""

    loss_scale = 1.0

    def __init__(self, model: torch.nn.Module, s: Any):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.max_grad_norm = s.max_grad_norm
        fused = bool(self.params) and all(p.is_cuda for p in self.params)
        self.opt = torch.optim.AdamW(self.params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay, fused=fused or None)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        loss.backward()

    def step(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm if self.max_grad_norm > 0 else float("inf"))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(norm)

    def save(self, d: Path, rank: int) -> None:
        torch.save(self.opt.state_dict(), d / "optimizer.pt")

    def load(self, d: Path, rank: int) -> None:
        self.opt.load_state_dict(torch.load(d / "optimizer.pt", map_location="cpu", weights_only=True))


def rng_state() -> dict[str, Any]:
    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def atomic_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Write a directory via a temp sibling and renames (never a half-written ``final``)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with full_disk_named(final):
            write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def save_peft_adapter(model: torch.nn.Module, path: str | Path, adapter_name: str = "default") -> None:
    """peft ``save_pretrained`` of one adapter into ``path``, atomically. ``default`` is peft's flat
    layout (``adapter_config.json`` at ``path``); other adapters of the model are not written."""

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp), selected_adapters=[adapter_name])
        if adapter_name != "default":  # peft nests non-default adapters in a sub-folder: flatten
            for p in (tmp / adapter_name).iterdir():
                os.replace(p, tmp / p.name)
            (tmp / adapter_name).rmdir()

    atomic_dir(Path(path), write)


def adapter_state(model: torch.nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """One adapter's tensors (peft names), on CPU."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(model, adapter_name=adapter_name).items()}


def save_checkpoint(
    root: Path,
    index: int,
    model: torch.nn.Module,
    backend: Any,
    state: dict[str, Any],
    keep: int,
    *,
    adapter_name: str = "default",
    rank: int = 0,
    barrier: Callable[[], None] = lambda: None,
    gathered: Callable[[], AbstractContextManager] = nullcontext,
) -> None:
    """Adapter, optimizer, RNG states and ``index`` (the last completed iteration or step) under
    ``root/iter_<index>``, then ``root/latest.json`` (``{"iteration", "dir"}``); only the newest ``keep`` are
    kept. Every rank enters: rank 0 writes the adapter (inside ``gathered``: ZeRO-3 shards gathered) and the
    state, each rank its optimizer shard and RNG state; the directory appears whole or not at all."""
    final, tmp = root / f"iter_{index:05d}", root / f".iter_{index:05d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    try:
        with full_disk_named(final), gathered():
            if rank == 0:
                save_peft_adapter(model, tmp / "adapter", adapter_name)
                atomic_write_json(tmp / "state.json", {"iteration": index, **state})
        with full_disk_named(final):
            backend.save(tmp, rank)
            torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    except BaseException:
        if rank == 0:  # the unfinished checkpoint's space back (the previous one stays the one to resume from)
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # an unreferenced leftover of a killed run
        os.replace(tmp, final)
        atomic_write_json(root / "latest.json", {"iteration": index, "dir": final.name})
        for p in sorted(p for p in root.glob("iter_*") if p.is_dir())[:-keep]:
            shutil.rmtree(p, ignore_errors=True)
    barrier()


def load_checkpoint(
    root: Path, model: torch.nn.Module, backend: Any, *, adapter_name: str = "default", rank: int = 0,
) -> int | None:
    """Restore ``root/latest.json``'s checkpoint (adapter, optimizer, this rank's RNG); -> its index, or None
    if there is none. A backend with ``restores_module`` (DeepSpeed) restores the adapter itself."""
    latest = root / "latest.json"
    if not latest.exists():
        return None
    meta = read_json(latest)
    d = root / meta["dir"]
    if not getattr(backend, "restores_module", False):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(str(d / "adapter" / "adapter_model.safetensors")), adapter_name=adapter_name)
    backend.load(d, rank)
    set_rng_state(torch.load(d / f"rng_rank{rank}.pt", weights_only=False))
    log.info("resumed from %s", d)
    return int(meta["iteration"])


class MetricsCSV:
    """``metrics.csv`` with fixed columns, rewritten atomically after each row; on resume the rows
    past the checkpoint (written by the killed run after its last checkpoint) are dropped."""

    def __init__(self, path: Path, columns: Sequence[str], index: str = "iteration"):
        self.path, self.columns, self.index = Path(path), list(columns), index
        self.rows: list[dict[str, Any]] = []

    def keep_through(self, last: int) -> None:
        if self.path.exists():
            rows = list(csv.DictReader(io.StringIO(self.path.read_text())))
            self.rows = [r for r in rows if int(r[self.index]) <= last]

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore")
        w.writeheader()
        for r in self.rows:
            w.writerow({k: r.get(k, "") for k in self.columns})
        atomic_write_text(self.path, buf.getvalue())
