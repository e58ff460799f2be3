"""Launchers for GRPO training: in-process (``local``) or DeepSpeed ZeRO in a subprocess.

``train(spec, launcher)`` is what the train stage calls. For ``deepspeed_zero2`` /
``deepspeed_zero3`` it writes the resolved spec to ``<out>/train_spec.json`` and runs
``torchrun --nproc_per_node N -m tracekit.rl.launch --spec <file>`` (or the ``deepspeed``
launcher), so the calling Hydra job stays single-process; each worker builds the model and the
environment from the spec's factories, wraps the peft model in a DeepSpeed engine (ZeRO stage 2 or
3, torch AdamW) and runs the same :class:`GRPOTrainer` loop data-parallel. The per-iteration
metrics come back through ``metrics.csv`` and are replayed to the callbacks when the run ends.

Factories are ``"module:function"`` strings (JSON-able, importable in a fresh process): the model
factory returns ``(model, tokenizer)``, the env factory an :class:`EnvSuite`.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tracekit.artifacts import atomic_write_json, read_json
from tracekit.envs.pool import REPLY_TIMEOUT_S, SuiteSpec, pooled
from tracekit.episodes import INFRA_RETRIES
from tracekit.llm.backbones import backbone_source_modules, import_backbone_sources
from tracekit.llm.decoding import causal_lm_of
from tracekit.llm.hf import HFChatClient
from tracekit.ports import free_port
from tracekit.rl.engines import ClientEngine
from tracekit.rl.fused import set_fused_update_kernels
from tracekit.rl.settings import LauncherSettings
from tracekit.rl.model import Dist
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer
from tracekit.rl.vllm_client import VLLMEngine, VLLMSettings, check_recipe

log = logging.getLogger(__name__)


@dataclass
class Factory:
    target: str  # "package.module:function"
    kwargs: dict[str, Any] = field(default_factory=dict)

    def function(self) -> Callable[..., Any]:
        """The factory's function (imported now)."""
        mod, _, fn = self.target.partition(":")
        if not fn:
            raise ValueError(f"factory {self.target!r} must be 'module:function'")
        try:
            return getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"factory {self.target!r} cannot be imported: {e}") from e

    def build(self) -> Any:
        return self.function()(**self.kwargs)


@dataclass
class TrainSpec:
    """Everything a (possibly separate) process needs to train one adapter."""

    model: Factory  # -> (model, tokenizer)
    env: Factory  # -> EnvSuite
    out_dir: str
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    chat_format: str = "qwen3"  # the backbone's tool-call syntax (backbone.chat_format)
    engine: dict[str, Any] = field(default_factory=lambda: {"kind": "hf"})  # or {"kind": "vllm", **VLLMSettings}
    env_workers: Any = 0  # rollout.env_workers: the env Factory's suite stepped in worker processes (tracekit.envs.pool)
    env_reply_timeout: float | None = REPLY_TIMEOUT_S  # rollout.env_reply_timeout_s: a silent worker is killed
    env_infra_retries: int = INFRA_RETRIES  # rollout.infra_retries: an episode's runs again after an infra failure
    # the modules that registered backbone sources in the process that made the spec (a planted backbone's builder:
    # llm.backbones' hook), imported again by a training subprocess before it builds the model
    backbone_sources: list[str] = field(default_factory=backbone_source_modules)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainSpec:
        return cls(
            model=Factory(**d["model"]),
            env=Factory(**d["env"]),
            out_dir=d["out_dir"],
            grpo=GRPOSettings(**d["grpo"]),
            chat_format=d.get("chat_format", "qwen3"),
            engine=dict(d.get("engine") or {"kind": "hf"}),
            env_workers=d.get("env_workers", 0),
            env_reply_timeout=d.get("env_reply_timeout", REPLY_TIMEOUT_S),
            env_infra_retries=d.get("env_infra_retries", INFRA_RETRIES),
            backbone_sources=list(d.get("backbone_sources", [])),
        )


def deepspeed_config(stage: int, s: GRPOSettings, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config for ZeRO ``stage``: torch AdamW (no cpu_adam JIT build), our grad clip.

    Micro-batching is ours (token-budget microbatches, boundary set per backward), so DeepSpeed's
    own accumulation is 1 and its batch sizes are nominal.
    """
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": False, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": s.lr, "betas": list(s.betas), "eps": 1e-8, "weight_decay": s.weight_decay, "torch_adam": True},
        },
        "zero_optimization": zero,
        "bf16": {"enabled": bool(bf16)},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if s.max_grad_norm > 0:
        cfg["gradient_clipping"] = s.max_grad_norm
    return cfg


class DeepSpeedBackend:
    """The optimizer side of :class:`GRPOTrainer` under a DeepSpeed ZeRO engine."""

    restores_module = True  # load_checkpoint brings the adapter weights back

    def __init__(self, model: torch.nn.Module, s: GRPOSettings, stage: int, world: int):
        import deepspeed

        self.stage = stage
        if stage == 3:
            # ZeRO-3 gathers a module's parameters in that module's forward hooks; the fused LoRA
            # forward reads lora_A/lora_B weights without calling those modules (shape-[0] partitions).
            if set_fused_update_kernels(causal_lm_of(model), False):
                log.info("ZeRO-3: fused update kernels off (they bypass per-module parameter gathering)")
        self.params = [p for p in model.parameters() if p.requires_grad]
        bf16 = torch.cuda.is_available() and s.dtype != "float32"
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=self.params, config=deepspeed_config(stage, s, bf16))
        # DeepSpeed averages gradients over ranks; our per-rank loss is already a share of the
        # global sum (eq. (2)'s 1/|B| uses the global count), so scale back by the world size.
        self.loss_scale = float(world)

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        # DeepSpeedEngine.forward() starts every micro-step by clearing the ZeRO optimizer's
        # backward flags, and ZeRO-3 counts micro-steps there: without it each micro-step's
        # gradient partition overwrites the previous one instead of accumulating. Our forward
        # calls the module directly, so do it here (after the forward, before its backward).
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def gathered_adapter(self):
        if self.stage != 3:
            return nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(self.params, modifier_rank=None)

    def save(self, d: Path, rank: int) -> None:
        self.engine.save_checkpoint(str(d / "deepspeed"), tag="state", save_latest=False, exclude_frozen_parameters=True)

    def load(self, d: Path, rank: int) -> None:
        path, _ = self.engine.load_checkpoint(str(d / "deepspeed"), tag="state", load_module_strict=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed checkpoint under {d / 'deepspeed'} could not be loaded")


def check_supported(spec: TrainSpec, zero_stage: int, world: int) -> None:
    """Refuse combinations that are not built (before any process starts).

    ZeRO-3 gathers each module's parameters with collectives in every forward, so all ranks must
    run the same number of forwards. The hf engine's rollouts do not (a rank whose sequences all
    stopped, or whose episodes ended, skips decode steps the others run, and the others wait
    forever), nor does the trainer's re-scoring for ``old_logprobs=recompute`` / ``kl_beta > 0``
    (each rank packs its own rows into its own number of microbatches).
    """
    if zero_stage == 3 and world > 1 and spec.engine.get("kind", "hf") == "hf":
        raise NotImplementedError(
            "launcher=deepspeed_zero3 with nproc > 1 and grpo.engine=hf is not built: rollouts need "
            "rank-synchronized decoding (every rank runs a forward until all ranks are done) or the full "
            "weights gathered for generation; use launcher=deepspeed_zero2, or nproc=1"
        )


def _engine_factory(spec: TrainSpec, dist: Dist) -> Callable[[torch.nn.Module, Any], Any] | None:
    """The rollout engine the spec asks for (None: the trainer's default hf engine)."""
    kind = spec.engine.get("kind", "hf")
    if kind == "hf":
        return None
    if kind == "agent":  # the evaluated agent's chat client (its tool-call grammar included) on the live model
        options = {k: v for k, v in spec.engine.items() if k != "kind"}
        if options.get("constrained_tool_calls") and spec.grpo.old_logprobs == "rollout":
            # a grammar-masked sampler reports masked log-probs; the policy's own must be recomputed
            raise ValueError("grpo.engine=agent with constrained tool calls needs grpo.old_logprobs=recompute")
        return lambda model, tok: ClientEngine(HFChatClient(model, tok, chat_format=spec.chat_format, **options))
    if kind == "vllm":
        if dist.active:
            raise NotImplementedError("grpo.engine=vllm under a multi-process launcher is not built: use launcher=local with vllm")

        s = VLLMSettings(**{k: v for k, v in spec.engine.items() if k != "kind"})
        check_recipe(s, spec.grpo.lora.rank, spec.grpo.temperature, spec.grpo.old_logprobs)  # validate() checks it too
        work = Path(spec.out_dir) / "vllm"
        return lambda model, tok: VLLMEngine(s, tok, work, chat_format=spec.chat_format, max_prompt_tokens=spec.grpo.max_prompt_tokens,
                                             lora_rank=spec.grpo.lora.rank)
    raise ValueError(f"grpo.engine={kind!r} is invalid: must be hf, agent or vllm")


def run_training(
    spec: TrainSpec,
    *,
    dist: Dist | None = None,
    backend_factory: Callable[..., Any] | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    device: str | None = None,
) -> Path:
    """Build model, tokenizer and env from the spec's factories and train in this process."""
    dist = dist or Dist()
    factory = _engine_factory(spec, dist)

    model, tokenizer = spec.model.build()
    suite = spec.env.build()
    # GRPO rollouts go through the episode core (tracekit.rl.episodes.run_episodes): a pooled suite steps there too
    with pooled(suite, SuiteSpec(spec.env.function(), kwargs=dict(spec.env.kwargs)), spec.env_workers,
                share=dist.world, reply_timeout=spec.env_reply_timeout) as stepped:
        trainer = GRPOTrainer(
            model, tokenizer, stepped, spec.grpo, spec.out_dir, chat_format=spec.chat_format, engine_factory=factory,
            backend_factory=backend_factory, dist=dist, callbacks=callbacks, device=device,
            infra_retries=spec.env_infra_retries,
        )  # fmt: skip
        try:
            return trainer.train()
        finally:
            trainer.engine.close()


def launch_command(spec_path: Path, launcher: LauncherSettings) -> list[str]:
    """The subprocess command line: one plain process for ``local``, else a DeepSpeed launcher."""
    if launcher.kind == "local":
        return [sys.executable, "-m", "tracekit.rl.launch", "--spec", str(spec_path), "--local"]
    port = str(launcher.master_port or free_port())
    if launcher.command == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
            f"--nproc_per_node={launcher.nproc}", f"--master_port={port}",
            "-m", "tracekit.rl.launch", "--spec", str(spec_path), "--zero-stage", str(launcher.zero_stage),
        ]  # fmt: skip
    return [
        "deepspeed", f"--num_gpus={launcher.nproc}", f"--master_port={port}",
        "--module", "tracekit.rl.launch", "--spec", str(spec_path), "--zero-stage", str(launcher.zero_stage),
    ]  # fmt: skip


def train(
    spec: TrainSpec,
    launcher: LauncherSettings | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
    timeout_s: float | None = None,
    isolate: bool = False,
) -> Path:
    """Train one adapter; returns ``<out_dir>/adapter`` (peft format). See the module docstring.

    ``isolate`` runs a ``local`` launcher's training in a subprocess of its own (the train stage's concurrent
    capability runs: each gets an equal share of the CPU cores for its torch threads)."""
    launcher = launcher or LauncherSettings()
    if launcher.kind == "local" and not isolate:
        return run_training(spec, callbacks=callbacks)
    if launcher.kind != "local":
        check_supported(spec, launcher.zero_stage, launcher.nproc)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "train_spec.json"
    atomic_write_json(spec_path, spec.to_json())
    cmd = launch_command(spec_path, launcher)
    env = dict(os.environ)
    if launcher.kind == "local":  # the machine's cores shared among the concurrent runs
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // launcher.concurrent_runs))
    root = str(Path(__file__).resolve().parents[2])  # the repo root, for an uninstalled checkout
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    log_path = out / "train_launch.log"
    log.info("launching %s (log: %s)", " ".join(cmd), log_path)
    with open(log_path, "ab") as logf:
        proc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty log)"]
        raise RuntimeError(f"{launcher.kind} training exited with code {proc.returncode}: {tail[0][:300]} (full log: {log_path})")
    metrics = out / "metrics.csv"
    if metrics.exists():
        for row in csv.DictReader(io.StringIO(metrics.read_text())):
            for cb in callbacks:
                cb({k: _num(v) for k, v in row.items()})
    return out / "adapter"


def _num(v: str) -> Any:
    try:
        f = float(v)
    except ValueError:
        return v
    return int(f) if f.is_integer() and "." not in v else f


def init_worker() -> tuple[Dist, str]:
    """Join the torchrun/deepspeed process group (NCCL on GPUs, gloo on CPU); returns (dist, device)."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise SystemExit(f"{key} is not set: run this under torchrun or deepspeed")
    import deepspeed

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    dist = Dist(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]))
    return dist, f"cuda:{os.environ['LOCAL_RANK']}" if cuda else "cpu"


def finish_worker() -> None:
    """Wait for every rank, then leave the process group."""
    import torch.distributed as td

    td.barrier()
    td.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    """Worker entry point under torchrun/deepspeed: one rank of a ZeRO data-parallel run."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--zero-stage", type=int, choices=(2, 3))
    ap.add_argument("--local", action="store_true", help="one process, no process group (concurrent runs)")
    ap.add_argument("--local_rank", type=int, default=None)  # the deepspeed launcher passes it
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = TrainSpec.from_json(read_json(args.spec))
    import_backbone_sources(spec.backbone_sources)  # the parent's backbone sources, registered here too
    if args.local:
        run_training(spec)
        return
    if args.zero_stage is None:
        ap.error("--zero-stage is required without --local")
    check_supported(spec, args.zero_stage, int(os.environ.get("WORLD_SIZE", "1")))
    dist, device = init_worker()
    run_training(
        spec,
        dist=dist,
        backend_factory=lambda model, s: DeepSpeedBackend(model, s, args.zero_stage, dist.world),
        device=device,
    )
    finish_worker()


if __name__ == "__main__":
    main()
