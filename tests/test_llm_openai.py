"""OpenAIChatClient against the local stand-in server: replies, tool calls, retries, timeouts, refusals."""

from __future__ import annotations

import json
import socket
import time

import pytest

from tests.openai_stub import Reply, StubOpenAIServer
from tracekit.llm import EndpointError, make_client
from tracekit.llm.base import ChatRequest
from tracekit.llm.openai import OpenAIChatClient
from tracekit.types import Message, ToolCall

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_order",
            "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}, "required": ["order_id"]},
        },
    }
]


# Clock bounds here only tell "waited out a timeout or a retry loop" from "did not": far from the expected times,
# so that a loaded machine does not fail them
PROMPTLY = 30.0  # s: failing at once (a refused connection, a spent retry budget with 0.01 s backoff)
LATE = 60.0  # s: a reply this late is never waited for (the stub's handler threads are daemons)


def _client(url: str, **kw) -> OpenAIChatClient:
    kw = {"timeout_s": 5.0, "connect_timeout_s": 1.0, "max_retries": 2, "backoff_s": 0.01, **kw}
    return OpenAIChatClient(base_url=url, model="stub-model", **kw)


def _req(**kw) -> ChatRequest:
    return ChatRequest(messages=[Message(role="user", content="Where is my order #W1?")], **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_text_reply_and_request_body():
    with StubOpenAIServer(responses=["It shipped yesterday."]) as srv:
        client = _client(srv.url)
        history = [
            Message(role="user", content="Where is #W1?"),
            Message(role="assistant", tool_calls=[ToolCall(id="call_1_0", name="get_order", arguments={"order_id": "#W1"})]),
            Message(role="tool", content='{"status": "shipped"}', tool_call_id="call_1_0", name="get_order"),
        ]
        (resp,) = client.chat([ChatRequest(messages=history, tools=TOOLS, temperature=0.0, seed=42, max_new_tokens=64)])
        body = srv.chat_requests[0]
    assert resp.message == Message(role="assistant", content="It shipped yesterday.")
    assert resp.finish_reason == "stop" and resp.usage["completion_tokens"] >= 1
    assert body["model"] == "stub-model" and body["tools"] == TOOLS and body["seed"] == 42 and body["max_tokens"] == 64
    call = body["messages"][1]["tool_calls"][0]
    assert call["function"]["arguments"] == '{"order_id": "#W1"}' and body["messages"][1]["content"] is None
    assert body["messages"][2] == {"role": "tool", "content": '{"status": "shipped"}', "tool_call_id": "call_1_0"}
    assert "logprobs" not in body


def test_tool_calls_from_the_response_get_deterministic_ids():
    reply = Reply(tool_calls=[{"name": "get_order", "arguments": {"order_id": "#W1"}}, {"name": "get_order", "arguments": "{}"}])
    with StubOpenAIServer(responses=[reply, reply]) as srv:
        client = _client(srv.url)
        a, b = client.chat([_req(tools=TOOLS), _req(tools=TOOLS)])
    assert a.message.tool_calls == [
        ToolCall(id="call_1_0", name="get_order", arguments={"order_id": "#W1"}),
        ToolCall(id="call_1_1", name="get_order", arguments={}),
    ]
    assert a.message == b.message and a.message.parse_error is None


def test_tool_calls_returned_as_text_are_parsed():
    text = '<tool_call>\n{"name": "get_order", "arguments": {"order_id": "#W2"}}\n</tool_call>'
    with StubOpenAIServer(responses=[text, text]) as srv:
        with_tools, without = _client(srv.url).chat([_req(tools=TOOLS), _req()])
    assert with_tools.message.tool_calls[0].arguments == {"order_id": "#W2"}
    assert without.message.tool_calls == [] and without.message.content == text  # no tools offered: plain text


def test_malformed_tool_call_arguments_become_a_parse_error():
    reply = Reply(tool_calls=[{"name": "get_order", "arguments": '{"order_id": '}])
    with StubOpenAIServer(responses=[reply]) as srv:
        (resp,) = _client(srv.url).chat([_req(tools=TOOLS)])
    assert resp.message.tool_calls == [] and "not JSON" in resp.message.parse_error
    assert "get_order" in resp.message.content


def test_logprobs_and_token_ids_when_asked():
    with StubOpenAIServer(responses=[Reply(content="ok!", logprobs=[-0.5, -0.25], token_ids=[17, 3])]) as srv:
        (resp,) = _client(srv.url, vllm=True).chat([_req(return_tokens=True)])
        body = srv.chat_requests[0]
    assert body["logprobs"] is True and body["return_token_ids"] is True
    assert resp.completion_logprobs == [-0.5, -0.25] and resp.completion_token_ids == [17, 3]


def test_http_500_is_retried_then_succeeds():
    with StubOpenAIServer(responses=["recovered"], fail_times=2) as srv:
        (resp,) = _client(srv.url, max_retries=2).chat([_req()])
        assert len(srv.chat_requests) == 3
    assert resp.message.content == "recovered"


def test_http_500_beyond_the_retry_budget_fails_cleanly():
    with StubOpenAIServer(responses=["never"], fail_times=10) as srv:
        url = srv.url
        client = _client(url, max_retries=2)
        t0 = time.perf_counter()
        with pytest.raises(EndpointError) as info:
            client.chat([_req()])
        assert len(srv.chat_requests) == 3
    msg = str(info.value)
    assert "\n" not in msg and url in msg and "after 3 attempts" in msg and "HTTP 500" in msg
    assert time.perf_counter() - t0 < PROMPTLY  # backoff_s=0.01: the three attempts are the time


def test_timeout_is_retried_then_fails_cleanly():
    with StubOpenAIServer(responses=[Reply(content="late", delay_s=LATE)], cycle=True) as srv:
        client = _client(srv.url, timeout_s=0.3, max_retries=1)
        t0 = time.perf_counter()
        with pytest.raises(EndpointError, match="ReadTimeout") as info:
            client.chat([_req()])
        elapsed = time.perf_counter() - t0
        assert len(srv.chat_requests) == 2
    assert "\n" not in str(info.value) and elapsed < LATE / 2  # two 0.3 s timeouts, not the server's delay


def test_timeout_then_success():
    # the timeout is long enough for a prompt reply on a loaded machine, the late reply far longer
    with StubOpenAIServer(responses=[Reply(content="late", delay_s=LATE), "on time"]) as srv:
        (resp,) = _client(srv.url, timeout_s=2.0, max_retries=1).chat([_req()])
    assert resp.message.content == "on time"


def test_refused_connection_fails_fast_with_one_line():
    url = f"http://127.0.0.1:{_free_port()}/v1"
    client = _client(url)
    t0 = time.perf_counter()
    with pytest.raises(EndpointError) as info:
        client.chat([_req()])
    assert time.perf_counter() - t0 < PROMPTLY
    msg = str(info.value)
    assert msg.startswith(f"endpoint {url} unreachable") and "\n" not in msg


def test_missing_or_refused_api_key():
    with pytest.raises(EndpointError, match=r"endpoint https://api\.example\.com/v1: no API key \(set \$TRACEKIT_NO_SUCH_KEY\)"):
        OpenAIChatClient(base_url="https://api.example.com/v1", model="m", api_key_env="TRACEKIT_NO_SUCH_KEY")
    with StubOpenAIServer(responses=["hi"], require_key="sekrit") as srv:
        with pytest.raises(EndpointError, match="refused the API key"):
            _client(srv.url, api_key="wrong").chat([_req()])
        (resp,) = _client(srv.url, api_key="sekrit").chat([_req()])
        assert resp.message.content == "hi"
        assert srv.chat_requests and srv.requests[-1]["headers"]["Authorization"] == "Bearer sekrit"


def test_client_error_answers_that_request_only():
    with StubOpenAIServer(responses=[Reply(status=400, error="prompt too long"), "fine"]) as srv:
        client = _client(srv.url, max_concurrency=1)
        bad, good = client.chat([_req(), _req()])
    assert bad.finish_reason == "error" and "prompt too long" in bad.text
    assert good.message.content == "fine"


def test_batches_run_concurrently_and_keep_order():
    import threading

    # an event, not a clock: no request is answered before all 8 are in flight at once (sequential requests would
    # break the barrier at its timeout: an HTTP 500, no retry)
    everyone = threading.Barrier(8, timeout=120)

    def echo(body):
        everyone.wait()
        return Reply(content=body["messages"][0]["content"].upper())

    with StubOpenAIServer(handler=echo) as srv:
        client = _client(srv.url, max_concurrency=8, timeout_s=300, max_retries=0)
        reqs = [ChatRequest(messages=[Message(role="user", content=f"q{i}")]) for i in range(8)]
        out = client.chat(reqs)
    assert [r.message.content for r in out] == [f"Q{i}" for i in range(8)]


def test_make_client_openai():
    with StubOpenAIServer(responses=["x"]) as srv:
        client = make_client({"kind": "openai", "base_url": srv.url, "model": "stub-model", "max_retries": 0, "check": True})
        assert isinstance(client, OpenAIChatClient) and client.max_retries == 0
        assert [r["path"] for r in srv.requests] == ["/v1/models"]
    with pytest.raises(KeyError, match="'model' is required"):
        make_client({"kind": "openai", "base_url": "http://127.0.0.1:1/v1"})
    with pytest.raises(KeyError, match="unknown keys"):
        make_client({"kind": "openai", "base_url": "http://127.0.0.1:1/v1", "model": "m", "retries": 3})


def test_stub_server_scripting():
    with StubOpenAIServer(responses=["a"]) as srv:
        client = _client(srv.url, max_retries=0)
        assert client.chat([_req()])[0].message.content == "a"
        with pytest.raises(EndpointError, match="no scripted response left"):
            client.chat([_req()])
    with pytest.raises(ValueError, match="unknown Reply fields"):
        StubOpenAIServer(responses=[{"text": "x"}])
    reply = StubOpenAIServer().completion(Reply(content="hi"), {"messages": []})
    assert json.loads(json.dumps(reply))["choices"][0]["message"]["content"] == "hi"
