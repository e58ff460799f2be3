"""Discovery and labeling through a ChatClient: schema enforcement, retries, gaps, resume."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import pytest

from tracekit.analysis.discovery import DiscoveryConfig, DiscoveryError, discover, load_dictionary, read_dictionary
from tracekit.analysis.labeling import CACHE_FILE, LabelingConfig, LabelingError, LLMLabeler, parse_label_reply
from tracekit.analysis.select import Thresholds
from tracekit.analysis.stages import label, read_labels, select_stage
from tracekit.artifacts import read_json
from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse
from tracekit.types import Capability, LabelValue, Message, ToolCall, Trajectory


class ScriptedClient(ChatClient):
    """A deterministic stand-in analysis agent: ``respond(request, call_no) -> reply text``."""

    def __init__(self, respond: Callable[[ChatRequest, int], str | tuple[str, str]], fail_after: int | None = None):
        self.respond = respond
        self.requests: list[ChatRequest] = []
        self.calls = 0
        self.fail_after = fail_after  # raise on the call after this many (simulates a killed job)

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        out = []
        for r in requests:
            self.requests.append(r)
            got = self.respond(r, len(self.requests) - 1)
            text, finish = got if isinstance(got, tuple) else (got, "stop")
            out.append(ChatResponse(message=Message(role="assistant", content=text), text=text, finish_reason=finish))
        return out


def traj(i: int, success: bool) -> Trajectory:
    return Trajectory(
        task_id=str(i),
        env="toy",
        messages=[
            Message(role="system", content="policy " * 50),
            Message(role="user", content=f"please cancel order #{i}"),
            Message(role="assistant", tool_calls=[ToolCall(id="c1", name="cancel", arguments={"order": f"#{i}"})]),
            Message(role="tool", tool_call_id="c1", name="cancel", content=json.dumps({"status": "ok", "blob": "x" * 3000})),
            Message(role="assistant", content="Done."),
        ],
        reward=float(success),
        success=success,
    )


TRAJS = [traj(i, i % 2 == 0) for i in range(4)]
DICT = [
    Capability(name="tool_use", description="calls tools right"),
    Capability(name="data_reading", description="reads records right"),
    Capability(name="finishing", description="completes every step"),
]


def asked(req: ChatRequest) -> list[str]:
    """Capabilities the request asks for: the retry's list if it is a retry, else the prompt's."""
    last = req.messages[-1].content or ""
    m = re.search(r"for exactly these capabilities: (.*)\.$", last) or re.search(r"using these exact names: ([^)]*)\)", last)
    assert m, last[:200]
    return [n.strip() for n in m.group(1).split(",")]


def honest(req: ChatRequest, _: int) -> str:
    failed = "outcome FAILURE" in req.messages[0].content
    return json.dumps(
        {
            "labels": [
                {"capability": c, "label": "LACKING" if failed and c != "finishing" else "PRESENT", "rationale": f"seed {req.seed}"}
                for c in asked(req)
            ]
        }
    )


# ---------------------------------------------------------------- reply validation


def test_parse_label_reply_kinds():
    known = {"a", "b", "c"}
    assert parse_label_reply("sure!", ["a"], known)[1][0][0] == "not_json"
    assert parse_label_reply('{"labels": 3}', ["a"], known)[1][0][0] == "schema"
    acc, errs = parse_label_reply(
        '```json\n{"labels": [{"capability": "a", "label": "lacking", "rationale": " x\\n y "},'
        ' {"capability": "zzz", "label": "NA"}, {"capability": "c", "label": "NA"},'
        ' {"capability": "b", "label": "MAYBE"}]}\n```',
        ["a", "b"],
        known,
    )
    assert acc == {"a": (LabelValue.LACKING, "x y")}
    assert [k for k, _ in errs] == ["unknown_capability", "not_requested", "invalid_label", "missing"]
    acc, errs = parse_label_reply(
        '{"labels": [{"capability": "a", "label": "NA"}, {"capability": "a", "label": "PRESENT"}]}', ["a"], known
    )
    assert acc == {} and [k for k, _ in errs] == ["conflicting", "missing"]


# ---------------------------------------------------------------- labeling


def test_labeling_runs_seeds_and_stage_files(tmp_path):
    client = ScriptedClient(honest)
    cfg = LabelingConfig(temperature=0.8, chunk_size=5)
    res = label(TRAJS, DICT, LLMLabeler(client, cfg), runs=3, seed=7, out_dir=tmp_path)
    assert len(res.labels) == 4 * 3 * 3 and res.report["missing"] == 0
    assert len(client.requests) == 4 * 3  # whole dictionary per call
    assert {r.temperature for r in client.requests} == {0.8}
    assert len({r.seed for r in client.requests}) == 12  # distinct per (run, trajectory)
    lab = next(x for x in res.labels if x.trajectory == "toy/1/0" and x.capability == "tool_use" and x.run == 0)
    assert lab.value == LabelValue.LACKING and not lab.success and lab.rationale.startswith("seed ")
    assert read_labels(tmp_path) == res.labels
    # failed trajectories (2) x capabilities other than finishing (2) x runs (3) are LACKING
    assert read_json(tmp_path / "labeling_report.json")["values"] == {"LACKING": 12, "PRESENT": 24}
    # the prompt holds the compacted trajectory: tool result truncated, policy left out
    prompt = client.requests[0].messages[0].content
    assert "middle elided" in prompt and "policy policy" not in prompt and 'CALL cancel({"order": "#0"})' in prompt


def test_capability_groups_split_calls(tmp_path):
    client = ScriptedClient(honest)
    res = LLMLabeler(client, LabelingConfig(capabilities_per_call=2)).label_runs(TRAJS, DICT, [0], 0, tmp_path)
    assert len(client.requests) == 4 * 2 and res.report["missing"] == 0
    assert sorted(len(asked(r)) for r in client.requests) == [1] * 4 + [2] * 4


def test_malformed_replies_are_retried_with_the_error(tmp_path):
    def respond(req: ChatRequest, _: int) -> str | tuple[str, str]:
        turn = len(req.messages) // 2  # 0 first ask, 1 first retry, ...
        want = asked(req)
        if turn == 0:
            return "I think the agent did fine."  # not JSON
        if turn == 1:  # an unknown name, a valid one, the rest missing
            return json.dumps({"labels": [{"capability": "speed", "label": "NA"}, {"capability": want[0], "label": "NA"}]})
        return json.dumps({"labels": [{"capability": c, "label": "PRESENT", "rationale": "ok"} for c in want]})

    client = ScriptedClient(respond)
    res = LLMLabeler(client, LabelingConfig(max_attempts=3)).label_runs(TRAJS[:1], DICT, [0], 0, tmp_path)
    assert [x.value for x in res.labels] == [LabelValue.NA, LabelValue.PRESENT, LabelValue.PRESENT]
    assert res.report["attempts_histogram"] == {"3": 1}
    assert res.report["error_kinds"] == {"missing": 1, "not_json": 1, "unknown_capability": 1}
    retry = client.requests[1].messages
    assert retry[1].role == "assistant" and "no JSON object" in retry[2].content
    assert "unknown capability 'speed'" in client.requests[2].messages[-1].content
    assert asked(client.requests[2]) == ["data_reading", "finishing"]  # only what is still missing
    schema = client.requests[2].response_format["json_schema"]["schema"]["properties"]["labels"]
    assert schema["items"]["properties"]["capability"]["enum"] == ["data_reading", "finishing"]
    assert schema["minItems"] == schema["maxItems"] == 2


def test_unobtainable_labels_are_missing_and_counted(tmp_path):
    def respond(req: ChatRequest, _: int) -> str | tuple[str, str]:
        if len(req.messages) == 1:
            return "upstream timeout", "error"  # an endpoint-side failure counts as an attempt
        return json.dumps(
            {"labels": [{"capability": c, "label": "MAYBE" if c == "finishing" else "NA"} for c in asked(req)]}
        )

    res = LLMLabeler(ScriptedClient(respond), LabelingConfig(max_attempts=2)).label_runs(TRAJS, DICT, [0, 1], 0, tmp_path)
    miss = [x for x in res.labels if x.value is None]
    assert len(miss) == 8 and {x.capability for x in miss} == {"finishing"}
    assert "missing after 2 attempts" in miss[0].rationale and "MAYBE" in miss[0].rationale
    assert res.report["missing"] == 8
    assert res.report["missing_by_capability"] == {"tool_use": 0, "data_reading": 0, "finishing": 8}
    assert res.report["error_kinds"]["endpoint_error"] == 8


def test_wrong_schema_everywhere_and_on_missing_fail(tmp_path):
    client = ScriptedClient(lambda r, i: '{"verdicts": {"tool_use": "NA"}}')
    res = LLMLabeler(client, LabelingConfig(max_attempts=2)).label_runs(TRAJS[:2], DICT, [0], 0, tmp_path / "skip")
    assert res.report["missing"] == 6 and res.report["error_kinds"] == {"schema": 4}
    with pytest.raises(LabelingError, match="no valid label for 'tool_use' on toy/0/0 run 0 .*on_missing=skip"):
        LLMLabeler(client, LabelingConfig(max_attempts=2, on_missing="fail")).label_runs(
            TRAJS[:2], DICT, [0], 0, tmp_path / "fail"
        )
    # gaps cached by an earlier run of the same work dir also stop a resumed run
    with pytest.raises(LabelingError, match="6 missing"):
        LLMLabeler(client, LabelingConfig(max_attempts=2, on_missing="fail")).label_runs(
            TRAJS[:2], DICT, [0], 0, tmp_path / "skip"
        )


def test_greedy_runs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        LLMLabeler(ScriptedClient(honest), LabelingConfig(temperature=0.0)).label_runs(TRAJS, DICT, [0, 1], 0, tmp_path)


def test_interrupted_labeling_resumes_where_it_stopped(tmp_path):
    cfg = LabelingConfig(chunk_size=3)
    full = LLMLabeler(ScriptedClient(honest), cfg).label_runs(TRAJS, DICT, [0, 1], 5, tmp_path / "ref")

    work = tmp_path / "run"
    killed = ScriptedClient(honest, fail_after=2)  # 2 chunks of 3 requests done, then killed
    with pytest.raises(KeyboardInterrupt):
        LLMLabeler(killed, cfg).label_runs(TRAJS, DICT, [0, 1], 5, work)
    assert len((work / CACHE_FILE).read_text().splitlines()) == 6
    with open(work / CACHE_FILE, "a") as f:
        f.write('{"dictionary": "torn')  # a write torn by the kill
    again = ScriptedClient(honest)
    res = LLMLabeler(again, cfg).label_runs(TRAJS, DICT, [0, 1], 5, work)
    assert len(again.requests) == 8 - 6  # only the unfinished requests
    assert res.report["requests_resumed"] == 6
    assert res.labels == full.labels  # same seeds -> same labels as an uninterrupted run
    # a changed dictionary does not reuse the cache
    other = [*DICT[:2], Capability(name="finishing", description="changed")]
    fresh = ScriptedClient(honest)
    LLMLabeler(fresh, cfg).label_runs(TRAJS, other, [0, 1], 5, work)
    assert len(fresh.requests) == 8


# ---------------------------------------------------------------- discovery


GOOD = {"capabilities": [{"name": f"cap_{i}", "description": f"capability {i}"} for i in range(6)]}


def test_discovery_valid_and_prompt(tmp_path):
    client = ScriptedClient(lambda r, i: "Here you go:\n```json\n" + json.dumps(GOOD) + "\n```")
    caps = discover(TRAJS, client, DiscoveryConfig(), tmp_path)
    assert [c.name for c in caps] == [f"cap_{i}" for i in range(6)]
    assert read_dictionary(tmp_path) == caps
    prompt = client.requests[0].messages[0].content
    assert "2 successful, 2 failed" in prompt and prompt.count("=== trajectory") == 4
    assert client.requests[0].response_format["json_schema"]["name"] == "capability_dictionary"
    log = read_json(tmp_path / "discovery_log.json")
    assert len(log["attempts"]) == 1 and len(log["prompt_sha"]) == 12


@pytest.mark.parametrize(
    "bad, why",
    [
        ("no json here", "no JSON object"),
        ('{"capabilities": [{"name": "BadName", "description": "x"}]}', "wrong schema"),
        (json.dumps({"capabilities": GOOD["capabilities"][:3]}), "expected 5 to 10"),
        (json.dumps({"capabilities": GOOD["capabilities"] + GOOD["capabilities"][:1]}), "duplicate"),
    ],
)
def test_discovery_retries_with_error_then_succeeds(tmp_path, bad, why):
    client = ScriptedClient(lambda r, i: bad if i == 0 else json.dumps(GOOD))
    caps = discover(TRAJS, client, DiscoveryConfig(), tmp_path)
    assert len(caps) == 6 and len(client.requests) == 2
    assert why in client.requests[1].messages[-1].content
    assert client.requests[1].messages[1].content == bad


def test_discovery_gives_up_with_clear_error(tmp_path):
    client = ScriptedClient(lambda r, i: "nope")
    with pytest.raises(DiscoveryError, match="after 3 attempts; last error: the reply contains no JSON"):
        discover(TRAJS, client, DiscoveryConfig(max_attempts=3), tmp_path)
    assert len(read_json(tmp_path / "discovery_log.json")["attempts"]) == 3
    assert not (tmp_path / "dictionary.json").exists()
    with pytest.raises(ValueError, match="all 2 succeeded"):
        discover([traj(0, True), traj(2, True)], client, DiscoveryConfig(), tmp_path)


def test_pinned_dictionary_yaml_and_json(tmp_path):
    y = tmp_path / "d.yaml"
    y.write_text("capabilities:\n  - name: alpha\n    description: first\n  - name: beta\n    description: second\n")
    caps = discover(TRAJS, None, DiscoveryConfig(pinned=str(y)), tmp_path / "out")
    assert [c.name for c in caps] == ["alpha", "beta"]
    assert read_json(tmp_path / "out" / "dictionary.json")["source"] == f"pinned:{y}"
    j = tmp_path / "d.json"
    j.write_text(json.dumps([{"name": "alpha", "description": "first"}]))
    assert load_dictionary(j) == caps[:1]
    j.write_text(json.dumps([{"name": "Alpha", "description": "first"}]))
    with pytest.raises(ValueError, match="d.json: invalid capability dictionary: wrong schema"):
        load_dictionary(j)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dictionary(tmp_path / "missing.yaml")


def test_the_official_candidate_file_pins_as_it_is(tmp_path):
    # the shape of ScalingIntelligence/TRACE pipeline/candidate_capabilities.json (entries written here)
    official = {"candidates": [
        {"name": "policy_constraint_enforcement", "description": "Refuse what the policy forbids.",
         "example_trajectories": [{"task_id": "airline:6", "reward": 1.0, "note": "refuses under pressure"}]},
        {"name": "multi_step_transaction_completion", "description": "Complete every dependent step.",
         "example_trajectories": []}]}
    path = tmp_path / "candidate_capabilities.json"
    path.write_text(json.dumps(official))
    caps = discover(TRAJS, None, DiscoveryConfig(pinned=str(path)), tmp_path / "out")
    assert [(c.name, c.description) for c in caps] == [
        ("policy_constraint_enforcement", "Refuse what the policy forbids."),
        ("multi_step_transaction_completion", "Complete every dependent step.")]
    official["candidates"][1]["name"] = "policy_constraint_enforcement"
    path.write_text(json.dumps(official))
    with pytest.raises(ValueError, match=r"candidate_capabilities.json: invalid capability dictionary: duplicate "
                                         r"capability names: \['policy_constraint_enforcement'\]"):
        load_dictionary(path)


# ---------------------------------------------------------------- end to end


def test_discover_label_select_end_to_end(tmp_path):
    def respond(req: ChatRequest, _: int) -> str:
        if "canonical dictionary" in req.messages[0].content:
            return json.dumps({"capabilities": [c.model_dump() for c in DICT] + GOOD["capabilities"][:2]})
        return honest(req, _)

    client = ScriptedClient(respond)
    dictionary = discover(TRAJS, client, DiscoveryConfig(), tmp_path / "discover")
    res = label(TRAJS, dictionary, LLMLabeler(client), runs=10, seed=0, out_dir=tmp_path / "label")
    assert res.report["missing"] == 0
    sel, paths = select_stage(res.labels, dictionary, Thresholds(), tmp_path / "select")
    # honest(): tool_use/data_reading/cap_* LACKING exactly on failures (Delta = 1, Cov = 1), finishing never
    assert [c["name"] for c in sel["selected"]] == ["cap_0", "cap_1", "data_reading", "tool_use"]
    assert all(c["selection_count"] == 10 for c in sel["selected"])
    assert sel["selected"][0]["example_failed_trajectories"] == ["toy/1/0", "toy/3/0"]
    assert all(p.exists() for p in paths.values())


# ---------------------------------------------------------------- the real OpenAI client, stand-in server


def test_llm_path_through_openai_client_and_stub_server(tmp_path):
    from tests.openai_stub import Reply, StubOpenAIServer
    from tracekit.llm.base import EndpointError
    from tracekit.llm.openai import OpenAIChatClient

    def handler(body: dict) -> Reply | str:
        msgs = body["messages"]
        prompt = msgs[0]["content"]
        if "canonical dictionary" in prompt:  # discovery: prose first, then a valid dictionary
            caps = [c.model_dump() for c in DICT] + GOOD["capabilities"][:2]
            return "Let me think." if len(msgs) == 1 else json.dumps({"capabilities": caps})
        if "toy/1/0" in prompt and len(msgs) == 1:
            return Reply(content='{"labels": [{"capability": "tool_use", "label": "PRESENT"}]')  # truncated JSON
        if "toy/2/0" in prompt:
            return '{"labels": [{"capability": "tool_use", "label": "LACKING", "rationale": "r"}]}'  # never complete
        req = ChatRequest(messages=[Message(role=m["role"], content=m["content"]) for m in msgs], seed=body["seed"])
        return honest(req, 0)

    with StubOpenAIServer(handler=handler, fail_times=1) as srv:  # one injected HTTP 500, retried by the client
        client = OpenAIChatClient(base_url=srv.url, model="stub-model", max_retries=2, backoff_s=0.01, max_concurrency=4)
        dictionary = discover(TRAJS, client, DiscoveryConfig(), tmp_path / "d")
        res = label(TRAJS, dictionary, LLMLabeler(client, LabelingConfig(max_attempts=2)), 2, 3, tmp_path / "l")
        bodies = srv.chat_requests
    assert [c.name for c in dictionary][:3] == [c.name for c in DICT]
    lab = [b for b in bodies if "canonical dictionary" not in b["messages"][0]["content"]]
    assert all(b["response_format"]["json_schema"]["name"] == "capability_labels" for b in lab)
    assert {b["temperature"] for b in lab} == {0.7}
    missing = [x for x in res.labels if x.value is None]
    # toy/2/0 never labels 4 of its 5 capabilities (2 runs); toy/1/0 recovers on the retry
    assert len(missing) == 8 and {x.trajectory for x in missing} == {"toy/2/0"}
    assert res.report["error_kinds"]["not_json"] == 2 and res.report["missing"] == 8

    with StubOpenAIServer(handler=handler, fail_times=10**6) as srv:  # the endpoint stays down
        client = OpenAIChatClient(base_url=srv.url, model="stub-model", max_retries=1, backoff_s=0.01)
        with pytest.raises(EndpointError, match="failed after 2 attempts"):
            label(TRAJS, dictionary, LLMLabeler(client), 2, 3, tmp_path / "down")
