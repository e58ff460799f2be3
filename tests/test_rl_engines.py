"""Rollout engines: in-process sampling, the chat layer, Hermes parsing, the vLLM client path."""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch

from tracekit.llm.base import ChatRequest
from tracekit.rl.engines import (
    ClientEngine,
    Completion,
    PolicyChat,
    sample_completions,
)
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.vllm_client import SUPPORTED_VLLM, VLLM_COMMAND, VLLMEngine, VLLMSettings, parse_vllm_choice
from tracekit.types import Message


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok), seed=2)


def test_greedy_is_padding_invariant_and_logprobs_match_a_full_forward(model):
    a, b = list(range(5, 40)), list(range(50, 62))
    both = sample_completions(model, [a, b], max_new_tokens=8, temperature=0.0)
    alone = sample_completions(model, [b], max_new_tokens=8, temperature=0.0)
    assert both[1].ids == alone[0].ids
    x = torch.tensor([b + both[1].ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits.float(), -1)[0, len(b) - 1 : -1]
    ref = lp.gather(1, torch.tensor(both[1].ids)[:, None]).squeeze(1)
    assert torch.allclose(ref, torch.tensor(both[1].logprobs), atol=1e-5)


def test_sampling_is_seeded_and_tempered_logprobs(model):
    p = [list(range(3, 20))] * 3
    s1 = sample_completions(model, p, max_new_tokens=10, temperature=0.7, seed=11)
    s2 = sample_completions(model, p, max_new_tokens=10, temperature=0.7, seed=11)
    s3 = sample_completions(model, p, max_new_tokens=10, temperature=0.7, seed=12)
    assert [c.ids for c in s1] == [c.ids for c in s2]
    assert [c.ids for c in s1] != [c.ids for c in s3]
    x = torch.tensor([p[0] + s1[0].ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits.float() / 0.7, -1)[0, len(p[0]) - 1 : -1]
    assert torch.allclose(lp.gather(1, torch.tensor(s1[0].ids)[:, None]).squeeze(1), torch.tensor(s1[0].logprobs), atol=1e-5)


def test_per_row_stopping_keeps_the_stop_token(model):
    prompt = list(range(3, 20))
    free = sample_completions(model, [prompt], max_new_tokens=6, temperature=0.0)[0]
    stop_tok = free.ids[2]  # greedy is deterministic: this token comes out at step 3
    out = sample_completions(model, [prompt, list(range(30, 40))], max_new_tokens=6, temperature=0.0, stop_ids=[stop_tok])
    first = out[0]
    assert first.finish_reason == "stop" and first.ids == free.ids[: free.ids.index(stop_tok) + 1]
    assert len(first.logprobs) == len(first.ids)
    assert out[1].finish_reason in ("stop", "length") and len(out[1].ids) <= 6


def test_top_p_restricts_to_the_nucleus(model):
    prompt = list(range(3, 20))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    top = int(logits.argmax())
    outs = sample_completions(model, [prompt] * 8, max_new_tokens=1, temperature=1.0, top_p=1e-6, seed=3)
    assert {c.ids[0] for c in outs} == {top}


def test_policy_chat_reports_context_overflow(tok, model):
    calls = []

    def gen(prompts, t, p, n, seed):
        calls.append(len(prompts))
        return [Completion([end], [-0.1], "stop") for _ in prompts]

    end = tok.convert_tokens_to_ids("<|im_end|>")
    chat = PolicyChat(tok, gen, [end], max_prompt_tokens=20)
    short = [Message(role="user", content="hi")]
    long = [Message(role="user", content="ping alpha " * 50)]
    r = chat.chat([ChatRequest(messages=long, return_tokens=True), ChatRequest(messages=short, return_tokens=True)])
    assert r[0].finish_reason == "error" and r[0].completion_token_ids is None
    assert r[1].finish_reason == "stop" and r[1].text == "" and calls == [1]
    assert r[1].prompt_token_ids == chat.prompt_ids(short, None)


def test_client_engine_with_the_agents_hf_chat_client(tok):
    """The llm package's HFChatClient plugs in as a rollout engine; its tokens re-score exactly."""
    from tracekit.llm.hf import HFChatClient
    from tracekit.rl.episodes import EpisodeSpec, run_episodes
    from tracekit.rl.tokens import Turn, collate, rows_for_trajectory
    from tracekit.rl.toy import KeywordSuite
    from tracekit.rl.model import build_peft_model, sequence_logprobs
    from tracekit.rl.settings import LoraSettings

    model = build_peft_model(tiny_model(len(tok), seed=4), LoraSettings(rank=4, alpha=8), seed=0)
    eng = ClientEngine(HFChatClient(model, tok, chat_format="qwen3", max_batch_size=8))
    suite = KeywordSuite(turns=2)
    specs = [EpisodeSpec(suite.tasks()[0], 5, k, 0) for k in range(3)]
    trajs = run_episodes(eng.client, suite, specs, temperature=1.0, max_new_tokens=10, sample_seed=1)
    rows = [r for t in trajs for r in rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], 0.0, 0)]
    b = collate(rows, tok.pad_token_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, b.input_ids, b.attention_mask, b.loss_mask)
    assert torch.allclose(lp, b.rollout_logprobs[:, 1:][b.loss_mask[:, 1:] > 0], atol=1e-4)


def test_parse_vllm_choice():
    c = parse_vllm_choice(
        {"finish_reason": "stop", "logprobs": {"tokens": ["token_id:5", "token_id:2"], "token_logprobs": [-0.5, -0.1]}}, [2]
    )
    assert c.ids == [5, 2] and c.logprobs == [-0.5, -0.1] and c.finish_reason == "stop"
    c2 = parse_vllm_choice({"finish_reason": "length", "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-1.0]}}, [2])
    assert c2.finish_reason == "length"
    with pytest.raises(Exception, match="token_id"):
        parse_vllm_choice({"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}, [2])


class _FakeVLLM(BaseHTTPRequestHandler):
    """Speaks the endpoints the vllm engine uses, like `vllm serve --enable-lora` does."""

    loaded: list[str] = []
    unloaded: list[str] = []
    requests: list[dict] = []

    def do_GET(self):  # noqa: N802 - the version check and the served base model
        out = {"version": SUPPORTED_VLLM} if self.path == "/version" else {"data": [{"id": "base", "parent": None}]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_lora_adapter":
            type(self).loaded.append(body["lora_name"])
            out: dict = {}
        elif self.path == "/v1/unload_lora_adapter":
            type(self).unloaded.append(body["lora_name"])
            out = {}
        else:
            type(self).requests.append(body)
            if body["model"] not in type(self).loaded:
                self.send_response(404)
                self.end_headers()
                return
            toks = [f"token_id:{(sum(body['prompt']) + i) % 50 + 10}" for i in range(3)] + [f"token_id:{body['stop_token_ids'][0]}"]
            out = {"choices": [{"finish_reason": "stop", "logprobs": {"tokens": toks, "token_logprobs": [-0.25] * 4}}]}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_vllm_engine_adapter_sync_and_token_requests(tok, tmp_path):
    srv = HTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        eng = VLLMEngine(VLLMSettings(model_path="unused", base_url=f"http://127.0.0.1:{srv.server_port}", concurrency=2), tok, tmp_path)
        saved = []

        def save(path):
            path.mkdir(parents=True)
            (path / "adapter_config.json").write_text("{}")
            saved.append(path)

        with pytest.raises(Exception, match="before sync"):
            eng.client.chat([ChatRequest(messages=[Message(role="user", content="hi")])])
        eng.sync(0, save)
        eng.sync(1, save)
        assert len(_FakeVLLM.loaded) == 2 and _FakeVLLM.unloaded == _FakeVLLM.loaded[:1]
        assert not saved[0].exists() and saved[1].exists()  # the old adapter's files are removed
        msgs = [Message(role="user", content="Please ping alpha.")]
        r = eng.client.chat([ChatRequest(messages=msgs, temperature=1.0, max_new_tokens=8, seed=1, return_tokens=True)] * 3)
        req = _FakeVLLM.requests[-1]
        assert req["model"] == _FakeVLLM.loaded[-1] and req["return_tokens_as_token_ids"] is True
        assert req["prompt"] == eng.client.prompt_ids(msgs, None)  # prompt ids rendered here, not by the server
        assert r[0].prompt_token_ids == req["prompt"] and len(r[0].completion_token_ids) == 4
        assert r[0].completion_logprobs == [-0.25] * 4 and r[0].finish_reason == "stop"
        eng.close()
    finally:
        srv.shutdown()


BF16_TOL = 0.25  # nats, as tests/test_vllm_server_gpu.py: the server's bf16 kernels against transformers' float32


@pytest.mark.gpu
def test_vllm_engine_real_server(tmp_path):
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tracekit.rl.model import build_peft_model
    from tracekit.rl.settings import LoraSettings

    tok = tiny_tokenizer()
    base = tiny_model(len(tok), seed=0)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    peft_model = build_peft_model(tiny_model(len(tok), seed=0), LoraSettings(rank=8, alpha=16), seed=0)
    # bf16: vLLM 0.26's LoRA kernels take fp16/bf16 only (float32 with LoRA is refused before any server starts)
    command = (sys.executable, "-m", "vllm.entrypoints.cli.main", *VLLM_COMMAND[1:], "--enforce-eager")
    settings = VLLMSettings(model_path=str(tmp_path / "base"), command=command, max_lora_rank=8, dtype="bfloat16",
                            max_model_len=2048, gpu_memory_utilization=0.2)
    eng = VLLMEngine(settings, tok, tmp_path / "v")
    try:
        eng.sync(0, lambda p: peft_model.save_pretrained(str(p)))
        msgs = [Message(role="user", content="Please ping alpha.")]
        r = eng.client.chat([ChatRequest(messages=msgs, temperature=0.0, max_new_tokens=8, return_tokens=True)])
        ids = r[0].prompt_token_ids + r[0].completion_token_ids
        with torch.no_grad():
            lp = torch.log_softmax(peft_model(input_ids=torch.tensor([ids])).logits.float(), -1)[0]
        n = len(r[0].prompt_token_ids)
        ref = lp[n - 1 : -1].gather(1, torch.tensor(r[0].completion_token_ids)[:, None]).squeeze(1)
        assert torch.allclose(ref, torch.tensor(r[0].completion_logprobs), atol=BF16_TOL)
    finally:
        eng.close()
