"""A local stand-in for an OpenAI-compatible chat server, for tests (stdlib only).

Usage::

    from tests.openai_stub import Reply, StubOpenAIServer

    with StubOpenAIServer(responses=["hello", Reply(tool_calls=[{"name": "f", "arguments": {"x": 1}}])]) as srv:
        client = OpenAIChatClient(base_url=srv.url, model="stub")   # srv.url == "http://127.0.0.1:<port>/v1"
        ...
        srv.chat_requests          # the JSON bodies the server received, in order

What the server does, per ``POST /v1/chat/completions``:

1. records the request (``srv.requests``: every request as ``{"method", "path", "headers", "json"}``);
2. while ``fail_times`` > 0: answers HTTP ``fail_status`` (default 500) and decrements;
3. sleeps ``delay_s`` (all requests) plus the reply's own ``delay_s`` (use a delay longer than the
   client's timeout to provoke a timeout);
4. answers the next scripted reply (``responses``, consumed in order; ``cycle=True`` repeats them;
   exhausted -> HTTP 500 "stub: no scripted response left"), or ``handler(body)`` if given.

A reply is a :class:`Reply`, a plain string (text content) or a dict of ``Reply`` fields.
``GET /v1/models`` lists ``model``; ``require_key="k"`` makes every request without
``Authorization: Bearer k`` get HTTP 401. The server binds 127.0.0.1 on a free port and runs in a
daemon thread; leaving the ``with`` block stops it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """One scripted answer.

    ``content``: assistant text. ``tool_calls``: ``[{"name": ..., "arguments": dict or JSON string}]``.
    ``status``: HTTP status (non-200 sends ``{"error": {"message": error}}``). ``delay_s``: extra
    sleep before answering. ``logprobs``: per-token log-probs (with ``token_ids``, tokens are sent
    as ``token_id:<id>`` like vLLM's ``return_tokens_as_token_ids``). ``body``: a raw JSON body sent
    as is (overrides everything else).
    """

    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    status: int = 200
    delay_s: float = 0.0
    finish_reason: str | None = None
    logprobs: list[float] | None = None
    token_ids: list[int] | None = None
    error: str = "stub error"
    body: dict[str, Any] | None = None
    usage: dict[str, int] = field(default_factory=dict)


def as_reply(item: Reply | str | dict[str, Any]) -> Reply:
    if isinstance(item, Reply):
        return item
    if isinstance(item, str):
        return Reply(content=item)
    names = {f.name for f in fields(Reply)}
    unknown = set(item) - names
    if unknown:
        raise ValueError(f"unknown Reply fields {sorted(unknown)}")
    return Reply(**item)


class StubOpenAIServer:
    """A scripted OpenAI-compatible server on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        responses: list[Reply | str | dict[str, Any]] | None = None,
        handler: Callable[[dict[str, Any]], Reply | str | dict[str, Any]] | None = None,
        fail_times: int = 0,
        fail_status: int = 500,
        delay_s: float = 0.0,
        cycle: bool = False,
        model: str = "stub-model",
        require_key: str | None = None,
    ):
        if responses is not None and handler is not None:
            raise ValueError("give responses or handler, not both")
        self.responses = [as_reply(r) for r in responses or []]
        self.handler = handler
        self.fail_times = fail_times
        self.fail_status = fail_status
        self.delay_s = delay_s
        self.cycle = cycle
        self.model = model
        self.require_key = require_key
        self.requests: list[dict[str, Any]] = []
        self._next = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("stub server not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    @property
    def chat_requests(self) -> list[dict[str, Any]]:
        """Bodies of the chat-completion requests received so far."""
        with self._lock:
            return [r["json"] for r in self.requests if r["path"].endswith("/chat/completions")]

    def start(self) -> StubOpenAIServer:
        server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        server.daemon_threads = True
        server.block_on_close = False  # a handler sleeping past the client's timeout must not block stop()
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.02}, name="stub-openai", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> StubOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- behaviour -------------------------------------------------------------------------------

    def _record(self, method: str, path: str, headers: dict[str, str], body: Any) -> None:
        with self._lock:
            self.requests.append({"method": method, "path": path, "headers": headers, "json": body})

    def _take_fault(self) -> bool:
        with self._lock:
            if self.fail_times > 0:
                self.fail_times -= 1
                return True
            return False

    def _reply_for(self, body: dict[str, Any]) -> Reply:
        if self.handler is not None:
            return as_reply(self.handler(body))
        with self._lock:
            if self._next >= len(self.responses):
                if not (self.cycle and self.responses):
                    return Reply(status=500, error="stub: no scripted response left")
                self._next = 0
            reply = self.responses[self._next]
            self._next += 1
        return reply

    def completion(self, reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completion JSON for ``reply``."""
        if reply.body is not None:
            return reply.body
        message: dict[str, Any] = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_stub_{i}",
                    "type": "function",
                    "function": {
                        "name": c.get("name"),
                        "arguments": c["arguments"] if isinstance(c.get("arguments"), str) else json.dumps(c.get("arguments", {})),
                    },
                }
                for i, c in enumerate(reply.tool_calls)
            ]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop"),
        }
        if reply.logprobs is not None:
            tokens = [f"token_id:{t}" for t in reply.token_ids] if reply.token_ids else ["?"] * len(reply.logprobs)
            choice["logprobs"] = {
                "content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []} for t, lp in zip(tokens, reply.logprobs)]
            }
        prompt_tokens = len(json.dumps(body.get("messages", []))) // 4
        completion_tokens = len(reply.logprobs) if reply.logprobs is not None else len(reply.content or "") // 4
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        usage.update(reply.usage)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {
            "id": f"chatcmpl-stub-{len(self.requests)}",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model", self.model),
            "choices": [choice],
            "usage": usage,
        }


def _make_handler(stub: StubOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
            return

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                pass

        def _authorized(self) -> bool:
            if stub.require_key is None:
                return True
            if self.headers.get("Authorization") == f"Bearer {stub.require_key}":
                return True
            self._send(401, {"error": {"message": "invalid api key"}})
            return False

        def do_GET(self) -> None:
            stub._record("GET", self.path, dict(self.headers), None)
            if not self._authorized():
                return
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, {"object": "list", "data": [{"id": stub.model, "object": "model"}]})
            elif self.path.rstrip("/").endswith("/health"):
                self._send(200, {"status": "ok"})
            else:
                self._send(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
            except json.JSONDecodeError:
                stub._record("POST", self.path, dict(self.headers), None)
                self._send(400, {"error": {"message": "body is not JSON"}})
                return
            stub._record("POST", self.path, dict(self.headers), body)
            if not self._authorized():
                return
            if not self.path.rstrip("/").endswith("/chat/completions"):
                self._send(404, {"error": {"message": f"no route {self.path}"}})
                return
            if stub._take_fault():
                self._send(stub.fail_status, {"error": {"message": f"stub: injected HTTP {stub.fail_status}"}})
                return
            reply = stub._reply_for(body)
            delay = stub.delay_s + reply.delay_s
            if delay > 0:
                time.sleep(delay)
            if reply.status != 200:
                self._send(reply.status, {"error": {"message": reply.error}})
                return
            self._send(200, stub.completion(reply, body))

    return Handler
