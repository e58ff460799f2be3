"""The episode core both runners drive: one episode's state machine and the batched loop over many.

An :class:`EpisodeRun` goes open -> reset -> (act -> step)* -> end. :func:`drive_episodes` keeps up
to ``batch_size`` runs live, answers all of them in one ``act`` call per round (one batched model
call) and steps them through ``suite.step_batch``, yielding each run once it has ended and been
scored. The evaluation runner (:func:`tracekit.rollout.run_rollouts`) drives it over an
:class:`~tracekit.agents.Agent` into a resumable file; the training runner
(:func:`tracekit.rl.episodes.run_episodes`) over a chat client with per-request sampling seeds.

Terminations: the environment's own (``done`` when it names none), including an episode already
done at reset (zero agent turns); ``max_steps``; ``context_overflow`` (the driver's budget check
said the next prompt does not fit, or the backend refused the request: ``finish_reason='error'``);
``error`` (an exception in the environment, the agent or the verifier: reward 0, recorded with its
traceback). An :class:`~tracekit.llm.base.EndpointError` (the model server is gone) is never
recorded on an episode: it aborts the loop.

Infrastructure failures are not outcomes. An episode that ends on an
:class:`~tracekit.envs.base.InfraError` (an env worker died or hung, the environment server failed, the
coding sandbox could not run) ends ``infra_error`` and is never yielded: :func:`drive_episodes` runs it
again from scratch (same task, sample and seed, so a clean retry is the episode a clean run would have
played), at most ``infra_retries`` times, then raises :class:`InfraFailure` naming the task. A yielded run
says how often it was retried (``EpisodeRun.retries``, the causes in ``infra_errors``).

A retry keeps the yield order a clean run has: a retried run takes its original place, not the last one (the
rollout file's row order feeds the labeler's seeded noise and the gate's data, so a clean run and one with a killed
worker must write the same file). The order of a clean run is a function of each run's own ending (the phase of
the loop it ended in and how many rounds it lived, :func:`clean_order`); runs ended before the first failure are
yielded as they end (that is the clean order's prefix: the schedule has not diverged yet), the rest once every run
has ended, in the clean order.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from tracekit.envs.base import Episode, EnvSuite, Observation, StepResult, infra_cause
from tracekit.llm.base import ChatResponse, EndpointError
from tracekit.types import Message, Task, Trajectory

log = logging.getLogger(__name__)

DONE = "done"
MAX_STEPS = "max_steps"
CONTEXT_OVERFLOW = "context_overflow"
ERROR = "error"
INFRA_ERROR = "infra_error"  # the infrastructure failed (never yielded: retried, or InfraFailure)
INFRA_RETRIES = 2  # rollout.infra_retries' default: runs of an episode after its first ends on an infra failure
# the phases of one round of drive_episodes' loop a run can end in, in the order it yields them
ENDED_AT_OPEN, ENDED_AT_CHECK, ENDED_AT_STEP = "open", "check", "step"


class InfraFailure(RuntimeError):
    """An episode kept ending on infrastructure failures after its retries: the run stops, naming the task."""


@dataclass(eq=False)  # identity semantics: drivers key their own per-episode data by the run
class EpisodeRun:
    """One episode from creation to its scored end."""

    task: Task
    sample: int
    seed: int  # the environment's seed
    episode: Episode | None = None
    messages: list[Message] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0  # agent actions taken
    turns: list[dict[str, Any]] = field(default_factory=list)  # per action: its token ids, when the response had them
    termination: str = ""
    error: BaseException | None = None
    reward: float = 0.0
    success: bool = False
    outcome_info: dict[str, Any] = field(default_factory=dict)
    started: float = 0.0
    seconds: float = 0.0
    _unscored: bool = field(default=False, repr=False)  # ended in a worker, its outcome not collected yet
    retries: int = 0  # times it was run again after an infrastructure failure
    infra_errors: list[str] = field(default_factory=list)  # each failure's cause, in order

    @property
    def ended(self) -> bool:
        return bool(self.termination)

    def open(self, suite: EnvSuite) -> None:
        self.started = time.time()
        try:
            self.episode = suite.episode(self.task, self.seed)
        except Exception as e:  # noqa: BLE001 - a task the suite cannot build ends only this run
            self._fail(e)

    def reset(self, obs: Observation | Exception) -> None:
        if isinstance(obs, Exception):
            return self._fail(obs)
        self.messages, self.tools = list(obs.messages), list(obs.tools)
        if obs.done:  # e.g. the simulated user stopped at once: scored without an agent turn
            self.end(obs.termination or DONE)

    def act(self, resp: ChatResponse | Exception) -> None:
        if isinstance(resp, Exception):
            return self._fail(resp)
        if resp.finish_reason == "error":  # the backend refused the prompt (over its context): nothing to step
            return self.end(CONTEXT_OVERFLOW)
        self.messages.append(resp.message)
        self.steps += 1
        if resp.prompt_token_ids is not None and resp.completion_token_ids is not None:
            self.turns.append({
                "prompt_ids": list(resp.prompt_token_ids),
                "completion_ids": list(resp.completion_token_ids),
                "completion_logprobs": list(resp.completion_logprobs or []),
                "finish_reason": resp.finish_reason,
            })

    def step(self, res: StepResult | Exception) -> None:
        if isinstance(res, Exception):
            return self._fail(res)
        self.messages.extend(res.messages)
        if res.done:
            self.end(res.termination or DONE)

    def end(self, termination: str, error: BaseException | None = None) -> None:
        """End and score the episode; an error, the verifier's included, scores 0 and is recorded.

        An episode living in an environment worker (:mod:`tracekit.envs.pool`) is scored there: ``end`` asks
        for its outcome and :meth:`settle` collects it."""
        ep = self.episode
        if error is None and ep is not None and hasattr(ep, "request_outcome"):
            self.termination, self._unscored = termination, True
            self.seconds = round(time.time() - self.started, 3)
            ep.request_outcome()
            return
        if error is not None and ep is not None and hasattr(ep, "release"):
            ep.release()
        if error is None and ep is not None:
            try:
                o = ep.outcome()
                self.reward, self.success, self.outcome_info = float(o.reward), bool(o.success), dict(o.info)
            except EndpointError:
                raise
            except Exception as e:  # noqa: BLE001
                error = e
        self._finish(termination, error)

    def settle(self) -> None:
        """Collect the outcome :meth:`end` asked a worker for (a no-op for in-process episodes)."""
        if not self._unscored:
            return
        self._unscored = False
        error: BaseException | None = None
        try:
            o = self.episode.outcome()
            self.reward, self.success, self.outcome_info = float(o.reward), bool(o.success), dict(o.info)
        except EndpointError:
            raise
        except Exception as e:  # noqa: BLE001
            error = e
        seconds = self.seconds
        self._finish(self.termination, error)
        self.seconds = seconds

    @property
    def infra_failed(self) -> bool:
        """It ended on an infrastructure failure (to be run again, never scored)."""
        return self.termination == INFRA_ERROR

    def restart(self) -> None:
        """Back to a fresh, unopened run of the same task, sample and seed, the failure kept in ``infra_errors``."""
        self.infra_errors.append(f"{type(self.error).__name__}: {self.error}")
        self.retries += 1
        self.episode, self.messages, self.tools, self.steps, self.turns = None, [], [], 0, []
        self.termination, self.error, self.reward, self.success, self.outcome_info = "", None, 0.0, False, {}
        self.started, self.seconds, self._unscored = 0.0, 0.0, False

    def _finish(self, termination: str, error: BaseException | None) -> None:
        if error is not None:
            infra = infra_cause(error) is not None
            termination, self.reward, self.success = INFRA_ERROR if infra else ERROR, 0.0, False
            log.warning("episode %s/%s %s: %s: %s", self.task.id, self.sample,
                        "hit an infrastructure failure (run again)" if infra else "failed", type(error).__name__, error)
        self.termination, self.error = termination, error
        self.seconds = round(time.time() - self.started, 3)

    def _fail(self, e: Exception) -> None:
        if isinstance(e, EndpointError):
            raise e
        self.end(ERROR, e)

    def trajectory(self, suite_name: str) -> Trajectory:
        """The ended run as a :class:`Trajectory`: the verifier's info, then steps, seconds, turns
        (and the traceback of an error)."""
        info = {**self.outcome_info, "steps": self.steps, "seconds": self.seconds, "turns": self.turns}
        e = self.error
        if e is not None:
            info["traceback"] = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
        return Trajectory(
            task_id=self.task.id,
            env=self.task.env or suite_name,
            seed=self.seed,
            sample=self.sample,
            messages=self.messages,
            reward=self.reward,
            success=self.success,
            termination=self.termination,
            error=None if e is None else f"{type(e).__name__}: {e}",
            info=info,
        )


Act = Callable[[list[EpisodeRun]], list[ChatResponse | Exception]]


def clean_order(endings: list[tuple[str, int]], batch_size: int) -> list[int]:
    """The order :func:`drive_episodes` yields runs in when none is retried, from each run's ending alone.

    ``endings[j]`` is run ``j``'s (in the order the runs are opened) ``(phase, rounds)``: the phase of a round it
    ended in (:data:`ENDED_AT_OPEN`: the suite could not build it; :data:`ENDED_AT_CHECK`: at reset or at the budget
    checks before an action; :data:`ENDED_AT_STEP`: at its action or the step after it) and the rounds from the one
    it was opened in to that one. Neither depends on the schedule (each live run acts once per round), so this
    replays the loop's slot filling: a slot freed in a round is refilled in the next; within a phase runs end in
    the order they were opened."""
    order: list[int] = []
    live: list[tuple[int, int, str]] = []  # (run, the round it ends in, the phase), in opening order
    nxt, rnd = 0, 0
    while True:
        while len(live) < batch_size and nxt < len(endings):
            phase, rounds = endings[nxt]
            if phase == ENDED_AT_OPEN:
                order.append(nxt)
            else:
                live.append((nxt, rnd + rounds, phase))
            nxt += 1
        if not live:
            return order
        for phase in (ENDED_AT_CHECK, ENDED_AT_STEP):
            order += [j for j, end, p in live if p == phase and end == rnd]
            live = [x for x in live if not (x[2] == phase and x[1] == rnd)]
        rnd += 1


def drive_episodes(
    suite: EnvSuite,
    runs: Iterable[EpisodeRun],
    act: Act,
    *,
    max_steps: int,
    batch_size: int,
    fits: Callable[[EpisodeRun], bool] | None = None,
    infra_retries: int = INFRA_RETRIES,
) -> Iterator[EpisodeRun]:
    """Play ``runs`` (opened in order, lazily) with continuous batching; yield each as it ends.

    ``act(live)`` answers every live run (an Exception for a run ends only that run). Before each
    action a run ends with ``max_steps`` after ``max_steps`` actions, and with ``context_overflow``
    where ``fits(run)`` says its next prompt does not fit. A slot freed by an ended run is refilled
    at the next round, so ``batch_size >= len(runs)`` is lockstep: every run live from the start.

    A suite with ``defers_scoring`` (:class:`tracekit.envs.pool.PooledSuite`) scores ended runs in its
    worker processes: the runs that ended in a round are yielded after the next ``act`` call (the
    decode the scoring overlaps), in the same order, and with the same slots refilled, as in-process.

    A run that ends on an infrastructure failure (``infra_error``) is not yielded: it is restarted and opened
    again before the next new run, up to ``infra_retries`` times; one more failure raises :class:`InfraFailure`
    (after yielding the runs held back for their order, so a resumable file keeps them). The runs are yielded in
    the order a clean run yields them, retried or not (the module docstring).
    """
    if infra_retries < 0:
        raise ValueError(f"infra_retries must be >= 0, got {infra_retries}")
    deferred = bool(getattr(suite, "defers_scoring", False))
    queue = iter(runs)
    retry: deque[EpisodeRun] = deque()  # runs to play again (an infrastructure failure), before the queue's next
    live: list[EpisodeRun] = []
    ended: list[EpisodeRun] = []  # ended, not yet yielded (in the order they ended)
    opened: dict[EpisodeRun, int] = {}  # run -> its place in the opening order (a retried run keeps its first)
    opened_in: dict[EpisodeRun, int] = {}  # run -> the round its current attempt was opened in
    endings: dict[EpisodeRun, tuple[str, int]] = {}  # run -> (phase, rounds) of its last ending, for clean_order
    yielded: list[EpisodeRun] = []
    held: list[EpisodeRun] | None = None  # after the first infrastructure failure: ended, yielded in clean order
    rnd = 0

    def end_in(phase: str, rs: Iterable[EpisodeRun]) -> None:
        for r in rs:
            endings[r] = (phase, rnd - opened_in[r])
            ended.append(r)

    def emit(rs: list[EpisodeRun]) -> Iterator[EpisodeRun]:
        yielded.extend(rs)
        yield from rs

    def flush() -> Iterator[EpisodeRun]:
        nonlocal held
        out = list(ended)
        ended.clear()
        for r in out:
            r.settle()
        done = []
        for r in out:
            if not r.infra_failed:
                (done if held is None else held).append(r)
                continue
            held = [] if held is None else held  # the schedule diverges from a clean run's here
            if r.retries >= infra_retries:
                yield from emit(done + sorted(held, key=opened.__getitem__))
                raise InfraFailure(
                    f"episode {r.task.id} (sample {r.sample}) ended on an infrastructure failure "
                    f"{r.retries + 1} time(s), not an outcome of the agent: {type(r.error).__name__}: "
                    f"{' '.join(str(r.error).split())} (rollout.infra_retries={infra_retries}; earlier: "
                    f"{'; '.join(r.infra_errors) or 'none'})")
            log.warning("episode %s/%s: running it again (infrastructure retry %d of %d)", r.task.id, r.sample,
                        r.retries + 1, infra_retries)
            r.restart()
            retry.append(r)
        yield from emit(done)

    def in_clean_order() -> Iterator[EpisodeRun]:
        runs_opened = sorted(opened, key=opened.__getitem__)
        order = [runs_opened[j] for j in clean_order([endings[r] for r in runs_opened], batch_size)]
        if order[: len(yielded)] != yielded:  # an episode played differently when run again (not seeded?)
            log.warning("the episodes yielded before an infrastructure failure are not a clean run's first ones: "
                        "the order of the others follows a clean run's all the same")
        first = set(yielded)
        yield from emit([r for r in order if r not in first])

    def next_run() -> EpisodeRun | None:
        return retry.popleft() if retry else next(queue, None)

    while True:
        fresh: list[EpisodeRun] = []
        while len(live) + len(fresh) < batch_size and (r := next_run()) is not None:
            opened.setdefault(r, len(opened))
            opened_in[r] = rnd
            r.open(suite)
            if r.ended:
                end_in(ENDED_AT_OPEN, [r])
                if not deferred:
                    yield from flush()
            else:
                fresh.append(r)
        if not fresh and not live:
            yield from flush()
            if retry:
                rnd += 1
                continue
            if held is not None:
                yield from in_clean_order()
            return
        for r, obs in zip(fresh, suite.reset_batch([r.episode for r in fresh]), strict=True):
            r.reset(obs)
        for r in live + fresh:
            if r.ended:
                continue
            if r.steps >= max_steps:
                r.end(MAX_STEPS)
            elif fits is not None and not fits(r):
                r.end(CONTEXT_OVERFLOW)
        end_in(ENDED_AT_CHECK, [r for r in live + fresh if r.ended])
        live = [r for r in live + fresh if not r.ended]
        if not deferred:
            yield from flush()
        if not live:
            rnd += 1
            continue
        if deferred:
            suite.submit()  # the workers score the runs that ended while the model decodes the others
        for r, resp in zip(live, act(live), strict=True):
            r.act(resp)
        if deferred:
            yield from flush()  # the runs that ended before this decode, scored meanwhile, in the in-process order
        stepping = [r for r in live if not r.ended]
        results = suite.step_batch([r.episode for r in stepping], [r.messages[-1] for r in stepping])
        for r, res in zip(stepping, results, strict=True):
            r.step(res)
        end_in(ENDED_AT_STEP, [r for r in live if r.ended])
        live = [r for r in live if not r.ended]
        rnd += 1
        if not deferred:
            yield from flush()
