"""``gepa``: prompt optimization of the capabilities block with the real ``gepa`` package (paper Tables 1-3,
6; Figure 4). The paper hands GEPA the capabilities TRACE identified and lets it refine their descriptions
in the agent's system prompt for the pass rate on the target, at a matched budget.

- Candidate: one component per selected capability (name -> description), top-ranked first; the policy's
  system-prompt suffix is :func:`~tracekit.methods.target_train.capabilities_block` of the candidate. The seed
  candidate is exactly ``prompt_only``'s block.
- :class:`TargetAdapter` (a ``gepa.GEPAAdapter``) over tracekit's rollout runner: ``evaluate`` rolls a batch of
  the target's *training* tasks out with the candidate's prompt (the evaluation agent and decoding); the score
  is the episode's success (a failing or crashing episode scores 0, nothing raises); ``make_reflective_dataset``
  builds one record per episode (the request, a compact transcript of the calls and results, the outcome and
  the verifier's info as feedback) for each component to update.
- Budget: ``baselines.gepa.max_metric_calls`` training episodes, by default TRACE's per-capability GRPO
  episodes (``train`` is then an input). A metric call is one episode rolled out: each candidate's episodes
  are kept per (candidate text, task) under the run's ``episodes/`` ledger, so a repeated evaluation (gepa's
  ``cache_evaluation`` semantics) and a resumed run never pay twice. gepa's own metric-call stopper may
  overshoot by an iteration; a ledger stopper instead ends the loop before an iteration that could exceed the
  budget (``2 x reflection_minibatch_size + |valset|`` episodes at most), so the budget is never exceeded.
- Reflection LM: ``llm.endpoints.<baselines.gepa.endpoint>`` (openai: any server; hf: the backbone in process),
  at ``reflection_temperature``. When it fails (unreachable), the loop stops, gepa's state is saved, and the
  stage fails with one line naming the endpoint; a rerun resumes.
- Resume: the run is a sub-artifact ``gepa_runs/<key>`` computed in its ``.partial`` dir, which holds gepa's
  ``run_dir`` (``gepa_state.bin``, saved each iteration) and the ledger. gepa does not persist its samplers'
  RNG: a resumed run continues from the saved state, not with the same minibatches.
- Validation split: ``valset_size`` training tasks (auto: a tenth of the budget, at most half the training
  tasks, at least 1) for gepa's Pareto tracking; the rest are the reflection minibatches' pool. The best
  candidate (by gepa's valset score) is evaluated on the test tasks like any policy; its text is saved.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, ClassVar

from tracekit.artifacts import Artifact, JsonlAppender, atomic_write_json, iter_jsonl, read_json
from tracekit.llm.base import ChatRequest, EndpointError
from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.target_train import (capabilities_block, open_target_train, ranked_capabilities,
                                           refuse_without_training_split, trace_episodes, train_suite_reads,
                                           train_suite_spec)
from tracekit.pipeline import Stage, derive_seed
from tracekit.policy import Budget, Policy
from tracekit.ranges import Choice
from tracekit.rollout import TRAJECTORIES, load_done, run_rollouts
from tracekit.synthesis.stage import trajectory_excerpt
from tracekit.targets.registry import target, target_of
from tracekit.types import Message, stable_hash
from tracekit.wiring import client_for, llm_agent, release_client, select

log = logging.getLogger(__name__)


@dataclass
class GepaSettings:
    """gepa: the ``gepa`` package's optimize loop over the capabilities block of the system prompt."""

    endpoint: str = "analysis"  # the reflection LM: a key of llm.endpoints (llm=local: the backbone in process)
    # target training episodes GEPA may roll out (each rolled-out episode is one metric call); None: TRACE's episodes
    # (matched)
    max_metric_calls: int | None = None
    reflection_minibatch_size: int = 3  # gepa's default
    # training tasks held out for GEPA's Pareto tracking; None: auto (a tenth of the budget, at most half the
    # training tasks)
    valset_size: int | None = None
    train_limit: int | None = None  # target training tasks GEPA draws from (official: 200 seeds); None: all
    candidate_selection: str = "pareto"  # pareto | current_best | epsilon_greedy | top_k_pareto (gepa's strategies)
    module_selector: str = "round_robin"  # round_robin (one capability description per proposal) | all
    use_merge: bool = False
    reflection_temperature: float = 0.7  # official TRACE GEPA run
    reflection_max_new_tokens: int = 1024

    RANGES: ClassVar[dict[str, str]] = {
        "max_metric_calls": ">= 1", "reflection_minibatch_size": ">= 1", "valset_size": ">= 1", "train_limit": ">= 2",
        "reflection_temperature": "[0, 2]", "reflection_max_new_tokens": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {
        "endpoint": r"[A-Za-z_][\w\-]*",  # a key of llm.endpoints (checked in validate())
        "candidate_selection": ("pareto", "current_best", "epsilon_greedy", "top_k_pareto"),
        "module_selector": ("round_robin", "all")}


LABEL = "GEPA"
RESULT = "gepa.json"  # the gepa stage's pointer to its run
RUN_RESULT = "gepa_result.json"  # a run's outcome
OFFICIAL_TRAIN_SEEDS = 200  # official TRACE GEPA: 200 training seeds (synthetic targets: instances in all)

REFLECTION_TEMPLATE = """I gave a tool-using agent a system prompt that lists capabilities it must exercise. One entry \
describes the capability "{name}":
```
<curr_param>
```

Below are tasks the agent attempted with this system prompt: the request, the agent's tool calls and results, \
and feedback on the outcome:
```
<side_info>
```

Write an improved description of this capability: what the agent must do, when, and how to check that it did, \
using what the failures show (tool names, argument values, policy rules seen above). Keep it short (a few \
sentences) and specific. Provide the new description within ``` blocks."""


# --------------------------------------------------------------------------------------------
# config reads


def run_reads(cfg) -> tuple[str, ...]:
    """What a GEPA run depends on: the agent and its decoding (as evaluation), the target's training suite,
    the gepa settings, the reflection endpoint, the master seed."""
    return ("backbone", "agent", "eval.temperature", "eval.seeds", "eval.max_steps", "eval.context_budget",
            *train_suite_reads(cfg), "baselines.gepa", f"llm.endpoints.{cfg.baselines.gepa.endpoint}", "seed")


def stage_inputs(cfg) -> tuple[str, ...]:
    return ("select", *(("train",) if cfg.baselines.gepa.max_metric_calls is None else ()))


def _values(cfg, keys) -> dict[str, Any]:
    return select(cfg, tuple(keys))


# --------------------------------------------------------------------------------------------
# the adapter, the reflection LM, the stopper, the recorder


class TargetAdapter:
    """``gepa.GEPAAdapter`` over tracekit's rollout runner on the target's training tasks."""

    propose_new_texts = None  # gepa's reflective proposer writes the texts

    def __init__(self, cfg, suite, root: Path, order: list[str], seed: int):
        self.cfg, self.suite, self.root, self.order = cfg, suite, Path(root), list(order)
        self.seed = cfg.eval.seeds[0] if cfg.eval.temperature == 0 else seed
        self.root.mkdir(parents=True, exist_ok=True)
        self.spent = self.ledger_size()
        self.generated_tokens = 0

    def ledger_size(self) -> int:
        return sum(sum(1 for _ in iter_jsonl(p)) for p in self.root.glob(f"*/{TRAJECTORIES}"))

    def suffix(self, candidate: dict[str, str]) -> str:
        return capabilities_block([(name, candidate[name]) for name in self.order])

    def evaluate(self, batch, candidate, capture_traces: bool = False):
        from gepa import EvaluationBatch


        suffix = self.suffix(candidate)
        d = self.root / stable_hash(suffix, length=16)
        if not (d / "candidate.json").exists():
            atomic_write_json(d / "candidate.json", {"candidate": candidate, "system_prompt_suffix": suffix})
        before = load_done(d / TRAJECTORIES)
        error = None
        try:
            agent = llm_agent(self.cfg, self.cfg.eval.temperature, system_prompt_suffix=suffix)
            agent.return_tokens = True  # the generated tokens are part of the budget
            run_rollouts(self.suite, agent, d, samples=1, seed=self.seed, max_steps=self.cfg.eval.max_steps,
                         context_budget=self.cfg.eval.context_budget, batch_size=self.cfg.agent.batch_size,
                         tasks=list(batch), progress=False)
        except Exception as e:  # never raise for examples (gepa's contract): they score 0 with the error
            error = f"{type(e).__name__}: {e}"
            log.warning("gepa: rollouts of a candidate failed: %s", error)
        done = load_done(d / TRAJECTORIES)
        fresh = [t for k, t in done.items() if k not in before]
        self.spent += len(fresh)
        self.generated_tokens += sum(len(turn.get("completion_ids", ())) for t in fresh
                                     for turn in t.info.get("turns", ()))
        outputs, scores, trajs = [], [], []
        for task in batch:
            t = done.get((task.id, 0))
            ok = bool(t and t.success)
            outputs.append({"task": task.id, "success": ok, "reward": float(t.reward) if t else 0.0})
            scores.append(1.0 if ok else 0.0)
            trajs.append({"task": task, "trajectory": t, "error": None if t else error or "no trajectory"})
        return EvaluationBatch(outputs=outputs, scores=scores, trajectories=trajs if capture_traces else None,
                               num_metric_calls=len(fresh))

    def make_reflective_dataset(self, candidate, eval_batch, components_to_update):
        records = []
        for score, tr in zip(eval_batch.scores, eval_batch.trajectories or [], strict=False):
            t, task = tr["trajectory"], tr["task"]
            request = next((m.content for m in (t.messages if t else []) if m.role == "user" and m.content), None)
            feedback = _feedback(t, tr["error"], score)
            records.append({"Inputs": {"request": (request or task.instruction or task.id)[:800]},
                            "Generated Outputs": trajectory_excerpt(t, 1500) if t else "(no episode)",
                            "Feedback": feedback})
        return {name: records for name in components_to_update}


def _feedback(t, error: str | None, score: float) -> str:
    if t is None:
        return f"The episode could not run ({error}). Score 0."
    if score >= 1.0:
        return f"The task was solved (reward {t.reward:.2f})."
    info = {k: v for k, v in t.info.items() if k not in ("turns", "steps", "seconds")}
    text = f"The task failed (reward {t.reward:.2f}; the episode ended by {t.termination or 'done'})."
    if t.error:
        text += f" Error: {t.error[:300]}."
    if info:
        text += f" Verifier: {json.dumps(info, default=str)[:600]}"
    return text


class ReflectionLM:
    """The reflection LM as gepa wants it (``prompt -> text``) over a tracekit chat client. The first endpoint
    failure is kept (``error``): the stopper then ends the loop, gepa saves its state, the stage names it."""

    def __init__(self, client, endpoint: str, url: str | None, temperature: float, max_new_tokens: int, seed: int,
                 log_path: Path):
        self.client, self.endpoint, self.url = client, endpoint, url
        self.temperature, self.max_new_tokens, self.seed = temperature, max_new_tokens, seed
        self.log_path = log_path
        self.error: Exception | None = None
        self.calls = sum(1 for _ in iter_jsonl(log_path)) if log_path.exists() else 0
        self.generated_tokens = 0

    def __call__(self, prompt) -> str:
        if self.error is not None:
            raise self.error
        text = prompt if isinstance(prompt, str) else "\n\n".join(
            str(m.get("content")) for m in prompt)  # gepa's chat-messages form (images: not used here)
        req = ChatRequest(messages=[Message(role="user", content=text)], temperature=self.temperature,
                          max_new_tokens=self.max_new_tokens, seed=derive_seed(self.seed, "reflection", self.calls))
        try:
            resp = self.client.chat([req])[0]
        except EndpointError as e:
            self.error = e
            raise
        out = resp.text or resp.message.content or ""
        self.calls += 1
        self.generated_tokens += int(resp.usage.get("completion_tokens") or len(resp.completion_token_ids or ())
                                     or len(out) // 4)
        with JsonlAppender(self.log_path) as sink:
            sink.append({"call": self.calls, "prompt_chars": len(text), "output": out})
        return out


class LedgerStopper:
    """Stop before an iteration that could exceed the budget (or after a reflection-endpoint failure)."""

    def __init__(self, adapter: TargetAdapter, reflection: ReflectionLM, budget: int, worst_iteration: int):
        self.adapter, self.reflection, self.budget, self.worst = adapter, reflection, budget, worst_iteration

    def __call__(self, state) -> bool:
        return self.reflection.error is not None or self.adapter.spent + self.worst > self.budget


class Recorder:
    """gepa callbacks -> JSONL: every candidate added (with the episodes spent when it was found) and every
    proposal (accepted or not). A resumed run's replays are deduplicated by candidate index."""

    def __init__(self, root: Path, adapter: TargetAdapter):
        self.root, self.adapter = root, adapter
        self.seen = {r["idx"] for r in iter_jsonl(root / "candidates.jsonl")} if (root / "candidates.jsonl").exists() else set()

    def on_valset_evaluated(self, event) -> None:
        if event["candidate_idx"] in self.seen:
            return
        self.seen.add(event["candidate_idx"])
        with JsonlAppender(self.root / "candidates.jsonl") as sink:
            sink.append({"idx": event["candidate_idx"], "iteration": event["iteration"],
                         "parents": [p for p in event["parent_ids"] if p is not None],
                         "val_score": event["average_score"], "episodes": self.adapter.spent,
                         "candidate": dict(event["candidate"])})

    def on_proposal_end(self, event) -> None:
        with JsonlAppender(self.root / "proposals.jsonl") as sink:
            sink.append({"iteration": event["iteration"], "texts": dict(event["new_instructions"]),
                         "episodes": self.adapter.spent, "time": time.time()})


class _FileLogger:
    def __init__(self, path: Path):
        self.path = path

    def log(self, message: str) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(f"{message}\n")
        log.debug("gepa: %s", message)


# --------------------------------------------------------------------------------------------
# one run


def auto_valset_size(budget: int, n_tasks: int) -> int:
    return max(1, min(n_tasks // 2 if n_tasks > 1 else 1, budget // 10))


def training_spec(cfg) -> dict[str, Any]:
    """The spec of the target's training suite GEPA draws its train and validation sets from."""
    s = cfg.baselines.gepa
    n_envs = target_of(cfg).train_envs(cfg)  # synthetic targets: the seeds spread over their environments
    return train_suite_spec(cfg, n_per_env=s.train_limit or math.ceil(OFFICIAL_TRAIN_SEEDS / n_envs),
                            limit=s.train_limit)


def training_tasks(cfg) -> tuple[Any, list[Any]]:
    """The target's training suite for GEPA and its tasks."""
    suite = open_target_train(training_spec(cfg))
    return suite, suite.tasks()


def run_gepa(cfg, capabilities: list[dict[str, str]], budget: int, work: Path, seed: int) -> dict[str, Any]:
    """One gepa.optimize run in ``work`` (resumable); writes and returns ``gepa_result.json``'s content."""
    import gepa


    s = cfg.baselines.gepa
    suite, tasks = training_tasks(cfg)
    rng = random.Random(derive_seed(seed, "gepa-split"))
    order = list(range(len(tasks)))
    rng.shuffle(order)
    n_val = s.valset_size or auto_valset_size(budget, len(tasks))
    n_val = min(n_val, len(tasks))
    valset = [tasks[i] for i in order[:n_val]]
    trainset = [tasks[i] for i in order[n_val:]] or valset
    mb = s.reflection_minibatch_size
    worst = 2 * mb + n_val
    if budget < n_val + worst:
        raise ValueError(f"gepa: max_metric_calls={budget} cannot pay for the seed candidate's valset evaluation "
                         f"({n_val}) and one proposal (up to {worst} episodes): raise baselines.gepa.max_metric_calls "
                         "or lower reflection_minibatch_size / valset_size")
    names = [c["name"] for c in capabilities]
    adapter = TargetAdapter(cfg, suite, work / "episodes", names, seed)
    ep = cfg.llm.endpoints[s.endpoint]
    reflection = ReflectionLM(client_for(cfg, s.endpoint), s.endpoint, ep.get("base_url"), s.reflection_temperature,
                              s.reflection_max_new_tokens, seed, work / "reflections.jsonl")
    recorder = Recorder(work, adapter)
    run_dir = work / "gepa"
    run_dir.mkdir(parents=True, exist_ok=True)
    result = gepa.optimize(
        seed_candidate={c["name"]: c["description"] for c in capabilities}, trainset=trainset, valset=valset,
        adapter=adapter, reflection_lm=reflection,
        reflection_prompt_template={n: REFLECTION_TEMPLATE.format(name=n.replace("_", " ")) for n in names},
        candidate_selection_strategy=s.candidate_selection, module_selector=s.module_selector,
        use_merge=s.use_merge, reflection_minibatch_size=mb, stop_callbacks=[LedgerStopper(adapter, reflection,
                                                                                           budget, worst)],
        run_dir=str(run_dir), callbacks=[recorder], logger=_FileLogger(run_dir / "run_log.txt"), seed=seed,
        raise_on_exception=True, display_progress_bar=False, track_best_outputs=False)
    if reflection.error is not None:
        raise EndpointError(f"gepa: reflection LM llm.endpoints.{s.endpoint}"
                            f"{f' ({reflection.url})' if reflection.url else ''} failed: "
                            f"{' '.join(str(reflection.error).split())}; gepa's state so far is kept in {run_dir} "
                            "(a rerun resumes it)")
    candidates = list(iter_jsonl(work / "candidates.jsonl")) if (work / "candidates.jsonl").exists() else []
    proposals = list(iter_jsonl(work / "proposals.jsonl")) if (work / "proposals.jsonl").exists() else []
    best = dict(result.best_candidate)
    out = {
        "capabilities": names, "seed_candidate": {c["name"]: c["description"] for c in capabilities},
        "best_idx": result.best_idx, "best_candidate": best, "best_val_score": result.val_aggregate_scores[result.best_idx],
        "system_prompt_suffix": adapter.suffix(best), "budget": budget, "episodes": adapter.spent,
        "gepa_metric_calls": result.total_metric_calls, "generated_tokens": adapter.generated_tokens,
        "reflection_calls": reflection.calls, "reflection_tokens": reflection.generated_tokens,
        "valset": [t.id for t in valset], "trainset": [t.id for t in trainset],
        "candidates": [{"idx": i, "candidate": c, "val_score": result.val_aggregate_scores[i],
                        "parents": [p for p in result.parents[i] if p is not None],
                        "episodes": next((r["episodes"] for r in candidates if r["idx"] == i), None)}
                       for i, c in enumerate(result.candidates)],
        "proposals": proposals,
    }
    atomic_write_json(work / RUN_RESULT, out)
    return out


def gepa_run(ctx, capabilities: list[dict[str, str]], budget: int) -> Artifact:
    """A GEPA run as the sub-artifact ``gepa_runs/<key>`` (keyed on its reads, capabilities and budget)."""
    cfg = ctx.cfg
    seed = derive_seed(cfg.seed, "gepa")
    key = stable_hash({"reads": _values(cfg, run_reads(cfg)), "capabilities": capabilities, "budget": budget},
                      length=20)

    t0 = time.time()
    try:
        art = ctx.cache.get_or_compute("gepa_runs", key, lambda work: run_gepa(cfg, capabilities, budget, work, seed),
                                       meta={"capabilities": [c["name"] for c in capabilities], "budget": budget})
    finally:  # the reflection LM (llm=local: a second in-process model) is not needed by the evaluation
        release_client(cfg, cfg.baselines.gepa.endpoint)
    ctx.use(art, time.time() - t0)
    return art


def run_budget(r: dict[str, Any]) -> Budget:
    return Budget(episodes=int(r["episodes"]), generated_tokens=int(r["generated_tokens"] + r["reflection_tokens"]))


# --------------------------------------------------------------------------------------------
# the stage and the method


def gepa_stage(ctx) -> None:
    s = ctx.cfg.baselines.gepa
    caps = ranked_capabilities(ctx.inputs["select"])
    if not caps:
        raise RuntimeError("gepa: the selection is empty (no capability passed the thresholds): nothing to optimize")
    matched = trace_episodes(ctx.inputs["train"]) if s.max_metric_calls is None else None
    budget = s.max_metric_calls if s.max_metric_calls is not None else matched
    art = gepa_run(ctx, caps, budget)
    atomic_write_json(ctx.work_dir / RESULT, {"run": {**art.ref(), "content_key": art.content_key},
                                             "matched_episodes": matched, "budget": budget,
                                             "train_suite": training_spec(ctx.cfg)})


def gepa_report(art: Artifact, ctx) -> None:
    p = read_json(art.path / RESULT)
    r = read_json(art.resolve(p["run"]).path / RUN_RESULT)
    texts = "\n".join(f"- **{k}**: {v}" for k, v in r["best_candidate"].items())
    ctx.record.section("GEPA", (
        f"{len(r['candidates'])} candidates ({len(r['proposals'])} proposals, {r['reflection_calls']} reflection "
        f"calls), {r['episodes']:,} of {r['budget']:,} training episodes; best candidate {r['best_idx']} "
        f"(valset score {r['best_val_score']:.3f}):\n\n{texts}"))


class Gepa(Method):
    settings = GepaSettings
    name = "gepa"
    summary = "GEPA (the gepa package) refining the capabilities' descriptions in the system prompt, matched budget"
    stages = (Stage("gepa", reads=run_reads, inputs=stage_inputs, compute=gepa_stage, report=gepa_report),)

    def inputs(self, cfg):
        return ("gepa",)

    def validate(self, cfg):
        refuse_without_training_split(cfg, self.name)

    def rows(self, ctx):
        p = read_json(ctx.inputs["gepa"].path / RESULT)
        r = read_json(ctx.inputs["gepa"].resolve(p["run"]).path / RUN_RESULT)
        matched = (f"TRACE's per-capability GRPO runs: {p['matched_episodes']:,}" if p["matched_episodes"] is not None
                   else "set by baselines.gepa.max_metric_calls")
        spec = p.get("train_suite")  # absent from a gepa.json written before it was recorded
        split = target(spec["benchmark"]["kind"]) if spec else None
        return [PolicyRow(LABEL, Policy("prompt", system_prompt_suffix=r["system_prompt_suffix"]), run_budget(r), (
            f"best of {len(r['candidates'])} candidates ({len(r['proposals'])} proposals): {r['episodes']:,} of "
            f"{r['budget']:,} training episodes ({matched})"
            + (f" on the {split.train_split_label(spec)}" if split else ""),
            *(split.train_split_notes(spec) if split else ())))]
