"""A local stand-in for ``vllm serve --enable-lora``: the API subset tracekit's server rollout path uses.

    python tests/vllm_standin.py --model DIR --host 127.0.0.1 --port 8000

``DIR`` is an HF folder (a tiny model on CPU). Endpoints, shaped like vLLM's:

- ``GET /health``, ``GET /version`` (``--version``, default the release the client supports), ``GET /v1/models``
  (the base first, adapters naming it as ``parent``);
- ``POST /v1/load_lora_adapter`` ``{lora_name, lora_path}``: a peft adapter directory, loaded at
  runtime (400 for a name already loaded, like vLLM); ``POST /v1/unload_lora_adapter`` ``{lora_name}``;
- ``POST /v1/completions`` with ``prompt`` as token ids, ``model`` = a loaded adapter's name (404 with
  vLLM's error body otherwise) or the base; ``max_tokens``, ``temperature``, ``top_p``, ``seed``,
  ``stop_token_ids`` (the stop token kept, as ``include_stop_str_in_output``), ``logprobs`` (the
  sampled token's log-prob under the tempered distribution), ``return_tokens_as_token_ids``
  (``"token_id:<id>"`` tokens), ``return_token_ids`` (``prompt_token_ids`` and ``token_ids``).

It uses transformers only (not tracekit's samplers, not peft: an adapter is read from its
safetensors and merged, ``W + alpha/r * B A``, into a copy of the base, as a server's LoRA kernels
would apply it), so the client is tested against an independent implementation, and a start costs
one transformers import. State lives in the process: a restart forgets every loaded adapter.
``--log FILE`` appends one JSON line per request (endpoint and body) for the tests to inspect.
``--no-lora`` answers an adapter load as vLLM 0.26 started without ``--enable-lora`` does (500, "LoRA is not
enabled"); ``--no-runtime-lora`` as one without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (the route absent: 404).
``GET /metrics`` answers with one gauge per engine as vLLM's Prometheus logger labels them (``engine="0"``, ...);
``--metrics-engines N`` names N engines, as a data-parallel server of N replicas does.
"""

from __future__ import annotations

import argparse
import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def merged(base: torch.nn.Module, path: str) -> torch.nn.Module:
    """A copy of ``base`` with the peft LoRA adapter at ``path`` merged in (plain LoRA on Linear layers only)."""
    import math
    import re
    from pathlib import Path

    from safetensors.torch import load_file

    cfg = json.loads((Path(path) / "adapter_config.json").read_text())
    if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise ValueError("the stand-in merges plain LoRA adapters only")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in load_file(str(Path(path) / "adapter_model.safetensors")).items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", key)
        if m is None:
            raise ValueError(f"unsupported adapter tensor {key}")
        parts.setdefault(m[1], {})[m[2]] = t
    model = copy.deepcopy(base)
    with torch.no_grad():
        for module, ab in parts.items():
            lin = model.get_submodule(module)
            lin.weight += scale * (ab["B"].float() @ ab["A"].float()).to(lin.weight.dtype)
    return model.eval()


class Server:
    def __init__(self, model_dir: str, log_path: str | None, lora: bool = True):
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.name = model_dir
        self.adapters: dict[str, torch.nn.Module] = {}
        self.lock = threading.Lock()
        self.log_path = log_path
        self.lora = lora

    def record(self, path: str, body: dict) -> None:
        if self.log_path:
            with self.lock, open(self.log_path, "a") as f:
                f.write(json.dumps({"path": path, "body": body}) + "\n")

    def load(self, body: dict) -> tuple[int, dict | str]:
        name, path = body["lora_name"], body["lora_path"]
        if not self.lora:  # vLLM's worker raises and the route answers 500 with its message
            return 500, {"error": {"message": "LoRA is not enabled. Use --enable-lora to enable LoRA.", "type": "InternalServerError", "code": 500}}
        with self.lock:
            if name in self.adapters:
                return 400, {"error": {"message": f"The lora adapter '{name}' has already been loaded.", "type": "InvalidUserInput", "code": 400}}
            self.adapters[name] = merged(self.base, path)
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: dict) -> tuple[int, dict | str]:
        with self.lock:
            if self.adapters.pop(body["lora_name"], None) is None:
                return 404, {"error": {"message": f"The lora adapter '{body['lora_name']}' cannot be found.", "type": "NotFoundError", "code": 404}}
        return 200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully."

    @torch.no_grad()
    def complete(self, body: dict) -> tuple[int, dict]:
        name = body["model"]
        model = self.base if name == self.name else self.adapters.get(name)
        if model is None:
            return 404, {"error": {"message": f"The model `{name}` does not exist.", "type": "NotFoundError", "code": 404}}
        prompt = list(body["prompt"])
        temp, top_p = float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0))
        stops = set(body.get("stop_token_ids") or [])
        gen = torch.Generator().manual_seed(int(body.get("seed") or 0))
        ids, lps, finish = [], [], "length"
        with self.lock:
            for _ in range(int(body.get("max_tokens", 16))):
                logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, -1].float()
                if temp > 0:
                    logp = torch.log_softmax(logits / temp, -1)
                    p = logp.exp()
                    if top_p < 1.0:
                        sp, idx = p.sort(descending=True)
                        keep = sp.cumsum(0) - sp < top_p
                        p = torch.zeros_like(p).scatter_(0, idx[keep], sp[keep])
                    tok = int(torch.multinomial(p, 1, generator=gen))
                else:
                    logp = torch.log_softmax(logits, -1)
                    tok = int(logits.argmax())
                ids.append(tok)
                lps.append(float(logp[tok]))
                if tok in stops:
                    finish = "stop"
                    break
        as_ids = body.get("return_tokens_as_token_ids", False)
        choice = {
            "index": 0, "text": "", "finish_reason": finish, "stop_reason": ids[-1] if finish == "stop" else None,
            "logprobs": {"tokens": [f"token_id:{t}" if as_ids else str(t) for t in ids], "token_logprobs": lps,
                         "top_logprobs": None, "text_offset": list(range(len(ids)))} if body.get("logprobs") is not None else None,
        }  # fmt: skip
        if body.get("return_token_ids"):
            choice["prompt_token_ids"], choice["token_ids"] = prompt, ids
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)}
        return 200, {"id": "cmpl-standin", "object": "text_completion", "model": name, "choices": [choice], "usage": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--version", default="0.26.0")
    ap.add_argument("--no-lora", action="store_true")
    ap.add_argument("--no-runtime-lora", action="store_true")
    ap.add_argument("--metrics-engines", type=int, default=1)
    args, _ = ap.parse_known_args()  # vLLM's other flags are accepted and ignored
    srv = Server(args.model, args.log, lora=not args.no_lora)
    lora_routes = () if args.no_runtime_lora else ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, out) -> None:
            data = (json.dumps(out) if not isinstance(out, str) else out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json" if not isinstance(out, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if self.path == "/health":
                self._send(200, "")
            elif self.path == "/version":
                self._send(200, {"version": args.version})
            elif self.path == "/metrics":
                self._send(200, "".join(f'vllm:num_requests_running{{engine="{i}",model_name="{srv.name}"}} 0.0\n'
                                        for i in range(args.metrics_engines)))
            elif self.path == "/v1/models":
                data = [{"id": srv.name, "object": "model", "root": srv.name, "parent": None}]
                data += [{"id": n, "object": "model", "root": n, "parent": srv.name} for n in srv.adapters]
                self._send(200, {"object": "list", "data": data})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            srv.record(self.path, body)
            handler = {"/v1/load_lora_adapter": srv.load, "/v1/unload_lora_adapter": srv.unload, "/v1/completions": srv.complete}.get(self.path)
            if handler is None or (self.path not in lora_routes and self.path != "/v1/completions"):
                self._send(404, {"detail": "Not Found"})  # FastAPI's answer for a route not registered
                return
            try:
                self._send(*handler(body))
            except Exception as e:  # noqa: BLE001 - a stand-in answers 500 like a server would
                self._send(500, {"error": {"message": f"{type(e).__name__}: {e}"}})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
