"""The synthesize stage: packages per selected capability, skips reported, packages reopen as suites."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tracekit.llm.base import ChatClient, ChatResponse
from tracekit.synthesis.agent import default_checks
from tracekit.synthesis.protocol import ground_truth_actions
from tracekit.synthesis.sandbox import SandboxLimits
from tracekit.synthesis.stage import SynthesisSettings, open_package, synthesize, trajectory_excerpt
from tracekit.synthesis.validate import ValidationConfig
from tracekit.types import Message, ToolCall, Trajectory

VALID = (Path(__file__).parent / "data" / "synthesis" / "valid_env.py").read_text()
LIMITS = SandboxLimits(wall_seconds=20, memory_bytes=1 << 30)


def run_ground_truth(suite) -> list[float]:
    rewards = []
    for task in suite.tasks():
        ep = suite.episode(task)
        ep.reset()
        for action in ground_truth_actions(ep.instance):
            if ep.step(action).done:
                break
        rewards.append(ep.outcome().reward)
    return rewards


def test_library_source_builds_ready_and_skipped_packages(tmp_path):
    selected = [
        {"name": "precondition_verification", "description": "check eligibility", "example_failed_trajectories": []},
        {"name": "sarcasm_detection", "description": "not a library capability"},
    ]
    settings = SynthesisSettings(checks=replace(default_checks(), validation=ValidationConfig(n_seeds=20)))
    manifest = synthesize(selected, "tau2", tmp_path, settings)
    assert (manifest["ready"], manifest["skipped"]) == (1, 1)
    skipped = manifest["environments"][1]
    assert skipped["status"] == "skipped" and "no built-in environment for 'sarcasm_detection'" in skipped["reason"]
    assert json.loads((tmp_path / "environments.json").read_text()) == manifest
    assert json.loads((tmp_path / "precondition_verification" / "validation.json").read_text())["passed"]
    suite = open_package(tmp_path / "precondition_verification", range(3), user="none")
    assert run_ground_truth(suite) == [1.0, 1.0, 1.0]


def test_generate_source_writes_a_sandboxed_package(tmp_path):
    class Canned(ChatClient):
        def chat(self, requests):
            text = f"```python\n{VALID}```"
            return [ChatResponse(message=Message(role="assistant", content=text), text=text)]

    failed = Trajectory(task_id="t1", env="toolsandbox", messages=[
        Message(role="user", content="Turn on wifi."),
        Message(role="assistant", tool_calls=[ToolCall(id="a", name="set_wifi_status", arguments={"on": True})]),
        Message(role="tool", content="PermissionError: Wifi cannot be turned on in low battery mode", tool_call_id="a"),
        Message(role="assistant", content="Sorry, I can't.")])
    selected = [{"name": "permission_error_recovery", "description": "recover", "example_failed_trajectories": [failed.uid]}]
    settings = SynthesisSettings(source="generate", checks=replace(default_checks(), limits=LIMITS))
    manifest = synthesize(selected, "toolsandbox", tmp_path, settings, trajectories={failed.uid: failed}, client=Canned())
    assert manifest["ready"] == 1
    prompt = (tmp_path / "permission_error_recovery" / "transcript.jsonl").read_text()
    assert "PermissionError: Wifi cannot be turned on" in prompt  # the failure excerpt reached the prompt
    suite = open_package(tmp_path / "permission_error_recovery", range(2), user="none", limits=LIMITS)
    try:
        assert run_ground_truth(suite) == [1.0, 1.0]
    finally:
        suite.close()
    with pytest.raises(ValueError, match="needs a generation ChatClient"):
        synthesize(selected, "toolsandbox", tmp_path, settings)
    with pytest.raises(ValueError, match="concrete target"):
        synthesize(selected, "tau2", tmp_path, settings, client=Canned())


def test_trajectory_excerpt_is_bounded():
    traj = Trajectory(task_id="t", env="e", messages=[Message(role="user", content="x" * 5000)] * 3)
    text = trajectory_excerpt(traj, max_chars=500)
    assert len(text) <= 500 and text.endswith("[... truncated]")
