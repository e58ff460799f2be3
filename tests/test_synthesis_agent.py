"""The generation agent: prompt, code extraction, validate -> repair loop, calibration -> mutation loop."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.synthesis.agent import (
    EnvChecks,
    GenerationAgentConfig,
    GenerationSpec,
    build_prompt,
    default_checks,
    extract_code,
    fill,
    generate_environment,
    pick_example,
)
from tracekit.synthesis.calibrate import CalibrationTargets
from tracekit.synthesis.sandbox import SandboxLimits
from tracekit.synthesis.targets import target_tools
from tracekit.synthesis.validate import ValidationConfig
from tracekit.types import Capability, Message

VALID = (Path(__file__).parent / "data" / "synthesis" / "valid_env.py").read_text()
BROKEN = VALID.replace("# HOOK:module", "def broken(:")
CAP = Capability(name="permission_error_recovery",
                 description="Recover from a PermissionError caused by a device setting instead of giving up.")
FAST = GenerationAgentConfig(max_repair_rounds=2, max_mutation_rounds=2)
CHECKS = EnvChecks(validation=ValidationConfig(n_seeds=50), limits=SandboxLimits(wall_seconds=20, memory_bytes=1 << 30),
                   targets=CalibrationTargets(), calibration_seeds=4, calibration_k=4)


def fenced(code: str, before: str = "Here is the module.") -> str:
    return f"{before}\n```python\n{code}```\nDone."


class ScriptedClient(ChatClient):
    """Returns canned replies in order and records every request."""

    def __init__(self, replies: list[str]):
        self.replies = list(replies)
        self.requests: list[ChatRequest] = []

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        self.requests += requests
        text = self.replies.pop(0)
        return [ChatResponse(message=Message(role="assistant", content=text), text=text)]


def spec() -> GenerationSpec:
    return GenerationSpec(capability=CAP, target="toolsandbox",
                          failure_excerpts=["user: Turn on wifi.\nassistant: set_wifi_status(on=True)\n"
                                            "tool: PermissionError: Wifi cannot be turned on in low battery mode\n"
                                            "assistant: Sorry, I cannot turn on wifi."])


def test_extract_code_variants():
    assert extract_code(fenced("x = 1\n")) == "x = 1\n"
    two = "```python\nimport os\n```\ntext\n```python\nclass E(SyntheticEnv):\n    pass\n```"
    assert extract_code(two).startswith("class E(SyntheticEnv)")  # the block that defines the env
    assert extract_code("```python\nclass A:\n    x = 1\n") == "class A:\n    x = 1\n"  # truncated reply
    assert extract_code("class A:\n    pass\n") == "class A:\n    pass\n"  # bare code
    assert extract_code("I cannot do that, sorry.") is None


def test_prompt_is_filled_from_the_versioned_template():
    prompt = build_prompt(spec())
    assert "<<" not in prompt
    assert "Name: permission_error_recovery" in prompt and "Wifi cannot be turned on" in prompt
    schemas = prompt.split("Tool schemas of the target:\n", 1)[1].split("\n\nPolicy of the target:", 1)[0]
    assert json.loads(schemas) == list(target_tools("toolsandbox").values())
    assert "class PermissionErrorRecovery(ToolSandboxEnv)" in prompt  # the library example's source
    assert pick_example("structured_data_reasoning", "tau2_retail") == "tau2_structured_data_reasoning"
    with pytest.raises(KeyError, match="unfilled"):
        fill("<<A>> and <<B>>", A="a")


def test_valid_module_is_accepted_in_one_round(tmp_path):
    client = ScriptedClient([fenced(VALID)])
    result = generate_environment(client, spec(), tmp_path, FAST, checks=CHECKS)
    assert result.status == "accepted" and len(result.rounds) == 1 and result.rounds[0].passed
    assert (tmp_path / "env.py").read_text() == VALID
    assert json.loads((tmp_path / "validation.json").read_text())["passed"] is True
    assert json.loads((tmp_path / "generation.json").read_text())["status"] == "accepted"
    assert len((tmp_path / "transcript.jsonl").read_text().splitlines()) == 3  # system, prompt, reply


def test_broken_module_is_repaired(tmp_path):
    client = ScriptedClient([fenced(BROKEN), fenced(VALID)])
    result = generate_environment(client, spec(), tmp_path, FAST, checks=CHECKS)
    assert result.status == "accepted"
    assert [r.kind for r in result.rounds] == ["initial", "repair"]
    assert not result.rounds[0].passed and "SyntaxError" in result.rounds[0].reason
    repair = client.requests[1].messages[-1].content
    assert repair.startswith("Your module failed validation") and "SyntaxError" in repair
    assert (tmp_path / "rounds" / "round_0.md").exists() and (tmp_path / "env.py").read_text() == VALID


def test_model_that_never_writes_a_module_fails_cleanly(tmp_path):
    client = ScriptedClient(["I am a small model."] * 3)
    result = generate_environment(client, spec(), tmp_path, FAST, checks=CHECKS)
    assert result.status == "failed" and len(result.rounds) == 3
    assert result.reason.startswith("no valid module after 3 round(s)")
    assert not (tmp_path / "env.py").exists()
    assert json.loads((tmp_path / "generation.json").read_text())["status"] == "failed"


def test_endpoint_error_is_a_clean_failure(tmp_path):
    class Down(ChatClient):
        def chat(self, requests):
            raise EndpointError("connection refused")

    result = generate_environment(Down(), spec(), tmp_path, FAST, checks=CHECKS)
    assert result.status == "failed" and result.reason == "generation endpoint failed: connection refused"


def test_too_easy_environment_gets_a_mutation_round(tmp_path):
    harder = VALID.replace('name = "wifi_recovery"', 'name = "wifi_recovery_v2"')
    client = ScriptedClient([fenced(VALID), fenced(harder)])
    seen: list[tuple[str, int]] = []

    def rollout_fn(suite, seeds, k):
        seen.append((suite.name, suite.info.difficulty))
        if suite.name == "wifi_recovery":  # the policy solves every instance
            return {z: [1.0] * k for z in seeds}
        return {z: [1.0, 0.0, 0.0, 1.0][:k] for z in seeds}

    result = generate_environment(client, spec(), tmp_path, FAST, rollout_fn=rollout_fn, checks=CHECKS)
    assert result.status == "accepted" and result.calibrated is True
    assert [r.kind for r in result.rounds] == ["initial", "mutation"]
    assert [r.calibration for r in result.rounds] == ["too_easy", "ok"]
    mutation_prompt = client.requests[1].messages[-1].content
    assert "too easy" in mutation_prompt and "harder" in mutation_prompt and "mean reward 1.000" in mutation_prompt
    assert seen[0] == ("wifi_recovery", 1) and seen[-1][0] == "wifi_recovery_v2"
    assert 'name = "wifi_recovery_v2"' in (tmp_path / "env.py").read_text()
    assert json.loads((tmp_path / "calibration.json").read_text())["passed"] is True


def test_generation_loop_against_the_stub_openai_server(tmp_path):
    from tests.openai_stub import StubOpenAIServer
    from tracekit.llm.openai import OpenAIChatClient

    # first run: the server returns a fixed valid module; second run: a broken one, then the repair
    with StubOpenAIServer(responses=[fenced(VALID), fenced(BROKEN), fenced(VALID)]) as srv:
        client = OpenAIChatClient(base_url=srv.url, model="stub-model", max_retries=0)
        first = generate_environment(client, spec(), tmp_path / "first", FAST, checks=CHECKS)
        second = generate_environment(client, spec(), tmp_path / "second", FAST, checks=CHECKS)
        bodies = srv.chat_requests
    assert first.status == "accepted" and len(first.rounds) == 1
    assert second.status == "accepted" and [r.passed for r in second.rounds] == [False, True]
    assert len(bodies) == 3
    assert bodies[0]["messages"][1]["content"].startswith("You design reinforcement-learning training environments")
    assert bodies[2]["messages"][-2]["role"] == "assistant"  # the broken module went back with the errors
    assert "SyntaxError" in bodies[2]["messages"][-1]["content"]
    assert (tmp_path / "second" / "env.py").read_text() == VALID


def test_endpoint_refusal_is_a_clean_failure(tmp_path):
    from tests.openai_stub import Reply, StubOpenAIServer
    from tracekit.llm.openai import OpenAIChatClient

    with StubOpenAIServer(responses=[Reply(status=400, error="prompt is longer than the context")]) as srv:
        client = OpenAIChatClient(base_url=srv.url, model="stub-model", max_retries=0)
        result = generate_environment(client, spec(), tmp_path, FAST, checks=CHECKS)
    assert result.status == "failed" and "prompt is longer than the context" in result.reason


@pytest.mark.slow
def test_offline_generation_with_the_bundled_model_ends_cleanly(tmp_path):
    """The bundled 135M model will rarely write a valid module; whatever it writes, the run ends in a
    written result (accepted, or failed with a reason) and never raises."""
    pytest.importorskip("gguf")
    from tracekit.llm.backbones import load_backbone
    from tracekit.llm.hf import HFChatClient

    model, tokenizer = load_backbone("smollm2_135m")
    client = HFChatClient(model, tokenizer, chat_format="smollm2", max_context_tokens=8192)
    cfg = GenerationAgentConfig(max_repair_rounds=0, max_new_tokens=192, temperature=0.0)
    result = generate_environment(client, spec(), tmp_path, cfg,
                                  checks=replace(default_checks(), limits=SandboxLimits(wall_seconds=30, memory_bytes=1 << 30)))
    assert json.loads((tmp_path / "generation.json").read_text())["status"] == result.status
    if result.status == "failed":
        assert result.reason and (tmp_path / "transcript.jsonl").exists()
    else:
        assert (tmp_path / "env.py").exists()
