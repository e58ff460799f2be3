"""The rollout runner on tau^2: batching, budgets, seeds, token records, errors, kill-and-resume."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tracekit.agents import AgentState, GoldAgent, LLMAgent, turn_seed
from tracekit.targets.tau2 import suite as T
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.rollout import episode_seed, read_trajectories, run_rollouts, single_token_record
from tracekit.types import Message, ToolCall, stable_hash

SHORT = ["airline/0", "airline/1", "airline/5", "airline/6", "airline/9", "airline/10"]


def _tok(m: Message) -> int:
    return int(stable_hash(m.model_dump()), 16) % 50_000


class ScriptedClient(ChatClient):
    """Test double at the model boundary: ``script(request, turn)`` gives the assistant message
    (turn = assistant messages already in the request, minus the greeting). Token ids: one id per
    message, so each prompt extends the previous prompt + completion exactly like a chat template."""

    def __init__(self, script: Callable[[ChatRequest, int], Message]):
        self.script = script
        self.batches: list[list[ChatRequest]] = []

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        self.batches.append(list(requests))
        out = []
        for r in requests:
            turn = sum(m.role == "assistant" for m in r.messages) - 1
            msg = self.script(r, turn)
            tokens = {}
            if r.return_tokens:
                tokens = dict(prompt_token_ids=[_tok(m) for m in r.messages], completion_token_ids=[_tok(msg)],
                              completion_logprobs=[-0.5])
            out.append(ChatResponse(message=msg, text=msg.content or "", **tokens))
        return out


def probing_script(request: ChatRequest, turn: int) -> Message:
    """A malformed call, an unknown tool, a wrongly typed call, then a closing statement."""
    if turn == 0:
        return Message(role="assistant", content="<tool_call>{oops", parse_error="invalid JSON in tool call")
    if turn == 1:
        return Message(role="assistant", tool_calls=[ToolCall(id="c1", name="teleport", arguments={})])
    if turn == 2:
        name = "get_user_details"
        return Message(role="assistant", tool_calls=[ToolCall(id="c2", name=name, arguments={"user_id": 7})])
    return Message(role="assistant", content="Your request has been processed.")


def test_llm_agent_plumbing_batched_with_tool_errors_and_tokens(tmp_path):
    suite = T.Tau2Suite("tau2", split="base", task_ids=["airline/0", "retail/5"])
    client = ScriptedClient(probing_script)
    agent = LLMAgent(client, temperature=0.0, max_new_tokens=64, return_tokens=True)
    summary = run_rollouts(suite, agent, tmp_path, batch_size=2, progress=False)
    assert summary.ran == 2 and summary.errors == 0
    assert [len(b) for b in client.batches] == [2, 2, 2, 2]  # both episodes in every model call
    first = client.batches[0]
    assert first[0].tools == list(T.tool_schemas("airline")) and first[1].tools == list(T.tool_schemas("retail"))
    assert first[0].messages[0].content == T.system_prompt("airline")
    assert [r.seed for r in client.batches[2]] == [turn_seed(42, 2)] * 2 and first[0].temperature == 0.0
    air, ret = read_trajectories(tmp_path)
    tool_msgs = [m for m in air.messages if m.role == "tool"]
    assert [m.error for m in tool_msgs] == [True, True, True]
    assert tool_msgs[0].content.startswith("Error: could not parse the tool call")
    assert tool_msgs[1].content == "Error: Tool 'teleport' not found."
    assert tool_msgs[2].content == "Error: User 7 not found"
    # airline/0 needs no DB change and no info: scored 1 by tau^2; retail/5 needs a return: 0
    assert (air.termination, air.reward, ret.termination, ret.reward) == ("user_stop", 1.0, "user_stop", 0.0)
    assert air.info["steps"] == 4 and len(air.info["turns"]) == 4
    rec = air.tokens
    assert rec is not None and sum(rec.loss_mask) == 4 and len(rec.token_ids) == len(rec.logprobs)
    assert [lp for lp, m in zip(rec.logprobs, rec.loss_mask) if m] == [-0.5] * 4
    assert rec.token_ids == air.info["turns"][-1]["prompt_ids"] + air.info["turns"][-1]["completion_ids"]


def test_single_token_record_prefix_rule():
    turns = [
        {"prompt_ids": [1, 2], "completion_ids": [3], "completion_logprobs": [-0.1]},
        {"prompt_ids": [1, 2, 3, 4], "completion_ids": [5, 6], "completion_logprobs": [-0.2, -0.3]},
    ]
    rec = single_token_record(turns)
    assert rec.token_ids == [1, 2, 3, 4, 5, 6]
    assert rec.loss_mask == [0, 0, 1, 0, 1, 1]
    assert rec.logprobs == [0.0, 0.0, -0.1, 0.0, -0.2, -0.3]
    broken = [turns[0], dict(turns[1], prompt_ids=[1, 9, 3, 4])]  # the template re-rendered history
    assert single_token_record(broken) is None and single_token_record([]) is None


def test_budgets_end_episodes_with_recorded_reasons(tmp_path):
    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=["1"])
    looping = ScriptedClient(lambda r, t: Message(role="assistant", tool_calls=[
        ToolCall(id=f"c{t}", name="get_user_details", arguments={"user_id": "raj_sanchez_7340"})]))
    run_rollouts(suite, LLMAgent(looping), tmp_path / "steps", max_steps=3, progress=False)
    (t,) = read_trajectories(tmp_path / "steps")
    assert (t.termination, t.info["steps"], t.reward) == ("max_steps", 3, 0.0)
    assert len(looping.batches) == 3

    never = ScriptedClient(lambda r, t: pytest.fail("the model must not be called past the budget"))
    run_rollouts(suite, LLMAgent(never, max_new_tokens=256), tmp_path / "ctx", context_budget=2000, progress=False)
    (t,) = read_trajectories(tmp_path / "ctx")
    assert (t.termination, t.info["steps"], t.reward) == ("context_overflow", 0, 0.0)


def test_sampled_seeds_are_per_episode_and_reproducible(tmp_path):
    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=["0"])
    client = ScriptedClient(lambda r, t: Message(role="assistant", content="Your request has been processed."))
    run_rollouts(suite, LLMAgent(client, temperature=0.7), tmp_path, samples=2, seed=3, progress=False)
    a, b = read_trajectories(tmp_path)
    assert a.seed == episode_seed(3, "airline/0", 0, True) and b.seed == episode_seed(3, "airline/0", 1, True)
    assert a.seed != b.seed and episode_seed(42, "airline/0", 1, False) == 42
    assert sorted(r.seed for r in client.batches[0]) == sorted([turn_seed(a.seed, 0), turn_seed(b.seed, 0)])
    assert client.batches[0][0].temperature == 0.7
    with pytest.raises(ValueError, match="other settings"):  # same directory, different decoding
        run_rollouts(suite, LLMAgent(client, temperature=0.0), tmp_path, samples=2, seed=3, progress=False)


class Crash(BaseException):
    """Stands in for a kill: not an Exception, so the runner does not record it on an episode."""


class CrashingGold(GoldAgent):
    def __init__(self, after: int):
        self.after, self.calls = after, 0

    def act(self, states: list[AgentState]):
        self.calls += 1
        if self.calls > self.after:
            raise Crash
        return super().act(states)


def test_kill_and_resume_gives_exactly_one_trajectory_per_task_and_sample(tmp_path):
    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=SHORT)
    with pytest.raises(Crash):
        run_rollouts(suite, CrashingGold(after=4), tmp_path, samples=2, batch_size=3, progress=False)
    partial = read_trajectories(tmp_path)
    assert 0 < len(partial) < 12
    with open(tmp_path / "trajectories.jsonl", "a") as f:  # a line torn by the kill
        f.write('{"task_id": "airline/9", "env": "tau2_air')
    summary = run_rollouts(suite, GoldAgent(), tmp_path, samples=2, batch_size=3, progress=False)
    assert (summary.resumed, summary.ran, summary.total) == (len(partial), 12 - len(partial), 12)
    final = read_trajectories(tmp_path)
    keys = [(t.task_id, t.sample) for t in final]
    assert len(keys) == len(set(keys)) == 12 and set(keys) == {(t, s) for t in SHORT for s in (0, 1)}
    assert all(t.reward == 1.0 for t in final)
    again = run_rollouts(suite, GoldAgent(), tmp_path, samples=2, batch_size=3, progress=False)
    assert (again.resumed, again.ran) == (12, 0)


def test_episode_errors_are_recorded_and_endpoint_errors_abort(tmp_path):
    class Flaky(GoldAgent):
        def act(self, states):
            if any(s.task.id == "airline/5" for s in states):
                raise ValueError("model exploded")
            return super().act(states)

    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=SHORT[:4])
    summary = run_rollouts(suite, Flaky(), tmp_path / "flaky", batch_size=4, progress=False)
    trajs = {t.task_id: t for t in read_trajectories(tmp_path / "flaky")}
    assert summary.errors == 1 and summary.terminations == {"user_stop": 3, "error": 1}
    bad = trajs["airline/5"]
    assert (bad.termination, bad.error, bad.reward) == ("error", "ValueError: model exploded", 0.0)
    assert "model exploded" in bad.info["traceback"]
    assert all(t.reward == 1.0 for k, t in trajs.items() if k != "airline/5")

    class Unreachable(GoldAgent):
        calls = 0

        def act(self, states):
            Unreachable.calls += 1
            if Unreachable.calls > 2:
                raise EndpointError("http://127.0.0.1:1/v1 unreachable")
            return super().act(states)

    with pytest.raises(EndpointError):
        run_rollouts(suite, Unreachable(), tmp_path / "down", batch_size=1, progress=False)
    done = read_trajectories(tmp_path / "down")
    assert all(t.error is None for t in done)  # nothing recorded as an episode error
    summary = run_rollouts(suite, GoldAgent(), tmp_path / "down", batch_size=1, progress=False)
    assert summary.resumed == len(done) and len(read_trajectories(tmp_path / "down")) == 4
