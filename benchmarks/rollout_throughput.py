"""Rollout throughput (issue 30): episodes/s and generated tokens/s of evaluation rollouts, with the time split.

For each named target the same seeded episodes (a composed config's evaluation: greedy, the agent's decoding) are
rolled out ``--repeats`` times per arm, the arms interleaved (ABBA order) so machine noise hits both alike:

- ``batched``: the current path (``HFChatClient.batched_host_step``: the step's grammar bitmasks filled in one
  call and applied where the logits are; on an accelerator the picks made there too (``tracekit.llm.picks``),
  three numbers per row copied back; on the CPU the float64 picks on the host's threads; a batch's grammars
  compiled in parallel);
- ``reference``: the row-by-row host step it replaces (the code before issue 30), same model, same session;
- ``host_pick`` (on an accelerator): the batched step with the host's float64 picks (only unfinished rows copied
  over), the accelerator's default before the device picks;
- ``lora`` (``--lora``, on ``--lora-target``): the batched path under a seeded random LoRA adapter (merged by the
  fast decoder; other episodes than the base policy's, so only its throughput compares);
- ``moe`` (``--moe``, on ``--lora-target``): the batched path under a seeded random LoRA-MoE over ``--moe-adapters``
  random adapters with random gates (the fast decoder runs its gates and bank in the layer step); its time over
  the base policy's (``batched``) per repeat is ``ratio_moe_over_base`` (issue 30's CPU target: <= 1.3x).

Each policy first decodes one untimed turn (what a process pays once stays out of the repeats); each rollout
compiles its grammars and renders its prompts anew, as a fresh evaluation does.

Time split (exclusive seconds): ``prefill`` (the session's setup, KV cache growth included, its prefill and the
prefix store's writes) and ``decode`` (its decode steps), ``mask`` (the reference's per-row bitmask fill and
masking; the batched step's batched fill and on an accelerator its masking, on the CPU the masking runs in the pick
threads), ``pick`` (the rest of the per-step host loop: transfer, token choice, stop checks), ``compile``
(copy_ids narrowing + grammar compilation), ``prompts`` (chat-template rendering and tokenizing, the context-budget
count, response parsing), ``env`` (episode creation, resets, steps, the tau^2 DB-replay reward) and ``other``.
Ratios are reference / batched, the median of the repeats with min-max. Every arm must produce the same episodes
(messages, rewards, every turn's token ids; log-probs bit for bit, within 1e-9 for the device picks, which sum
in another order): exit 1 if not.

Two more sections, same process:

- ``host`` (``--host-rows``, default 256): the host side of decoding at a GPU's batch size, without a model: the
  gain target's first-turn requests decoded against seeded random logits (the session replaced), greedy and
  T=0.7, every arm (the random logits on the GPU where there is one; and the host's picks on ``--host-threads``
  threads); per-step host milliseconds, which on the GPU are not hidden behind the model.
- ``generate`` (``--generate N``): the first turn of N tau2_mini episodes by plain transformers ``generate``
  (greedy, no grammar), batched and one prompt at a time, against this client's batched path.
- ``gold`` (``--gold N``): the environment's cost alone: N real tau^2 retail tasks with the gold agent (no model),
  in process (``env_workers=0``) against an env pool of ``--gold-workers`` processes (:mod:`tracekit.envs.pool`),
  interleaved repeats, serial/pool the median with min-max; the same trajectories required.

``--json`` is rewritten (atomically) after every target and section.

    python benchmarks/rollout_throughput.py                                   # tau2_mini + gain, 3 repeats
    python benchmarks/rollout_throughput.py --targets tau2_mini --repeats 3 --lora --generate 3
    python benchmarks/rollout_throughput.py --targets tau2_mini --repeats 3 --moe --host-rows 0
    python benchmarks/rollout_throughput.py --json benchmarks/results/rollout_throughput_cpu.json
    python benchmarks/rollout_throughput.py --targets gain --gain-limit 100 --generate 0   # the gain run's 300 (GPU)
    python benchmarks/rollout_throughput.py --targets --host-rows 0 --gold 20 --gold-workers 2   # env pool only
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracekit.cli import compose_config  # noqa: E402

LOGPROB_TOL = 1e-9  # the device picks' log-probs against the host's float64 ones (tracekit.llm.picks)
PARTS = ("prefill", "decode", "mask", "pick", "compile", "prompts", "env", "other")


def target_overrides(name: str, limit: int | None) -> list[str]:
    """The composed config of a named target: ``tau2_mini`` is the embedded experiment's evaluation
    (2 environments x 3 tasks, 2 agent turns); ``gain`` the gain experiment's three environments (4 turns)."""
    if name == "tau2_mini":
        return ["experiment=embedded", *([] if limit is None else [f"benchmark.limit={limit}"])]
    if name == "gain":
        return ["experiment=gain", f"benchmark.limit={limit or 1}"]
    raise SystemExit(f"unknown target {name!r} (tau2_mini | gain)")


# --------------------------------------------------------------------------------------------
# Timers: inclusive seconds per wrapped call, turned into the exclusive split


class Timers:
    def __init__(self, cuda: bool):
        self.t: dict[str, float] = defaultdict(float)
        self.cuda = cuda
        self._undo: list[tuple[Any, str, Any]] = []

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def wrap(self, owner: Any, name: str, key: str) -> None:
        fn = getattr(owner, name)
        timers = self

        def timed(*a, **kw):
            timers._sync()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers._sync()
                timers.t[key] += time.perf_counter() - t0

        self._undo.append((owner, name, owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else _MISSING))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, old in reversed(self._undo):
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._undo.clear()

    def split(self, wall: float) -> dict[str, float]:
        t = self.t
        gen = t["generate"] - t["prefill"] - t["decode"] - t["mask"] - t["remember"] - t["session"]
        chat = t["chat"] - t["generate"] - t["compile"]
        env = t["reset"] + t["step"] + t["open"] + t["end"]
        out = {"prefill": t["prefill"] + t["remember"] + t["session"], "decode": t["decode"], "mask": t["mask"], "pick": gen,
               "compile": t["compile"], "prompts": chat + t["count"], "env": env}
        out["other"] = wall - sum(out.values())
        return {k: round(v, 3) for k, v in out.items()}


_MISSING = object()


@contextmanager
def instrumented(suite: Any, cuda: bool):
    from tracekit.episodes import EpisodeRun
    from tracekit.llm import decoding
    from tracekit.llm.constrained import ToolCallGrammar
    from tracekit.llm.hf import HFChatClient

    timers = Timers(cuda)
    for cls in (decoding.FastSession, decoding.PlainSession):
        timers.wrap(cls, "prefill", "prefill")
        timers.wrap(cls, "step", "decode")
    timers.wrap(decoding.FastSession, "remember", "remember")
    timers.wrap(ToolCallGrammar, "mask_", "mask")
    timers.wrap(ToolCallGrammar, "mask_rows_", "mask")
    timers.wrap(ToolCallGrammar, "matchers", "compile")
    timers.wrap(ToolCallGrammar, "json_matcher", "compile")
    timers.wrap(HFChatClient, "_generate", "generate")
    timers.wrap(HFChatClient, "_session", "session")  # a batch's session: KV cache (re)allocation, re-merge
    timers.wrap(HFChatClient, "chat", "chat")
    timers.wrap(HFChatClient, "count_tokens", "count")
    timers.wrap(EpisodeRun, "open", "open")
    timers.wrap(EpisodeRun, "end", "end")
    timers.wrap(suite, "reset_batch", "reset")
    timers.wrap(suite, "step_batch", "step")
    try:
        yield timers
    finally:
        timers.undo()


# --------------------------------------------------------------------------------------------
# One rollout


def episodes_of(out: Path) -> dict[tuple[str, int], Any]:
    from tracekit.rollout import read_trajectories

    return {(t.task_id, t.sample): ([m.model_dump(mode="json") for m in t.messages], t.reward, t.info.get("turns"))
            for t in read_trajectories(out)}


def arm_settings(cuda: bool) -> dict[str, dict[str, Any]]:
    """The host-step arms (client attributes): ``batched`` is the client's default (on an accelerator: masks and
    picks there), ``reference`` the row-by-row step; on an accelerator ``host_pick`` is the batched step with the
    host's bit-exact float64 picks (the default before the device picks)."""
    arms = {"batched": {"batched_host_step": True, "pick_on_device": None},
            "reference": {"batched_host_step": False, "pick_on_device": None}}
    if cuda:
        arms["host_pick"] = {"batched_host_step": True, "pick_on_device": False}
    return arms


def exact_arm(batched_host_step: bool, pick_on_device: bool | None, cuda: bool) -> bool:
    """Whether an arm must give the reference's log-probs bit for bit (the device picks sum in another order)."""
    return not (batched_host_step and (cuda if pick_on_device is None else pick_on_device))


def close_logprobs(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and (a == b if tol == 0 else all(abs(p - q) <= tol for p, q in zip(a, b)))


def same_episode(a: Any, b: Any, tol: float) -> bool:
    """The same messages, reward and turn token ids; the turns' log-probs equal (``tol`` 0) or within ``tol``."""
    if tol == 0:
        return a == b
    (msgs_a, reward_a, turns_a), (msgs_b, reward_b, turns_b) = a, b
    turns_a, turns_b = turns_a or [], turns_b or []
    if (msgs_a, reward_a) != (msgs_b, reward_b) or len(turns_a) != len(turns_b):
        return False
    rest = lambda t: {k: v for k, v in t.items() if k != "completion_logprobs"}  # noqa: E731
    return all(rest(x) == rest(y) and close_logprobs(x.get("completion_logprobs") or [],
                                                     y.get("completion_logprobs") or [], tol)
               for x, y in zip(turns_a, turns_b))


def rollout_once(cfg, suite, agent, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """One rollout of the configured evaluation with the given host-step arm; -> seconds, split, tokens, episodes."""
    import torch

    from tracekit.rollout import run_rollouts

    client = agent.client
    agent.return_tokens = True  # the turns' token ids and log-probs: counted, and compared between the arms
    for k, v in settings.items():
        setattr(client, k, v)
    if client._grammar is not None:  # every rollout compiles its grammars, as a fresh evaluation does
        client._grammar.clear()
    client._prompts.clear()  # and renders its prompts (the cache serves one rollout's count-then-send)
    cuda = torch.cuda.is_available() and next(client.model.parameters()).is_cuda
    with instrumented(suite, cuda) as timers:
        t0 = time.perf_counter()
        summary = run_rollouts(suite, agent, out, samples=1, seed=cfg.eval.seeds[0], max_steps=cfg.eval.max_steps,
                               context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size, progress=False)
        wall = time.perf_counter() - t0
    client.batched_host_step, client.pick_on_device = True, None
    episodes = episodes_of(out)
    tokens = sum(len(t["completion_ids"]) for _, _, turns in episodes.values() for t in turns or [])
    return {"seconds": wall, "split": timers.split(wall), "episodes": len(episodes), "tokens": tokens,
            "turns": sum(len(turns or []) for _, _, turns in episodes.values()), "errors": summary.errors,
            "mean_reward": summary.mean_reward, "prefix_cache": summary.prefix_cache, "_episodes": episodes}


def first_turn_states(cfg, suite) -> list[Any]:
    """The agent's view of every episode's first turn (the episodes opened and reset, as a rollout does)."""
    from tracekit.agents import AgentState
    from tracekit.episodes import EpisodeRun

    runs = [EpisodeRun(t, 0, cfg.eval.seeds[0]) for t in suite.tasks()]
    for r in runs:
        r.open(suite)
    for r, obs in zip(runs, suite.reset_batch([r.episode for r in runs])):
        r.reset(obs)
    return [AgentState(r.task, r.messages, r.tools, r.seed, r.steps) for r in runs if not r.ended]


def warm_up(cfg, suite, agent) -> None:
    """One untimed turn of one episode: what a process pays once (the fast decoder's working copy, the grammar
    compiler's tokenizer tables, the stop-check table) stays out of the timed repeats."""
    agent.act(first_turn_states(cfg, suite)[:1])
    agent.clear_prefix_cache()


def random_lora(cfg, out: Path, seed: int = 0) -> Path:
    """A seeded LoRA adapter (r 8, every projection, B ~ N(0, 0.02)) on the configured backbone, saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from tracekit.llm.backbones import load_backbone
    from tracekit.wiring import backbone_dict

    model, _ = load_backbone(backbone_dict(cfg))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                          "down_proj"], task_type="CAUSAL_LM")
    gen = torch.Generator().manual_seed(seed)
    peft_model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    peft_model.save_pretrained(out)
    return out


def random_moe(cfg, out: Path, adapters: int, seed: int = 0) -> Path:
    """A seeded LoRA-MoE saved to ``out``: ``adapters`` random LoRAs (:func:`random_lora`, seeds seed..) composed
    with top-1 routing by random gates (N(0, 0.5)), so that tokens split over the adapters."""
    from tracekit.llm.backbones import load_backbone
    from tracekit.moe.model import MoEConfig, build_lora_moe
    from tracekit.wiring import backbone_dict

    dirs = {f"rand{i}": random_lora(cfg, out / f"adapter{i}", seed=seed + i) for i in range(adapters)}
    backbone, _ = load_backbone(backbone_dict(cfg))
    moe = build_lora_moe(backbone, dirs, MoEConfig(top_k=1, gate_init_std=0.5, seed=seed),
                         backbone_spec={"tracekit_backbone": backbone_dict(cfg)})
    return moe.save(out / "moe")


def summarize(runs: dict[str, list[dict[str, Any]]], tol: dict[str, float] | None = None) -> dict[str, Any]:
    """Medians and splits per arm; with a ``reference`` arm the ratios and how many episodes every arm decoded as
    it did (``tol``: an arm's log-prob tolerance, 0 where unnamed)."""
    arms = {}
    for arm, rs in runs.items():
        secs = [r["seconds"] for r in rs]
        med = statistics.median(secs)
        r0 = rs[0]
        arms[arm] = {
            "seconds": [round(s, 2) for s in secs], "median_s": round(med, 2),
            "episodes_per_s": round(r0["episodes"] / med, 4), "tokens_per_s": round(r0["tokens"] / med, 2),
            "episodes": r0["episodes"], "turns": r0["turns"], "generated_tokens": r0["tokens"],
            "errors": r0["errors"], "mean_reward": r0["mean_reward"],
            "split_median": {p: round(statistics.median(r["split"][p] for r in rs), 3) for p in PARTS},
            "split": [r["split"] for r in rs], "prefix_cache": r0["prefix_cache"],
        }
    out: dict[str, Any] = {"arms": arms}
    if "reference" in runs and "batched" in runs:
        ratios = [a["seconds"] / b["seconds"] for a, b in zip(runs["reference"], runs["batched"])]
        out["ratio_reference_over_batched"] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                               "max": round(max(ratios), 3), "per_repeat": [round(x, 3) for x in ratios]}
        host = [(a["split"]["mask"] + a["split"]["pick"] + a["split"]["compile"])
                / max(1e-9, b["split"]["mask"] + b["split"]["pick"] + b["split"]["compile"])
                for a, b in zip(runs["reference"], runs["batched"])]
        out["ratio_host_side"] = {"median": round(statistics.median(host), 2), "min": round(min(host), 2),
                                  "max": round(max(host), 2), "parts": ["mask", "pick", "compile"]}
        ref, tol = runs["reference"][0]["_episodes"], tol or {}
        out["identical"] = sum(all(k in r["_episodes"] and same_episode(r["_episodes"][k], v, tol.get(arm, 0.0))
                                   for arm, rs in runs.items() for r in rs) for k, v in ref.items())
        out["logprob_tolerance"] = {arm: tol.get(arm, 0.0) for arm in runs}
        out["episodes"] = len(ref)
    return out


def ratio(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds of ``runs`` over the base policy's, repeat by repeat (the arms interleaved): median, min, max; and
    per generated token (another policy writes other episodes, of other lengths)."""
    r = [a["seconds"] / b["seconds"] for a, b in zip(runs, base)]
    t = [(a["seconds"] / a["tokens"]) / (b["seconds"] / b["tokens"]) for a, b in zip(runs, base)]
    return {"median": round(statistics.median(r), 3), "min": round(min(r), 3), "max": round(max(r), 3),
            "per_repeat": [round(x, 3) for x in r], "per_token_median": round(statistics.median(t), 3),
            "per_token_min": round(min(t), 3), "per_token_max": round(max(t), 3)}


def run_target(name: str, args, tmp: Path) -> dict[str, Any]:
    from tracekit.wiring import build_agent, build_suite

    overrides = target_overrides(name, args.limit.get(name)) + args.overrides
    cfg = compose_config(overrides)
    suite, agent = build_suite(cfg), build_agent(cfg)
    cuda = next(agent.client.model.parameters()).is_cuda
    arms = arm_settings(cuda)
    agents = {arm: (agent, settings) for arm, settings in arms.items()}
    if args.lora and name == args.lora_target:  # the same episodes under a LoRA adapter (merged: the fast decoder)
        agents["lora"] = (build_agent(cfg, adapter=str(random_lora(cfg, tmp / "lora"))), arms["batched"])
    if args.moe and name == args.lora_target:  # and under a LoRA-MoE (its gates and bank in the fast decoder)
        agents["moe"] = (build_agent(cfg, moe=str(random_moe(cfg, tmp / "moe", args.moe_adapters))), arms["batched"])
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in agents}
    order = list(agents)
    warmup_s = {}
    if args.warmup == "rollout":  # every arm's whole rollout once, untimed: the batch sizes it meets as episodes
        # end are the timed repeats' (the same episodes), so every CUDA graph and compiled shape is built here
        for arm in order:
            policy, settings = agents[arm]
            warmup_s[arm] = round(rollout_once(cfg, suite, policy, settings, tmp / f"{name}-{arm}-warm")["seconds"], 2)
            policy.clear_prefix_cache()
        print(f"  {name} warm-up rollouts (untimed): " + ", ".join(f"{a} {s:.1f} s" for a, s in warmup_s.items()),
              flush=True)
    else:  # one turn per policy: the per-process costs only (quick, but shapes met later are compiled in repeat 0)
        for policy, _ in {id(a): (a, b) for a, b in agents.values()}.values():
            warm_up(cfg, suite, policy)
    for i in range(args.repeats):
        for arm in (order if i % 2 == 0 else order[::-1]):
            policy, settings = agents[arm]
            r = rollout_once(cfg, suite, policy, settings, tmp / f"{name}-{arm}{i}")
            runs[arm].append(r)
            print(f"  {name} repeat {i} {arm:>9}: {r['seconds']:7.1f} s  " + " ".join(f"{p} {r['split'][p]:.1f}" for p in PARTS),
                  flush=True)
    lora, moe = runs.pop("lora", None), runs.pop("moe", None)
    result = {"overrides": overrides, "batch_size": cfg.agent.batch_size, "max_steps": cfg.eval.max_steps,
              "max_new_tokens": cfg.agent.max_new_tokens, "warmup": args.warmup, "warmup_seconds": warmup_s,
              **summarize(runs, {arm: 0.0 if exact_arm(arms[arm]["batched_host_step"], arms[arm]["pick_on_device"], cuda)
                                else LOGPROB_TOL for arm in runs})}
    if lora:
        result["lora"] = summarize({"batched": lora})["arms"]["batched"]
        result["lora"]["note"] = "a seeded random LoRA (r 8, every projection): other episodes than the base policy's"
        result["ratio_lora_over_base"] = ratio(lora, runs["batched"])
        agents["lora"][0].close()
    if moe:
        result["moe"] = summarize({"batched": moe})["arms"]["batched"]
        result["moe"]["note"] = (f"a seeded random LoRA-MoE, {args.moe_adapters} random LoRAs (r 8, every projection), "
                                 "top-1 by random gates: other episodes than the base policy's")
        result["moe"]["decoder"] = "fast" if agents["moe"][0].client._decoder is not None else "plain"
        result["ratio_moe_over_base"] = ratio(moe, runs["batched"])
        agents["moe"][0].close()
    agent.close()
    getattr(suite, "close", lambda: None)()
    return result


# --------------------------------------------------------------------------------------------
# The host side at a GPU's batch size: the model replaced by seeded random logits


class ReplaySession:
    """A session whose logits are seeded random draws (a pool cycled, copied per step: the host step masks them in
    place); the same for every arm, so both arms decode the same tokens."""

    can_prune = False

    def __init__(self, batch: int, vocab: int, pool: list[Any]):
        self.batch, self.pool, self.t = batch, pool, 0
        self.dev = pool[0].device

    def prefill(self):
        self.t = 0
        return self.pool[0][: self.batch].clone()

    def step(self, tokens, active):
        self.t += 1
        return self.pool[self.t % len(self.pool)][: self.batch].clone()


def host_section(args) -> dict[str, Any]:
    import torch

    from tracekit.wiring import build_agent, build_suite

    rows = args.host_rows
    cfg = compose_config(["experiment=gain", f"benchmark.limit={-(-rows // 3)}"] + args.overrides)
    suite, agent = build_suite(cfg), build_agent(cfg)
    client = agent.client
    agent.return_tokens = True
    states = first_turn_states(cfg, suite)[:rows]
    gen = torch.Generator().manual_seed(0)
    vocab = client._vocab
    cuda = torch.cuda.is_available()  # the logits where a GPU's model leaves them
    pool = [(torch.randn((len(states), vocab), generator=gen) * 4).to("cuda" if cuda else "cpu") for _ in range(8)]
    client.max_batch_size = len(states)
    client._session = lambda prompts, max_new: ReplaySession(len(prompts), vocab, pool)
    agent.act(states[:8])  # untimed: the grammar compiler's and the stop check's tables
    threads = client.host_threads
    # arm: (batched_host_step, host_threads, pick_on_device)
    arms = {"reference": (False, 1, None), "batched": (True, threads, None)}
    if cuda:
        arms["host_pick"] = (True, threads, False)
    if args.host_threads != threads:  # the host's picks on another number of threads
        arms[f"host_pick_{args.host_threads}threads"] = (True, args.host_threads, False)
    tol = {arm: 0.0 if exact_arm(step, pick, cuda) else LOGPROB_TOL for arm, (step, _, pick) in arms.items()}
    out: dict[str, Any] = {"rows": len(states), "vocab": vocab, "max_new_tokens": agent.max_new_tokens,
                           "logits_on": "cuda" if cuda else "cpu", "logprob_tolerance": tol,
                           "threads": threads, "compile_threads": client.compile_threads, "arms": list(arms)}
    for temperature in (0.0, 0.7):
        agent.temperature = temperature
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        compile_s: dict[str, list[float]] = {arm: [] for arm in arms}
        first: list[Any] | None = None
        steps = row_steps = 0
        order = list(arms)
        for i in range(args.repeats):
            for arm in (order if i % 2 == 0 else order[::-1]):
                client.batched_host_step, client.host_threads, client.pick_on_device = arms[arm]
                if client._grammar is not None:
                    client._grammar.clear()
                client._prompts.clear()
                with instrumented(suite, False) as timers:
                    timers.wrap(ReplaySession, "prefill", "prefill")
                    timers.wrap(ReplaySession, "step", "decode")
                    resps = agent.act(states)
                t = timers.t
                host = t["generate"] - t["prefill"] - t["decode"]  # mask + pick: the whole host step
                times[arm].append(host)
                compile_s[arm].append(t["compile"])
                rs = [(r.completion_token_ids, r.completion_logprobs) for r in resps]
                if first is None:
                    first = rs
                elif not all(a[0] == b[0] and close_logprobs(a[1], b[1], tol[arm]) for a, b in zip(first, rs)):
                    raise SystemExit(f"host section: arm {arm} decoded other tokens or log-probs at T={temperature}")
                steps = max(len(r.completion_token_ids) for r in resps)
                row_steps = sum(len(r.completion_token_ids) for r in resps)
                print(f"  host T={temperature} repeat {i} {arm:>17}: {host:6.2f} s for {steps} steps "
                      f"({1e3 * host / steps:.1f} ms/step, {1e6 * host / row_steps:.0f} us/row-step), "
                      f"grammar compile {t['compile']:.2f} s", flush=True)
        client.batched_host_step, client.host_threads, client.pick_on_device = True, threads, None
        res: dict[str, Any] = {"steps": steps, "row_steps": row_steps}
        for arm in arms:
            med = statistics.median(times[arm])
            res[arm] = {"s": [round(x, 3) for x in times[arm]], "ms_per_step": round(1e3 * med / steps, 2),
                        "us_per_row_step": round(1e6 * med / row_steps, 1),
                        "compile_s": [round(x, 3) for x in compile_s[arm]]}
            if arm != "reference":
                ratios = [a / b for a, b in zip(times["reference"], times[arm])]
                res[arm]["ratio_vs_reference"] = {"median": round(statistics.median(ratios), 2),
                                                  "min": round(min(ratios), 2), "max": round(max(ratios), 2)}
                cr = [a / max(b, 1e-9) for a, b in zip(compile_s["reference"], compile_s[arm])]
                res[arm]["compile_ratio_vs_reference"] = round(statistics.median(cr), 2)
        res["identical"] = True
        out[f"T={temperature}"] = res
    agent.close()
    return out


# --------------------------------------------------------------------------------------------
# Plain transformers generate on the first turn


def generate_section(args) -> dict[str, Any]:
    import torch

    from tracekit.llm.tools import encode_prompt
    from tracekit.wiring import build_agent, build_suite

    cfg = compose_config(target_overrides("tau2_mini", None) + args.overrides)
    suite, agent = build_suite(cfg), build_agent(cfg)
    client = agent.client
    states = first_turn_states(cfg, suite)[: args.generate]
    warm_up(cfg, suite, agent)
    model, tok = client.model, client.tokenizer
    prompts = [encode_prompt(tok, s.messages, s.tools) for s in states]
    new = agent.max_new_tokens
    pad = client.pad_id

    def plain(batch: list[list[int]]) -> int:
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                 eos_token_id=client.stop_ids, pad_token_id=pad)
        stop = set(client.stop_ids)  # a finished row is padded after its stop token
        return sum(next((i + 1 for i, t in enumerate(row) if t in stop), len(row)) for row in out[:, width:].tolist())

    arms = {
        "client_batched": lambda: sum(len(r.completion_token_ids) for r in client.chat(
            [replace(agent.request(s), return_tokens=True) for s in states])),
        "generate_batched": lambda: plain(prompts),
        "generate_one_at_a_time": lambda: sum(plain([p]) for p in prompts),
    }
    times: dict[str, list[float]] = {a: [] for a in arms}
    tokens: dict[str, int] = {}
    names = list(arms)
    for i in range(args.repeats):
        for a in (names if i % 2 == 0 else names[::-1]):
            client.clear_prefix_cache()
            t0 = time.perf_counter()
            tokens[a] = arms[a]()
            times[a].append(time.perf_counter() - t0)
            print(f"  generate repeat {i} {a:>22}: {times[a][-1]:6.1f} s, {tokens[a]} tokens", flush=True)
    client.clear_prefix_cache()
    agent.close()
    return {"prompts": len(prompts), "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": new,
            **{a: {"seconds": [round(x, 2) for x in times[a]], "tokens": tokens[a],
                   "tokens_per_s": round(tokens[a] / statistics.median(times[a]), 2)} for a in arms},
            "note": "client_batched decodes with the configured grammar (tool_choice=required); generate has none, "
                    "so its rows may stop at a different length: compare tokens/s, not seconds"}


# --------------------------------------------------------------------------------------------
# The environment's cost alone: real tau^2 retail with the gold agent, in process vs an env pool


def gold_suite(limit: int) -> Any:
    """Real tau^2 retail (test split, scripted user), the first ``limit`` tasks: the gold section's suite (also a
    :class:`~tracekit.envs.pool.SuiteSpec` factory, so the workers build the same one)."""
    from tracekit.targets.tau2.suite import Tau2Suite
    from tracekit.targets.tau2.users import ScriptedUser

    return Tau2Suite(name="tau2_retail", domains=["retail"], limit=limit, user=ScriptedUser(max_turns=10))


def gold_section(args) -> dict[str, Any]:
    """``env_workers=0`` (in process, today's path) against ``env_workers=N`` on the same gold-agent episodes,
    interleaved (ABBA) over ``--repeats``; the pool's start (worker processes building their suites) is timed
    apart from its rollouts. Every arm must give the same trajectories."""
    from tracekit.agents import GoldAgent
    from benchmarks.rollout_throughput import gold_suite as factory  # by its module's name: this file may be __main__
    from tracekit.envs.pool import EnvPool, PooledSuite, SuiteSpec
    from tracekit.rollout import read_trajectories, run_rollouts

    n = args.gold_workers
    spec = SuiteSpec(factory, (args.gold,), preload=("tracekit.targets.tau2.suite",))
    suite = gold_suite(args.gold)
    arms = ["serial", f"pool{n}"]
    times: dict[str, list[float]] = {a: [] for a in arms}
    starts: list[float] = []
    seen: dict[str, Any] = {}
    t0 = time.perf_counter()
    pool = EnvPool(spec, n)  # one pool for the section, as a rollout stage starts one per rollout
    starts.append(time.perf_counter() - t0)
    stepped = {"serial": suite, arms[1]: PooledSuite(suite, pool)}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for a in arms:  # untimed: what a process pays once (imports, the domain's data, first evaluations)
                run_rollouts(stepped[a], GoldAgent(), Path(tmp) / f"warm-{a}", max_steps=50, batch_size=args.gold_batch,
                             progress=False)
            for i in range(args.repeats):
                for a in (arms if i % 2 == 0 else arms[::-1]):
                    out = Path(tmp) / f"{a}-{i}"
                    t0 = time.perf_counter()
                    s = run_rollouts(stepped[a], GoldAgent(), out, max_steps=50, batch_size=args.gold_batch,
                                     progress=False)
                    times[a].append(time.perf_counter() - t0)
                    seen[a] = {(t.task_id, t.sample): ([m.model_dump(mode="json") for m in t.messages], t.reward)
                               for t in read_trajectories(out)}
                    print(f"  gold repeat {i} {a:>7}: {times[a][-1]:6.2f} s, {s.ran} episodes, mean reward "
                          f"{s.mean_reward:.3f}, errors {s.errors}", flush=True)
    finally:
        pool.close()
    t0 = time.perf_counter()
    with EnvPool(spec, n):  # a second pool in the same process: the forkserver already holds the imports
        starts.append(time.perf_counter() - t0)
    ratios = [a / b for a, b in zip(times["serial"], times[arms[1]])]
    ref = seen["serial"]
    return {
        "target": "tau2 retail (test split), gold agent, scripted user", "episodes": len(ref),
        "workers": n, "batch_size": args.gold_batch,
        **{a: {"seconds": [round(x, 3) for x in times[a]], "median_s": round(statistics.median(times[a]), 3),
               "episodes_per_s": round(len(ref) / statistics.median(times[a]), 3)} for a in arms},
        "pool_start_s": [round(x, 3) for x in starts],
        "ratio_serial_over_pool": {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                   "max": round(max(ratios), 3)},
        "identical": sum(seen[arms[1]].get(k) == v for k, v in ref.items()),
        "note": f"within-run ratio on this machine ({os.cpu_count()} CPUs, load average at start in machine); the "
                "pool's start (pool_start_s: the first with a cold forkserver importing tau2, then a second pool's) is "
                "paid once per rollout and is not in the ratio; each arm warmed by one untimed rollout",
    }


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    """``results`` to ``path`` atomically (a temporary file, then ``os.replace``): written after every section, so
    a run cut by a time limit keeps the sections already done."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'target':>10} {'arm':>9} {'median s':>9} {'ep/s':>7} {'tok/s':>7} " + " ".join(f"{p:>8}" for p in PARTS))
    for name, res in results["targets"].items():
        arms = dict(res["arms"])
        arms.update({arm: res[arm] for arm in ("lora", "moe") if arm in res})
        for arm, a in arms.items():
            print(f"{name:>10} {arm:>9} {a['median_s']:>9.1f} {a['episodes_per_s']:>7.3f} {a['tokens_per_s']:>7.1f} "
                  + " ".join(f"{a['split_median'][p]:>8.2f}" for p in PARTS))
        if "ratio_reference_over_batched" in res:
            r, h = res["ratio_reference_over_batched"], res["ratio_host_side"]
            print(f"{'':>10} ratio reference/batched: wall {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f}), "
                  f"host side (mask+pick+compile) {h['median']:.2f}x ({h['min']:.2f}-{h['max']:.2f}); "
                  f"identical episodes {res['identical']}/{res['episodes']}")
        for arm in ("lora", "moe"):
            if f"ratio_{arm}_over_base" in res:
                r = res[f"ratio_{arm}_over_base"]
                print(f"{'':>10} ratio {arm}/base: {r['median']:.3f}x ({r['min']:.3f}-{r['max']:.3f}), per generated token "
                      f"{r['per_token_median']:.3f}x ({r['per_token_min']:.3f}-{r['per_token_max']:.3f})")
    if "host" in results:
        h = results["host"]
        print(f"\nhost step without a model, {h['rows']} rows x {h['vocab']} vocab, {h['threads']} host thread(s) by default "
              f"(same tokens in every arm, log-probs within {h['logprob_tolerance']}):")
        for key in ("T=0.0", "T=0.7"):
            x = h[key]
            for arm in h["arms"]:
                a = x[arm]
                ratio = a.get("ratio_vs_reference")
                print(f"  {key} {arm:>17}: {a['ms_per_step']:7.1f} ms/step {a['us_per_row_step']:6.0f} us/row-step"
                      + (f"  {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "")
                      + f"  grammar compile {statistics.median(a['compile_s']):.2f} s")
    if "gold" in results:
        g = results["gold"]
        r = g["ratio_serial_over_pool"]
        pool = f"pool{g['workers']}"
        print(f"\n{g['target']}, {g['episodes']} episodes (the environment's cost alone): serial "
              f"{g['serial']['median_s']:.2f} s ({g['serial']['episodes_per_s']:.2f} ep/s), {g['workers']} env workers "
              f"{g[pool]['median_s']:.2f} s ({g[pool]['episodes_per_s']:.2f} ep/s); serial/pool {r['median']:.2f}x "
              f"({r['min']:.2f}-{r['max']:.2f}); pool start {g['pool_start_s'][0]:.1f} s (cold forkserver), "
              f"{g['pool_start_s'][1]:.1f} s (warm); "
              f"identical episodes {g['identical']}/{g['episodes']}")
    if "generate" in results:
        g = results["generate"]
        print(f"\nfirst turn of {g['prompts']} tau2_mini episodes ({g['prompt_tokens']} prompt tokens), tokens/s:")
        for a in ("client_batched", "generate_batched", "generate_one_at_a_time"):
            print(f"  {a:>22}: {g[a]['tokens_per_s']:.1f} tok/s ({g[a]['tokens']} tokens, s: {g[a]['seconds']})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides applied to every target's config")
    ap.add_argument("--targets", nargs="*", default=["tau2_mini", "gain"], help="rollout targets (none: only the other sections)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", choices=("rollout", "turn"), default="rollout",
                    help="before the timed repeats: each arm's whole rollout once (every shape compiled), or one turn")
    ap.add_argument("--gain-limit", type=int, default=1, help="gain: tasks per environment")
    ap.add_argument("--host-rows", type=int, default=256, help="rows of the model-free host section (0: skip)")
    ap.add_argument("--host-threads", type=int, default=2, help="host section: also this many pick threads")
    ap.add_argument("--generate", type=int, default=0, help="first-turn prompts for plain transformers generate (0: skip)")
    ap.add_argument("--lora", action="store_true", help="also roll out a seeded random LoRA adapter (batched arm)")
    ap.add_argument("--moe", action="store_true", help="also roll out a seeded random LoRA-MoE (batched arm)")
    ap.add_argument("--moe-adapters", type=int, default=3, help="random adapters the LoRA-MoE composes")
    ap.add_argument("--lora-target", default="tau2_mini", help="the target of the lora and moe arms")
    ap.add_argument("--gold", type=int, default=0,
                    help="real tau^2 retail tasks for the gold-agent section (env_workers=0 vs N; 0: skip)")
    ap.add_argument("--gold-workers", type=int, default=2, help="gold section: env worker processes")
    ap.add_argument("--gold-batch", type=int, default=8, help="gold section: live episodes (batch size)")
    ap.add_argument("--json", type=Path, default=None, help="results, rewritten after every section")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    args.limit = {"gain": args.gain_limit}
    import torch

    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    "load_average_at_start": os.getloadavg()},
        "repeats": args.repeats, "targets": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.targets:
            print(f"target {name}", flush=True)
            res = run_target(name, args, Path(tmp))
            results["targets"][name] = res
            if res.get("identical") != res.get("episodes"):
                print(f"  {name}: episodes differ between the arms ({res.get('identical')}/{res.get('episodes')})")
            write_json(args.json, results)
        if args.host_rows > 0:
            print("host step at a GPU batch size (no model)", flush=True)
            results["host"] = host_section(args)
            write_json(args.json, results)
        if args.generate > 0:
            print("plain transformers generate, first turn", flush=True)
            results["generate"] = generate_section(args)
            write_json(args.json, results)
        if args.gold > 0:
            print(f"real tau^2 retail, gold agent: env_workers=0 vs {args.gold_workers}", flush=True)
            results["gold"] = gold_section(args)
            write_json(args.json, results)
    results["machine"]["load_average_at_end"] = os.getloadavg()
    print_table(results)
    write_json(args.json, results)
    same = all(r.get("identical") == r.get("episodes") for r in [*results["targets"].values(), results.get("gold", {})])
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
