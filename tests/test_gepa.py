"""GEPA through the real ``gepa`` package over tracekit's rollout runner (tiny model, tau2_mini training seeds):
with the local stand-in OpenAI server as reflection LM the loop proposes candidates, never exceeds its
metric-call budget, and a killed run resumes without re-running an episode; an unreachable reflection
endpoint stops it with one line naming the endpoint, keeping its state; the in-process model works offline."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from omegaconf import open_dict

from tests.openai_stub import StubOpenAIServer
from tracekit.artifacts import iter_jsonl

CAPS = [{"name": "tool_calling_precision", "description": "Pass the exact ids the user and the tools gave."},
        {"name": "precondition_verification", "description": "Check the policy before changing anything."}]


@pytest.fixture
def gepa_cfg(make_cfg):
    def make(base_url: str | None = None, endpoint: str = "reflect", **gepa):
        cfg = make_cfg("experiment=smoke", "benchmark=tau2_mini", "benchmark.limit=1", "eval.max_steps=2",
                       "agent.max_new_tokens=16", "baselines.gepa.train_limit=3", "baselines.gepa.valset_size=1",
                       "baselines.gepa.reflection_minibatch_size=1", "baselines.gepa.reflection_max_new_tokens=16",
                       f"baselines.gepa.endpoint={endpoint}", *(f"baselines.gepa.{k}={v}" for k, v in gepa.items()))
        if base_url is not None:
            from tracekit.config import EndpointConfig

            with open_dict(cfg):
                cfg.llm.endpoints.reflect = EndpointConfig(kind="openai", base_url=base_url, model="stub-model",
                                                           max_retries=0, timeout_s=10)
        return cfg

    return make


def _proposer():
    counter = itertools.count(1)
    return lambda body: f"Here is the new text:\n```\nproposal {next(counter)}: check every id twice\n```"


def _ledger(work: Path) -> list[tuple[str, str]]:
    """(candidate dir, task id) of every episode rolled out."""
    return [(p.parent.name, row["task_id"]) for p in sorted((work / "episodes").glob("*/trajectories.jsonl"))
            for row in iter_jsonl(p)]


def test_gepa_proposes_candidates_within_its_budget_through_a_stand_in_server(gepa_cfg, tmp_path):
    from tracekit.methods.gepa import run_gepa

    with StubOpenAIServer(handler=_proposer()) as srv:
        r = run_gepa(gepa_cfg(srv.url), CAPS, budget=7, work=tmp_path / "run", seed=3)
        reflection_requests = srv.chat_requests
    texts = [t for p in r["proposals"] for t in p["texts"].values()]
    assert len(texts) >= 2 and all(t.startswith("proposal ") for t in texts)
    assert len(reflection_requests) == r["reflection_calls"] == len(texts)
    assert "tool calling precision" in reflection_requests[0]["messages"][0]["content"]  # the capability's template
    ledger = _ledger(tmp_path / "run")
    worst = 2 * 1 + 1  # two minibatches of 1 and the valset of 1: the most one iteration can spend
    assert r["episodes"] == len(ledger) == len(set(ledger)) and 7 - worst < r["episodes"] <= 7
    assert r["candidates"][0]["candidate"] == {c["name"]: c["description"] for c in CAPS}  # the seed
    assert r["system_prompt_suffix"].startswith("Capabilities that tasks in this environment require")
    assert set(r["valset"]).isdisjoint(r["trainset"])


def test_a_killed_gepa_run_resumes_without_re_running_an_episode(gepa_cfg, tmp_path, monkeypatch):
    from tracekit.methods import gepa as gepa_mod

    work = tmp_path / "run"
    real_call = gepa_mod.ReflectionLM.__call__
    calls = []

    def dies_on_the_second_reflection(self, prompt):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process is killed mid-iteration (after that iteration's rollouts)
        return real_call(self, prompt)

    with StubOpenAIServer(handler=_proposer()) as srv:
        monkeypatch.setattr(gepa_mod.ReflectionLM, "__call__", dies_on_the_second_reflection)
        with pytest.raises(KeyboardInterrupt):
            gepa_mod.run_gepa(gepa_cfg(srv.url), CAPS, budget=10, work=work, seed=3)
        before = _ledger(work)
        assert (work / "gepa" / "gepa_state.bin").exists() and len(before) >= 2
        monkeypatch.setattr(gepa_mod.ReflectionLM, "__call__", real_call)

        ran = []  # (candidate dir, task) of every episode the resumed run rolls out
        import tracekit.rollout as rollout

        original = rollout.run_rollouts

        def counting(suite, agent, out_dir, *a, tasks=None, **k):
            done = rollout.load_done(Path(out_dir) / rollout.TRAJECTORIES)
            ran.extend((Path(out_dir).name, t.id) for t in tasks if (t.id, 0) not in done)
            return original(suite, agent, out_dir, *a, tasks=tasks, **k)

        monkeypatch.setattr(gepa_mod, "run_rollouts", counting)  # where the adapter looks it up when it evaluates
        r = gepa_mod.run_gepa(gepa_cfg(srv.url), CAPS, budget=10, work=work, seed=3)
    after = _ledger(work)
    assert not set(ran) & set(before)  # nothing already rolled out was rolled out again (the seed's valset too)
    assert set(before) <= set(after) and len(after) == len(set(after)) == len(before) + len(ran)
    assert r["episodes"] == len(after) <= 10
    assert "Loading gepa state from run dir" in (work / "gepa" / "run_log.txt").read_text()


def test_an_unreachable_reflection_endpoint_stops_gepa_in_one_line_keeping_its_state(gepa_cfg, tmp_path):
    from tracekit.llm.base import EndpointError
    from tracekit.methods.gepa import run_gepa
    from tracekit.ports import free_port

    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    with pytest.raises(EndpointError) as e:
        run_gepa(gepa_cfg(url), CAPS, budget=10, work=tmp_path / "run", seed=3)
    msg = str(e.value)
    assert "\n" not in msg and "llm.endpoints.reflect" in msg and url in msg and "rerun resumes" in msg
    assert (tmp_path / "run" / "gepa" / "gepa_state.bin").exists()
    spent = _ledger(tmp_path / "run")
    assert 1 <= len(spent) <= 3  # the seed's valset and the first parent minibatch, no more after the failure


def test_gepa_completes_offline_with_the_in_process_model_as_reflection_lm(gepa_cfg, tmp_path):
    from tracekit.methods.gepa import run_gepa

    r = run_gepa(gepa_cfg(endpoint="analysis"), CAPS, budget=4, work=tmp_path / "run", seed=3)
    assert r["reflection_calls"] >= 1 and len(r["proposals"]) == r["reflection_calls"] and r["episodes"] <= 4


def test_a_budget_below_one_proposal_is_refused_naming_the_setting(gepa_cfg, tmp_path):
    from tracekit.methods.gepa import run_gepa

    with pytest.raises(ValueError, match="max_metric_calls=3 cannot pay .*raise baselines.gepa.max_metric_calls"):
        run_gepa(gepa_cfg("http://127.0.0.1:9/v1"), CAPS, budget=3, work=tmp_path / "run", seed=3)
