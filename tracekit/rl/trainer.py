"""GRPO with a LoRA adapter on a frozen backbone, on any :class:`EnvSuite` (paper sec. 3.4, App. A).

One iteration, top to bottom (:meth:`GRPOTrainer.iteration`):

1. sync the adapter to the rollout engine (hf: nothing; vllm: save + runtime LoRA load);
2. sample G (task, env seed) pairs; run K episodes per pair at temperature 1.0 with the current
   adapter (on-policy), recording each turn's exact prompt/completion ids and log-probs;
3. group advantages, eq. (1); drop groups whose K rewards are all equal (counted); optionally
   sample more groups until G informative ones are found (DAPO-style dynamic sampling, off);
4. build exact training rows (``tokens.build_rows``), then for each epoch and minibatch:
   length-bucketed microbatches -> chunked log-probs of generated tokens -> eq. (2) (+ k3 KL,
   + TIS) -> backward; clip the gradient norm; AdamW step on the adapter only;
5. metrics row (CSV + callbacks); a checkpoint every ``checkpoint_every`` iterations; optionally an
   early stop (``early_stop_patience``: no informative group, or a reward plateau; ``stopped.json``).

Health columns of the metrics row, all on the tokens the update scores anyway: ``entropy`` (mean per-token
entropy of the tempered policy, from the same vocabulary chunks as the log-probs), ``logprob_gap_mean`` /
``logprob_gap_abs`` (rollout minus trainer log-prob before any step of the iteration: the re-scored old
log-probs with ``old_logprobs=recompute``, else the first minibatch's forward), ``kl_ref`` (token mean of
k3 against the frozen base, when ``kl_beta > 0`` or ``health_kl_ref``; an empty cell otherwise),
``informative_groups``, ``clip_frac`` and ``grad_norm`` (pre-clip: ``clip_grad_norm_``'s return value,
DeepSpeed's ``get_global_grad_norm``). Cells that measured nothing (no token to score) stay empty.
``skip_saturated`` retires tasks solved by every sample of their last group from later draws
(``tasks_retired``; kept in the checkpoints).

Constrained decoding: an engine sampling under a tool-call grammar reports log-probs of the masked,
renormalized distribution (>= the trainer's unmasked ones; the gap columns show it). With
``old_logprobs=recompute`` the ratio is taken between the trainer's unmasked new and old log-probs, so the
masking cancels out of it; the rollout's masked log-probs enter only through TIS (``tis_cap``), whose
``min(pi_old/pi_rollout, cap)`` then down-weights tokens where the grammar removed mass.

The same loop runs single-process or data-parallel under DeepSpeed ZeRO (``tracekit.rl.launch``):
each rank rolls out its share of the groups, and eq. (2)'s ``1/|B|`` uses the global trajectory
count, so the summed gradient equals the single-process one.

Defaults and why:
- LoRA on q,k,v,o,gate,up,down: the paper applies LoRA to "all attention and MLP projections";
  rank 32 / alpha 64: with rank 32 on those projections of Qwen3-30B-A3B (all 128 experts) the
  adapter has 1.69B parameters, the closest power of two to the paper's "~1.6B (5.3%)" (rank 16
  would give 0.84B); alpha = 2 x rank is the common LoRA scaling.
- G=4 groups x K=8: the paper reports 5,120 rollouts for 4 capabilities x 40 iterations, i.e. 32
  rollouts per iteration; the split into G x K is not given.
- ``old_logprobs='rollout'``: rho is taken against the log-probs the rollout engine reported
  (eq. (2)'s pi_old). ``recompute`` re-scores the batch with the trainer first; with ``tis_cap``
  set, the trainer's re-scored log-probs are pi_old and ``min(pi_old/pi_rollout, cap)`` reweights
  each token (truncated importance sampling for engine/trainer numerics mismatch, e.g. vLLM).
- ``num_minibatches=4``: several optimizer steps per rollout batch, so the ratio leaves 1 and
  the clip matters, as in the official trainer (which steps every 4 samples); the paper gives no
  number.

Memory of the update (what bounds a CPU run's peak): activations grow with the tokens of one
microbatch (SmolLM2-135M, fp32: ~1.9 MB per token without checkpointing, ~0.6 MB with it, measured
as RSS). ``microbatch_tokens`` caps a microbatch's padded tokens (rows x longest row); the loss is
one weighted token sum (``grpo.trajectory_token_weights``: ``1 / (T_traj |B|)``, with ``|B|`` the
minibatch's trajectories, not the microbatch's), so any split of a minibatch into microbatches
accumulates the same gradient (tests). A row is never split: a causal row longer than the budget runs
alone (its later tokens attend to the earlier ones' activations, so splitting it saves nothing over
``gradient_checkpointing``). ``release_rollout_memory`` drops the rollout engine's decoder state
before the update. Attention runs through SDPA (transformers' default ``attn_implementation``; the
right-padded rows pass no mask, so no [T, T] scores are materialized).
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tracekit.artifacts import atomic_write_json, read_json, write_jsonl
from tracekit.envs.base import EnvSuite
from tracekit.episodes import INFRA_RETRIES
from tracekit.llm.backbones import release_memory
from tracekit.llm.decoding import causal_lm_of
from tracekit.llm.hf import padding_id
from tracekit.rl import grpo
from tracekit.rl.components import (LocalBackend, MetricsCSV, atomic_dir, load_checkpoint, place_model, save_checkpoint,
                                    seed_everything)
from tracekit.rl.engines import HFEngine
from tracekit.rl.episodes import EpisodeSpec, run_episodes, tool_calls
from tracekit.rl.fused import set_fused_update_kernels
from tracekit.rl.model import Dist, build_peft_model, sequence_logprobs, set_activation_checkpointing
from tracekit.rl.settings import GRPOSettings
from tracekit.rl.tokens import PolicyRow, Turn, collate, pack_microbatches, rows_for_trajectory
from tracekit.types import Trajectory, stable_hash

log = logging.getLogger(__name__)


METRIC_COLUMNS = [
    "iteration", "reward_mean", "reward_std", "success_rate", "groups", "groups_dropped", "frac_groups_dropped",
    "resample_rounds", "trajectories_kept", "loss", "policy_loss", "kl", "clip_frac", "approx_kl", "ratio_mean",
    "grad_norm", "optimizer_steps", "tokens_generated", "tokens_forward", "rows", "episode_turns_mean",
    "episode_tokens_mean", "tool_calls_mean", "time_rollout_s", "time_update_s", "time_total_s",
    "informative_groups", "entropy", "logprob_gap_mean", "logprob_gap_abs", "kl_ref", "tasks_retired",
    "retired_fallbacks", "infra_retried",
]  # fmt: skip
# informative_groups: groups with reward variance (those with a non-zero advantage), over all rounds;
# entropy / kl_ref: token means over the update's forwards (every epoch and minibatch); logprob_gap_*: over
# the tokens scored before the iteration's first step (module docstring); grad_norm: pre-clip, mean over
# the steps; tasks_retired: size of the skip_saturated record after the rollouts; retired_fallbacks: rounds
# that drew from all tasks because every task was retired. entropy, logprob_gap_* and kl_ref are empty
# cells (absent from the callbacks' dict) when they measured nothing: no token, or kl_ref not asked for.
# infra_retried: episodes run again after an infrastructure failure (a worker died, a server or sandbox failed);
# none of their failed runs is trained on (tracekit.episodes).


def health_columns(tot: dict[str, float], measured_ref: bool) -> dict[str, float]:
    """The health cells of a metrics row from the update's global sums (``ent``, ``klref`` over ``tok``
    scored tokens; ``gap``, ``gap_abs`` over ``gap_tok``); a cell that measured nothing is left out
    (an empty CSV cell), never 0 or NaN: no token scored, or ``kl_ref`` not asked for."""
    out: dict[str, float] = {}
    if tot["tok"] > 0:
        out["entropy"] = tot["ent"] / tot["tok"]
        if measured_ref:
            out["kl_ref"] = tot["klref"] / tot["tok"]
    if tot["gap_tok"] > 0:
        out["logprob_gap_mean"] = tot["gap"] / tot["gap_tok"]
        out["logprob_gap_abs"] = tot["gap_abs"] / tot["gap_tok"]
    return out


# --------------------------------------------------------------------------------------------
# The trainer


class GRPOTrainer:
    """GRPO for one LoRA adapter on ``suite`` (see the module docstring for the recipe).

    ``model`` is the plain backbone (frozen here) and ``tokenizer`` its tokenizer with a chat
    template; ``chat_format`` is the backbone's tool-call syntax (``tracekit.llm.tools``).
    ``engine_factory(peft_model, tokenizer)`` builds the rollout engine (default: the in-process
    hf engine on the live model); ``backend_factory`` the optimizer side (default
    :class:`LocalBackend`; ``tracekit.rl.launch`` passes a DeepSpeed one).
    ``callbacks`` get each iteration's metrics dict (rank 0); one that raises stops training after
    that iteration's checkpoint logic ran.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        suite: EnvSuite,
        settings: GRPOSettings,
        out_dir: str | Path,
        *,
        chat_format: str = "qwen3",
        engine_factory: Callable[[torch.nn.Module, Any], Any] | None = None,
        backend_factory: Callable[[torch.nn.Module, GRPOSettings], Any] | None = None,
        dist: Dist | None = None,
        callbacks: Sequence[Callable[[dict[str, Any]], None]] = (),
        device: str | torch.device | None = None,
        infra_retries: int = INFRA_RETRIES,
    ):
        self.s = settings
        self.infra_retries = infra_retries  # an episode ending on an infrastructure failure is run again, not trained on
        self.suite = suite
        self.tokenizer = tokenizer
        self.out = Path(out_dir)
        self.dist = dist or Dist()
        self.callbacks = list(callbacks)
        model, self.device = place_model(model, device, settings.dtype)
        self.model = build_peft_model(model, settings.lora, settings.seed)
        set_fused_update_kernels(causal_lm_of(self.model), settings.fused_update_kernels)
        if settings.gradient_checkpointing or settings.compile_update:
            lm = causal_lm_of(self.model)
            set_activation_checkpointing(lm, settings.gradient_checkpointing, settings.checkpoint_policy, compile=settings.compile_update)
        self.backend = (backend_factory or LocalBackend)(self.model, settings)
        if engine_factory is None:
            def engine_factory(m, t):
                return HFEngine(
                    m,
                    t,
                    chat_format=chat_format,
                    max_prompt_tokens=settings.max_prompt_tokens,
                    batch_size=settings.rollout_batch_size,
                    fast=settings.rollout_fast,
                    cuda_graphs=None if settings.rollout_cuda_graphs else False,
                    compile_layers=settings.rollout_compile,
                )

        self.engine = engine_factory(self.model, tokenizer)
        self.pad_id = padding_id(tokenizer)
        self.start_iteration = 0
        self.metrics = MetricsCSV(self.out / "metrics.csv", METRIC_COLUMNS)
        # run state beside the weights (same on every rank; saved in the checkpoints): the skip_saturated
        # record (sorted task keys) and the early-stop history (informative groups, reward_mean per iteration)
        self.retired: list[str] = []
        self.history: dict[str, list] = {"informative_groups": [], "reward_mean": []}

    # ---- paths -----------------------------------------------------------------------------
    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    @property
    def adapter_dir(self) -> Path:
        return self.out / "adapter"

    # ---- the loop --------------------------------------------------------------------------
    def train(self) -> Path:
        """Run (or resume) all iterations; return the final adapter directory (peft format)."""
        self.out.mkdir(parents=True, exist_ok=True)
        if not self.resume():  # a fresh run seeds the global RNGs (LoRA dropout draws from torch's)
            seed_everything(self.s.seed, self.dist.rank)
        from tqdm import tqdm

        its = range(self.start_iteration, self.s.iterations)
        # a resumed run that had stopped early stays stopped (the rule reads the restored history)
        reason = self.stop_reason()
        if reason is not None:
            self._record_stop(self.start_iteration - 1, reason)
        bar = tqdm(its, desc=f"grpo {self.suite.name}", disable=self.dist.rank != 0, initial=self.start_iteration, total=self.s.iterations)
        for it in bar:
            if reason is not None:
                break
            metrics = self.iteration(it)
            self.history["informative_groups"].append(int(metrics["informative_groups"]))
            reward = float(metrics["reward_mean"])
            if self.s.skip_saturated:  # the plateau rule reads the pool's reward, not the ever harder draws'
                reward = grpo.pool_reward(reward, len(self.retired), len(self.suite.tasks()))
            self.history["reward_mean"].append(reward)
            reason = self.stop_reason()
            if self.dist.rank == 0:
                self.metrics.append(metrics)
            if (it + 1) % self.s.checkpoint_every == 0 or it + 1 == self.s.iterations or reason is not None:
                self.save_checkpoint(it)
            if reason is not None:
                self._record_stop(it, reason)
            if self.dist.rank == 0:
                log.info("iter %d reward %.3f dropped %d/%d", it, metrics["reward_mean"], metrics["groups_dropped"], metrics["groups"])
                for cb in self.callbacks:
                    cb(metrics)
        bar.close()
        self.save_adapter(self.adapter_dir)
        self.dist.barrier()
        return self.adapter_dir

    def stop_reason(self) -> str | None:
        """The early-stop rule (``GRPOSettings.early_stop_patience``) on the iterations run so far."""
        h, s = self.history, self.s
        return grpo.early_stop_reason(h["informative_groups"], h["reward_mean"], s.early_stop_patience, s.early_stop_min_delta)

    def _record_stop(self, it: int, reason: str) -> None:
        """One log line and ``stopped.json`` (the budget actually spent: iterations 0..it)."""
        if self.dist.rank != 0:
            return
        run = it + 1
        log.info("early stop after iteration %d (%d of %d iterations run): %s (patience %d)",
                 it, run, self.s.iterations, reason, self.s.early_stop_patience)
        atomic_write_json(self.out / "stopped.json", {"iteration": it, "reason": reason, "iterations_run": run})

    def iteration(self, it: int) -> dict[str, Any]:
        t0 = time.time()
        self.engine.sync(it, self.save_adapter)
        trajs, stats = self.collect(it)
        if self.s.release_rollout_memory:
            self.release_rollout_memory()
        t1 = time.time()
        upd = self.update_on(trajs, it)
        if self.s.release_rollout_memory:
            release_memory()  # the update's freed activations back to the OS before the next rollouts
        t2 = time.time()
        return {"iteration": it, **stats, **upd, "time_rollout_s": t1 - t0, "time_update_s": t2 - t1, "time_total_s": t2 - t0}

    def release_rollout_memory(self) -> None:
        """Drop what the rollout engine keeps between rollouts (a fast decoder's merged working copy of the
        weights and its static KV cache: rebuilt from the current weights at the next rollouts) and hand
        freed memory back to the OS, so the update runs beside one copy of the weights."""
        release = getattr(self.engine, "release", None)
        if release is not None:
            release()
        release_memory()

    # ---- rollouts --------------------------------------------------------------------------
    @staticmethod
    def task_key(task: Any) -> str:
        """A task's name in the skip_saturated record (``env/id``: ids repeat across a mixture's environments)."""
        return f"{task.env}/{task.id}"

    def _sample_groups(self, it: int, rnd: int, n: int) -> tuple[list[tuple[Any, int]], bool]:
        """n (task, env seed) pairs, the same on every rank, from (seed, iteration, round) and the retired
        record: drawn from the tasks not retired, or from all of them when every task is retired (-> True).
        With nothing retired (always so without ``skip_saturated``) the draws are the paper recipe's."""
        tasks = self.suite.tasks()
        if not tasks:
            raise ValueError(f"environment {self.suite.name} has no tasks")
        retired = set(self.retired)
        pool = [t for t in tasks if self.task_key(t) not in retired] if retired else tasks
        fallback = not pool
        pool = pool or tasks
        rng = random.Random(int(stable_hash([self.s.seed, it, rnd], 15), 16))
        return [(pool[rng.randrange(len(pool))], rng.randrange(2**31)) for _ in range(n)], fallback

    def collect(self, it: int) -> tuple[list[Trajectory], dict[str, Any]]:
        """Roll out groups (this rank's share), drop zero-variance groups, optionally refill.

        Returns this rank's kept trajectories, each with ``info['advantage']``, and global stats.
        """
        s, K = self.s, self.s.group_size
        kept: list[Trajectory] = []
        all_trajs: list[Trajectory] = []
        n_kept_global, total_groups, dropped, rnd, gid, informative, fallbacks = 0, 0, 0, 0, 0, 0, 0
        while True:
            need = s.groups if rnd == 0 else s.groups - n_kept_global
            pairs, fallback = self._sample_groups(it, rnd, need)
            fallbacks += int(fallback)
            mine = [g for g in range(len(pairs)) if g % self.dist.world == self.dist.rank]
            specs = [
                EpisodeSpec(task=pairs[g][0], seed=pairs[g][1], sample=k, group=gid + g) for g in mine for k in range(K)
            ]
            trajs = run_episodes(
                self.engine.client,
                self.suite,
                specs,
                temperature=s.temperature,
                top_p=s.top_p,
                max_new_tokens=s.max_new_tokens,
                max_steps=s.max_steps,
                sample_seed=int(stable_hash([s.seed, it, rnd], 15), 16),
                infra_retries=self.infra_retries,
            )
            all_trajs += trajs
            keep_flags = [0.0] * len(pairs)
            var_flags = [0.0] * len(pairs)  # reward variance (informative), whatever the filter does
            solved_flags = [0.0] * len(pairs)
            for j, g in enumerate(mine):
                group = trajs[j * K : (j + 1) * K]
                rewards = torch.tensor([[t.reward for t in group]], dtype=torch.float64)
                keep, _ = grpo.zero_variance_filter(rewards)
                var_flags[g] = float(bool(keep[0]))
                solved_flags[g] = float(bool(grpo.solved_groups(rewards, torch.tensor([[t.success for t in group]]))[0]))
                adv = grpo.group_advantages(rewards, s.adv_eps)[0]
                if bool(keep[0]) or not s.filter_zero_variance:
                    keep_flags[g] = 1.0
                    for t, a in zip(group, adv.tolist()):
                        t.info["advantage"] = a
                    kept += group
            n = len(pairs)  # global view (one reduction): which groups of this round are kept, informative, solved
            flags = self.dist.sum(keep_flags + var_flags + solved_flags)
            keep_flags, var_flags, solved_flags = flags[:n], flags[n : 2 * n], flags[2 * n :]
            informative += int(sum(var_flags))
            if s.skip_saturated:  # every rank applies the same global outcomes, in draw order
                self.retired = grpo.update_retired(
                    self.retired, [(self.task_key(task), solved_flags[g] > 0) for g, (task, _) in enumerate(pairs)]
                )
            total_groups += len(pairs)
            dropped += int(len(pairs) - sum(keep_flags))
            n_kept_global += int(sum(keep_flags))  # <= G: a round samples only the groups still missing
            gid += len(pairs)
            rnd += 1
            if not s.dynamic_resampling or n_kept_global >= s.groups or rnd > s.max_resample_rounds:
                break
        self._save_rollouts(it, all_trajs)
        stats = self._rollout_stats(all_trajs, total_groups, dropped, rnd - 1, n_kept_global * K)
        stats.update(informative_groups=informative, tasks_retired=len(self.retired), retired_fallbacks=fallbacks,
                     infra_retried=int(self.dist.sum([sum(1 for t in all_trajs if t.info.get("infra_retries"))])[0]))
        return kept, stats

    def _rollout_stats(self, trajs: list[Trajectory], groups: int, dropped: int, rounds: int, kept: int) -> dict[str, Any]:
        rewards = [t.reward for t in trajs]
        gen = [sum(len(tt["completion_ids"]) for tt in t.info["turns"]) for t in trajs]
        n, r1, r2, succ, turns, toks, calls = self.dist.sum(
            [
                len(trajs),
                sum(rewards),
                sum(r * r for r in rewards),
                sum(t.success for t in trajs),
                sum(len(t.info["turns"]) for t in trajs),
                sum(gen),
                sum(tool_calls(t.messages) for t in trajs),
            ]
        )
        mean = r1 / max(n, 1)
        return {
            "reward_mean": mean,
            "reward_std": math.sqrt(max(r2 / max(n, 1) - mean * mean, 0.0)),
            "success_rate": succ / max(n, 1),
            "groups": groups,
            "groups_dropped": dropped,
            "frac_groups_dropped": dropped / max(groups, 1),
            "resample_rounds": rounds,
            "trajectories_kept": kept,
            "tokens_generated": int(toks),
            "episode_turns_mean": turns / max(n, 1),
            "episode_tokens_mean": toks / max(n, 1),
            "tool_calls_mean": calls / max(n, 1),
        }

    def _save_rollouts(self, it: int, trajs: list[Trajectory]) -> None:
        if self.s.save_rollouts == "none":
            return
        rows = []
        for t in trajs:
            d = t.model_dump(mode="json")
            if self.s.save_rollouts == "messages":
                d["info"] = {k: v for k, v in d["info"].items() if k != "turns"}
            rows.append(d)
        suffix = f".rank{self.dist.rank}" if self.dist.active else ""
        write_jsonl(self.out / "rollouts" / f"iter_{it:05d}{suffix}.jsonl", rows)

    # ---- the update ------------------------------------------------------------------------
    def update_on(self, trajs: list[Trajectory], it: int) -> dict[str, Any]:
        """Eq. (2) updates on this rank's kept trajectories (``info['advantage']`` set by collect)."""
        s = self.s
        rows_by_traj = [
            rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], float(t.info["advantage"]), i)
            for i, t in enumerate(trajs)
        ]
        rows_by_traj = [r for r in rows_by_traj if r]  # a trajectory with no generated token trains nothing
        all_rows = [r for rs in rows_by_traj for r in rs]
        old = self._score(all_rows, adapter=True) if s.old_logprobs == "recompute" else None
        ref = self._score(all_rows, adapter=False) if self._measures_ref else None
        extra = {id(r): {} for r in all_rows}
        for j, r in enumerate(all_rows):
            if old is not None:
                extra[id(r)]["old"] = old[j]
            if ref is not None:
                extra[id(r)]["ref"] = ref[j]
        rng = random.Random(int(stable_hash([s.seed, it, "minibatches"], 15), 16))
        acc = dict(loss=0.0, policy=0.0, kl=0.0, clip=0.0, ratio=0.0, akl=0.0, tok=0.0, grad=[], fwd=0.0, rows=0.0,
                   ent=0.0, klref=0.0, gap=0.0, gap_abs=0.0, gap_tok=0.0)
        if old:  # the gap before any step: the trainer's re-scored old log-probs (host tensors), every token
            trainer_lp = torch.cat(old)
            gap, gap_abs = grpo.logprob_gap_sums(torch.cat([self._rollout_logprobs(r) for r in all_rows]), trainer_lp)
            acc.update(gap=float(gap), gap_abs=float(gap_abs), gap_tok=float(trainer_lp.numel()))
        self.model.train()
        first = True
        for epoch in range(s.epochs):
            order = list(range(len(rows_by_traj)))
            rng.shuffle(order)
            for chunk in np.array_split(np.array(order, dtype=np.int64), s.num_minibatches):
                mb_rows = [r for i in chunk.tolist() for r in rows_by_traj[i]]
                (b_global,) = self.dist.sum([len(chunk)])
                if b_global == 0:
                    continue
                # without re-scored old log-probs, the gap is read off the first minibatch's forward (before its step)
                self._minibatch_step(mb_rows, int(b_global), extra, acc, gap=first and old is None)
                first = False
        self.model.eval()
        keys = ("loss", "policy", "kl", "clip", "ratio", "akl", "tok", "fwd", "rows", "ent", "klref", "gap", "gap_abs", "gap_tok")
        tot = dict(zip(keys, self.dist.sum([acc[k] for k in keys])))
        steps = len(acc["grad"])
        ntok = max(tot["tok"], 1.0)
        health = health_columns(tot, measured_ref=self._measures_ref)
        return {
            "loss": tot["loss"] / max(steps, 1),
            "policy_loss": tot["policy"] / max(steps, 1),
            "kl": tot["kl"] / max(steps, 1),
            "clip_frac": tot["clip"] / ntok,
            "ratio_mean": tot["ratio"] / ntok if tot["tok"] else 1.0,
            "approx_kl": tot["akl"] / ntok,
            "grad_norm": float(np.mean(acc["grad"])) if acc["grad"] else 0.0,
            "optimizer_steps": steps,
            "tokens_forward": int(tot["fwd"]),
            "rows": int(tot["rows"]),
            **health,
        }

    @property
    def _measures_ref(self) -> bool:
        """Whether the update scores the batch under the frozen base (for the KL term, or for kl_ref only)."""
        return self.s.kl_beta > 0 or self.s.health_kl_ref

    @staticmethod
    def _rollout_logprobs(r: PolicyRow) -> torch.Tensor:
        """The rollout log-probs of a row's generated tokens, in the order ``sequence_logprobs`` scores them."""
        return torch.tensor([lp for lp, m in zip(r.rollout_logprobs, r.loss_mask) if m > 0], dtype=torch.float32)

    def _minibatch_step(self, rows: list[PolicyRow], b_global: int, extra: dict[int, dict], acc: dict, gap: bool = False) -> None:
        """Forward/backward of one minibatch's microbatches, one optimizer step; sums into ``acc``. ``gap``:
        also sum the rollout-minus-trainer log-prob gap of these forwards (run before the step)."""
        s = self.s
        micro = pack_microbatches([len(r) for r in rows], s.microbatch_tokens) if rows else []
        n_micro = self.dist.max(len(micro))  # every rank runs as many backward passes (ZeRO collectives)
        stats: list[torch.Tensor] = []
        for j in range(n_micro):
            dummy = j >= len(micro)
            mrows = [rows[i] for i in micro[j]] if not dummy else [self._dummy_row()]
            b = collate(mrows, self.pad_id)
            dev = self.device
            logp, ent = sequence_logprobs(
                self.model, b.input_ids.to(dev), b.attention_mask, b.loss_mask, temperature=s.temperature, chunk=s.logprob_chunk,
                entropy=True,
            )
            sel = b.loss_mask[:, 1:] > 0
            rollout_lp = b.rollout_logprobs[:, 1:][sel].to(dev)
            adv = grpo.token_advantages(b.advantages, b.loss_mask)[:, 1:][sel].to(dev)
            w = grpo.trajectory_token_weights(b.loss_mask, b.traj_tokens, b_global)[:, 1:][sel].to(dev)
            if dummy:
                w = torch.zeros_like(w)
            old = self._flat(mrows, extra, "old", dev) if s.old_logprobs == "recompute" and not dummy else rollout_lp
            ref = self._flat(mrows, extra, "ref", dev) if self._measures_ref and not dummy else None
            isw = grpo.truncated_is_weights(old, rollout_lp, s.tis_cap) if s.tis_cap is not None and not dummy else None
            out = grpo.grpo_loss(
                logp, old, adv, w, clip_eps=s.clip_eps, clip_eps_high=s.clip_eps_high, ref_logp=ref if s.kl_beta > 0 else None,
                kl_beta=s.kl_beta, is_weights=isw,
            )
            self.backend.backward(out.loss * self.backend.loss_scale, boundary=j == n_micro - 1)
            with torch.no_grad():  # health sums over the loss's tokens (weight > 0: not a dummy row)
                scored = (w > 0).to(torch.float64)
                lp = logp.detach()
                zero = scored.new_zeros(())
                klref = (grpo.k3_kl(lp, ref).double() * scored).sum() if ref is not None else zero
                g, g_abs = grpo.logprob_gap_sums(rollout_lp, lp) if gap and not dummy else (zero, zero)
                health = (ent.double() * scored).sum(), klref, g, g_abs, scored.sum() if gap else zero
            values = (out.loss, out.policy_loss, out.kl, out.clip_count, out.ratio_sum, out.approx_kl_sum, out.tokens, *health)
            stats.append(torch.stack([v.detach().double() for v in values]))
            if not dummy:
                acc["fwd"] += float(b.attention_mask.sum())
                acc["rows"] += len(mrows)
        acc["grad"].append(self.backend.step())
        # read the statistics once, after the optimizer step is queued: a host read per value after the
        # backward would idle the GPU while the host then launches the optimizer
        keys = ("loss", "policy", "kl", "clip", "ratio", "akl", "tok", "ent", "klref", "gap", "gap_abs", "gap_tok")
        for key, value in zip(keys, torch.stack(stats).sum(0).tolist()):
            acc[key] += value

    def _dummy_row(self) -> PolicyRow:
        """A 2-token row with zero loss weight: keeps ranks' backward counts equal."""
        return PolicyRow([self.pad_id, self.pad_id], [0, 1], [0.0, 0.0], 0.0, -1, 1)

    @staticmethod
    def _flat(rows: list[PolicyRow], extra: dict[int, dict], key: str, dev: torch.device) -> torch.Tensor:
        return torch.cat([extra[id(r)][key] for r in rows]).to(dev)

    @torch.no_grad()
    def _score(self, rows: list[PolicyRow], adapter: bool) -> list[torch.Tensor]:
        """Per-row log-probs of the generated tokens (eval mode), with the adapter on or off."""
        out: list[torch.Tensor | None] = [None] * len(rows)
        self.model.eval()
        ctx = nullcontext() if adapter else self.model.disable_adapter()
        with ctx:
            for idx in pack_microbatches([len(r) for r in rows], self.s.microbatch_tokens):
                b = collate([rows[i] for i in idx], self.pad_id)
                lp = sequence_logprobs(
                    self.model,
                    b.input_ids.to(self.device),
                    b.attention_mask,
                    b.loss_mask,
                    temperature=self.s.temperature,
                    chunk=self.s.logprob_chunk,
                ).float().cpu()
                counts = (b.loss_mask[:, 1:] > 0).sum(1).tolist()
                for i, piece in zip(idx, torch.split(lp, counts)):
                    out[i] = piece
        return out  # type: ignore[return-value]

    # ---- adapter and checkpoints -----------------------------------------------------------
    def _gathered(self):
        """All ranks enter: full adapter tensors even if ZeRO-3 partitioned them."""
        return getattr(self.backend, "gathered_adapter", nullcontext)()

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (peft names), on CPU."""
        from peft import get_peft_model_state_dict

        with self._gathered():
            return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    def save_adapter(self, path: Path) -> None:
        """peft ``save_pretrained`` into ``path``, atomically (rank 0 writes; all ranks wait)."""
        with self._gathered():
            if self.dist.rank == 0:
                atomic_dir(Path(path), lambda tmp: self.model.save_pretrained(str(tmp)))
        self.dist.barrier()

    def save_checkpoint(self, it: int) -> None:
        """Adapter, optimizer, RNG states, iteration and run state (the retired tasks, the early-stop history)
        under checkpoints/iter_<it>, then ``latest.json`` (all ranks)."""
        state = {"settings": asdict(self.s), "retired_tasks": list(self.retired), "history": self.history}
        save_checkpoint(self.ckpt_root, it, self.model, self.backend, state, self.s.keep_checkpoints,
                        rank=self.dist.rank, barrier=self.dist.barrier, gathered=self._gathered)

    def resume(self) -> bool:
        """Continue from ``checkpoints/latest.json`` if present (adapter, optimizer, RNG, iteration, metrics rows,
        the retired tasks and the early-stop history)."""
        last = load_checkpoint(self.ckpt_root, self.model, self.backend, rank=self.dist.rank)
        if last is None:
            return False
        self.start_iteration = last + 1
        self.metrics.keep_through(last)
        state = read_json(self.ckpt_root / read_json(self.ckpt_root / "latest.json")["dir"] / "state.json")
        self.retired = sorted(state.get("retired_tasks", []))
        history = state.get("history", {})
        self.history = {k: list(history.get(k, [])) for k in ("informative_groups", "reward_mean")}
        log.info("next iteration %d", self.start_iteration)
        return True
