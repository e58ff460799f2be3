"""The episode core: evaluation (run_rollouts) and training (run_episodes) end every episode alike."""

from __future__ import annotations

import pytest

from tracekit.agents import LLMAgent
from tracekit.envs.base import Episode, EnvSuite, Observation, Outcome, StepResult
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.rl.episodes import EpisodeSpec, request_seed, run_episodes
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.types import Message, Task, stable_hash

REFUSED_CHARS = 200_000  # the stub client refuses longer prompts


def _tok(m: Message) -> int:
    return int(stable_hash(m.model_dump()), 16) % 50_000


class StubClient(ChatClient):
    """Deterministic: the reply depends only on the conversation; one token id per message. Refuses
    (``finish_reason='error'``) prompts over ``REFUSED_CHARS`` or asking for it, as backends do past their context."""

    def __init__(self):
        self.requests: list[ChatRequest] = []

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        self.requests += requests
        out = []
        for r in requests:
            text = "".join(m.content or "" for m in r.messages)
            if len(text) > REFUSED_CHARS or "refuse me" in text:
                out.append(ChatResponse(message=Message(role="assistant"), text="too long", finish_reason="error"))
                continue
            n = sum(m.role == "assistant" for m in r.messages)
            msg = Message(role="assistant", content=f"answer {n} to {r.messages[1].content}")
            out.append(ChatResponse(message=msg, text=msg.content, prompt_token_ids=[_tok(m) for m in r.messages],
                                    completion_token_ids=[_tok(msg)], completion_logprobs=[-0.5]))  # fmt: skip
        return out


class StubEpisode(Episode):
    """``kind`` picks the ending: talk (done after 2 actions), silent (done at reset), boom (step raises),
    judge (the verifier raises), loop (never done), long (a prompt over any context budget), refused (a
    prompt the evaluation budget admits but the model refuses after one turn), down (server gone)."""

    def __init__(self, task: Task):
        self.task, self.kind, self.actions = task, task.data["kind"], 0

    def reset(self) -> Observation:
        opening = "x" * (REFUSED_CHARS + 1) if self.kind == "long" else f"hello from {self.task.id}"
        msgs = [Message(role="system", content="be brief"), Message(role="user", content=opening)]
        return Observation(msgs, tools=[], done=self.kind == "silent", termination="user_stop" if self.kind == "silent" else "")

    def step(self, action: Message) -> StepResult:
        if self.kind == "boom":
            raise RuntimeError("db exploded")
        if self.kind == "down":
            raise EndpointError("user simulator unreachable")
        self.actions += 1
        done = self.kind == "talk" and self.actions == 2
        reply = "refuse me" if self.kind == "refused" else f"more {self.actions}"
        return StepResult([Message(role="user", content=reply)], done=done, termination="user_stop" if done else "")

    def outcome(self) -> Outcome:
        if self.kind == "judge":
            raise ValueError("verifier crashed")
        return Outcome(reward=0.25 * self.actions + 0.5 * (self.kind == "talk"), success=self.kind == "talk", info={"kind": self.kind})


class StubSuite(EnvSuite):
    def __init__(self, kinds: list[str]):
        self.name = "stub"
        self._tasks = [Task(id=f"{k}-{i}", env="stub", data={"kind": k}) for i, k in enumerate(kinds)]

    def tasks(self) -> list[Task]:
        return self._tasks

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return StubEpisode(task)


KINDS = ["talk", "silent", "boom", "judge", "loop", "long", "refused", "talk"]


def _evaluate(suite, tmp_path, batch_size=3):
    agent = LLMAgent(StubClient(), temperature=0.0, max_new_tokens=16, return_tokens=True)
    run_rollouts(suite, agent, tmp_path, seed=7, max_steps=3, batch_size=batch_size, progress=False)
    return {t.task_id: t for t in read_trajectories(tmp_path)}


def _train(suite, client=None):
    specs = [EpisodeSpec(t, 7, 0, g) for g, t in enumerate(suite.tasks())]
    return run_episodes(client or StubClient(), suite, specs, temperature=0.0, max_new_tokens=16, max_steps=3)


def test_evaluation_and_training_end_each_episode_alike(tmp_path):
    suite = StubSuite(KINDS)
    evals = _evaluate(suite, tmp_path)
    trains = {t.task_id: t for t in _train(suite)}
    assert list(trains) == [t.id for t in suite.tasks()]  # training keeps spec order
    for tid, e in evals.items():
        t = trains[tid]
        assert (e.messages, e.reward, e.success, e.termination, e.error, e.seed) == (
            t.messages, t.reward, t.success, t.termination, t.error, t.seed), tid  # fmt: skip
        assert e.info["steps"] == t.info["steps"] and e.info["turns"] == t.info["turns"], tid
    got = {tid: (t.termination, t.info["steps"], t.reward) for tid, t in trains.items()}
    assert got == {
        "talk-0": ("user_stop", 2, 1.0),
        "silent-1": ("user_stop", 0, 0.0),
        "boom-2": ("error", 1, 0.0),
        "judge-3": ("error", 3, 0.0),
        "loop-4": ("max_steps", 3, 0.75),
        "long-5": ("context_overflow", 0, 0.0),  # evaluation: its budget check; training: the refusal
        "refused-6": ("context_overflow", 1, 0.25),  # both: the refusal, with nothing appended
        "talk-7": ("user_stop", 2, 1.0),
    }
    for runs in (evals, trains):  # done at reset: scored, no agent turn
        silent = runs["silent-1"]
        assert silent.info["turns"] == [] and [m.role for m in silent.messages] == ["system", "user"]
        assert "db exploded" in runs["boom-2"].info["traceback"] and runs["boom-2"].error == "RuntimeError: db exploded"
        assert runs["judge-3"].error == "ValueError: verifier crashed" and len(runs["judge-3"].info["turns"]) == 3
        assert runs["refused-6"].messages[-1].content == "refuse me"
    assert evals["loop-4"].info["kind"] == trains["loop-4"].info["kind"] == "loop"
    assert trains["loop-4"].info["outcome"] == {"kind": "loop"} and trains["talk-7"].info["group"] == 7
    assert evals["talk-0"].tokens is not None and trains["talk-0"].tokens is None  # the single record is evaluation's


def test_evaluation_batch_size_changes_nothing_but_speed(tmp_path):
    suite = StubSuite(KINDS)
    one, many = _evaluate(suite, tmp_path / "one", batch_size=1), _evaluate(suite, tmp_path / "many", batch_size=8)
    assert {k: (t.messages, t.reward, t.termination) for k, t in one.items()} == {
        k: (t.messages, t.reward, t.termination) for k, t in many.items()
    }


def test_training_request_seeds_do_not_depend_on_the_batch():
    suite = StubSuite(["talk", "loop", "silent", "talk"])
    specs = [EpisodeSpec(t, 3, k, g) for g, t in enumerate(suite.tasks()) for k in range(2)]

    def seeds(chosen: list[EpisodeSpec]) -> dict[tuple[str, int], list[int]]:
        client = StubClient()
        run_episodes(client, suite, chosen, temperature=1.0, max_steps=3, sample_seed=11)
        by_episode: dict[tuple[str, int], list[int]] = {}
        for r in client.requests:  # the opening names the task; the seed tells the sample apart
            by_episode.setdefault(r.messages[1].content, []).append(r.seed)
        return by_episode

    everything, alone = seeds(specs), seeds(specs[6:7])
    want = [request_seed(11, specs[6], s) for s in range(2)]
    assert alone["hello from talk-3"] == want and set(want) <= set(everything["hello from talk-3"])
    assert "hello from silent-2" not in everything  # done at reset: never sent to the model


@pytest.mark.parametrize("runner", ["evaluation", "training"])
def test_an_endpoint_error_aborts_instead_of_being_recorded(tmp_path, runner):
    suite = StubSuite(["talk", "down"])
    with pytest.raises(EndpointError):
        _evaluate(suite, tmp_path) if runner == "evaluation" else _train(suite)


# -- infrastructure failures are not outcomes: run again, never yielded, counted ----------------------------------


def _infra_errors():
    """One of each infrastructure failure the episode core retries: a dead env worker, the ToolSandbox server, the
    coding sandbox's jail (tagged, its module imports no tracekit code), and an error raised from one."""
    from tracekit.coding.sandbox import JailUnavailable
    from tracekit.envs.pool import WorkerDied
    from tracekit.targets.toolsandbox.suite import EnvironmentServerError

    def wrapped():
        try:
            raise JailUnavailable("coding sandbox: cannot make the command's cgroup")
        except JailUnavailable as e:
            raise RuntimeError("the test run could not start") from e

    try:
        wrapped()
    except RuntimeError as e:
        chained = e
    return [WorkerDied("env worker 0 exited with code -9"), EnvironmentServerError("ToolSandbox server died during step"),
            JailUnavailable("coding sandbox: the jail cannot start here"), chained]


class FlakyEpisode(StubEpisode):
    """A talk episode whose infrastructure fails at its second step the first ``fails`` times (counted per task)."""

    def __init__(self, task, failures):
        super().__init__(task)
        self.failures = failures

    def step(self, action):
        left = self.failures.get(self.task.id, [])
        if self.actions == 1 and left:
            raise left.pop(0)
        return super().step(action)


class FlakySuite(StubSuite):
    def __init__(self, kinds, failures):
        super().__init__(kinds)
        self.failures = failures

    def episode(self, task, seed=0):
        return FlakyEpisode(task, self.failures)


def test_every_kind_of_infrastructure_failure_is_one_type_and_the_agents_errors_are_not():
    from tracekit.envs.base import infra_cause

    assert all(infra_cause(e) is not None for e in _infra_errors())
    assert infra_cause(RuntimeError("db exploded")) is None and infra_cause(ValueError("verifier crashed")) is None


def test_infrastructure_failures_are_run_again_and_never_recorded(tmp_path):
    """Each kind fails one episode once (the same episode: three retries): the file and the training batch hold the
    clean run of every episode; the rollout summary counts the retried episodes (not as errors), the training
    trajectory says how often; the agent's own failure (boom) stays an outcome."""
    clean = run_rollouts(StubSuite(["talk", "talk", "boom"]), LLMAgent(StubClient(), temperature=0.0),
                         tmp_path / "clean", max_steps=5, progress=False)
    errs = _infra_errors()
    suite = FlakySuite(["talk", "talk", "boom"], {"talk-0": errs[:3], "talk-1": errs[3:]})
    s = run_rollouts(suite, LLMAgent(StubClient(), temperature=0.0), tmp_path / "flaky", max_steps=5, progress=False,
                     infra_retries=3)
    got, want = read_trajectories(tmp_path / "flaky"), read_trajectories(tmp_path / "clean")
    view = lambda t: (t.task_id, [m.model_dump() for m in t.messages], t.reward, t.termination, t.error)  # noqa: E731
    assert sorted(map(view, got)) == sorted(map(view, want))
    assert s.retried == 2 and s.errors == clean.errors == 1 and len(s.infra_errors) == 4
    assert s.terminations == clean.terminations and "infra_error" not in s.terminations

    suite = FlakySuite(["talk", "talk"], {"talk-1": _infra_errors()[:1]})
    specs = [EpisodeSpec(t, 7, k, 0) for k, t in enumerate(suite.tasks())]
    trajs = run_episodes(StubClient(), suite, specs, temperature=0.0, max_new_tokens=16, max_steps=5)
    assert [t.error for t in trajs] == [None, None] and [t.info.get("infra_retries") for t in trajs] == [None, 1]


def test_an_episode_that_keeps_failing_its_infrastructure_stops_the_run_naming_it(tmp_path):
    from tracekit.episodes import InfraFailure

    suite = FlakySuite(["talk", "talk"], {"talk-1": _infra_errors()[:3]})
    with pytest.raises(InfraFailure, match=r"^episode talk-1 \(sample 0\) ended on an infrastructure failure 3 "
                                           r"time\(s\), not an outcome of the agent: JailUnavailable: "):
        run_rollouts(suite, LLMAgent(StubClient(), temperature=0.0), tmp_path, max_steps=5, progress=False)
    specs = [EpisodeSpec(t, 7, 0, 0) for t in suite.tasks()]
    suite.failures["talk-1"] = _infra_errors()[:1]
    with pytest.raises(InfraFailure, match="rollout.infra_retries=0"):
        run_episodes(StubClient(), suite, specs, temperature=0.0, max_steps=5, infra_retries=0)


def test_a_resumed_file_drops_an_infrastructure_failure_recorded_before_and_a_cached_one_is_refused(tmp_path):
    import json

    from tracekit.artifacts import Artifact, CorruptArtifact
    from tracekit.rollout import TRAJECTORIES
    from tracekit.runs import read_trajectories_dir

    run_rollouts(StubSuite(["talk", "talk"]), LLMAgent(StubClient(), temperature=0.0), tmp_path, max_steps=5,
                 progress=False)
    lines = (tmp_path / TRAJECTORIES).read_text().splitlines()
    old = json.loads(lines[1])
    old.update(error="WorkerDied: env worker 1 (pid 7) exited with code -9", termination="error", reward=0.0)
    (tmp_path / TRAJECTORIES).write_text(lines[0] + "\n" + json.dumps(old) + "\n")
    with pytest.raises(CorruptArtifact, match=r"1 of its 2 episodes ended on an infrastructure failure recorded as an "
                                              rf"outcome \(e.g. talk-1: WorkerDied: .*; recompute: rm -r {tmp_path}$"):
        read_trajectories_dir(Artifact("episodes", "k", tmp_path, "k", True))
    s = run_rollouts(StubSuite(["talk", "talk"]), LLMAgent(StubClient(), temperature=0.0), tmp_path, max_steps=5,
                     progress=False)
    assert s.resumed == 1 and s.ran == 1 and all(t.error is None for t in read_trajectories(tmp_path))
