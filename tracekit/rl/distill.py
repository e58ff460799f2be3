"""On-policy distillation of per-capability teachers into one student adapter (paper App. C).

"On-Policy Distillation trains a LoRA teacher for each synthetic capability environment, then trains
one student LoRA on a uniform mix by having the student generate on-policy rollouts and match the
relevant teacher's token-level distributions (Lu and Lab, 2025)." The method is Thinking Machines'
(tinker-cookbook ``distillation/train_on_policy.py``): the student samples, the teacher scores the
same tokens, and the per-token reverse KL is the (negative) advantage of a policy-gradient step.

One iteration, top to bottom (:func:`train_distill`):

1. sync the student adapter to the rollout engine (hf: re-merge; vllm: save + runtime load);
2. draw ``groups`` tasks, each from an environment drawn uniformly (seeded by (seed, iteration)),
   and run ``samples_per_task`` episodes of each with the student at ``temperature``; every turn's
   prompt ids, sampled ids and the sampler's log-probs are recorded (``episodes.run_episodes``);
3. exact training rows (``tokens.rows_for_trajectory``); the teacher of each episode's environment
   scores the same tokens (its adapter switched on over the shared backbone, eval mode, no grad);
4. per-token advantage ``A_t = -kl_coef * (log pi_sampler(a_t) - log pi_teacher(a_t))`` on the
   sampled tokens (reverse KL, single-sample estimate, no discount; the student's log-probs are the
   sampler's, detached), :func:`distill_advantages`;
5. for each minibatch: ``loss = -sum_t w_t exp(logp_theta(a_t) - logp_sampler(a_t)) A_t`` with
   ``w_t = 1 / N`` (N: sampled tokens of the minibatch), :func:`importance_sampled_loss` ->
   backward (length-bucketed microbatches) -> clip -> AdamW on the student adapter;
6. a metrics row (reverse KL overall and per environment, budget columns); a checkpoint every
   ``checkpoint_every`` iterations.

Normalization: the loss is the token mean over the minibatch (every sampled token weighs the same;
a long episode weighs by its length, as in the cookbook's token sum, divided by the count so that the
step size does not depend on how many tokens were sampled).

Teachers: one PeftModel holds the backbone once, the student as adapter ``default`` (trainable; peft's
flat save layout, so ``adapter/`` loads like any GRPO adapter) and each teacher as a frozen adapter
(``teacher0``, ``teacher1``, ... by sorted environment name) loaded from its GRPO adapter dir with
``load_adapter``; scoring switches the active adapter (:func:`active_adapter`) and back. A LoRA
teacher costs its adapter's parameters only (~5% of the backbone each at the paper's scale), where a
frozen copy per teacher would cost a whole backbone each. The teachers must be adapters of the same
backbone.

Temperatures: the sampler's log-probs are those of the sampling distribution (``temperature``); the
teacher is scored at temperature 1 (its own distribution, as the cookbook's ``compute_logprobs``).
With the default temperature 1.0 the two coincide and A_t is exactly minus the per-token reverse KL.

Defaults and why: LoRA r 32 and kl_coef 1 (the cookbook's); lr 1e-4 (the cookbook's distillation
recipes for LoRA students); temperature 1.0 (the cookbook's, and the GRPO rollouts'); 4 tasks x 8
samples per iteration and 40 iterations (the GRPO recipe's G x K and iterations: the same episodes
per iteration, so budgets match by default); one optimizer step per iteration (the cookbook's
``num_substeps=1``: then the importance ratio is 1 up to sampler/trainer numerics).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from tracekit.artifacts import write_jsonl
from tracekit.envs.base import EnvSuite
from tracekit.llm.decoding import FAST_MODES, causal_lm_of
from tracekit.llm.hf import padding_id
from tracekit.rl.components import (LocalBackend, MetricsCSV, load_checkpoint, place_model,
                                    save_checkpoint, save_peft_adapter, seed_everything)
from tracekit.rl.engines import HFEngine
from tracekit.rl.episodes import EpisodeSpec, run_episodes
from tracekit.rl.fused import set_fused_update_kernels
from tracekit.ranges import DTYPES, Choice, check_declared
from tracekit.rl.settings import SAVE_ROLLOUTS, LoraSettings, lora_ranges
from tracekit.rl.tokens import PolicyRow, Turn, collate, pack_microbatches, rows_for_trajectory
from tracekit.rl.model import build_peft_model, sequence_logprobs, set_activation_checkpointing
from tracekit.types import Trajectory, stable_hash

log = logging.getLogger(__name__)

STUDENT = "default"  # peft's default adapter name: save_pretrained writes it flat, like a GRPO adapter


@dataclass
class DistillSettings:
    """Every knob of the on-policy distillation recipe."""

    lr: float = 1e-4
    iterations: int = 40
    groups: int = 4  # tasks per iteration (each from a uniformly drawn environment)
    samples_per_task: int = 8  # student episodes per task
    temperature: float = 1.0
    top_p: float = 1.0
    kl_coef: float = 1.0
    max_new_tokens: int = 512  # per assistant turn
    max_steps: int = 50  # assistant turns per episode
    max_prompt_tokens: int = 32000
    num_minibatches: int = 1  # optimizer steps per iteration (the cookbook's num_substeps)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 = no clipping
    microbatch_tokens: int = 8192
    logprob_chunk: int = 1024
    rollout_batch_size: int = 64  # sequences per generate call (hf engine)
    rollout_fast: str = "auto"  # hf engine: merged-weight fast decoding: auto | on | off
    gradient_checkpointing: bool = False
    fused_update_kernels: bool = True  # as GRPO's: LoRA as bf16 addmm, fused RMSNorm (rl/fused.py)
    dtype: str = "auto"
    seed: int = 0
    checkpoint_every: int = 5
    keep_checkpoints: int = 2
    save_rollouts: str = "messages"  # none | messages | full (full keeps per-turn token ids)
    lora: LoraSettings = field(default_factory=LoraSettings)  # r 32 / alpha 64

    # checked here and by tracekit.validate for the consolidation.distill group (one check per knob)
    RANGES: ClassVar[dict[str, str]] = {
        "lr": "> 0", "iterations": ">= 1", "groups": ">= 1", "samples_per_task": ">= 1", "temperature": "> 0",
        "top_p": "(0, 1]", "kl_coef": "> 0", "max_new_tokens": ">= 1", "max_steps": ">= 1",
        "max_prompt_tokens": ">= 256", "num_minibatches": ">= 1", "betas": "[0, 1)", "weight_decay": ">= 0",
        "max_grad_norm": ">= 0", "microbatch_tokens": ">= 1", "logprob_chunk": ">= 1", "rollout_batch_size": ">= 1",
        "seed": ">= 0", "checkpoint_every": ">= 1", "keep_checkpoints": ">= 1", **lora_ranges()}  # fmt: skip

    CHOICES: ClassVar[dict[str, Choice]] = {"rollout_fast": FAST_MODES, "dtype": DTYPES, "save_rollouts": SAVE_ROLLOUTS}

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            self.lora = LoraSettings(**self.lora)
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        check_declared("distill", self)


DISTILL_METRIC_COLUMNS = [
    "iteration", "reverse_kl", "reward_mean", "success_rate", "loss", "ratio_mean", "grad_norm",
    "optimizer_steps", "tokens_generated", "episodes", "tokens_forward", "rows",
    "time_rollout_s", "time_teacher_s", "time_update_s", "time_total_s",
]  # fmt: skip
# + one reverse_kl/<env> column per environment. optimizer_steps / tokens_generated / episodes are per
# iteration: summed over the file they give the run's budget (as for GRPO's metrics.csv).


# --------------------------------------------------------------------------------------------
# The math (pure functions)


def distill_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """``A_t = -coef * (log pi_student(a_t) - log pi_teacher(a_t))`` on sampled tokens, 0 elsewhere.

    Any shape (all three alike); ``student_logp`` are the sampler's log-probs of the sampled tokens
    (the result carries no gradient). Off the mask the log-probs may be anything (even inf).
    """
    diff = student_logp.detach().float() - teacher_logp.detach().float()
    return torch.where(mask > 0, -coef * diff, torch.zeros_like(diff))


def importance_sampled_loss(
    logp: torch.Tensor, sampler_logp: torch.Tensor, advantages: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """``-sum_t w_t * exp(logp_t - sampler_logp_t) * A_t`` (scalar; differentiable in ``logp`` only).

    The importance ratio corrects for the sampler differing from the policy being trained (a later
    minibatch, or engine numerics); with ``w_t = 1/N`` it is the token mean. Tokens with weight 0
    contribute nothing whatever their log-probs.
    """
    ratio = torch.exp(logp - sampler_logp.detach())
    term = weights * ratio * advantages.detach()
    return -torch.where(weights > 0, term, torch.zeros_like(term)).sum()


# --------------------------------------------------------------------------------------------
# Teachers as frozen adapters on the student's backbone


def teacher_adapter_dir(path: str | Path) -> Path:
    """The peft adapter folder of a GRPO artifact dir (``<dir>/adapter``) or of an adapter dir itself."""
    p = Path(path)
    for d in (p / "adapter", p):
        if (d / "adapter_config.json").exists():
            return d
    raise ValueError(f"teacher {p}: no adapter_config.json in it or in its adapter/ (not a peft adapter)")


def attach_teachers(model: torch.nn.Module, teachers: Mapping[str, str | Path]) -> dict[str, str]:
    """Load each teacher as a frozen adapter of ``model`` (a PeftModel whose active adapter stays
    the student); -> {env: adapter name}."""
    names = {}
    for i, env in enumerate(sorted(teachers)):
        name = f"teacher{i}"
        model.load_adapter(str(teacher_adapter_dir(teachers[env])), adapter_name=name, is_trainable=False)
        names[env] = name
    model.set_adapter(STUDENT)  # the student active and trainable, every teacher frozen
    return names


@contextmanager
def active_adapter(model: torch.nn.Module, name: str) -> Iterator[None]:
    """``name`` as the active adapter (frozen), then the student again (active, trainable)."""
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter(STUDENT)


@torch.no_grad()
def score_rows(
    model: torch.nn.Module, rows: Sequence[PolicyRow], pad_id: int, device: torch.device, *,
    temperature: float = 1.0, microbatch_tokens: int = 8192, chunk: int = 1024,
) -> list[torch.Tensor]:  # fmt: skip
    """Per-row log-probs of the generated tokens under ``model`` as it is (eval mode), on CPU, float32."""
    out: list[torch.Tensor | None] = [None] * len(rows)
    was_training = model.training
    model.eval()
    for idx in pack_microbatches([len(r) for r in rows], microbatch_tokens):
        b = collate([rows[i] for i in idx], pad_id)
        lp = sequence_logprobs(model, b.input_ids.to(device), b.attention_mask, b.loss_mask, temperature=temperature, chunk=chunk)
        counts = (b.loss_mask[:, 1:] > 0).sum(1).tolist()
        for i, piece in zip(idx, torch.split(lp.float().cpu(), counts)):
            out[i] = piece
    model.train(was_training)
    return out  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# Rollouts


def environments(suite: EnvSuite) -> list[str]:
    """The environments a suite's tasks belong to (``Task.env``), sorted."""
    envs = sorted({t.env for t in suite.tasks()})
    if not envs:
        raise ValueError(f"environment {suite.name} has no tasks")
    return envs


def sample_specs(suite: EnvSuite, s: DistillSettings, it: int) -> list[EpisodeSpec]:
    """``s.groups`` tasks (environment uniform, then task uniform within it, then an env seed), each
    ``s.samples_per_task`` times: a function of (seed, iteration) only."""
    tasks = suite.tasks()
    envs = environments(suite)
    by_env = {e: [t for t in tasks if t.env == e] for e in envs}
    rng = random.Random(int(stable_hash([s.seed, it, "distill-tasks"], 15), 16))
    specs = []
    for g in range(s.groups):
        pool = by_env[envs[rng.randrange(len(envs))]]
        task, env_seed = pool[rng.randrange(len(pool))], rng.randrange(2**31)
        specs += [EpisodeSpec(task=task, seed=env_seed, sample=k, group=g) for k in range(s.samples_per_task)]
    return specs


def hf_engine_factory(
    chat_format: str, max_prompt_tokens: int, batch_size: int, fast: str
) -> Callable[[torch.nn.Module, Any], Any]:
    """The in-process hf rollout engine on the live (peft) model, as GRPOTrainer's default."""
    def factory(model: torch.nn.Module, tokenizer: Any) -> Any:
        kw = dict(chat_format=chat_format, max_prompt_tokens=max_prompt_tokens, batch_size=batch_size, fast=fast)
        return HFEngine(model, tokenizer, **kw)

    return factory


def save_rollouts(out: Path, it: int, trajs: Sequence[Trajectory], mode: str) -> None:
    """``rollouts/iter_<it>.jsonl`` as GRPO writes them (``messages`` drops the per-turn token ids)."""
    if mode == "none":
        return
    rows = []
    for t in trajs:
        d = t.model_dump(mode="json")
        if mode == "messages":
            d["info"] = {k: v for k, v in d["info"].items() if k != "turns"}
        rows.append(d)
    write_jsonl(out / "rollouts" / f"iter_{it:05d}.jsonl", rows)


# --------------------------------------------------------------------------------------------
# The recipe


def train_distill(
    student_model: torch.nn.Module,
    tokenizer: Any,
    suite: EnvSuite,
    teachers: Mapping[str, str | Path],
    settings: DistillSettings,
    out_dir: str | Path,
    *,
    chat_format: str = "qwen3",
    engine_factory: Callable[[torch.nn.Module, Any], Any] | None = None,
    device: str | torch.device | None = None,
    callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
) -> dict[str, Any]:
    """Distill ``teachers`` ({env name: GRPO adapter dir}) into a fresh student adapter on ``suite``
    (a :class:`MixtureSuite` of the capability environments, or any suite whose tasks' envs all have
    a teacher), resuming ``out_dir``'s checkpoint if there is one.

    ``student_model`` is the plain backbone the teachers were trained on (frozen here);
    ``engine_factory(peft_model, tokenizer)`` builds the rollout engine (default: in-process hf).
    Writes ``out_dir/adapter`` (the student, peft), ``metrics.csv``, ``checkpoints/`` and
    ``rollouts/``. ``callbacks`` get each iteration's metrics; one that raises stops training after
    that iteration's checkpoint logic ran. Returns a summary (adapter dir, budget, first/last KL).
    """
    s = settings
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    envs = environments(suite)
    missing, unknown = sorted(set(envs) - set(teachers)), sorted(set(teachers) - set(envs))
    if missing or unknown:
        raise ValueError(f"distill teachers: environments without a teacher {missing}, teachers of no environment {unknown}")
    model, dev = place_model(student_model, device, s.dtype)
    model = build_peft_model(model, s.lora, s.seed)
    teacher_of = attach_teachers(model, teachers)
    set_fused_update_kernels(causal_lm_of(model), s.fused_update_kernels)  # after the teachers: their layers too
    if s.gradient_checkpointing:
        set_activation_checkpointing(causal_lm_of(model), True)
    backend = LocalBackend(model, s)  # the student's parameters only
    factory = engine_factory or hf_engine_factory(chat_format, s.max_prompt_tokens, s.rollout_batch_size, s.rollout_fast)
    engine = factory(model, tokenizer)
    pad_id = padding_id(tokenizer)
    metrics = MetricsCSV(out / "metrics.csv", DISTILL_METRIC_COLUMNS + [f"reverse_kl/{e}" for e in envs])
    ckpts = out / "checkpoints"

    last = load_checkpoint(ckpts, model, backend)
    start = 0 if last is None else last + 1
    if last is None:
        seed_everything(s.seed)
    else:
        metrics.keep_through(last)
    model.eval()
    try:
        for it in range(start, s.iterations):
            t0 = time.time()
            # 1-2. on-policy episodes of the student, environments drawn uniformly
            engine.sync(it, lambda p: save_peft_adapter(model, p))
            specs = sample_specs(suite, s, it)
            trajs = run_episodes(
                engine.client, suite, specs, temperature=s.temperature, top_p=s.top_p, max_new_tokens=s.max_new_tokens,
                max_steps=s.max_steps, sample_seed=int(stable_hash([s.seed, it, "distill-sample"], 15), 16),
            )  # fmt: skip
            for t, sp in zip(trajs, specs):
                t.info["task_env"] = sp.task.env
            save_rollouts(out, it, trajs, s.save_rollouts)
            t1 = time.time()

            # 3. exact rows; each episode's teacher scores the tokens the student sampled
            rows_of = [rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], 0.0, i) for i, t in enumerate(trajs)]
            rows = [r for rs in rows_of for r in rs]
            teacher_lp: dict[int, torch.Tensor] = {}
            for env in envs:
                mine = [r for r in rows if specs[r.traj_index].task.env == env]
                if mine:
                    with active_adapter(model, teacher_of[env]):
                        scored = score_rows(model, mine, pad_id, dev, microbatch_tokens=s.microbatch_tokens,
                                            chunk=s.logprob_chunk)  # fmt: skip
                    teacher_lp.update({id(r): lp for r, lp in zip(mine, scored)})

            # 4. per-token advantages: minus the reverse KL to the teacher, on the sampled tokens
            sampler_lp: dict[int, torch.Tensor] = {}
            adv: dict[int, torch.Tensor] = {}
            kl_sum, kl_tok = {e: 0.0 for e in envs}, {e: 0 for e in envs}
            for r in rows:
                lp = torch.tensor([x for x, m in zip(r.rollout_logprobs, r.loss_mask) if m])  # the sampled tokens, in order
                sampler_lp[id(r)] = lp
                adv[id(r)] = distill_advantages(lp, teacher_lp[id(r)], torch.ones(len(lp)), s.kl_coef)
                env = specs[r.traj_index].task.env
                kl_sum[env] += float((lp - teacher_lp[id(r)]).sum())
                kl_tok[env] += len(lp)
            t2 = time.time()

            # 5. importance-sampled policy-gradient steps on the student (token mean per minibatch)
            order = [i for i, rs in enumerate(rows_of) if rs]
            random.Random(int(stable_hash([s.seed, it, "distill-minibatches"], 15), 16)).shuffle(order)
            acc = dict(loss=0.0, ratio=0.0, tok=0, fwd=0, steps=0, grad=[])
            model.train()
            for chunk in np.array_split(np.array(order, dtype=np.int64), s.num_minibatches):
                mb_rows = [r for i in chunk.tolist() for r in rows_of[i]]
                n_tok = sum(sum(r.loss_mask) for r in mb_rows)
                if n_tok == 0:
                    continue
                for micro in pack_microbatches([len(r) for r in mb_rows], s.microbatch_tokens):
                    mrows = [mb_rows[j] for j in micro]
                    b = collate(mrows, pad_id)
                    logp = sequence_logprobs(
                        model, b.input_ids.to(dev), b.attention_mask, b.loss_mask, temperature=s.temperature, chunk=s.logprob_chunk
                    )
                    old = torch.cat([sampler_lp[id(r)] for r in mrows]).to(dev)
                    a = torch.cat([adv[id(r)] for r in mrows]).to(dev)
                    w = torch.full_like(logp, 1.0 / n_tok)
                    loss = importance_sampled_loss(logp, old, a, w)
                    backend.backward(loss, boundary=True)
                    acc["loss"] += float(loss.detach())
                    acc["ratio"] += float(torch.exp(logp.detach() - old).sum())
                    acc["tok"] += logp.numel()
                    acc["fwd"] += int(b.attention_mask.sum())
                acc["grad"].append(backend.step())
                acc["steps"] += 1
            model.eval()
            t3 = time.time()

            # 6. metrics and checkpoint
            n_kl = max(sum(kl_tok.values()), 1)
            row = {
                "iteration": it,
                "reverse_kl": sum(kl_sum.values()) / n_kl,
                "reward_mean": float(np.mean([t.reward for t in trajs])),
                "success_rate": float(np.mean([t.success for t in trajs])),
                "loss": acc["loss"] / max(acc["steps"], 1),
                "ratio_mean": acc["ratio"] / acc["tok"] if acc["tok"] else 1.0,
                "grad_norm": float(np.mean(acc["grad"])) if acc["grad"] else 0.0,
                "optimizer_steps": acc["steps"],
                "tokens_generated": sum(len(d["completion_ids"]) for t in trajs for d in t.info["turns"]),
                "episodes": len(trajs),
                "tokens_forward": acc["fwd"],
                "rows": len(rows),
                "time_rollout_s": t1 - t0, "time_teacher_s": t2 - t1, "time_update_s": t3 - t2, "time_total_s": t3 - t0,
                **{f"reverse_kl/{e}": (kl_sum[e] / kl_tok[e] if kl_tok[e] else "") for e in envs},
            }  # fmt: skip
            metrics.append(row)
            if (it + 1) % s.checkpoint_every == 0 or it + 1 == s.iterations:
                state = {"settings": asdict(s), "teachers": {e: str(p) for e, p in teachers.items()}}
                save_checkpoint(ckpts, it, model, backend, state, s.keep_checkpoints)
            log.info("distill iter %d reverse KL %.4f reward %.3f", it, row["reverse_kl"], row["reward_mean"])
            for cb in callbacks:
                cb(row)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    save_peft_adapter(model, out / "adapter")
    kls = [float(r["reverse_kl"]) for r in metrics.rows]
    return {
        "adapter": str(out / "adapter"),
        "episodes": sum(int(float(r["episodes"])) for r in metrics.rows),
        "tokens_generated": sum(int(float(r["tokens_generated"])) for r in metrics.rows),
        "optimizer_steps": sum(int(float(r["optimizer_steps"])) for r in metrics.rows),
        "reverse_kl_first": kls[0] if kls else None,
        "reverse_kl_last": kls[-1] if kls else None,
    }
