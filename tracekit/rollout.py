"""The rollout runner: tasks x samples episodes, batched across episodes, resumable.

A driver of the episode core (:mod:`tracekit.episodes`, shared with RL training): up to
``batch_size`` episodes are live at once. Each round the agent answers every live episode in one
``act`` call (one batched model call), each episode is stepped (``suite.step_batch``, which also
batches simulated-user replies), finished episodes are scored and appended to
``trajectories.jsonl`` (one fsynced line each), and the freed slots are refilled.

Budgets: at most ``max_steps`` agent actions per episode (``max_steps`` termination); before each
action the prompt is measured with ``agent.count_tokens`` and the episode ends with
``context_overflow`` when prompt + ``agent.max_new_tokens`` would exceed ``context_budget``
(the paper's 32k context), or when the model refuses the prompt (``finish_reason='error'``).
Both endings score 0, as any premature tau^2 ending does.

Seeds: greedy agents (temperature 0) use ``seed`` for every episode (the paper's T=0, seed 42);
sampling agents derive one seed per episode from (seed, task, sample), see :func:`episode_seed`.

Resume: on start the runner reads what ``trajectories.jsonl`` already holds (a line torn by a kill
is dropped) and runs only the missing (task, sample) pairs, so a killed run finishes with exactly
one trajectory per pair. ``rollout_meta.json`` pins the settings the file was produced with; a
resume with different settings is refused.

Failures: an exception inside one episode (environment, user, agent parsing, evaluation) is
recorded on its trajectory (``error``, termination ``error``, reward 0) and counted in the summary;
an :class:`~tracekit.llm.base.EndpointError` (the model server is gone) aborts the run, keeping
everything written so far for the resume. An infrastructure failure (:class:`~tracekit.envs.base.InfraError`:
an env worker died or hung, the environment server or the coding sandbox failed) is not the agent's: the
episode runs again (``infra_retries`` times at most, then :class:`~tracekit.episodes.InfraFailure` names the
task and the run stops, the file kept for the resume) and never reaches the file; the summary counts the
episodes retried (``retried``) and names each failure (``infra_errors``). A file resumed from that holds an
infrastructure failure (written before these retries) has it dropped and run again.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tracekit.agents import Agent, AgentState
from tracekit.artifacts import JsonlAppender, atomic_write_json, iter_jsonl, read_json, write_jsonl
from tracekit.envs.base import INFRA_ERROR_NAMES, EnvSuite
from tracekit.episodes import INFRA_RETRIES, EpisodeRun, drive_episodes
from tracekit.llm.base import ChatResponse, EndpointError
from tracekit.types import Task, TokenRecord, Trajectory, stable_hash

log = logging.getLogger(__name__)

TRAJECTORIES = "trajectories.jsonl"
META = "rollout_meta.json"


def episode_seed(seed: int, task_id: str, sample: int, sampled: bool) -> int:
    """Greedy: ``seed``. Sampled: ``int(sha256([seed, task_id, sample])[:16], 16) mod 2^31``."""
    if not sampled:
        return seed
    return int(stable_hash([seed, task_id, sample]), 16) % 2**31


def single_token_record(turns: list[dict[str, Any]]) -> TokenRecord | None:
    """One exact :class:`TokenRecord` for an episode's turns, or None where none exists.

    Turn ``k``'s prompt must start with everything before it (turn ``k-1``'s prompt + completion);
    then the record is the last prompt + its completion, ``loss_mask = 1`` exactly on generated
    tokens and ``logprobs`` their rollout log-probs (0.0 elsewhere). When a chat template
    re-renders history differently (prefix broken) there is no single exact sequence: None, and
    the per-turn ids in ``Trajectory.info['turns']`` remain the source of truth.
    """
    if not turns:
        return None
    ids: list[int] = []
    mask: list[int] = []
    logps: list[float] = []
    for t in turns:
        prompt, comp, lp = t["prompt_ids"], t["completion_ids"], t["completion_logprobs"]
        if len(lp) != len(comp) or prompt[: len(ids)] != ids:
            return None
        rest = prompt[len(ids):]
        ids += list(rest) + list(comp)
        mask += [0] * len(rest) + [1] * len(comp)
        logps += [0.0] * len(rest) + [float(x) for x in lp]
    return TokenRecord(token_ids=ids, logprobs=logps, loss_mask=mask)


@dataclass
class RolloutSummary:
    """What a rollout call produced; counts cover the requested (task, sample) pairs."""

    path: str
    total: int  # requested pairs = tasks x samples
    resumed: int  # pairs already in the file when the call started
    ran: int  # episodes run by this call
    errors: int  # trajectories recorded with an exception (the agent's or the environment's, never infrastructure)
    terminations: dict[str, int] = field(default_factory=dict)
    mean_reward: float = 0.0
    success_rate: float = 0.0
    seconds: float = 0.0
    # in-process agents: prompt tokens this call's episodes sent and tokens actually prefilled (prefix reuse)
    prefix_cache: dict[str, int] = field(default_factory=dict)
    retried: int = 0  # this call's episodes run again after an infrastructure failure (none of them in the file)
    infra_errors: list[str] = field(default_factory=list)  # "task/sample: cause" of each failure retried

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _settings(suite: EnvSuite, agent: Agent, seed: int, max_steps: int, context_budget: int) -> dict[str, Any]:
    return {
        "suite": suite.name,
        "agent": agent.name,
        "temperature": float(getattr(agent, "temperature", 0.0)),
        "seed": seed,
        "max_steps": max_steps,
        "context_budget": context_budget,
    }


def is_infra_record(t: Trajectory) -> bool:
    """A trajectory recorded for an infrastructure failure (before these were retried): no outcome."""
    return t.error is not None and t.error.split(":", 1)[0] in INFRA_ERROR_NAMES


def drop_infra_records(path: Path) -> int:
    """Rewrite ``path`` without the trajectories :func:`is_infra_record` names; how many it dropped."""
    if not path.exists():
        return 0
    rows = list(iter_jsonl(path, Trajectory))
    kept = [t for t in rows if not is_infra_record(t)]
    if len(kept) < len(rows):
        write_jsonl(path, kept)
    return len(rows) - len(kept)


def load_done(path: Path) -> dict[tuple[str, int], Trajectory]:
    """Trajectories already in ``path`` keyed by (task_id, sample); a duplicate pair raises."""
    done: dict[tuple[str, int], Trajectory] = {}
    if not path.exists():
        return done
    for t in iter_jsonl(path, Trajectory):
        key = (t.task_id, t.sample)
        if key in done:
            raise ValueError(f"{path}: two trajectories for task {t.task_id} sample {t.sample}")
        done[key] = t
    return done


def run_rollouts(
    suite: EnvSuite,
    agent: Agent,
    out_dir: str | Path,
    samples: int = 1,
    seed: int = 42,
    max_steps: int = 50,
    context_budget: int = 32000,
    batch_size: int = 8,
    tasks: list[Task] | None = None,
    progress: bool = True,
    infra_retries: int = INFRA_RETRIES,
) -> RolloutSummary:
    """Run every (task, sample) of ``tasks`` (default: ``suite.tasks()``) missing from
    ``out_dir/trajectories.jsonl`` and return the summary over all requested pairs.

    The simulated user (if any) is part of the suite (e.g. ``Tau2Suite(user=...)``).
    """
    if samples < 1 or max_steps < 1 or context_budget < 1 or batch_size < 1:
        raise ValueError(
            f"samples, max_steps, context_budget and batch_size must be >= 1 "
            f"(got {samples}, {max_steps}, {context_budget}, {batch_size})"
        )
    t_start = time.time()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / TRAJECTORIES
    settings = _settings(suite, agent, seed, max_steps, context_budget)
    meta_path = out_dir / META
    if meta_path.exists():
        old = read_json(meta_path)
        if old != settings:
            diff = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
            raise ValueError(f"{out_dir} holds rollouts made with other settings (old, new): {diff}")
    else:
        atomic_write_json(meta_path, settings)

    if dropped := drop_infra_records(path):
        log.warning("rollout %s: %d episode(s) in %s had ended on an infrastructure failure (recorded before those "
                    "were retried): running them again", suite.name, dropped, path)
    tasks = suite.tasks() if tasks is None else tasks
    wanted = [(t, s) for t in tasks for s in range(samples)]
    done = load_done(path)
    resumed = sum((t.id, s) in done for t, s in wanted)
    pending = [(t, s) for t, s in wanted if (t.id, s) not in done]
    sampled = settings["temperature"] > 0
    if resumed:
        log.info("rollout %s: %d of %d episodes already in %s, running %d", suite.name, resumed, len(wanted), path, len(pending))

    ran = 0
    retried: list[EpisodeRun] = []
    runs = (EpisodeRun(task, s, episode_seed(seed, task.id, s, sampled)) for task, s in pending)

    def act(live: list[EpisodeRun]) -> list[ChatResponse | Exception]:
        return _act(agent, [AgentState(r.task, list(r.messages), r.tools, r.seed, r.steps) for r in live])

    def fits(r: EpisodeRun) -> bool:
        n = agent.count_tokens(r.messages, r.tools)
        return n is None or n + agent.max_new_tokens <= context_budget

    # prompt prefixes are reused within this rollout only: its episodes decode the same whatever ran before
    agent.clear_prefix_cache()
    try:
        with JsonlAppender(path) as sink, tqdm(total=len(pending), desc=f"rollout {suite.name}", disable=not progress) as bar:
            for r in drive_episodes(suite, runs, act, max_steps=max_steps, batch_size=batch_size, fits=fits,
                                    infra_retries=infra_retries):
                if r.retries:
                    retried.append(r)
                traj = r.trajectory(suite.name)
                traj.tokens = single_token_record(r.turns)  # evaluation files carry the one exact sequence, where it exists
                sink.append(traj)
                done[(traj.task_id, traj.sample)] = traj
                ran += 1
                bar.update(1)
    finally:
        reuse = agent.clear_prefix_cache()
    if reuse.get("prompt_tokens"):
        log.info("rollout %s: prefilled %d tokens for %d prompt tokens (%.0f%% reused from cached prefixes)", suite.name,
                 reuse["prefilled_tokens"], reuse["prompt_tokens"], 100 * (1 - reuse["prefilled_tokens"] / reuse["prompt_tokens"]))

    summary = _summary(path, wanted, done, resumed, ran, time.time() - t_start)
    summary.prefix_cache = reuse
    summary.retried = len(retried)
    summary.infra_errors = [f"{r.task.id}/{r.sample}: {e}" for r in retried for e in r.infra_errors]
    if retried:
        log.warning("rollout %s: %d episode(s) were run again after an infrastructure failure (%d failure(s); none "
                    "is in the file)", suite.name, len(retried), len(summary.infra_errors))
    return summary


def _act(agent: Agent, states: list[AgentState]) -> list[ChatResponse | Exception]:
    """The agent's batched answer; if the batch raises, each state is retried alone so one bad
    episode cannot fail the others (an EndpointError is fatal)."""
    try:
        return list(agent.act(states))
    except EndpointError:
        raise
    except Exception as e:  # noqa: BLE001
        if len(states) == 1:
            return [e]
        log.warning("batched agent call failed (%s: %s); retrying %d episodes one by one", type(e).__name__, e, len(states))
    out: list[ChatResponse | Exception] = []
    for s in states:
        try:
            out.append(agent.act([s])[0])
        except EndpointError:
            raise
        except Exception as e:  # noqa: BLE001
            out.append(e)
    return out


def _summary(path: Path, wanted, done, resumed: int, ran: int, seconds: float) -> RolloutSummary:
    trajs = [done[(t.id, s)] for t, s in wanted if (t.id, s) in done]
    n = len(trajs)
    summary = RolloutSummary(
        path=str(path),
        total=len(wanted),
        resumed=resumed,
        ran=ran,
        errors=sum(t.error is not None for t in trajs),
        terminations=dict(Counter(t.termination for t in trajs)),
        mean_reward=sum(t.reward for t in trajs) / n if n else 0.0,
        success_rate=sum(t.success for t in trajs) / n if n else 0.0,
        seconds=round(seconds, 3),
    )
    if summary.errors:
        log.warning("rollout: %d of %d episodes ended with an error (see Trajectory.error)", summary.errors, n)
    return summary


def read_trajectories(out_dir: str | Path) -> list[Trajectory]:
    """All trajectories of a rollout directory, in file order."""
    return list(load_done(Path(out_dir) / TRAJECTORIES).values())
