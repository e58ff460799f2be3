"""Slow tau^2 checks: the gold agent on every airline and retail task; a rollout killed by SIGKILL."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import procs
from tracekit.agents import GoldAgent
from tracekit.targets.tau2 import suite as T
from tracekit.evaluate import summarize
from tracekit.rollout import TRAJECTORIES, read_trajectories, run_rollouts

pytestmark = pytest.mark.slow


def test_gold_agent_scores_one_on_all_164_tasks(tmp_path):
    suite = T.Tau2Suite("tau2", split="base")
    t0 = time.time()
    summary = run_rollouts(suite, GoldAgent(), tmp_path, batch_size=8, progress=False)
    seconds = time.time() - t0
    trajs = read_trajectories(tmp_path)
    res = summarize(trajs, suite.tasks())
    print(f"gold replay of {len(trajs)} tasks: {seconds:.1f}s, {res['domains']}")
    assert summary.errors == 0 and summary.terminations == {"user_stop": 164}
    assert res["domains"]["tau2_airline"]["solved"] == res["domains"]["tau2_airline"]["total"] == 50
    assert res["domains"]["tau2_retail"]["solved"] == res["domains"]["tau2_retail"]["total"] == 114
    assert res["overall"]["pass_rate"] == 1.0
    for d in T.DOMAINS:
        assert T.base_db(d).get_hash() == T.pristine_db_hash(d)


CHILD = textwrap.dedent(
    """
    import sys, time
    from tracekit.agents import GoldAgent
    from tracekit.targets.tau2.suite import Tau2Suite
    from tracekit.rollout import run_rollouts

    class SlowGold(GoldAgent):
        def act(self, states):
            time.sleep(0.2)
            return super().act(states)

    run_rollouts(Tau2Suite("tau2_retail", split="test"), SlowGold(), sys.argv[1], samples=2, batch_size=4, progress=False)
    """
)


def test_sigkill_mid_run_then_resume(tmp_path):
    out = tmp_path / "run"
    proc = procs.popen([sys.executable, "-c", CHILD, str(out)], cwd=Path(__file__).parents[1])
    path = out / TRAJECTORIES
    deadline = time.time() + 300
    try:
        while time.time() < deadline and proc.poll() is None:
            if path.exists() and path.read_text().count("\n") >= 5:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the child finished (or died) before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    before = len(read_trajectories(out))
    suite = T.Tau2Suite("tau2_retail", split="test")
    summary = run_rollouts(suite, GoldAgent(), out, samples=2, batch_size=4, progress=False)
    keys = [(t.task_id, t.sample) for t in read_trajectories(out)]
    assert 5 <= before < 80 and summary.resumed == before and summary.ran == 80 - before
    assert len(keys) == len(set(keys)) == 80
