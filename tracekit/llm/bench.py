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


class _Timer:
    """Wall and process-CPU seconds of a block (CPU time is what an idle machine would need with
    one thread; wall time on a shared machine includes waiting for the CPU)."""

    def __enter__(self) -> _Timer:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu

    def __str__(self) -> str:
        return f"{self.wall:.1f} s wall, {self.cpu:.1f} s CPU"


def _throughput(client: HFChatClient, requests: list[ChatRequest], batch: int) -> str:
    client.max_batch_size = batch
    with _Timer() as t:
        out = client.chat(requests)
    tokens = sum(r.usage["completion_tokens"] for r in out)
    return f"{tokens / t.wall:.1f} tokens/s wall, {tokens / t.cpu:.1f} tokens/CPU-s ({tokens} tokens; {t})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh-export", action="store_true")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows: list[tuple[str, str]] = [("torch threads", str(torch.get_num_threads())), ("load average (1/5/15 min)", load)]

    import transformers  # noqa: F401  (imported before timing, so load time is the load alone)

    if args.fresh_export:
        with tempfile.TemporaryDirectory() as tmp, _Timer() as t:
            export_smollm2(tmp)
        rows.append(("SmolLM2 GGUF export (dequantize + save)", str(t)))
    with _Timer() as t:
        model, tok = load_backbone("smollm2_135m")
    rows.append(("SmolLM2 load from the exported folder", str(t)))

    client = HFChatClient(model, tok, chat_format="smollm2")
    prompts = [f"Write a short note about topic number {i}: " + "please be detailed. " * (i % 3) for i in range(args.batch)]
    requests = [
        ChatRequest(messages=[Message(role="user", content=p)], temperature=1.0, seed=i, max_new_tokens=args.new_tokens)
        for i, p in enumerate(prompts)
    ]
    _throughput(client, requests[:1], 1)  # warm-up
    for batch in (1, args.batch):
        rows.append((f"generation, batch {batch} ({len(requests)} requests)", _throughput(client, requests, batch)))

    for domain in ("airline", "retail"):
        messages, tools = tau2_agent_prompt(domain)
        n = client.count_tokens(messages, tools)
        with _Timer() as t:
            client.chat([ChatRequest(messages=messages, tools=tools, max_new_tokens=1)])
        rows.append((f"tau2 {domain} first agent prompt ({len(tools)} tools)", f"{n} tokens; prefill {t}"))

    print("| measure | value |\n|---|---|")
    for k, v in rows:
        print(f"| {k} | {v} |")


if __name__ == "__main__":
    main()
