"""The tau^2 adapter: real tasks, tools, errors and tau^2's own reward, on copy-on-write DBs."""

from __future__ import annotations

import pytest

from tracekit.agents import GoldAgent
from tracekit.targets.tau2 import suite as T
from tracekit.evaluate import summarize
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.types import Message, Task, ToolCall

WRITE_PREFIXES = ("cancel_", "book_", "update_", "modify_", "exchange_", "return_", "send_")


def call(tool: str, **arguments) -> Message:
    return Message(role="assistant", tool_calls=[ToolCall(id=f"c_{tool}", name=tool, arguments=arguments)])


def started(task_id: str, split: str = "base") -> T.Tau2Episode:
    suite = T.Tau2Suite("tau2", split=split, task_ids=[task_id])
    ep = suite.episode(suite.tasks()[0], seed=0)
    ep.reset()
    return ep


def test_splits_subsets_and_ids():
    assert {k: len(v) for k, v in T.load_splits("airline").items()} == {"train": 30, "test": 20, "base": 50}
    assert {k: len(v) for k, v in T.load_splits("retail").items()} == {"train": 74, "test": 40, "base": 114}
    test = T.Tau2Suite("tau2_airline", split="test").tasks()
    assert [t.id for t in test] == [f"airline/{i}" for i in T.load_splits("airline")["test"]]
    assert all(t.env == "tau2_airline" for t in test)
    both = T.Tau2Suite("tau2", split="base", limit=2).tasks()
    assert [t.id for t in both] == ["airline/0", "airline/1", "retail/0", "retail/1"]
    sub = T.Tau2Suite("tau2", split="base", task_ids=["retail/5", "7"]).tasks()
    assert [t.id for t in sub] == ["airline/7", "retail/5", "retail/7"]
    with pytest.raises(ValueError, match="not in split"):
        T.Tau2Suite("tau2_airline", split="test", task_ids=["0"])  # airline/0 is a train task
    with pytest.raises(ValueError, match="split must be one of"):
        T.Tau2Suite("tau2_retail", split="dev")
    with pytest.raises(ValueError, match="unknown tau2 benchmark"):
        T.Tau2Suite("tau3")


def test_prompt_and_tools_exactly_as_tau2_defines_them():
    from tau2.agent.llm_agent import LLMAgent

    stock = T.stock_environment("retail")  # what tau2's run_task builds
    agent = LLMAgent(tools=stock.get_tools(), domain_policy=stock.get_policy(), llm="unused")
    suite = T.Tau2Suite("tau2_retail", split="base", limit=1)
    ep = suite.episode(suite.tasks()[0])
    obs = ep.reset()
    assert obs.messages[0] == Message(role="system", content=agent.system_prompt)
    assert obs.messages[1] == Message(role="assistant", content="Hi! How can I help you today?")
    assert obs.messages[2].role == "user" and obs.messages[2].content
    assert obs.tools == [t.openai_schema for t in agent.tools]
    assert ep.env.get_policy() == stock.get_policy() and not obs.done
    assert suite.interface()["retail"]["tools"] == obs.tools


def test_gold_agent_scores_one_on_a_few_tasks_per_domain(tmp_path):
    suite = T.Tau2Suite("tau2", split="base", task_ids=["airline/3", "airline/7", "airline/11", "retail/2", "retail/10", "retail/11"])
    summary = run_rollouts(suite, GoldAgent(), tmp_path, batch_size=4, progress=False)
    trajs = read_trajectories(tmp_path)
    assert summary.total == summary.ran == 6 and summary.errors == 0
    assert [t.reward for t in trajs] == [1.0] * 6 and all(t.success for t in trajs)
    assert all(t.termination == "user_stop" and t.info["db_match"] for t in trajs)
    res = summarize(trajs, suite.tasks())
    assert res["overall"] == {"solved": 6, "total": 6, "pass_rate": 1.0, "mean_reward": 1.0}
    assert res["domains"]["tau2_airline"]["total"] == 3
    for d in T.DOMAINS:  # no tool call reached the shared DB
        assert T.base_db(d).get_hash() == T.pristine_db_hash(d)


class AlteredGold(GoldAgent):
    """Gold replay with one write action's first string argument altered."""

    def actions(self, task: Task):
        actions = [dict(a, arguments=dict(a["arguments"])) for a in super().actions(task)]
        for a in actions:
            if a["name"].startswith(WRITE_PREFIXES):
                key = next(k for k, v in a["arguments"].items() if isinstance(v, str))
                a["arguments"][key] += "_altered"
                return actions
        raise AssertionError(f"{task.id} has no write action")


class SilentGold(GoldAgent):
    """Gold actions, but the final message omits the communicate-info strings."""

    def final_message(self, task: Task) -> str:
        return "Your request has been processed."


def test_altered_gold_argument_or_missing_info_scores_zero(tmp_path):
    suite = T.Tau2Suite("tau2", split="base", task_ids=["airline/9", "retail/5"])
    run_rollouts(suite, AlteredGold(), tmp_path / "altered", progress=False)
    trajs = read_trajectories(tmp_path / "altered")
    assert [(t.task_id, t.reward, t.info["db_match"]) for t in trajs] == [("airline/9", 0.0, False), ("retail/5", 0.0, False)]
    # the altered call reached the environment and came back as the tool error the agent saw
    assert any(m.role == "tool" and m.error for m in trajs[0].messages)

    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=["3"])  # communicate_info = ["4"]
    run_rollouts(suite, SilentGold(), tmp_path / "silent", progress=False)
    (t,) = read_trajectories(tmp_path / "silent")
    assert t.info["db_match"] is True and t.info["communicate"] == [{"info": "4", "met": False}]
    assert t.reward == 0.0 and not t.success


def test_malformed_unknown_and_wrongly_typed_calls_come_back_as_tool_errors():
    ep = started("airline/1")
    r = ep.step(Message(role="assistant", content='<tool_call>{"name": "get_user_details", "arguments": {', parse_error="invalid JSON"))
    assert not r.done and len(r.messages) == 1
    assert r.messages[0].role == "tool" and r.messages[0].error
    assert r.messages[0].content == "Error: could not parse the tool call: invalid JSON"
    r = ep.step(call("fly_me_to_the_moon", when="now"))
    assert r.messages[0].content == "Error: Tool 'fly_me_to_the_moon' not found." and r.messages[0].error
    r = ep.step(call("get_user_details", user_id=12345))
    assert r.messages[0].content == "Error: User 12345 not found" and r.messages[0].error
    r = ep.step(call("get_user_details", name="raj"))  # tau2 calls the function: Python's TypeError message
    assert r.messages[0].error and "unexpected keyword argument 'name'" in r.messages[0].content
    r = ep.step(call("get_user_details", user_id="raj_sanchez_7340"))
    assert not r.messages[0].error and '"user_id": "raj_sanchez_7340"' in r.messages[0].content
    assert ep.num_errors == 4 and not ep.done
    # the episode still finishes and is scored by tau^2's evaluator (which replays the errors too)
    ep.step(call("get_reservation_details", reservation_id="Q69X3R"))
    r = ep.step(Message(role="assistant", content="The reservation cannot be cancelled."))
    assert r.done and r.termination == "user_stop"  # the scripted user stops on a statement
    out = ep.outcome()
    assert out.reward == 1.0 and out.info["num_errors"] == 4


def test_terminations_agent_error_agent_stop_too_many_errors():
    ep = started("airline/5")
    r = ep.step(Message(role="assistant", content="   "))
    assert r.done and r.termination == "agent_error" and ep.outcome().reward == 0.0

    ep = started("airline/0")  # no gold actions, no info: an agent stop right away is scored (DB unchanged)
    r = ep.step(Message(role="assistant", content="I cannot help with that. ###STOP###"))
    assert r.done and r.termination == "agent_stop" and r.messages == []
    assert ep.outcome().reward == 1.0

    suite = T.Tau2Suite("tau2_airline", split="base", task_ids=["5"], max_errors=3)
    ep = suite.episode(suite.tasks()[0])
    ep.reset()
    results = [ep.step(call("nope")) for _ in range(3)]
    assert [r.done for r in results] == [False, False, True] and results[-1].termination == "too_many_errors"
    assert ep.outcome().reward == 0.0 and "prematurely" in ep.outcome().info["note"]
    with pytest.raises(RuntimeError, match="is done"):
        ep.step(call("nope"))


def test_fast_hash_and_copy_on_write_match_stock_tau2():
    env = T.make_environment("airline")
    stock = T.stock_environment("airline")
    assert env.get_db_hash() == stock.get_db_hash()
    from tau2.data_model.message import ToolCall as T2Call

    calls = [
        T2Call(id="1", name="cancel_reservation", arguments={"reservation_id": "EHGLP3"}),
        T2Call(id="2", name="send_certificate", arguments={"user_id": "emma_kim_9957", "amount": 50}),
    ]
    for c in calls:
        a, b = env.get_response(c), stock.get_response(c)
        assert a.content == b.content and not a.error
        assert env.get_db_hash() == stock.get_db_hash()
    assert env.get_db_hash() != T.make_environment("airline").get_db_hash()
    # the stock way of hashing our view agrees with the cached-JSON way
    from tau2.utils.utils import get_dict_hash

    assert T.db_hash("airline", env.tools.db) == get_dict_hash(env.tools.db.model_dump())
    assert T.base_db("airline").get_hash() == T.pristine_db_hash("airline")


def test_cow_dict_copies_on_lookup_only():
    shared = {"a": [1], "b": [2]}
    view = T.CowDict(shared)
    view["a"].append(9)
    assert shared["a"] == [1] and view["a"] == [1, 9]
    assert view.get("b") == [2] and view.get("zz", 0) == 0
    view["c"] = [3]
    assert view.pop("b") == [2] and "b" not in view and "b" in shared
    del view["c"]
    assert sorted(view) == ["a"]


def test_rewards_identical_to_stock_evaluation():
    # stock evaluation parses db.json twice per call: one airline episode, two retail ones
    for domain, tid, variants in [("airline", "7", (False,)), ("retail", "11", (False, True))]:
        task = next(t for t in T.load_tasks(domain) if t.id == tid)
        for drop_last in variants:
            ours = T.evaluate_messages(domain, task, T.gold_replay_messages(T.make_environment(domain), task, drop_last), "user_stop")
            stock = T.evaluate_messages(
                domain, task, T.gold_replay_messages(T.stock_environment(domain), task, drop_last), "user_stop", stock=True
            )
            assert ours.reward == stock.reward == (0.0 if drop_last else 1.0)
            assert ours.db_check == stock.db_check
