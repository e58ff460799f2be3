"""The data model round-trips through JSONL exactly and rejects malformed rows."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tracekit.artifacts import read_jsonl, write_jsonl
from tracekit.types import Capability, Label, LabelValue, Message, TokenRecord, ToolCall, Trajectory, stable_hash


def _trajectory() -> Trajectory:
    return Trajectory(
        task_id="retail/7", env="tau2_retail", seed=3, sample=1,
        messages=[
            Message(role="system", content="policy"),
            Message(role="user", content="cancel my order"),
            Message(role="assistant", tool_calls=[ToolCall(id="c0", name="get_order_details", arguments={"order_id": "#W1"})]),
            Message(role="tool", tool_call_id="c0", name="get_order_details", content='{"status": "pending"}'),
            Message(role="assistant", content="<tool_call>{bad", parse_error="invalid JSON in tool call"),
        ],
        reward=0.0, success=False, termination="max_steps",
        tokens=TokenRecord(token_ids=[1, 2, 3], logprobs=[0.0, -0.5, -1.2], loss_mask=[0, 1, 1]),
    )


def test_trajectory_jsonl_round_trip(tmp_path):
    rows = [_trajectory(), Trajectory(task_id="a/1", env="x", success=True, reward=1.0)]
    write_jsonl(tmp_path / "t.jsonl", rows)
    back = read_jsonl(tmp_path / "t.jsonl", Trajectory)
    assert back == rows
    assert back[0].uid == "tau2_retail/retail/7/1"


def test_label_and_capability_round_trip(tmp_path):
    labels = [Label(trajectory="e/t/0", capability="tool_calling_precision", run=2, value=LabelValue.LACKING,
                    rationale="wrong payment id", success=False),
              Label(trajectory="e/t/0", capability="x_y", run=2, value=None, success=False)]
    write_jsonl(tmp_path / "l.jsonl", labels)
    assert read_jsonl(tmp_path / "l.jsonl", Label) == labels


def test_malformed_rows_are_rejected():
    with pytest.raises(ValidationError):
        Capability(name="Not Snake", description="x")
    with pytest.raises(ValidationError):
        Label.model_validate({"trajectory": "t", "capability": "c", "run": 0, "value": "MAYBE", "success": True})
    with pytest.raises(ValidationError):
        Message.model_validate({"role": "robot", "content": "hi"})


def test_to_chat_shapes_tool_messages():
    m = _trajectory().messages
    assert m[2].to_chat()["tool_calls"][0]["function"] == {"name": "get_order_details", "arguments": {"order_id": "#W1"}}
    assert m[3].to_chat() == {"role": "tool", "content": '{"status": "pending"}', "tool_call_id": "c0",
                              "name": "get_order_details"}


def test_stable_hash_ignores_key_order():
    assert stable_hash({"a": 1, "b": [1, 2]}) == stable_hash({"b": [1, 2], "a": 1})
    assert stable_hash({"a": 1}) != stable_hash({"a": 2})
