"""``OpenAIChatClient``: any OpenAI-compatible chat endpoint (a vLLM server, a hosted API) over httpx.

- Fail fast: the first ``chat`` (or an explicit ``check()``) asks ``GET {base_url}/models`` with a
  short connect timeout; an unreachable endpoint, a missing key or a rejected key raises
  ``EndpointError`` with one line naming the endpoint. A key is required unless the host is local.
- Per-request timeouts; bounded retries with exponential backoff (``backoff_s * 2**attempt``, capped)
  on timeouts, connection errors, 429 and 5xx; after the budget, ``EndpointError`` (one line).
  Other 4xx (e.g. a prompt over the context limit) answer that request with ``finish_reason="error"``.
- Batches run on a thread pool of ``max_concurrency`` workers; responses keep request order.
- Tool calls come from the response's ``tool_calls``, or are parsed from the text when the server
  returns them as text; ids are re-issued deterministically (``call_{turn}_{i}``).
- Log-probs when ``return_tokens`` (``logprobs: true``); token ids where the server returns them
  (vLLM: ``vllm=True`` asks for ``return_token_ids`` and ``return_tokens_as_token_ids``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import httpx

from tracekit.llm.base import ChatClient, ChatRequest, ChatResponse, EndpointError
from tracekit.llm.tools import (ToolCallParseError, call_from_json, check_chat_format, encode_prompt,
                                parse_assistant_text, strip_reasoning, tool_call_id)
from tracekit.types import Message, ToolCall

log = logging.getLogger(__name__)

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _is_local(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified or ip.is_private


def to_openai_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages in OpenAI wire format (tool-call arguments as JSON strings, null content beside calls;
    tool results carry only ``tool_call_id``, as the OpenAI schema has no ``name`` for them)."""
    out = []
    for m in messages:
        d = m.to_chat()
        d.pop("name", None)
        if m.tool_calls:
            d["content"] = m.content or None
            for c in d["tool_calls"]:
                c["function"]["arguments"] = json.dumps(c["function"]["arguments"], ensure_ascii=False)
        out.append(d)
    return out


class OpenAIChatClient(ChatClient):
    """Chat over an OpenAI-compatible HTTP endpoint.

    ``base_url`` ends with the API root (e.g. ``http://127.0.0.1:8000/v1``). ``api_key`` or the
    environment variable ``api_key_env``; ``require_api_key=None`` requires one unless the host is
    local. ``timeout_s``: per-request read timeout; ``connect_timeout_s``: connect timeout (also the
    health check's). ``max_retries``: retries after the first attempt. ``chat_format``: how to
    parse tool calls that come back as text. ``extra_body``: merged into every request body.
    ``tokenizer``: optional HF tokenizer of the served model, for exact ``count_tokens``.
    """

    name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        require_api_key: bool | None = None,
        timeout_s: float = 120.0,
        connect_timeout_s: float = 5.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_concurrency: int = 8,
        chat_format: str = "qwen3",
        vllm: bool = False,
        extra_body: dict[str, Any] | None = None,
        tokenizer: Any = None,
    ):
        if not base_url:
            raise EndpointError("openai client: base_url is empty")
        if max_retries < 0 or max_concurrency < 1 or timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("need max_retries >= 0, max_concurrency >= 1 and positive timeouts")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key or (os.environ.get(api_key_env) if api_key_env else None)
        needs_key = (not _is_local(self.base_url)) if require_api_key is None else require_api_key
        if needs_key and not self.api_key:
            where = f"${api_key_env}" if api_key_env else "api_key"
            raise EndpointError(f"endpoint {self.base_url}: no API key (set {where})")
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.connect_timeout_s = connect_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_concurrency = max_concurrency
        self.chat_format = check_chat_format(chat_format)
        self.vllm = vllm
        self.extra_body = dict(extra_body or {})
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._http = httpx.Client(
            headers=headers,
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )
        self._checked = False

    # -- health --------------------------------------------------------------------------------

    def check(self) -> None:
        """One short request to ``/models``: raise ``EndpointError`` if unreachable, the key is refused, or the answer
        is not an OpenAI model list (``{"data": [{"id": ...}, ...]}``: HTTP 500, an HTML page, another server)."""
        url = f"{self.base_url}/models"
        try:
            r = self._http.get(url, timeout=httpx.Timeout(max(self.connect_timeout_s, 1.0) * 2, connect=self.connect_timeout_s))
        except httpx.TransportError as e:
            raise EndpointError(f"endpoint {self.base_url} unreachable: {type(e).__name__}: {_one_line(e)}") from None
        if r.status_code in (401, 403):
            raise EndpointError(f"endpoint {self.base_url} refused the API key (HTTP {r.status_code})")
        not_openai = (f"endpoint {self.base_url} is not an OpenAI-compatible server: GET {url} answered "
                      f"HTTP {r.status_code}")
        if r.status_code != 200:
            raise EndpointError(f"{not_openai}: {_one_line(r.text, 120) or 'no body'}; check the URL (it ends with "
                                "the API root, e.g. http://host:8000/v1) and that the server is up")
        try:
            data = r.json()
            models = [m["id"] for m in data["data"]]
        except (ValueError, KeyError, TypeError) as e:
            raise EndpointError(f"{not_openai} but not a model list ({type(e).__name__}: {_one_line(r.text, 80)!r}); "
                                "check the URL (it ends with the API root, e.g. http://host:8000/v1)") from None
        if self.model and models and self.model not in models:
            log.warning("endpoint %s does not list model %r (it lists %s)", self.base_url, self.model,
                        ", ".join(map(str, models[:5])))
        self._checked = True

    # -- chat ----------------------------------------------------------------------------------

    def count_tokens(self, messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        if self.tokenizer is not None:
            return len(encode_prompt(self.tokenizer, messages, tools))
        return super().count_tokens(messages, tools)

    def chat(self, requests: list[ChatRequest]) -> list[ChatResponse]:
        if not self._checked:
            self.check()
        if len(requests) <= 1:
            return [self._one(r) for r in requests]
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(requests))) as pool:
            return list(pool.map(self._one, requests))

    def close(self) -> None:
        self._http.close()

    def body(self, req: ChatRequest) -> dict[str, Any]:
        """The JSON body sent for one request."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": to_openai_messages(req.messages),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "max_tokens": req.max_new_tokens,
        }
        if req.seed is not None:
            body["seed"] = req.seed
        if req.tools:
            body["tools"] = req.tools
        if req.response_format:
            body["response_format"] = req.response_format
        if req.return_tokens:
            body["logprobs"] = True
            if self.vllm:
                body["return_token_ids"] = True
                body["return_tokens_as_token_ids"] = True
        body.update(self.extra_body)
        return body

    def _one(self, req: ChatRequest) -> ChatResponse:
        url = f"{self.base_url}/chat/completions"
        body = self.body(req)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s))
            try:
                r = self._http.post(url, json=body, timeout=self.timeout)
            except httpx.TransportError as e:  # timeouts, refused/reset connections
                last = f"{type(e).__name__}: {_one_line(e) or 'no detail'}"
                log.warning("%s attempt %d/%d: %s", url, attempt + 1, self.max_retries + 1, last)
                continue
            if r.status_code == 200:
                try:
                    return self._parse(req, r.json())
                except (ValueError, KeyError, IndexError, TypeError) as e:
                    raise EndpointError(f"endpoint {self.base_url}: malformed response: {_one_line(e)}") from None
            detail = _one_line(r.text, 200)
            if r.status_code in RETRY_STATUS:
                last = f"HTTP {r.status_code}: {detail}"
                log.warning("%s attempt %d/%d: %s", url, attempt + 1, self.max_retries + 1, last)
                continue
            if r.status_code in (401, 403, 404):
                raise EndpointError(f"endpoint {self.base_url}: HTTP {r.status_code} for model {self.model!r}: {detail}")
            return ChatResponse(message=Message(role="assistant"), text=detail, finish_reason="error")
        raise EndpointError(f"endpoint {self.base_url}: failed after {self.max_retries + 1} attempts: {last}")

    def _parse(self, req: ChatRequest, data: dict[str, Any]) -> ChatResponse:
        choice = data["choices"][0]
        msg = choice.get("message") or {}
        text = msg.get("content") or ""
        turn = len(req.messages)
        raw_calls = msg.get("tool_calls") or []
        if raw_calls:
            message = _message_from_tool_calls(text, raw_calls, turn)
        elif req.tools and "<tool_call>" in text:
            message = parse_assistant_text(text, self.chat_format, turn=turn, tools=req.tools)
        else:
            message = Message(role="assistant", content=strip_reasoning(text).strip() or None)
        finish = choice.get("finish_reason")
        usage = {k: int(v) for k, v in (data.get("usage") or {}).items() if k in ("prompt_tokens", "completion_tokens")}
        resp = ChatResponse(message=message, text=text, finish_reason="length" if finish == "length" else "stop", usage=usage)
        if req.return_tokens:
            content = (choice.get("logprobs") or {}).get("content") or []
            resp.completion_logprobs = [float(t["logprob"]) for t in content] or None
            ids = choice.get("token_ids")
            if ids is None and content and all(_TOKEN_ID.match(str(t.get("token"))) for t in content):
                ids = [int(_TOKEN_ID.match(t["token"]).group(1)) for t in content]
            resp.completion_token_ids = list(ids) if ids is not None else None
            prompt_ids = data.get("prompt_token_ids", choice.get("prompt_token_ids"))
            resp.prompt_token_ids = list(prompt_ids) if prompt_ids is not None else None
        return resp


def _message_from_tool_calls(text: str, raw_calls: list[dict[str, Any]], turn: int) -> Message:
    """An assistant message from OpenAI ``tool_calls``; malformed ones give ``parse_error``, no exception."""
    calls = []
    try:
        for i, rc in enumerate(raw_calls):
            fn = rc.get("function") or {}
            name, args = call_from_json({"name": fn.get("name"), "arguments": fn.get("arguments") or {}})
            calls.append(ToolCall(id=tool_call_id(turn, i), name=name, arguments=args))
    except ToolCallParseError as e:
        raw = json.dumps(raw_calls, ensure_ascii=False)
        return Message(role="assistant", content=(text + "\n" + raw).strip(), parse_error=str(e))
    return Message(role="assistant", content=strip_reasoning(text).strip() or None, tool_calls=calls)
