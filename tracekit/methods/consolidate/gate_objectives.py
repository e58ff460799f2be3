"""The ``moe`` strategy's gate objectives beyond the paper's CE + LB (issue 39; ``consolidation.gate.objective``).

``soft_target`` mirrors the official ``train/warmstart_gater.py`` (``--routing-scope per_layer``): a routing target
per example from each adapter's reward on the example's environment, ``softmax(reward / temperature)``, and each
block's gate pulled to it by KL. Rewards: every adapter (the base too with ``moe.base_slot``) rolled out greedily
on ``consolidation.gate.soft_target.seeds`` instances of every capability environment (seeds from
:data:`MEASURE_SEED_OFFSET`, disjoint from GRPO's training seeds and the validation seeds), each (adapter,
environment) pair a cached ``gate_rewards/<key>`` sub-artifact keyed on the adapter's content, the package's
content, the seeds, the agent and backbone settings and the episode limits. Deviations from the official script:
the target is per environment (every example of an environment shares it; the official step 4 builds one per seed,
from rollouts of each adapter on that seed), and the gate trains on the same GRPO rollouts as CE + LB (the whole
trajectory's tokens, routed top-1 as at inference), not on first-turn prompts only (whose mean the official code
takes over padded positions too).

``grpo`` mirrors the official ``train/grpo_gater.py``: GRPO on the gate parameters alone (adapters and backbone
frozen) from a warm start (``warm_start``: ce_lb or soft_target, run first as configured), lr 1e-3, clip 0.2, token
temperature 0.9, and ``hint_fraction`` of each group's rollouts shown the gold actions (the instance's solution)
in the system prompt, so that groups have reward variance; evaluation never sees hints. Routing is locked per
trajectory: one expert is sampled per trajectory from ``pi(c | prompt)`` (the gates' probabilities on the first
prompt, averaged over its tokens and the blocks: :func:`tracekit.moe.gate.prompt_routing`) and that adapter alone
acts for the whole episode; the update is GRPO's clipped surrogate (``tracekit.rl.grpo``) on ``log pi(c | prompt)``
with the group-normalized advantages, zero-variance groups dropped. Deviations from the official script: the
official trajectory granularity locks the gate's *soft* prompt mixture for the episode and differentiates the token
log-probs through it; here the expert is sampled, so the policy-gradient term is the expert choice's (every token
of the episode then comes from one adapter, as top-1 inference routes most tokens); the whole episode's reward
counts (the official code also scores the whole game) and the update scores the first prompt only (as the official
``(prompt, completion)`` pair of the first turn); the gates stay token-level and inference stays top-1 per token.
``moe.base_slot`` is refused with grpo (the base slot's "no adapter" policy is not one of the rollout adapters).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from tracekit.agents import LLMAgent
from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.config import ConfigError
from tracekit.envs.base import EnvSuite
from tracekit.llm.backbones import load_backbone
from tracekit.llm.hf import HFChatClient, padding_id
from tracekit.llm.tools import encode_prompt
from tracekit.moe.gate import expert_logprobs
from tracekit.moe.model import GRANULARITIES, LoRAMoEModel
from tracekit.pipeline import StageContext
from tracekit.policy import Budget
from tracekit.ranges import Choice, check_declared
from tracekit.rl import grpo
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.runs import package_identity, train_seeds
from tracekit.synthesis.stage import open_package
from tracekit.types import Message, Task, stable_hash
from tracekit.wiring import backbone_dict, device, dtype, llm_agent, plain

log = logging.getLogger(__name__)

MEASURE_SEED_OFFSET = 20_000_000  # adapter-reward measurements: disjoint from training (100,000+) and validation seeds
# what an adapter's measured reward depends on besides its weights, the environment and the seeds
MEASURE_READS = ("agent", "eval.max_steps", "eval.context_budget")
GRPO_READS = ("agent", "eval.max_steps", "eval.context_budget", "grpo.groups", "grpo.iterations")


@dataclass(frozen=True)
class GateObjective:
    """What one gate objective is to the ``moe`` strategy: its row words, what its key reads, and how it trains."""

    name: str
    words: str | None  # the TRACE row's words for gates trained so (None: the paper's gate, the plain TRACE row)
    reads: tuple[str, ...] = ()  # compose's reads beyond the objective's name (none for the paper's: keys as before)
    soft_targets: bool = False  # trains toward the adapters' measured rewards (rolls them out in their environments)
    gate_grpo: bool = False  # GRPO on the gates, after the warm start ``consolidation.gate.grpo.warm_start`` names

    @property
    def paper(self) -> bool:
        """The paper's CE + LB: in no key, rolls nothing out, adds no note."""
        return self.words is None


# consolidation.gate.objective; top-1 routing at inference whatever trains the gates
GATE_OBJECTIVES: dict[str, GateObjective] = {o.name: o for o in (
    # the paper's: CE on the GRPO rollouts' response tokens + lambda_LB * load balancing
    GateObjective("ce_lb", None),
    # KL(softmax(adapter rewards / T) || mean gate probability), each adapter's reward measured greedily on every
    # capability environment (official train/warmstart_gater.py, per_layer)
    GateObjective("soft_target", "soft-target", ("consolidation.gate.soft_target", *MEASURE_READS), soft_targets=True),
    # GRPO on the gates alone from a warm start, one expert sampled per trajectory from the gate's prompt routing
    # (official train/grpo_gater.py: lr 1e-3, clip 0.2, temperature 0.9, hints)
    GateObjective("grpo", "GRPO", ("consolidation.gate.grpo", *GRPO_READS), gate_grpo=True),
)}
PAPER_GATE = next(name for name, o in GATE_OBJECTIVES.items() if o.paper)
# the objectives gate GRPO may start from (any but itself)
WARM_STARTS = tuple(name for name, o in GATE_OBJECTIVES.items() if not o.gate_grpo)


@dataclass
class SoftTargetConfig:
    """moe with gate_objective=soft_target: KL(target || gate) toward softmax(adapter rewards / temperature)."""

    temperature: float = 0.1  # of the softmax over each environment's measured adapter rewards (in [0, 1])
    seeds: int = 16  # instances per environment each adapter is measured on (greedy, disjoint from training seeds)

    RANGES: ClassVar[dict[str, str]] = {"temperature": "> 0", "seeds": ">= 1"}


@dataclass
class GateGrpoConfig:
    """moe with gate_objective=grpo: GRPO on the gates alone (official train/grpo_gater.py's defaults)."""

    warm_start: str = PAPER_GATE  # the gates GRPO starts from: a WARM_STARTS objective
    iterations: int = 10
    groups: int = 4  # (environment, seed) groups per iteration (official --num-tasks)
    group_size: int = 4  # rollouts per group (official --rollouts-per)
    lr: float = 1.0e-3
    clip_eps: float = 0.2
    temperature: float = 0.9  # token sampling of the rollouts
    hint_fraction: float = 0.5  # share of each group's rollouts shown the gold actions (never at evaluation)
    updates: int = 2  # optimizer steps per iteration on its rollouts (the clip matters from the second)
    max_grad_norm: float = 1.0

    RANGES: ClassVar[dict[str, str]] = {
        "iterations": ">= 1", "groups": ">= 1", "group_size": ">= 1", "lr": "> 0", "clip_eps": "(0, 1)",
        "temperature": "[0, 2]", "hint_fraction": "[0, 1]", "updates": ">= 1", "max_grad_norm": ">= 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"warm_start": WARM_STARTS}


@dataclass
class RoutingConfig:
    """How the trained gates route at inference (issue 53). The defaults are the paper's (token-level, hard top-k by
    ``moe.top_k``) and keep TRACE's compose key; any other value is read by compose and names the row."""

    granularity: str = "token"  # token (each token by its block's gate) | turn (one decision per assistant turn) | trajectory (one per episode)
    soft_top_k: int | None = None  # None: hard routing; k: soft top-k mixing, weights softmax(logit / temperature) over the k kept
    temperature: float = 1.0  # of soft top-k (only with soft_top_k)

    RANGES: ClassVar[dict[str, str]] = {"soft_top_k": ">= 1", "temperature": "> 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"granularity": GRANULARITIES}

    def __post_init__(self) -> None:
        check_declared("consolidation.gate.routing", self)

    @property
    def is_default(self) -> bool:
        return self.granularity == "token" and self.soft_top_k is None and self.temperature == 1.0

    def label(self) -> str:
        """The row's words for a non-default routing: ``turn routing``, ``soft top-2 T=0.5``, ..."""
        parts = [] if self.granularity == "token" else [f"{self.granularity} routing"]
        if self.soft_top_k is not None:
            parts.append(f"soft top-{self.soft_top_k}" + (f" T={self.temperature:g}" if self.temperature != 1.0 else ""))
        return ", ".join(parts)


@dataclass
class GateObjectiveConfig:
    """The ``moe`` strategy's gate objective (issue 39): ce_lb (the paper's), soft_target or grpo; and how the gates
    route at inference (issue 53, ``routing``)."""

    objective: str = PAPER_GATE  # a GATE_OBJECTIVES name
    soft_target: SoftTargetConfig = field(default_factory=SoftTargetConfig)
    grpo: GateGrpoConfig = field(default_factory=GateGrpoConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)

    CHOICES: ClassVar[dict[str, Choice]] = {"objective": tuple(GATE_OBJECTIVES)}


# --------------------------------------------------------------------------------------------- small pure rules


def hint_schedule(group_size: int, fraction: float) -> list[bool]:
    """Which rollouts of a group of ``group_size`` are shown the hint: none for ``fraction <= 0``, else
    ``min(K, max(1, round(K * fraction)))`` first ones (the official ``--hint-fraction`` rule)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"hint fraction must be in [0, 1], got {fraction}")
    n = 0 if fraction <= 0 else min(group_size, max(1, round(group_size * fraction)))
    return [True] * n + [False] * (group_size - n)


def variance_sources(group_size: int, hint_fraction: float, temperature: float, n_experts: int) -> list[str]:
    """What can make a GRPO group's rewards differ: sampled tokens (temperature > 0), the hint splitting the group,
    the sampled expert (two or more); none with a group of one. Empty: GRPO could never learn."""
    if group_size < 2:
        return []
    hints = hint_schedule(group_size, hint_fraction)
    return ([f"token sampling at temperature {temperature:g}"] if temperature > 0 else []) + \
        ([f"hints on {sum(hints)} of {group_size}"] if 0 < sum(hints) < group_size else []) + \
        ([f"the expert sampled among {n_experts}"] if n_experts > 1 else [])


def hint_text(solution: list[Any]) -> str:
    """The gold actions as a system-prompt hint."""
    calls = "; ".join(f"{c.name}({json.dumps(c.arguments, sort_keys=True)})" for c in solution)
    return f"\n\nHint: the correct tool calls for this task, in order: {calls}"


class HintedSuite(EnvSuite):
    """An environment package's suite whose tasks are ``(seed, hint)`` rows: a hinted row's episode shows the gold
    actions (:func:`hint_text`) at the end of its system prompt; the verifier is the environment's own."""

    def __init__(self, suite: Any, rows: list[tuple[str, int, bool]]):
        self.suite, self.name = suite, suite.name
        self._tasks = [Task(id=tid, env=suite.name, instruction="", data={"seed": z, "hint": h}) for tid, z, h in rows]

    def tasks(self) -> list[Task]:
        return self._tasks

    def opening(self, z: int, hint: bool) -> tuple[list[Message], list[dict[str, Any]]]:
        """The episode's first observation (messages, tools), as ``SyntheticEpisode.reset`` makes it without opening
        the environment: what the gate routes the trajectory by."""
        inst = self.suite.instances([z])[0]
        system = inst.system_prompt + (hint_text(inst.solution) if hint else "")
        return [Message(role="system", content=system), Message(role="user", content=inst.user_goal)], self.suite.info.tools

    def episode(self, task: Task, seed: int = 0) -> Any:
        ep = self.suite.episode(Task(id=f"seed-{task.data['seed']}", env=self.name, instruction="",
                                     data={"seed": task.data["seed"]}), seed)
        if task.data.get("hint"):
            ep.instance = ep.instance.model_copy(
                update={"system_prompt": ep.instance.system_prompt + hint_text(ep.instance.solution)})
        return ep

    def close(self) -> None:
        self.suite.close()


def _generated_tokens(tokenizer: Any, trajs: list[Any]) -> int:
    """Tokens the agent generated in ``trajs`` (the exact record where the rollout kept one, else its assistant
    messages re-tokenized)."""
    n = 0
    for t in trajs:
        if t.tokens is not None:
            n += sum(t.tokens.loss_mask)
        else:
            n += sum(len(tokenizer((m.content or "") + json.dumps([c.model_dump() for c in (m.tool_calls or [])]),
                                   add_special_tokens=False)["input_ids"]) for m in t.messages if m.role == "assistant")
    return n


# --------------------------------------------------------------------------------------------- soft targets


def measure_rewards(ctx: StageContext, slots: dict[str, Artifact | None], pkgs: dict[str, Path], n: int
                    ) -> dict[str, dict[str, float]]:
    """{environment capability: {slot: mean reward}}: each slot's policy (an adapter; None: the base) rolled out
    greedily on ``n`` instances of each environment, one cached ``gate_rewards`` sub-artifact per pair."""
    seeds = list(range(MEASURE_SEED_OFFSET, MEASURE_SEED_OFFSET + n))
    out: dict[str, dict[str, float]] = {}
    for env_cap, pkg in sorted(pkgs.items()):
        for slot, art in slots.items():
            out.setdefault(env_cap, {})[slot] = rollout_reward(
                ctx, "gate_rewards", None if art is None else art.content_key,
                None if art is None else art.path / "adapter", pkg, seeds, {"slot": slot, "env": env_cap})
    return out


def rollout_reward(ctx: StageContext, kind: str, identity: str | None, adapter: Path | None, pkg: Path,
                   seeds: list[int], meta: dict[str, Any]) -> float:
    """The mean reward of the backbone with ``adapter`` (None: alone), whose content ``identity`` names, rolled out
    greedily on ``seeds`` of the environment package ``pkg``: a cached ``<kind>/<key>`` sub-artifact."""
    cfg = ctx.cfg
    key = stable_hash({"adapter": identity, "env": package_identity(pkg), "seeds": seeds, "backbone": backbone_dict(cfg),
                       "agent": plain(cfg.agent), "max_steps": cfg.eval.max_steps,
                       "context_budget": cfg.eval.context_budget}, length=20)

    def compute(work: Path) -> None:
        agent = llm_agent(cfg, 0.0, adapter=None if adapter is None else str(adapter))
        suite = open_package(pkg, seeds)
        try:
            run_rollouts(suite, agent, work / "episodes", samples=1, seed=0, max_steps=cfg.eval.max_steps,
                         context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size, progress=False)
        finally:
            suite.close()
        trajs = read_trajectories(work / "episodes")
        atomic_write_json(work / "rewards.json", {"mean": sum(t.reward for t in trajs) / len(trajs),
                                                  "episodes": len(trajs)})

    t0 = time.time()
    got = ctx.cache.get_or_compute(kind, key, compute, meta=meta)
    ctx.use(got, time.time() - t0)
    return float(read_json(got.path / "rewards.json")["mean"])


# --------------------------------------------------------------------------------------------- GRPO on the gates


def _rollout_client(cfg: Any, adapters: dict[str, Artifact]) -> tuple[Any, HFChatClient]:
    """One peft model holding every capability adapter (named by capability; the active one acts) and its chat
    client, with the agent's client settings."""
    from peft import PeftModel

    model, tokenizer = load_backbone(backbone_dict(cfg), device(cfg), dtype(cfg))
    names = sorted(adapters)
    peft = PeftModel.from_pretrained(model, str(adapters[names[0]].path / "adapter"), adapter_name=names[0])
    for name in names[1:]:
        peft.load_adapter(str(adapters[name].path / "adapter"), adapter_name=name)
    peft.eval()
    a = cfg.agent
    client = HFChatClient(peft, tokenizer, chat_format=cfg.backbone.chat_format, max_batch_size=a.batch_size,
                          constrained_tool_calls=a.constrained_tool_calls, tool_choice=a.tool_choice,
                          copy_ids=a.copy_ids, prefix_cache_mib=a.prefix_cache_mib)
    return peft, client


def train_gates_grpo(ctx: StageContext, model: LoRAMoEModel, tokenizer: Any, adapters: dict[str, Artifact],
                     pkgs: dict[str, Path], s: Any) -> tuple[list[dict[str, float]], Budget]:
    """GRPO on ``model``'s gates (module docstring); returns one log row per iteration and the budget spent."""
    cfg = ctx.cfg
    slots = list(model.slot_names)
    if model.moe_config.include_base_slot:
        raise ConfigError("moe.base_slot=true is invalid with consolidation.gate.objective=grpo: the trajectory's "
                          "expert is one of the capability adapters (the base slot has no adapter to roll out)")
    sources = variance_sources(s.group_size, s.hint_fraction, s.temperature, len(slots))
    if not sources:
        raise ConfigError(f"consolidation.gate.grpo: no source of reward variance (group_size={s.group_size}, "
                          f"hint_fraction={s.hint_fraction}, temperature={s.temperature}, {len(slots)} expert): "
                          "GRPO's advantages would all be 0")
    pad = padding_id(tokenizer)
    peft, client = _rollout_client(cfg, adapters)
    base_agent = dict(temperature=s.temperature, top_p=cfg.agent.top_p, max_new_tokens=cfg.agent.max_new_tokens)
    seeds = train_seeds(cfg)  # the capability runs' training instances (never evaluated)
    suites = {cap: open_package(pkg, seeds) for cap, pkg in sorted(pkgs.items())}
    envs = sorted(suites)
    hints = hint_schedule(s.group_size, s.hint_fraction)
    opt = torch.optim.AdamW(list(model.trainable_parameters().values()), lr=s.lr)
    rows: list[dict[str, float]] = []
    episodes = tokens = steps = 0
    out = ctx.work_dir / "gate_grpo"
    try:
        for it in range(s.iterations):
            rng = random.Random(int(stable_hash([ctx.seed, "gate-grpo", it], 15), 16))
            draws = [(envs[rng.randrange(len(envs))], seeds[rng.randrange(len(seeds))]) for _ in range(s.groups)]
            rows_: list[tuple[int, int, str, int, bool]] = [(g, k, cap, z, hints[k]) for g, (cap, z) in enumerate(draws)
                                                           for k in range(s.group_size)]
            prompts = []
            for _, _, cap, z, hint in rows_:
                msgs, tools = HintedSuite(suites[cap], []).opening(z, hint)
                prompts.append(encode_prompt(tokenizer, msgs, tools))
            with torch.no_grad():
                old = expert_logprobs(model, prompts, pad).float().cpu()
            gen = torch.Generator().manual_seed(int(stable_hash([ctx.seed, "gate-grpo-experts", it], 15), 16))
            experts = torch.multinomial(old.exp(), 1, generator=gen).squeeze(1).tolist()
            rewards = [0.0] * len(rows_)
            for cap in envs:
                for e in sorted(set(experts)):
                    mine = [i for i, r in enumerate(rows_) if r[2] == cap and experts[i] == e]
                    if not mine:
                        continue
                    peft.set_adapter(slots[e])
                    suite = HintedSuite(suites[cap], [(f"g{rows_[i][0]}-k{rows_[i][1]}", rows_[i][3], rows_[i][4])
                                                      for i in mine])
                    where = out / f"iter_{it:04d}" / f"{cap}__{slots[e]}"
                    run_rollouts(suite, LLMAgent(client, **base_agent), where, samples=1,
                                 seed=int(stable_hash([ctx.seed, it], 15), 16) % 2**31, max_steps=cfg.eval.max_steps,
                                 context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size, progress=False)
                    trajs = {t.task_id: t for t in read_trajectories(where)}
                    for i in mine:
                        rewards[i] = float(trajs[f"g{rows_[i][0]}-k{rows_[i][1]}"].reward)
                    episodes += len(trajs)
                    tokens += _generated_tokens(tokenizer, list(trajs.values()))
            r = torch.tensor(rewards, dtype=torch.float64).view(s.groups, s.group_size)
            keep, dropped = grpo.zero_variance_filter(r)
            adv = grpo.group_advantages(r).view(-1)
            kept = [i for i in range(len(rows_)) if bool(keep[rows_[i][0]])]
            row = {"iteration": it, "reward_mean": float(r.mean()), "groups_dropped": dropped,
                   "reward_hinted": _mean([rewards[i] for i in range(len(rows_)) if rows_[i][4]]),
                   "reward_unhinted": _mean([rewards[i] for i in range(len(rows_)) if not rows_[i][4]]),
                   **{f"expert/{slots[e]}": experts.count(e) / len(experts) for e in range(len(slots))}}
            if kept:  # the clipped surrogate on the sampled experts' log-probabilities, `updates` steps
                idx = torch.tensor(kept)
                losses = gate_grpo_update(model, opt, [prompts[i] for i in kept], [experts[i] for i in kept],
                                          old[idx, torch.tensor([experts[i] for i in kept])], adv[idx].float(),
                                          s.updates, s.clip_eps, s.max_grad_norm, pad)
                steps += len(losses)
                row["loss"] = losses[-1]
            rows.append(row)
            log.info("gate grpo iter %d: reward %.3f, %d/%d groups dropped", it, row["reward_mean"], dropped, s.groups)
    finally:
        for suite in suites.values():
            suite.close()
        client.close()
    return rows, Budget(episodes, tokens, steps)


def gate_grpo_update(model: LoRAMoEModel, opt: torch.optim.Optimizer, prompts: list[list[int]], experts: list[int],
                     old_lp: torch.Tensor, adv: torch.Tensor, updates: int, clip_eps: float, max_grad_norm: float,
                     pad_id: int = 0) -> list[float]:
    """``updates`` optimizer steps on ``-mean(clipped_surrogate(log pi_new(c | prompt), log pi_old, A))`` over the
    trajectories' (prompt, sampled expert c, advantage A); only the gates move. Returns each step's loss."""
    params = list(model.trainable_parameters().values())
    chosen = torch.tensor(experts)
    losses = []
    for _ in range(updates):
        lp = expert_logprobs(model, prompts, pad_id).cpu()
        loss = -grpo.clipped_surrogate(lp[torch.arange(len(experts)), chosen], old_lp, adv, clip_eps).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        opt.step()
        losses.append(float(loss))
    return losses


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")
