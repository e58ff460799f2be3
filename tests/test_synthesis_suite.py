"""Synthetic environments as EnvSuites: episodes, simulated users (scripted, LLM, none), sandboxed backends."""

from __future__ import annotations

from pathlib import Path

import pytest

from tracekit.synthesis.suite import CLOSING_REPLY, CONFIRM_REPLY, ScriptedUser, SyntheticSuite
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.synthesis.library import library_env
from tracekit.synthesis.protocol import ground_truth_actions
from tracekit.synthesis.sandbox import SandboxBackend, SandboxLimits
from tracekit.types import Message, Task, ToolCall

VALID = (Path(__file__).parent / "data" / "synthesis" / "valid_env.py").read_text()


def say(text: str) -> Message:
    return Message(role="assistant", content=text)


def test_tasks_are_seeds_and_observation_is_the_instance():
    env = library_env("tau2_tool_calling_precision")(1)
    suite = SyntheticSuite.from_env(env, range(3, 6))
    tasks = suite.tasks()
    assert [t.id for t in tasks] == ["seed-3", "seed-4", "seed-5"]
    assert all(t.env == "tau2_tool_calling_precision" for t in tasks)
    ep = suite.episode(tasks[0])
    obs = ep.reset()
    inst = env.generate(3)
    assert [m.role for m in obs.messages] == ["system", "user"]
    assert obs.messages[0].content == inst.system_prompt and obs.messages[1].content == inst.user_goal
    assert obs.tools == env.tools()
    assert suite.interface()["tools"] == env.tools()
    with pytest.raises(ValueError, match="is not seed-<int>"):
        suite.episode(Task(id="task-7", env="x"))


def test_scripted_user_answers_confirms_and_stops():
    inst = library_env("tau2_precondition_verification")(1).generate(0)
    user = ScriptedUser(inst)
    rid = inst.user_facts["reservation_id"]
    assert user.reply("Could you give me your reservation id?") == (f"My reservation id is {rid}.", False)
    assert user.reply("I will cancel it. Do you want me to proceed?") == (CONFIRM_REPLY, False)
    assert user.reply("Your reservation has been cancelled.") == (CLOSING_REPLY, True)
    assert ScriptedUser(inst).reply("Is there anything else I can help with?") == (CLOSING_REPLY, True)


def test_ground_truth_episode_with_scripted_user_scores_one():
    env = library_env("tau2_multi_step_task_completion")(1)
    suite = SyntheticSuite.from_env(env, range(2))
    for task in suite.tasks():
        ep = suite.episode(task)
        ep.reset()
        first = ep.step(say("Sure. What is your email?"))
        assert first.messages[0].role == "user" and "@example.com" in first.messages[0].content
        for action in ground_truth_actions(ep.instance)[:-1]:
            result = ep.step(action)
            assert [m.role for m in result.messages] == ["tool"] and not result.done
        last = ep.step(say("All your requests are done."))
        assert last.done and last.termination == "user_stop"
        out = ep.outcome()
        assert out.reward == 1.0 and out.success and out.info["seed"] == ep.instance.seed


def test_stopping_early_and_turn_limit():
    env = library_env("tau2_multi_step_task_completion")(0)
    suite = SyntheticSuite.from_env(env, [0], user="none", max_turns=2)
    ep = suite.episode(suite.tasks()[0])
    ep.reset()
    first = ground_truth_actions(ep.instance)[0]
    assert not ep.step(first).done
    res = ep.step(first.model_copy(update={"tool_calls": [ToolCall(id="x", name="get_order_details",
                                                                   arguments={"order_id": "#W0"})]}))
    assert res.done and res.termination == "max_steps"
    assert ep.outcome().reward == 0.0
    with pytest.raises(RuntimeError, match="after the episode ended"):
        ep.step(say("hello"))
    ep2 = suite.episode(suite.tasks()[0])
    ep2.reset()
    assert ep2.step(say("Bye.")).termination == "agent_stop"


class EchoUserClient(ChatClient):
    """Replies 'yes' to questions and ###STOP### otherwise; records batch sizes."""

    def __init__(self):
        self.batches: list[int] = []

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        self.batches.append(len(requests))
        out = []
        for r in requests:
            assert r.messages[0].role == "system" and "Your request" in r.messages[0].content
            text = "yes" if "?" in (r.messages[-1].content or "") else "Thanks! ###STOP###"
            out.append(ChatResponse(message=Message(role="assistant", content=text), text=text))
        return out


def test_llm_user_calls_are_batched_across_episodes():
    env = library_env("toolsandbox_permission_error_recovery")(0)
    client = EchoUserClient()
    suite = SyntheticSuite.from_env(env, range(3), user="llm", user_client=client)
    eps = [suite.episode(t, seed=i) for i, t in enumerate(suite.tasks())]
    suite.reset_batch(eps)
    results = suite.step_batch(eps, [say("Should I turn off low battery mode?")] * 3)
    assert client.batches == [3]
    assert all(r.messages[0].content == "yes" and not r.done for r in results)
    results = suite.step_batch(eps, [say("Done.")] * 3)
    assert all(r.done and r.termination == "user_stop" and r.messages[0].content == "Thanks!" for r in results)
    with pytest.raises(ValueError, match="needs a user_client"):
        SyntheticSuite.from_env(env, [0], user="llm").episode(Task(id="seed-0", env=env.name))


def test_generated_env_runs_through_the_sandbox_as_a_suite():
    backend = SandboxBackend(VALID, SandboxLimits(wall_seconds=20, memory_bytes=1 << 30))
    suite = SyntheticSuite(backend, range(4))
    try:
        rewards = []
        for task in suite.tasks():
            ep = suite.episode(task)
            ep.reset()
            for action in ground_truth_actions(ep.instance):
                ep.step(action)
            rewards.append(ep.outcome().reward)
        assert rewards == [1.0] * 4
    finally:
        suite.close()
