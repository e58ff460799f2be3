"""Trajectory compaction: head/tail truncation, budgets, determinism."""

from __future__ import annotations

import json

import pytest

from tracekit.analysis.compact import CompactConfig, compact_many, compact_trajectory, truncate_middle
from tracekit.types import Message, ToolCall, Trajectory


def make(n_turns: int, result_len: int = 2000, success: bool = False, i: int = 0) -> Trajectory:
    msgs = [Message(role="system", content="SYSTEM POLICY " * 100), Message(role="user", content="hello, I need help")]
    for k in range(n_turns):
        msgs.append(Message(role="assistant", tool_calls=[ToolCall(id=f"c{k}", name="lookup", arguments={"id": k})]))
        body = json.dumps({"id": k, "data": "d" * result_len, "total": 42 + k})
        msgs.append(Message(role="tool", tool_call_id=f"c{k}", name="lookup", content=body, error=k == 1))
    msgs.append(Message(role="assistant", content="FINAL ANSWER: done"))
    return Trajectory(task_id=str(i), env="toy", messages=msgs, success=success, reward=float(success), termination="user_stop")


def test_truncate_middle_keeps_head_and_tail_within_limit():
    text = "HEAD" + "x" * 1000 + "TAIL"
    out = truncate_middle(text, 100)
    assert len(out) <= 100 and out.startswith("HEAD") and out.endswith("TAIL")
    assert "[1008 chars, middle elided]" in out
    assert truncate_middle("short", 100) == "short"
    assert truncate_middle(text, 10) == text[:10]  # no room for a marker: bare head


def test_transcript_content_and_determinism():
    t = make(3)
    out = compact_trajectory(t, CompactConfig())
    assert out == compact_trajectory(t, CompactConfig())
    lines = out.splitlines()
    assert lines[0] == "=== trajectory toy/0/0 | outcome FAILURE | reward 0 | ended by user_stop ==="
    assert "SYSTEM POLICY" not in out  # the policy is the same for every trajectory
    assert 'CALL lookup({"id": 0})' in out and "RESULT lookup ERROR ->" in out
    assert lines[-1] == "AGENT: FINAL ANSWER: done"
    assert '"total": 44}' in out  # tails of results survive truncation
    assert len(out) <= CompactConfig().max_chars


@pytest.mark.parametrize("max_chars, elided", [(300, True), (800, True), (2000, True), (6000, False)])
def test_budget_is_met_and_ends_survive(max_chars, elided):
    t = make(30)  # ~60 kB of tool results
    out = compact_trajectory(t, CompactConfig(max_chars=max_chars))
    assert len(out) <= max_chars
    assert out.startswith("=== trajectory toy/0/0")
    assert ("messages elided" in out) == elided
    if max_chars >= 800:
        assert out.rstrip().endswith("FINAL ANSWER: done")
        assert "USER: hello, I need help" in out


def test_shrinks_results_before_eliding_messages():
    t = make(4, result_len=3000)
    out = compact_trajectory(t, CompactConfig(max_chars=1500))
    assert "messages elided" not in out  # shrinking the four 3 kB results was enough
    assert out.count("CALL lookup") == 4


def test_token_budget_with_counter():
    t = make(10)
    words = lambda s: len(s.split())  # noqa: E731
    out = compact_trajectory(t, CompactConfig(max_chars=100000, max_tokens=60), words)
    assert words(out) <= 60
    assert len(compact_trajectory(t, CompactConfig(max_chars=100000))) > len(out)


def test_compact_many_alternates_outcomes_and_fits():
    trajs = [make(2, success=i < 2, i=i) for i in range(6)]  # 2 successes, 4 failures
    block, shown = compact_many(trajs, CompactConfig(max_chars=1000), total_chars=3400)  # 4 blocks of ~815 chars fit
    assert len(block) <= 3400
    assert shown == ["toy/2/0", "toy/0/0", "toy/3/0", "toy/1/0"]  # failure, success, failure, success


def test_config_validation():
    with pytest.raises(ValueError, match="max_chars"):
        CompactConfig(max_chars=10)
