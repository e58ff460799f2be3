"""A retried episode takes its original place (issue 49, item 4): drive_episodes yields, and a rollout file holds,
the order of a clean run whatever was retried, in process and through env worker processes."""

from __future__ import annotations

import os
import random
import sys

import pytest

from tracekit.agents import LLMAgent
from tracekit.envs.base import Episode, EnvSuite, Observation, Outcome, StepResult
from tracekit.envs.pool import EnvPool, PooledSuite, SuiteSpec, WorkerDied
from tracekit.episodes import (ENDED_AT_CHECK, ENDED_AT_OPEN, ENDED_AT_STEP, EpisodeRun, clean_order,
                               drive_episodes)
from tracekit.rollout import TRAJECTORIES, run_rollouts
from tracekit.types import Message, Task
from tests.test_episodes import StubClient

pytestmark = pytest.mark.timeout(300)

# kinds: "talkN" done after N actions (its ending at the step; over MAX_STEPS: at the check); "silent" done at reset; "nobuild" the suite cannot
# build it; "loop" never done (max_steps, at the budget check); "long" over the context budget (at the check)
MAX_STEPS = 4


class LengthEpisode(Episode):
    def __init__(self, task: Task, fail_marker: str | None):
        self.task, self.n, self.fail_marker = task, 0, fail_marker
        self.kind = task.data["kind"]

    def reset(self) -> Observation:
        text = "x" * 5000 if self.kind == "long" else f"hello {self.task.id}"
        return Observation([Message(role="system", content="s"), Message(role="user", content=text)], tools=[],
                           done=self.kind == "silent")

    def step(self, action: Message) -> StepResult:
        self.n += 1
        fail_at = self.task.data.get("fail_at")
        if fail_at == self.n and self.fail_marker is not None and not os.path.exists(self.fail_marker + self.task.id):
            open(self.fail_marker + self.task.id, "w").close()  # the first attempt only
            if self.task.data.get("kill"):  # the worker process dies holding it (and its other episodes)
                print("worker killed", file=sys.stderr, flush=True)
                os._exit(9)
            raise WorkerDied(f"env worker 0 exited with code -9 (stepping {self.task.id})")
        done = self.kind.startswith("talk") and self.n == int(self.kind[4:])
        return StepResult([Message(role="user", content=f"more {self.n}")], done=done)

    def outcome(self) -> Outcome:
        return Outcome(reward=0.1 * self.n, success=self.kind.startswith("talk"))


class LengthSuite(EnvSuite):
    def __init__(self, tasks: list[dict], fail_marker: str | None = None):
        self.name, self.fail_marker = "lengths", fail_marker
        self._tasks = [Task(id=f"e{i}", env="lengths", data=d) for i, d in enumerate(tasks)]

    def tasks(self) -> list[Task]:
        return self._tasks

    def episode(self, task: Task, seed: int = 0) -> Episode:
        if task.data["kind"] == "nobuild":
            raise ValueError("no such scenario")
        return LengthEpisode(task, self.fail_marker)


def length_suite(tasks: list[dict], fail_marker: str | None = None) -> EnvSuite:
    return LengthSuite(tasks, fail_marker)


def _tasks(rng: random.Random, n: int, failing: int) -> list[dict]:
    kinds = [rng.choice(["talk1", "talk2", "talk3", "talk5", "silent", "nobuild", "loop", "long"]) for _ in range(n)]
    tasks = [{"kind": k} for k in kinds]
    talkers = [i for i, k in enumerate(kinds) if k.startswith("talk")]
    for i in rng.sample(talkers, min(failing, len(talkers))):
        tasks[i]["fail_at"] = rng.randint(1, int(kinds[i][4:]))
    return tasks


def _drive(suite: EnvSuite, batch_size: int) -> list[str]:
    agent = LLMAgent(StubClient(), temperature=0.0, max_new_tokens=16)

    def act(live):
        return agent.act([__import__("tracekit.agents", fromlist=["AgentState"]).AgentState(
            r.task, list(r.messages), r.tools, r.seed, r.steps) for r in live])

    def fits(r):
        return sum(len(m.content or "") for m in r.messages) < 1000

    runs = (EpisodeRun(t, 0, 0) for t in suite.tasks())
    return [r.task.id for r in drive_episodes(suite, runs, act, max_steps=MAX_STEPS, batch_size=batch_size,
                                              fits=fits, infra_retries=3)]


ENDINGS = {"silent": (ENDED_AT_CHECK, 0), "nobuild": (ENDED_AT_OPEN, 0), "loop": (ENDED_AT_CHECK, MAX_STEPS),
           "long": (ENDED_AT_CHECK, 0)}


@pytest.mark.parametrize("seed", range(12))
def test_clean_order_replays_the_loop_and_a_retried_episode_takes_its_original_place(tmp_path, seed):
    """Random mixes of endings and batch sizes: clean_order, from each run's ending alone, is the order a clean
    drive yields; a drive where some episodes fail their infrastructure once (at a random action) yields the
    same order."""
    rng = random.Random(seed)
    tasks = _tasks(rng, rng.randint(1, 14), failing=rng.randint(1, 3))
    batch = rng.randint(1, 6)
    clean = _drive(LengthSuite(tasks), batch)
    endings = [ENDINGS.get(d["kind"]) or ((ENDED_AT_STEP, int(d["kind"][4:]) - 1) if int(d["kind"][4:]) <= MAX_STEPS
                                          else ENDINGS["loop"]) for d in tasks]
    assert [f"e{j}" for j in clean_order(endings, batch)] == clean
    assert _drive(LengthSuite(tasks, str(tmp_path / "failed-")), batch) == clean


def test_a_killed_worker_leaves_the_rollout_file_a_clean_run_writes(tmp_path):
    """Through env worker processes (scoring deferred): the worker holding e0 dies at e0's second step (its other
    episodes fail with it), the retried episodes run again; the file is byte for byte the in-process clean run's
    apart from each row's seconds, and the rows are not in the opening order (the episodes' lengths differ)."""
    import json

    tasks = [{"kind": "talk3", "fail_at": 2, "kill": True}, {"kind": "talk1"}, {"kind": "talk2"}, {"kind": "silent"},
             {"kind": "talk5"}, {"kind": "talk1"}, {"kind": "loop"}, {"kind": "talk2"}]
    agent = LLMAgent(StubClient(), temperature=0.0, max_new_tokens=16, return_tokens=True)
    clean = run_rollouts(LengthSuite(tasks), agent, tmp_path / "clean", max_steps=MAX_STEPS, batch_size=3,
                         progress=False)
    marker = str(tmp_path / "killed-")
    with EnvPool(SuiteSpec(length_suite, (tasks, marker)), 2) as pool:
        killed = run_rollouts(PooledSuite(LengthSuite(tasks, marker), pool), agent, tmp_path / "killed",
                              max_steps=MAX_STEPS, batch_size=3, progress=False)
        assert len(pool.deaths) == 1
    assert killed.retried >= 1 and clean.retried == 0

    def rows(d):
        out = []
        for line in (d / TRAJECTORIES).read_text().splitlines():
            row = json.loads(line)
            row["info"].pop("seconds")
            out.append(row)
        return out

    assert rows(tmp_path / "killed") == rows(tmp_path / "clean")
    assert [r["task_id"] for r in rows(tmp_path / "clean")] != [f"e{i}" for i in range(len(tasks))]


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_a_pipeline_whose_rollout_lost_a_worker_caches_what_a_clean_one_does(make_cfg, tmp_path, monkeypatch):
    """The smoke pipeline to compose (tiny model on tau2 retail): one env worker SIGKILLed at the rollout's first
    decode (its episodes run again) against a clean in-process run. Every file of the two caches (rollout, labels,
    synthesized environments, adapters, the composed MoE's gates and gate log) is the same, apart from timing
    fields and the rollout's own history (tests/test_env_pool.py's cache_but_timing); before issue 49 the retried
    rows came last and the labels, the adapters' data and compose's gates followed the other order. Slow (two
    smoke pipelines, ~4 min on 2 busy cores); the rollout level is test_a_killed_worker_leaves_the_rollout_file_a_
    clean_run_writes and tests/test_env_pool.py's killed-worker rollout stage test."""
    import multiprocessing as mp
    import signal

    import tracekit.runs as R
    from tests.test_env_pool import cache_but_timing
    from tests.test_kill_resume import _diff
    from tracekit.artifacts import StageCache
    from tracekit.pipeline import RunRecord
    from tracekit.stages import build_pipeline

    monkeypatch.setenv("PYTHONHASHSEED", "0")  # a training subprocess writes PEFT's target_modules set in one order
    from tracekit.report.logging import RunLogger

    overrides = ("experiment=smoke", "logger=none", "stages=[compose]")

    def run(cfg, name):
        build_pipeline().run(cfg, ["compose"], StageCache(tmp_path / name),
                             RunRecord(tmp_path / f"run-{name}", logger=RunLogger(cfg, tmp_path / f"run-{name}")))

    real, killed = R.build_agent, []

    def build_agent(*a, **k):
        agent = real(*a, **k)
        act = agent.act

        def act_then_kill(states):
            workers = [p for p in mp.active_children() if p.name.startswith("tracekit-env-")]
            if not killed and workers:  # the rollout's first decode: its episodes live in the workers
                w = min(workers, key=lambda p: p.name)
                os.kill(w.pid, signal.SIGKILL)
                killed.append(w.pid)
            return act(states)

        agent.act = act_then_kill
        return agent

    monkeypatch.setattr(R, "build_agent", build_agent)
    run(make_cfg(*overrides, "rollout.env_workers=2"), "killed")
    assert killed
    monkeypatch.setattr(R, "build_agent", real)
    run(make_cfg(*overrides, "rollout.env_workers=0"), "clean")
    killed_view = cache_but_timing(tmp_path / "killed")
    assert any(k.startswith("compose/") for k in killed_view) and any("gate" in k for k in killed_view)
    problems = _diff(cache_but_timing(tmp_path / "clean"), killed_view)
    assert not problems, "\n".join(problems[:20])
