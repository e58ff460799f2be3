"""Measure the bundled backbone on this machine: export and load time, batched vs unbatched
generation throughput, and tau^2 prompt lengths.

    python -m tracekit.llm.bench [--fresh-export] [--new-tokens 32] [--batch 8] [--threads N]

``--fresh-export`` exports the GGUF into a temporary cache (the real one is left alone) to time the
one-time dequantization. Prints one Markdown table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from tracekit.llm.backbones import export_smollm2, load_backbone
from tracekit.llm.base import ChatRequest
from tracekit.llm.hf import HFChatClient
from tracekit.types import Message


def tau2_agent_prompt(domain: str) -> tuple[list[Message], list[dict[str, Any]]]:
    """The first agent turn of a tau^2 domain: tau^2's own system prompt (instructions + policy) and
    a user greeting, plus the domain's tool schemas in OpenAI format."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm
    from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
    from tau2.registry import registry

    env = registry.get_env_constructor(domain)()
    system = SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=env.get_policy())
    tools = [t.openai_schema for t in env.get_tools()]
    return [Message(role="system", content=system), Message(role="user", content="Hi, I need help with my booking.")], tools


def _throughput(client: HFChatClient, requests: list[ChatRequest], batch: int) -> tuple[float, int, float]:
    client.max_batch_size = batch
    t0 = time.perf_counter()
    out = client.chat(requests)
    seconds = time.perf_counter() - t0
    tokens = sum(r.usage["completion_tokens"] for r in out)
    return tokens / seconds, tokens, seconds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh-export", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[tuple[str, str]] = [("torch threads", str(torch.get_num_threads())), ("load average", str(os.getloadavg()))]

    if args.fresh_export:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            export_smollm2(tmp)
            rows.append(("SmolLM2 GGUF export (dequantize + save)", f"{time.perf_counter() - t0:.1f} s"))
    t0 = time.perf_counter()
    model, tok = load_backbone("smollm2_135m")
    rows.append(("SmolLM2 load from the exported folder", f"{time.perf_counter() - t0:.2f} s"))

    client = HFChatClient(model, tok, chat_format="smollm2")
    prompts = [f"Write a short note about topic number {i}: " + "please be detailed. " * (i % 3) for i in range(args.batch)]
    requests = [
        ChatRequest(messages=[Message(role="user", content=p)], temperature=1.0, seed=i, max_new_tokens=args.new_tokens)
        for i, p in enumerate(prompts)
    ]
    _throughput(client, requests[:1], 1)  # warm-up
    for batch in (1, args.batch):
        tps, tokens, seconds = _throughput(client, requests, batch)
        rows.append((f"generation, batch {batch} ({len(requests)} requests)", f"{tps:.1f} tokens/s ({tokens} tokens, {seconds:.1f} s)"))

    for domain in ("airline", "retail"):
        messages, tools = tau2_agent_prompt(domain)
        n = client.count_tokens(messages, tools)
        t0 = time.perf_counter()
        client.chat([ChatRequest(messages=messages, tools=tools, max_new_tokens=1)])
        rows.append((f"tau2 {domain} first agent prompt ({len(tools)} tools)", f"{n} tokens; prefill {time.perf_counter() - t0:.1f} s"))

    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
