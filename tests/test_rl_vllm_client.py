"""The scale-out rollout path's client side (issue 22) against a local stand-in of ``vllm serve --enable-lora``.

The stand-in (``tests/vllm_standin.py``, transformers + peft, a tiny model on CPU) is started by the
engine as its managed server. Adapters only travel (saved, loaded at runtime, old ones unloaded and
removed); prompts go as token ids; the log-probs the server sampled with are those of the trainer's
model on exactly those tokens; the server is stopped for the update and restarted between iterations,
and a crashed server or one that forgot its adapter is recovered without losing the request.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from tracekit.llm.base import ChatRequest, EndpointError
from tracekit.rl.settings import LoraSettings
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.model import build_peft_model
from tracekit.rl.vllm_client import SUPPORTED_VLLM, VLLMEngine, VLLMServer, VLLMSettings, parse_vllm_choice
from tracekit.types import Message

STANDIN = str(Path(__file__).with_name("vllm_standin.py"))
MSGS = [Message(role="user", content="Please ping alpha.")]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _policy(tok, seed: int = 3):
    model = build_peft_model(tiny_model(len(tok), seed=0), LoraSettings(rank=4, alpha=8), seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _trainer_logprobs(model, r) -> torch.Tensor:
    """The trainer's log-probs of the completion ids on prompt + completion (one full forward)."""
    ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids])
    n = len(r.prompt_token_ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return lp[n - 1 : -1].gather(1, torch.tensor(r.completion_token_ids)[:, None]).squeeze(1)


def _chat(eng, k: int = 3):
    reqs = [ChatRequest(messages=MSGS, temperature=1.0, max_new_tokens=6, seed=s, return_tokens=True) for s in range(k)]
    return eng.client.chat(reqs)


def test_managed_standin_adapter_sync_restarts_and_exact_tokens(tok, tmp_path):
    base = tiny_model(len(tok), seed=0)
    base.save_pretrained(tmp_path / "base")
    model = _policy(tok)
    log = tmp_path / "requests.jsonl"
    cmd = (sys.executable, STANDIN, "--model", "{model}", "--host", "{host}", "--port", "{port}", "--log", str(log))
    settings = VLLMSettings(model_path=str(tmp_path / "base"), command=cmd, stop_during_update=True, concurrency=3, startup_timeout_s=180)
    eng = VLLMEngine(settings, tok, tmp_path / "work")
    saved = []

    def save(path: Path) -> None:
        model.save_pretrained(str(path))
        saved.append(path)

    try:
        eng.sync(0, save)
        pid0 = eng.proc.pid
        for r in _chat(eng):  # the server's log-probs are the trainer's on exactly the returned ids
            assert r.prompt_token_ids == eng.client.prompt_ids(MSGS, None) and len(r.completion_token_ids) >= 1
            assert torch.allclose(_trainer_logprobs(model, r), torch.tensor(r.completion_logprobs), atol=1e-4)

        eng.release()  # between rollouts and the update: the server gives its memory back
        assert eng.proc is None
        with torch.no_grad():  # the update
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.add_(torch.randn_like(p) * 0.3)
        eng.sync(1, save)  # restarts the server and loads the new adapter only
        assert eng.proc.pid != pid0 and eng.restarts == 1
        assert not saved[0].exists() and saved[1].exists()
        stale = _policy(tok)  # the adapter of iteration 0, rebuilt
        for r in _chat(eng):
            assert torch.allclose(_trainer_logprobs(model, r), torch.tensor(r.completion_logprobs), atol=1e-4)
            assert not torch.allclose(_trainer_logprobs(stale, r), torch.tensor(r.completion_logprobs), atol=1e-3)

        eng.proc.kill()  # a crash mid-iteration: the next request restarts it and loads the adapter again
        eng.proc.wait()
        for r in _chat(eng):
            assert torch.allclose(_trainer_logprobs(model, r), torch.tensor(r.completion_logprobs), atol=1e-4)
        assert eng.restarts == 2 and eng.reloads == 1
    finally:
        eng.close()
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    loads = [r["body"] for r in rows if r["path"] == "/v1/load_lora_adapter"]
    assert len(loads) == 3 and loads[2]["lora_name"] == loads[1]["lora_name"]  # the re-load after the crash: same name
    for b in loads:  # only the adapter travels: peft's adapter files, never full weights
        d = Path(b["lora_path"])
        assert d.parent == tmp_path / "work" / "adapters"
    assert sorted(p.name for p in saved[1].iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    comps = [r["body"] for r in rows if r["path"] == "/v1/completions"]
    assert all(c["prompt"] == eng.client.prompt_ids(MSGS, None) and c["return_tokens_as_token_ids"] and c["logprobs"] == 1 for c in comps)
    # every completion names its iteration's adapter (requests to the dead server never arrived)
    assert [c["model"] for c in comps] == [loads[0]["lora_name"]] * 3 + [loads[1]["lora_name"]] * 6


class _Forgetful(BaseHTTPRequestHandler):
    """An external server (base_url) that restarts behind the engine's back: ``forget()`` drops its adapters."""

    loaded: set[str] = set()
    loads: list[str] = []
    echo_wrong_prompt = False

    def do_GET(self):  # noqa: N802
        if self.path == "/version":
            return self._send(200, {"version": SUPPORTED_VLLM})
        self._send(200, {"data": [{"id": "base-model", "parent": None}]} if self.path == "/v1/models" else {})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        if self.path == "/v1/load_lora_adapter":
            cls.loaded.add(body["lora_name"])
            cls.loads.append(body["lora_name"])
            return self._send(200, {})
        if self.path == "/v1/unload_lora_adapter":
            cls.loaded.discard(body["lora_name"])
            return self._send(200, {})
        if body["model"] not in cls.loaded:
            return self._send(404, {"error": {"message": f"The model `{body['model']}` does not exist.", "type": "NotFoundError"}})
        ids = [11, 12, body["stop_token_ids"][0]]
        prompt = body["prompt"][:-1] if cls.echo_wrong_prompt else body["prompt"]
        choice = {"finish_reason": "stop", "prompt_token_ids": prompt, "token_ids": ids,
                  "logprobs": {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": [-0.5, -0.25, -0.1]}}  # fmt: skip
        self._send(200, {"choices": [choice]})

    def _send(self, code, out):
        data = json.dumps(out).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_external_server_that_forgot_the_adapter_gets_it_again(tok, tmp_path):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Forgetful)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng = VLLMEngine(VLLMSettings(model_path="unused", base_url=f"http://127.0.0.1:{srv.server_port}", concurrency=4), tok, tmp_path)

        def save(p):
            p.mkdir(parents=True)
            (p / "adapter_config.json").write_text("{}")

        eng.sync(0, save)
        _Forgetful.loaded.clear()  # the server restarted without telling anyone
        r = _chat(eng, k=4)
        assert [x.completion_token_ids for x in r] == [[11, 12, eng.client.stop_ids[0]]] * 4 and r[0].finish_reason == "stop"
        assert _Forgetful.loads.count(eng.lora_name) == 2 and eng.reloads == 1  # one re-load for the 4 concurrent requests
        _Forgetful.echo_wrong_prompt = True  # the server saw other tokens than we sent: refuse, the rollout is not ours
        with pytest.raises(EndpointError, match="prompt_token_ids differ"):
            _chat(eng, k=1)
        _Forgetful.echo_wrong_prompt = False
        eng.close()
    finally:
        srv.shutdown()


def test_parse_choice_prefers_token_ids_and_checks_them():
    c = parse_vllm_choice({"token_ids": [5, 2], "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]}}, [2])
    assert c.ids == [5, 2] and c.finish_reason == "stop"
    with pytest.raises(EndpointError, match="disagree"):
        parse_vllm_choice({"token_ids": [5, 3], "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]}}, [2])
    with pytest.raises(EndpointError, match="null log-prob"):
        parse_vllm_choice({"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [None]}}, [2])


def test_server_command_template_and_missing_binary(tmp_path):
    s = VLLMSettings(model_path="/m", max_lora_rank=16, extra_args=("--enforce-eager",))
    argv = VLLMServer(s, tmp_path).argv(8123)
    assert argv[:3] == ["vllm", "serve", "/m"] and argv[argv.index("--port") + 1] == "8123" and argv[-1] == "--enforce-eager"
    assert argv[argv.index("--max-lora-rank") + 1] == "16" and "--enable-lora" in argv
    with pytest.raises(EndpointError, match="not found on PATH"):
        VLLMServer(VLLMSettings(model_path="/m", command=("no-such-vllm-binary", "{port}")), tmp_path).start()


def _standin(tmp_path, tok, *flags: str) -> VLLMSettings:
    base = tiny_model(len(tok), seed=0)
    base.save_pretrained(tmp_path / "base")
    cmd = (sys.executable, STANDIN, "--model", "{model}", "--host", "{host}", "--port", "{port}", *flags)
    return VLLMSettings(model_path=str(tmp_path / "base"), command=cmd, concurrency=2, startup_timeout_s=180)


class _Launched:
    """Records the processes VLLMServer launches (subprocess.Popen as the client calls it)."""

    def __init__(self, monkeypatch):
        import tracekit.rl.vllm_client as vc

        self.procs: list = []
        real = vc.subprocess.Popen

        def popen(*a, **kw):
            self.procs.append(real(*a, **kw))
            return self.procs[-1]

        monkeypatch.setattr(vc.subprocess, "Popen", popen)

    def groups_gone(self) -> bool:
        import os

        for p in self.procs:
            try:
                os.killpg(p.pid, 0)
                return False
            except ProcessLookupError:
                continue
        return bool(self.procs)


def test_a_server_of_another_vllm_version_is_refused_before_any_rollout(tok, tmp_path, monkeypatch):
    launched = _Launched(monkeypatch)
    with pytest.raises(EndpointError, match=r"is vLLM 0\.25\.1; tracekit's vLLM client supports vLLM 0\.26\.0") as e:
        VLLMEngine(_standin(tmp_path, tok, "--version", "0.25.1"), tok, tmp_path / "work")
    assert "\n" not in str(e.value)
    assert launched.groups_gone()  # the refused server tracekit started is stopped (it outlived the suite before)


# A stand-in server that is cheap to start (no model): /health, /version, /v1/models, /metrics with ENGINES engines;
# it starts a child that stays in its process group, as vLLM's engine core does, and writes the child's pid.
_CHEAP_SERVER = """
import http.server, json, subprocess, sys
port, engines, child_pid_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(child_pid_file, "w").write(str(child.pid))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        out = {"/health": "", "/version": json.dumps({"version": "0.26.0"}),
               "/v1/models": json.dumps({"data": [{"id": "base", "parent": None}]}),
               "/metrics": "".join(f'vllm:num_requests_running{{engine="{i}"}} 0.0\\n' for i in range(engines))}[self.path]
        self.send_response(200); self.send_header("Content-Length", str(len(out))); self.end_headers()
        self.wfile.write(out.encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def _cheap(tmp_path, engines: int = 1, **kw) -> VLLMSettings:
    script = tmp_path / "cheap_server.py"
    script.write_text(_CHEAP_SERVER)
    cmd = (sys.executable, str(script), "{port}", str(engines), str(tmp_path / "child.pid"))
    return VLLMSettings(model_path="unused", command=cmd, startup_timeout_s=60, **kw)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_data_parallel_server_is_refused_in_one_line_and_stopped(tok, tmp_path, monkeypatch):
    launched = _Launched(monkeypatch)
    with pytest.raises(EndpointError, match=r"is data-parallel \(2 engines in GET /metrics\): a runtime LoRA load reaches one replica") as e:
        VLLMEngine(_cheap(tmp_path, engines=2), tok, tmp_path / "work")
    assert "\n" not in str(e.value) and launched.groups_gone()
    assert not _alive(int((tmp_path / "child.pid").read_text()))  # the server's child (its engine core) too
    for extra in (("--data-parallel-size", "2"), ("-dp=4",)):  # asked for in the command: refused before any start
        with pytest.raises(EndpointError, match=r"^grpo\.vllm data-parallel size \d is invalid: a runtime LoRA load"):
            VLLMEngine(VLLMSettings(model_path="/m", extra_args=extra, max_lora_rank=8), tok, tmp_path / "w2")
    assert len(launched.procs) == 1


def test_float32_with_lora_is_refused_before_a_server_starts(tok, tmp_path, monkeypatch):
    launched = _Launched(monkeypatch)
    with pytest.raises(EndpointError, match=r"^grpo\.vllm\.dtype=float32 is invalid: vLLM 0\.26\.0 serves LoRA adapters in bfloat16 / float16 only"):
        VLLMEngine(VLLMSettings(model_path="/m", dtype="float32", max_lora_rank=8), tok, tmp_path / "work")
    assert launched.procs == []


def test_every_exit_ends_the_servers_process_group(tok, tmp_path):
    """close(), the interpreter's exit after an error or Ctrl-C (atexit), and the pid file a shell reads after a
    SIGKILL (TRACEKIT_SERVER_PIDS)."""
    import os
    import signal
    import subprocess

    eng = VLLMEngine(_cheap(tmp_path), tok, tmp_path / "work")
    child = int((tmp_path / "child.pid").read_text())
    assert _alive(child)
    eng.close()
    assert not _alive(child) and eng.proc is None
    pids = tmp_path / "pids"
    for how in ("raise SystemExit(3)", "raise KeyboardInterrupt", "os.kill(os.getpid(), signal.SIGKILL)"):
        code = ("import os, signal, sys, pathlib; sys.path.insert(0, sys.argv[1])\n"
                "from tracekit.rl.vllm_client import VLLMServer, VLLMSettings\n"
                f"s = VLLMSettings(model_path='unused', command={_cheap(tmp_path).command!r}, startup_timeout_s=60)\n"
                "VLLMServer(s, pathlib.Path(sys.argv[2])).start()\n" + how)
        r = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parents[1]), str(tmp_path / "w")],
                           env=dict(os.environ, TRACEKIT_SERVER_PIDS=str(pids)), capture_output=True, text=True, timeout=120)
        child = int((tmp_path / "child.pid").read_text())
        if "SIGKILL" not in how:
            assert r.returncode != 0 and not _alive(child), (how, r.stderr[-500:])
            assert list(pids.iterdir()) == []  # stopped: its pid file removed
        else:  # nothing in the process ran: the pid file names the group for the caller to end
            (f,) = list(pids.iterdir())
            assert _alive(child)
            os.killpg(int(f.read_text()), signal.SIGKILL)
            f.unlink()


def test_max_lora_rank_defaults_to_the_adapters_rank(tok, tmp_path):
    from tracekit.rl.vllm_client import check_recipe, served_rank

    assert [served_rank(r) for r in (1, 4, 8, 16, 17, 64)] == [1, 8, 8, 16, 32, 64]
    eng = VLLMEngine(_cheap(tmp_path), tok, tmp_path / "work", lora_rank=4)
    try:
        assert eng.s.max_lora_rank == 8
        full = VLLMServer(VLLMSettings(model_path="/m", max_lora_rank=eng.s.max_lora_rank), tmp_path).argv(8000)
        assert full[full.index("--max-lora-rank") + 1] == "8"
    finally:
        eng.close()
    with pytest.raises(ValueError, match=r"^grpo\.vllm\.max_lora_rank is unset"):
        VLLMServer(VLLMSettings(model_path="/m"), tmp_path).argv(8000)
    with pytest.raises(ValueError, match=r"^grpo\.vllm\.max_lora_rank=12 is invalid: vLLM accepts 1, 8, 16"):
        check_recipe(VLLMSettings(model_path="/m", max_lora_rank=12), 8, 1.0, "recompute")
    check_recipe(VLLMSettings(model_path="/m"), 16, 1.0, "recompute")  # unset: taken from the rank, no error


def test_base_rollouts_then_a_server_without_lora_is_one_line(tok, tmp_path):
    settings = _standin(tmp_path, tok, "--no-lora")
    eng = VLLMEngine(settings, tok, tmp_path / "work")
    try:
        with pytest.raises(EndpointError, match="before sync"):
            _chat(eng, k=1)
        eng.use_base()  # the served base model, no adapter: the trainer's base log-probs on the returned ids
        base = tiny_model(len(tok), seed=0).eval()
        for r in _chat(eng, k=2):
            assert torch.allclose(_trainer_logprobs(base, r), torch.tensor(r.completion_logprobs), atol=1e-4)
        model = _policy(tok)
        with pytest.raises(EndpointError, match=r"was started without LoRA support \(start it with --enable-lora\)"):
            eng.sync(0, lambda p: model.save_pretrained(str(p)))
    finally:
        eng.close()


def test_a_server_without_runtime_lora_loading_is_one_line(tok, tmp_path):
    eng = VLLMEngine(_standin(tmp_path, tok, "--no-runtime-lora"), tok, tmp_path / "work")
    try:
        model = _policy(tok)
        with pytest.raises(EndpointError, match="has no runtime LoRA loading .*VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            eng.sync(0, lambda p: model.save_pretrained(str(p)))
    finally:
        eng.close()


def test_the_gpu_extra_pins_the_vllm_the_client_supports():
    import tomllib

    extra = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert f"vllm=={SUPPORTED_VLLM}" in extra
