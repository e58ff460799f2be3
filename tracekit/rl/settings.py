"""GRPO, LoRA and launcher settings: plain dataclasses, also the Hydra schema of
the ``grpo`` and ``launcher`` config groups (see :mod:`tracekit.schema`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from tracekit.llm.decoding import FAST_MODES
from tracekit.ranges import DTYPES, Choice, check_declared

KINDS = ("local", "deepspeed_zero2", "deepspeed_zero3")
CHECKPOINT_POLICIES = ("full", "selective")  # recompute whole layers | elementwise ops only (rl/model.py)
SAVE_ROLLOUTS = ("none", "messages", "full")  # what a run keeps of its rollouts (full: per-turn token ids too)


@dataclass
class LoraSettings:
    # LoRA on all attention and MLP projections (the paper's text). Rank 32 on these projections of Qwen3-30B-A3B
    # (all 128 experts) gives 1.69B parameters, closest to the paper's ~1.6B (5.3%)
    rank: int = 32
    alpha: int = 64
    dropout: float = 0.0
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    # nn.Parameters to adapt (peft ``target_parameters``): MoE experts fused into 3-D tensors, e.g.
    # Qwen3-MoE in transformers 5: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    target_parameters: list[str] = field(default_factory=list)

    RANGES: ClassVar[dict[str, str]] = {"rank": ">= 1", "alpha": "> 0", "dropout": "[0, 1)"}


def lora_ranges() -> dict[str, str]:
    """A recipe's ``lora.*`` ranges (its ``lora`` field is a :class:`LoraSettings`)."""
    return {f"lora.{k}": v for k, v in LoraSettings.RANGES.items()}


@dataclass
class GRPORecipe:
    """Every knob of the recipe (the ``grpo`` config group is this class plus the rollout engine), its default the
    paper's (sec. 3.4, App. A: AdamW lr 1e-5, up to 40 iterations, rollouts at T=1.0, group-normalized advantages
    with the population std, zero-variance groups dropped, clipped token-level surrogate, gradient checkpointing);
    ``conf/grpo/paper.yaml`` sets only the seed."""

    iterations: int = 40
    # 5,120 rollouts / (4 capabilities x 40 iterations) = 32 per iteration; the G x K split is not given
    groups: int = 4  # G seeds per iteration
    group_size: int = 8  # K rollouts per seed
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 512  # per assistant turn
    max_steps: int = 50  # assistant turns per episode (the paper's 50 interaction steps)
    max_prompt_tokens: int = 32000  # context budget (the paper's 32,000)
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # DAPO clip-higher; None = clip_eps (eq. (2))
    adv_eps: float = 1e-6
    kl_beta: float = 0.0  # k3 KL to the frozen base (adapter disabled); 0 = off (paper)
    old_logprobs: str = "rollout"  # rollout | recompute
    tis_cap: float | None = None  # truncated importance sampling cap; needs old_logprobs=recompute
    filter_zero_variance: bool = True
    dynamic_resampling: bool = False
    max_resample_rounds: int = 4
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # max global grad norm; 0 = no clipping
    epochs: int = 1  # passes over each rollout batch
    num_minibatches: int = 4  # optimizer steps per epoch (per rollout batch; not given by the paper)
    microbatch_tokens: int = 8192  # padded tokens per forward/backward (length bucketing)
    logprob_chunk: int = 1024  # rows of the [tokens x vocab] logits alive at once
    rollout_batch_size: int = 64  # sequences per generate call (hf engine)
    gradient_checkpointing: bool = True  # the paper's recipe (and every run's before the default moved here)
    # between an iteration's rollouts and its update: drop the rollout engine's fast decoder (merged weight
    # copy, static KV cache; rebuilt from the current weights at the next rollouts) and hand freed memory
    # back to the OS (gc + malloc_trim): the update then runs beside one copy of the weights, not two (not a paper
    # setting)
    release_rollout_memory: bool = False
    # full (recompute whole layers) | selective (recompute elementwise ops only; faster on 8B+)
    checkpoint_policy: str = "full"
    fused_update_kernels: bool = True  # LoRA as bf16 addmm (fp32 master weights), fused RMSNorm (rl/fused.py)
    # torch.compile the decoder layers of the update, checkpointing inside (~12 s compile; 1.7B selective: 16.6% ->
    # 37.0% MFU)
    compile_update: bool = False
    rollout_fast: str = "auto"  # hf engine: adapter merged into a working copy, static KV cache: auto | on | off
    rollout_cuda_graphs: bool = True  # hf engine: CUDA-graph decode steps (CUDA, dense MLPs)
    # hf engine: torch.compile the fast decoder's layers (bmm attention; ~5 s compile, +20% decode at Qwen3-1.7B b64)
    rollout_compile: bool = False
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    seed: int = 0
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    # run health and control (none is a paper setting; the defaults, off, are the paper's recipe):
    # health_kl_ref: with kl_beta = 0, still measure kl_ref (k3 KL of the policy to the frozen base) at the
    # cost of one no-grad forward of the batch with the adapter disabled; off: the kl_ref cell stays empty
    health_kl_ref: bool = False
    # skip_saturated: a task (env/id) whose most recent group was solved by every sample (all successes, one
    # reward) is retired: later draws (the next rounds and iterations) pick from the other tasks, or from all
    # tasks when every task is retired (counted as retired_fallbacks); a retired task drawn that way and not
    # saturated again comes back. The record is saved in the checkpoints (exact resume).
    skip_saturated: bool = False
    # early_stop_patience = p > 0 stops training after iteration t when either
    #   (a) the last p iterations had no informative group (so, with the zero-variance filter, no optimizer step), or
    #   (b) the moving average of reward_mean over p iterations (m_t = mean of iterations t-p+1..t, defined from
    #       t = p-1) last set a new best (m > previous best + early_stop_min_delta; the first m_t is a best) at
    #       an iteration b with t - b >= p. With skip_saturated, reward_mean is the pool's (grpo.pool_reward:
    #       retired tasks count as solved), since the drawn tasks get harder as the solved ones retire.
    # 0 = off: always run all iterations.
    early_stop_patience: int = 0
    early_stop_min_delta: float = 0.0
    lora: LoraSettings = field(default_factory=LoraSettings)

    # the value ranges, checked here and by tracekit.validate for the grpo group (one check per knob)
    RANGES: ClassVar[dict[str, str]] = {
        "iterations": ">= 1", "groups": ">= 1", "group_size": ">= 2", "temperature": "> 0", "top_p": "(0, 1]",
        "max_new_tokens": ">= 1", "max_steps": ">= 1", "max_prompt_tokens": ">= 256", "clip_eps": "(0, 1)",
        "clip_eps_high": "> 0", "adv_eps": "> 0", "kl_beta": ">= 0", "tis_cap": ">= 1", "max_resample_rounds": ">= 0",
        "lr": "> 0", "betas": "[0, 1)", "weight_decay": ">= 0", "max_grad_norm": ">= 0", "epochs": ">= 1",
        "num_minibatches": ">= 1", "microbatch_tokens": ">= 1", "logprob_chunk": ">= 1", "rollout_batch_size": ">= 1",
        "seed": ">= 0", "checkpoint_every": ">= 1", "keep_checkpoints": ">= 1", "early_stop_patience": ">= 0",
        "early_stop_min_delta": ">= 0", **lora_ranges()}  # fmt: skip
    CHOICES: ClassVar[dict[str, Choice]] = {
        "old_logprobs": ("rollout", "recompute"), "checkpoint_policy": CHECKPOINT_POLICIES, "rollout_fast": FAST_MODES,
        "dtype": DTYPES}

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        check_declared("grpo", self)
        checks = [
            (self.tis_cap is None or self.old_logprobs == "recompute", "tis_cap", "null unless old_logprobs=recompute"),
            (isinstance(self.release_rollout_memory, bool), "release_rollout_memory", "true or false"),
            (isinstance(self.health_kl_ref, bool), "health_kl_ref", "true or false"),
            (isinstance(self.skip_saturated, bool), "skip_saturated", "true or false"),
            (isinstance(self.early_stop_patience, int) and not isinstance(self.early_stop_patience, bool),
             "early_stop_patience", "an integer >= 0 (0 = off)"),
        ]
        for ok, key, valid in checks:
            if not ok:
                raise ValueError(f"grpo.{key}={getattr(self, key)!r} is invalid: must be {valid}")


@dataclass
class GRPOSettings(GRPORecipe):
    """The recipe plus what one run keeps of its rollouts: a run's own choice, not the ``grpo`` group's (tracekit's
    runs keep them ``full``: the MoE gate's and SFT's data)."""

    save_rollouts: str = "messages"  # none | messages | full (full keeps per-turn token ids)

    CHOICES: ClassVar[dict[str, Choice]] = {**GRPORecipe.CHOICES, "save_rollouts": SAVE_ROLLOUTS}


@dataclass
class LauncherSettings:
    kind: str = "local"  # local | deepspeed_zero2 | deepspeed_zero3
    nproc: int = 1  # processes (GPUs, or CPU processes over gloo)
    command: str = "torchrun"  # torchrun | deepspeed
    master_port: int | None = None  # None: a free port
    # capability GRPO runs trained at once by the train stage, each in its own process (one small model uses a
    # sliver of a GPU, e.g. 4 on one H200 for a 135M backbone; the env steps of several runs fill the CPU cores); 1:
    # one after another, in process. Same adapters either way (tests/test_train_concurrent.py)
    concurrent_runs: int = 1

    RANGES: ClassVar[dict[str, str]] = {"nproc": ">= 1", "master_port": "[1, 65535]", "concurrent_runs": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"kind": KINDS, "command": ("torchrun", "deepspeed")}

    def __post_init__(self) -> None:
        check_declared("launcher", self)

    @property
    def zero_stage(self) -> int:
        return {"local": 0, "deepspeed_zero2": 2, "deepspeed_zero3": 3}[self.kind]
