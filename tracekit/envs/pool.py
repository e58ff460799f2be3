"""Environment steps off the decoder's critical path: a pool of worker processes stepping episodes.

For suites whose steps are expensive (tau^2's DB replay and evaluator, the ToolSandbox server, the coding
sandbox), :class:`EnvPool` runs ``N`` worker processes (``multiprocessing``'s ``forkserver`` context), each
building its own copy of the suite from a small picklable :class:`SuiteSpec` (never from live objects) and owning
a shard of the episodes. :class:`PooledSuite` is the :class:`~tracekit.envs.base.EnvSuite` the episode core
(:func:`tracekit.episodes.drive_episodes`) drives, so evaluation rollouts and GRPO/distillation rollouts
(:func:`tracekit.rl.episodes.run_episodes`) both step through it:

- one IPC message per worker per turn: ``reset_batch``/``step_batch`` send each worker the batch of its own
  episodes (plus any queued scoring/drop requests) and the workers step them in parallel;
- an episode that ends is scored inside its worker (the verifier: tau^2's DB replay) *after* the worker has
  answered the step, while the driver decodes the next turn of the others; the driver collects the outcome
  later (``PooledSuite.defers_scoring``: :func:`~tracekit.episodes.drive_episodes` yields ended runs after the
  next ``act`` call, in the same order as in-process);
- a worker that dies: every episode it held ends with a :class:`WorkerDied` error naming the worker, its exit
  code and the last line of its stderr (never a hang), and the pool starts a new worker in its slot for later
  episodes (at most ``max_restarts`` times per slot). ``WorkerDied`` is an infrastructure failure
  (:class:`~tracekit.envs.base.InfraError`): the episode core runs those episodes again (``rollout.infra_retries``
  times at most, then the run fails naming the task) and never records one as an outcome;
- a worker that hangs (no reply to a turn's batch, or no outcome it owes, within ``reply_timeout`` seconds:
  ``rollout.env_reply_timeout_s``) is killed and handled as one that died, its error saying it hung;
- clean shutdown: a context manager, and an ``atexit`` hook for pools never closed; workers are joined,
  then terminated, then killed.

Episodes are independent and seeded, so results do not depend on which worker holds which episode: the same
seeded episodes give the same trajectories, rewards and token ids with and without the pool
(``tests/test_env_pool.py``). The pool is an execution setting (``rollout.env_workers``) in no cache key.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import sys
import queue
import tempfile
import threading
import time
import traceback
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from tracekit.envs.base import Episode, EnvSuite, InfraError, Observation, Outcome, StepResult, infra_cause
from tracekit.types import Message, Task

log = logging.getLogger(__name__)

MAX_AUTO_WORKERS = 8  # auto: min(cpus - 1, this) for suites with expensive steps
MIN_AUTO_WORKERS = 2  # auto: in-process below this many (a 2-CPU machine)
REPLY_TIMEOUT_S = 900.0  # a worker's reply to one turn covers all its episodes' steps (a coding shard: minutes)


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SuiteSpec:
    """How a worker builds its suite: ``factory(*args, **kwargs)``, all picklable (plain data: no clients, no
    models, no open servers).

    The worker entry point is the ``factory`` function itself, a module-level function of the caller's choosing
    (``tracekit.wiring.suite_from_config``, an env Factory's function in ``tracekit.rl.launch``): the caller holds
    it through a real import, where the import contract sees the edge, and it crosses to the worker process as
    pickle sends a function, by its module and name (the worker imports that module: the forkserver already has, as
    a preload). The pool itself imports nothing by name."""

    factory: Callable[..., EnvSuite]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    preload: tuple[str, ...] = ()  # modules the forkserver imports once, before it forks workers (tau^2: ~10 s)

    @property
    def factory_name(self) -> str:
        return f"{self.factory.__module__}:{self.factory.__qualname__}"

    def build(self) -> EnvSuite:
        return self.factory(*self.args, **self.kwargs)


class WorkerDied(InfraError):
    """The environment worker holding an episode exited or hung; the message names its exit and last stderr line.
    An infrastructure failure: the episode core retries the episode (``rollout.infra_retries``), never scores it."""


def _picklable(x: Any) -> Any:
    """``x`` if it pickles (an exception with odd constructor args may not), else a RuntimeError naming it. An
    exception raised from an infrastructure failure crosses as an :class:`InfraError` (pickling drops its
    ``__cause__``, which is what says so)."""
    if isinstance(x, BaseException) and infra_cause(x) not in (None, x):
        return InfraError(f"{type(x).__name__}: {x} (from {type(infra_cause(x)).__name__}: {infra_cause(x)})")
    try:
        pickle.loads(pickle.dumps(x))
        return x
    except Exception:  # noqa: BLE001
        if isinstance(x, BaseException):
            return (InfraError if infra_cause(x) is not None else RuntimeError)(f"{type(x).__name__}: {x}")
        raise


# --------------------------------------------------------------------------------------------
# the worker process


def _worker_main(conn: Any, spec: SuiteSpec, stderr_path: str) -> None:
    fd = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 2)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    try:
        suite = spec.build()
    except BaseException:  # noqa: BLE001 - reported to the driver, which refuses to start the pool
        conn.send(("failed", traceback.format_exc()[-3000:]))
        return
    # every message out goes through one sender thread, so this loop never blocks on a full pipe: it keeps reading
    # the driver's batches while an outcome waits to be read (no deadlock whatever the message sizes)
    out: queue.Queue = queue.Queue()

    def sender() -> None:
        while (m := out.get()) is not None:
            try:
                conn.send(m)
            except (OSError, ValueError):
                return

    thread = threading.Thread(target=sender, name="tracekit-env-sender", daemon=True)
    thread.start()
    out.put(("ready", suite.name))
    episodes: dict[int, Episode] = {}
    to_score: list[int] = []  # ended episodes, scored while the driver decodes

    def score(key: int) -> None:
        ep = episodes.pop(key, None)
        if ep is None:
            return
        try:
            res: Any = ep.outcome()
        except Exception as e:  # noqa: BLE001
            res = e
        out.put(("outcome", key, _picklable(res)))

    try:
        while True:
            if to_score and not conn.poll():
                score(to_score.pop(0))
                continue
            msg = conn.recv()
            if msg[0] == "close":
                break
            batch = msg[1]
            for key in batch.get("drop", ()):
                episodes.pop(key, None)
            for key in batch.get("score", ()):
                if key in episodes and key not in to_score:
                    to_score.append(key)
            reply: dict[str, list[Any]] = {}
            if "reset" in batch:
                made: list[tuple[int, Any]] = []
                for key, task, seed in batch["reset"]:
                    try:
                        made.append((key, suite.episode(task, seed)))
                    except Exception as e:  # noqa: BLE001
                        made.append((key, e))
                ok = [(k, ep) for k, ep in made if not isinstance(ep, Exception)]
                obs = iter(suite.reset_batch([ep for _, ep in ok]))
                results = []
                for key, ep in made:
                    r = ep if isinstance(ep, Exception) else next(obs)
                    if not isinstance(r, Exception):
                        episodes[key] = ep
                        if r.done:
                            to_score.append(key)
                    results.append(_picklable(r))
                reply["reset"] = results
            if "step" in batch:
                keys = [k for k, _ in batch["step"]]
                live = [k for k in keys if k in episodes]
                res = iter(suite.step_batch([episodes[k] for k in live], [a for k, a in batch["step"] if k in episodes]))
                results = []
                for key in keys:
                    r = next(res) if key in episodes else KeyError(f"env worker holds no episode {key}")
                    if isinstance(r, Exception):
                        episodes.pop(key, None)
                    elif r.done:
                        to_score.append(key)
                    results.append(_picklable(r))
                reply["step"] = results
            if msg[0] == "batch":
                out.put(("reply", reply))
    except (EOFError, OSError, KeyboardInterrupt):
        pass  # the driver is gone
    finally:
        out.put(None)
        thread.join(10)
        getattr(suite, "close", lambda: None)()


# --------------------------------------------------------------------------------------------
# the driver's side


class _Dead(Exception):
    pass


class _Worker:
    def __init__(self, ctx: Any, slot: int, gen: int, spec: SuiteSpec, tmp: str):
        self.slot, self.gen = slot, gen
        self.stderr_path = os.path.join(tmp, f"worker-{slot}-{gen}.stderr")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, self.stderr_path),
                                name=f"tracekit-env-{slot}", daemon=False)
        self.proc.start()
        child.close()
        self.live: set[int] = set()
        self.outcomes: dict[int, Any] = {}
        self.queued: dict[str, list[int]] = {"score": [], "drop": []}
        self.dead: str | None = None  # why it died

    def last_stderr(self) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - 8192))
                lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:500] if lines else ""

    def recv(self, outcome: bool = False, timeout: float | None = None) -> Any:
        """The worker's next message (outcomes are stored, and returned only with ``outcome``); raises _Dead
        when it exited, or when ``timeout`` seconds pass without the message (it is killed: hung)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                if self.conn.poll(0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))):
                    msg = self.conn.recv()
                    if msg[0] == "outcome":
                        self.outcomes[msg[1]] = msg[2]
                        self.live.discard(msg[1])
                        if not outcome:
                            continue
                    return msg
            except (EOFError, OSError):
                self.die()
            if not self.proc.is_alive() and not self.conn.poll(0):
                self.die()
            if deadline is not None and time.monotonic() >= deadline:
                self.die(hung=timeout)

    def send(self, msg: Any) -> None:
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            self.die()

    def die(self, hung: float | None = None) -> None:
        if self.dead is None:
            if hung is not None:  # alive but silent: its episodes would wait forever
                self.proc.kill()
            self.proc.join(5)
            if self.proc.is_alive():  # a broken pipe from a live worker: stop it
                self.proc.kill()
                self.proc.join(5)
            last = self.last_stderr()
            what = (f"sent no reply in {hung:g} s (hung) and was killed" if hung is not None
                    else f"exited with code {self.proc.exitcode}")
            self.dead = (f"env worker {self.slot} (pid {self.proc.pid}) {what}"
                         + (f"; last stderr line: {last}" if last else "; no stderr output"))
            log.warning("%s: %d episode(s) it held end with an error", self.dead, len(self.live))
            self.conn.close()
        raise _Dead(self.dead)

    def stop(self, timeout: float = 10.0) -> None:
        if self.dead is None:
            try:
                self.conn.send(("close",))
            except (OSError, ValueError):
                pass
        self.proc.join(timeout if self.dead is None else 1)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(3)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(3)
        try:
            self.conn.close()
        except OSError:
            pass


class RemoteEpisode(Episode):
    """An episode living in a worker; the driver holds its key."""

    def __init__(self, pool: EnvPool, key: int, worker: _Worker, task: Task, seed: int):
        self.pool, self.key, self.worker, self.task, self.seed = pool, key, worker, task, seed
        self.created = False  # reset sent
        self.scoring = False  # the worker scores it (it ended there, or the driver asked)

    def reset(self) -> Observation:
        return _raise(self.pool.reset([self])[0])

    def step(self, action: Message) -> StepResult:
        return _raise(self.pool.step([self], [action])[0])

    def outcome(self) -> Outcome:
        return _raise(self.pool.outcome(self))

    def request_outcome(self) -> None:
        self.pool.request_outcome(self)

    def release(self) -> None:
        self.pool.release(self)


def _raise(x: Any) -> Any:
    if isinstance(x, BaseException):
        raise x
    return x


class EnvPool:
    """``workers`` processes, each with its own suite built from ``spec``; see the module docstring."""

    def __init__(self, spec: SuiteSpec, workers: int, *, max_restarts: int = 3, start_timeout: float = 600.0,
                 reply_timeout: float | None = REPLY_TIMEOUT_S):
        if workers < 1:
            raise ValueError(f"an EnvPool needs >= 1 worker, got {workers}")
        if reply_timeout is not None and reply_timeout <= 0:
            raise ValueError(f"reply_timeout must be > 0 seconds or None, got {reply_timeout}")
        self.spec, self.n, self.max_restarts, self.reply_timeout = spec, workers, max_restarts, reply_timeout
        self.start_timeout = start_timeout
        self._ctx = mp.get_context("forkserver")
        from multiprocessing import forkserver

        if getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", 1) is None:  # not started yet
            # heavy imports paid once in the forkserver: every worker (and every restart) forks with them loaded
            self._ctx.set_forkserver_preload(list(dict.fromkeys([spec.factory.__module__, *spec.preload])))
        self._tmp = tempfile.mkdtemp(prefix="tracekit-envpool-")
        self._next_key = 0
        self._restarts = [0] * workers
        self._closed = False
        self.deaths: list[str] = []
        self.workers: list[_Worker | None] = []
        ref = weakref.ref(self)
        self._atexit = lambda: (p := ref()) is not None and p.close()
        atexit.register(self._atexit)
        try:
            self.workers = [_Worker(self._ctx, i, 0, spec, self._tmp) for i in range(workers)]
            self.suite_name = None
            for w in self.workers:
                self.suite_name = self._await_ready(w)
        except BaseException:
            self.close()
            raise
        log.info("env pool: %d worker processes for suite %s", workers, self.suite_name)

    def _await_ready(self, w: _Worker) -> str:
        try:
            msg = w.recv(timeout=self.start_timeout)
        except _Dead as e:
            raise RuntimeError(f"env pool could not start: {e}") from None
        if msg[0] == "failed":
            raise RuntimeError(f"env worker {w.slot} could not build its suite ({self.spec.factory_name}):\n{msg[1]}")
        return msg[1]

    # ---- lifecycle

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self.workers:
            if w is not None:
                w.stop()
        shutil.rmtree(self._tmp, ignore_errors=True)
        atexit.unregister(self._atexit)

    def __enter__(self) -> EnvPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _replace(self, w: _Worker) -> None:
        """Start a new worker in a dead one's slot (for later episodes), up to ``max_restarts`` times."""
        if self.workers[w.slot] is not w:
            return
        self.deaths.append(w.dead or "")
        if self._restarts[w.slot] >= self.max_restarts:
            log.warning("env pool: slot %d died %d times; not restarted", w.slot, self._restarts[w.slot] + 1)
            self.workers[w.slot] = None
            return
        self._restarts[w.slot] += 1
        new = _Worker(self._ctx, w.slot, w.gen + 1, self.spec, self._tmp)
        self.workers[w.slot] = new
        try:
            self._await_ready(new)
        except RuntimeError as e:
            log.warning("env pool: the restarted worker failed: %s", e)
            new.stop()
            self.workers[w.slot] = None

    # ---- episodes

    def new_episode(self, task: Task, seed: int) -> RemoteEpisode:
        alive = [w for w in self.workers if w is not None]
        if not alive:
            raise WorkerDied(f"env pool: every worker died ({'; '.join(self.deaths[-3:])})")
        w = min(alive, key=lambda w: (len(w.live), w.slot))  # the least loaded: shards stay even
        ep = RemoteEpisode(self, self._next_key, w, task, seed)
        self._next_key += 1
        w.live.add(ep.key)
        return ep

    def _exchange(self, parts: dict[_Worker, dict[str, list[Any]]]) -> dict[_Worker, dict[str, list[Any]] | str]:
        """Send each worker its batch (one message), then collect each reply; a dead worker's entry is why."""
        out: dict[_Worker, Any] = {}
        sent = []
        for w, batch in parts.items():
            if w.dead is not None:
                out[w] = w.dead
                continue
            batch.update({k: v for k, v in w.queued.items() if v})
            w.queued = {"score": [], "drop": []}
            try:
                w.send(("batch", batch))
                sent.append(w)
            except _Dead as e:
                out[w] = str(e)
        for w in sent:
            try:
                out[w] = w.recv(timeout=self.reply_timeout)[1]
            except _Dead as e:
                out[w] = str(e)
        for w, r in out.items():
            if isinstance(r, str):
                self._replace(w)
        return out

    def _batched(self, op: str, eps: list[RemoteEpisode], items: list[Any]) -> list[Any]:
        groups: dict[_Worker, list[int]] = defaultdict(list)
        for i, ep in enumerate(eps):
            groups[ep.worker].append(i)
        replies = self._exchange({w: {op: [items[i] for i in idx]} for w, idx in groups.items()})
        out: list[Any] = [None] * len(eps)
        for w, idx in groups.items():
            r = replies[w]
            for j, i in enumerate(idx):
                out[i] = WorkerDied(r) if isinstance(r, str) else r[op][j]
                if isinstance(out[i], Exception):
                    w.live.discard(eps[i].key)
                elif out[i].done:
                    eps[i].scoring = True
        return out

    def reset(self, eps: list[RemoteEpisode]) -> list[Observation | Exception]:
        for ep in eps:
            ep.created = True
        return self._batched("reset", eps, [(ep.key, ep.task, ep.seed) for ep in eps])

    def step(self, eps: list[RemoteEpisode], actions: list[Message]) -> list[StepResult | Exception]:
        return self._batched("step", eps, [(ep.key, a) for ep, a in zip(eps, actions, strict=True)])

    def request_outcome(self, ep: RemoteEpisode) -> None:
        """Queue ``ep``'s scoring (sent with the worker's next message, or by :meth:`submit`)."""
        if not ep.scoring and ep.worker.dead is None:
            ep.scoring = True
            ep.worker.queued["score"].append(ep.key)

    def release(self, ep: RemoteEpisode) -> None:
        """The driver ended ``ep`` without a score (an error on its side): the worker drops it."""
        ep.worker.live.discard(ep.key)
        ep.worker.outcomes.pop(ep.key, None)
        if ep.created and ep.worker.dead is None:
            ep.worker.queued["drop"].append(ep.key)

    def submit(self) -> None:
        """Send every worker's queued scoring/drop requests now (no reply awaited): scoring overlaps the decode."""
        for w in self.workers:
            if w is not None and w.dead is None and any(w.queued.values()):
                batch = {k: v for k, v in w.queued.items() if v}
                w.queued = {"score": [], "drop": []}
                try:
                    w.send(("async", batch))
                except _Dead:
                    self._replace(w)

    def outcome(self, ep: RemoteEpisode) -> Outcome | Exception:
        w = ep.worker
        if not ep.scoring:
            self.request_outcome(ep)
        while ep.key not in w.outcomes:
            if w.dead is not None:
                return WorkerDied(w.dead)
            if any(w.queued.values()):
                self.submit()
                continue
            try:
                msg = w.recv(outcome=True, timeout=self.reply_timeout)
            except _Dead:
                self._replace(w)
                continue
            if msg[0] != "outcome":
                log.warning("env pool: unexpected message %r from worker %d", msg[0], w.slot)
        return w.outcomes.pop(ep.key)


class PooledSuite(EnvSuite):
    """``suite``'s tasks, its episodes stepped in ``pool``'s workers (which built their own copies of it)."""

    defers_scoring = True  # drive_episodes collects ended runs' scores after the next decode

    def __init__(self, suite: EnvSuite, pool: EnvPool):
        self.base, self.pool, self.name = suite, pool, suite.name
        if pool.suite_name is not None and pool.suite_name != suite.name:
            raise ValueError(f"env pool workers built suite {pool.suite_name!r}, the driver's is {suite.name!r}")

    def tasks(self) -> list[Task]:
        return self.base.tasks()

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return self.pool.new_episode(task, seed)

    def reset_batch(self, episodes: list[Episode]) -> list[Observation | Exception]:
        return self.pool.reset(episodes)  # type: ignore[arg-type]

    def step_batch(self, episodes: list[Episode], actions: list[Message]) -> list[StepResult | Exception]:
        return self.pool.step(episodes, actions)  # type: ignore[arg-type]

    def submit(self) -> None:
        self.pool.submit()

    def interface(self) -> dict[str, Any]:
        return self.base.interface()

    def __getattr__(self, name: str) -> Any:  # suite-specific attributes (skipped, ...) from the driver's copy
        if name in ("base", "pool"):
            raise AttributeError(name)
        return getattr(self.base, name)


# --------------------------------------------------------------------------------------------
# sizing


def resolve_workers(setting: Any, suite: EnvSuite | None = None, share: int = 1) -> int:
    """``rollout.env_workers`` as a worker count: ``0`` in-process; ``auto``: ``min(cpus - 1, 8)`` for suites
    flagged ``expensive_steps`` when that is >= 2, else 0; ``N``: clamped to the machine's CPUs (logged)."""
    cpus = max(1, cpu_count() // max(1, share))  # share: processes on this machine each sizing a pool (ranks)
    if setting == "auto":
        if suite is None or not getattr(suite, "expensive_steps", False):
            return 0
        n = min(cpus - 1, MAX_AUTO_WORKERS)
        # one worker steps nothing in parallel and costs the pool's start (tau^2: ~20 s on 2 busy cores, where a
        # gold retail episode costs ~10-40 ms in process): benchmarks/rollout_throughput.py --gold
        return n if n >= MIN_AUTO_WORKERS else 0
    n = int(setting)
    if n < 0:
        raise ValueError(f"rollout.env_workers={setting!r}: must be auto, 0 or a positive integer")
    if n > cpus:
        log.warning("rollout.env_workers=%d is more than this machine's %d CPUs: clamped to %d", n, cpus, cpus)
        n = cpus
    return n


def valid_setting(setting: Any) -> bool:
    if setting == "auto":
        return True
    if isinstance(setting, bool):
        return False
    if isinstance(setting, int):
        return setting >= 0
    return isinstance(setting, str) and setting.isdigit()


@contextmanager
def pooled(suite: EnvSuite, spec: SuiteSpec | Callable[[], SuiteSpec | None] | None, workers: Any,
           share: int = 1, reply_timeout: float | None = REPLY_TIMEOUT_S) -> Iterator[EnvSuite]:
    """``suite`` itself (``workers`` resolves to 0, or no ``spec``), else a :class:`PooledSuite` over a pool of
    that many workers (each killed when silent for ``reply_timeout`` s), closed on exit. ``spec`` may be a
    function, called only when a pool is made."""
    n = resolve_workers(workers, suite, share)
    if n > 0 and callable(spec):
        spec = spec()
    if n == 0 or spec is None:
        yield suite
        return
    spec = replace(spec, preload=(*spec.preload, type(suite).__module__))
    with EnvPool(spec, n, reply_timeout=reply_timeout) as pool:
        yield PooledSuite(suite, pool)

