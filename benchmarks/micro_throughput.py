"""The micro backbone's speed on this machine (issue 42): rollouts and training, each against plain transformers.

Two sections, each the median of ``--repeats`` interleaved repeats (ABAB...) with its min-max:

- ``rollout``: ``--tasks`` held-out micro episodes (every task kind of ``benchmark=micro``, greedy, the agent's
  decoding: at most 8 turns of <= 48 new tokens) through tracekit's rollout engine (``HFChatClient``: batched,
  grammar-constrained, KV reuse across turns): episodes/s and generated tokens/s; against it, plain transformers
  ``generate`` (greedy, batched, left-padded, no grammar) on the same episodes' first-turn prompts, 48 new
  tokens each: generated tokens/s. ``ratio`` = tracekit's generated tokens/s over plain generate's.
- ``training``: ``--rows`` warm-start demonstration rows, one epoch of tracekit's SFT recipe
  (``tracekit.rl.sft.train_sft``, full parameters, length-bucketed microbatches, the masked CE) against a plain
  PyTorch loop (AdamW, batch 16 right-padded, ``model(input_ids, labels)``): tokens/s (every forward token).

The model is the ``experiment=micro`` warm start (built once, cached), so the numbers are the ladder's.

    python benchmarks/micro_throughput.py --json benchmarks/results/micro/throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "repeats": xs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=8, help="held-out instances per task kind (9 kinds)")
    ap.add_argument("--rows", type=int, default=256, help="demonstration rows of the training section")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)

    import dataclasses

    import torch
    from transformers import AutoModelForCausalLM

    from tracekit.agents import LLMAgent
    from tracekit.cli import compose_config
    from tracekit.llm.backbones import get_spec, load_backbone
    from tracekit.llm.hf import HFChatClient
    from tracekit.llm.tools import render_prompt
    from tracekit.warmstart.planted import PlantedSpec, demonstrations, planted_dir
    from tracekit.rl.settings import LoraSettings
    from tracekit.rl.sft import SFTSettings, train_sft
    from tracekit.rollout import read_trajectories, run_rollouts
    from tracekit.targets.micro.library import COMBOS
    from tracekit.targets.synthetic.suite import LibraryTargetSuite
    from tracekit.wiring import backbone_dict

    torch.manual_seed(0)
    cfg = compose_config(["experiment=micro", f"benchmark.limit={a.tasks}"])
    spec = get_spec(backbone_dict(cfg))
    model, tokenizer = load_backbone(spec, "cpu", None, None)
    folder = planted_dir(spec, "cpu") / "model"
    suite = LibraryTargetSuite("bench", list(cfg.benchmark.micro.envs), n_per_env=a.tasks, extra_envs=COMBOS)
    tasks = suite.tasks()
    prompts = []
    for t in tasks:
        obs = suite.episode(t, 0).reset()
        prompts.append(render_prompt(tokenizer, list(obs.messages), list(obs.tools or []), add_generation_prompt=True))
    out: dict = {"machine": f"{torch.get_num_threads()} torch threads, CPU", "torch": torch.__version__,
                 "episodes": len(tasks), "rollout": {}, "training": {}}

    ours_eps, ours_tps, plain_tps = [], [], []
    for r in range(a.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            client = HFChatClient(model, tokenizer, chat_format=spec.chat_format, max_batch_size=256, seed=0)
            t0 = time.perf_counter()
            agent = LLMAgent(client, max_new_tokens=int(cfg.agent.max_new_tokens), return_tokens=True)
            run_rollouts(suite, agent, tmp, samples=1, seed=0, max_steps=int(cfg.eval.max_steps),
                         context_budget=int(cfg.eval.context_budget), batch_size=256, progress=False)
            dt = time.perf_counter() - t0
            # every policy-sampled token (the agent records its exact tokens: TokenRecord.loss_mask)
            gen = sum(sum(tr.tokens.loss_mask) for tr in read_trajectories(tmp) if tr.tokens is not None)
        ours_eps.append(len(tasks) / dt)
        ours_tps.append(gen / dt)
        tokenizer.padding_side = "left"
        batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            res = model.generate(**batch, max_new_tokens=48, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        dt = time.perf_counter() - t0
        plain_tps.append((res.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / dt)
        print(f"repeat {r}: tracekit {ours_eps[-1]:.1f} episodes/s, {ours_tps[-1]:.0f} gen tok/s; "
              f"plain generate {plain_tps[-1]:.0f} gen tok/s", flush=True)
    out["rollout"] = {"tracekit_episodes_per_s": _median(ours_eps), "tracekit_gen_tokens_per_s": _median(ours_tps),
                      "plain_generate_gen_tokens_per_s": _median(plain_tps),
                      "ratio_tracekit_over_plain": _median([o / p for o, p in zip(ours_tps, plain_tps)])}

    planted = PlantedSpec.from_config(spec.planted)
    rows, _, _ = demonstrations(dataclasses.replace(planted, demos_strong=a.rows // 3, demos_weak=0,
                                                    weak_correct=1.0), tokenizer)
    rows = rows[: a.rows]
    tokens = sum(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    ours, plain = [], []
    for r in range(a.repeats):
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        settings = SFTSettings(lr=1e-4, epochs=1, batch_size=16, dtype="float32", seed=0, full_parameters=True,
                               lora=LoraSettings(rank=8, alpha=16), checkpoint_every=10**9)
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            train_sft(m, pad, rows, settings, tmp, device="cpu")
            ours.append(tokens / (time.perf_counter() - t0))
        m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        t0 = time.perf_counter()
        for s in range(0, len(rows), 16):
            chunk = rows[s:s + 16]
            L = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), L), pad)
            labels = torch.full((len(chunk), L), -100)
            attn = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, (x, mask) in enumerate(chunk):
                ids[i, :len(x)] = torch.tensor(x)
                attn[i, :len(x)] = 1
                labels[i, :len(x)] = torch.tensor([t if k else -100 for t, k in zip(x, mask)])
            loss = m(input_ids=ids, attention_mask=attn, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
        plain.append(tokens / (time.perf_counter() - t0))
        print(f"repeat {r}: tracekit SFT {ours[-1]:.0f} tok/s; plain loop {plain[-1]:.0f} tok/s", flush=True)
    out["training"] = {"rows": len(rows), "tokens": tokens, "tracekit_sft_tokens_per_s": _median(ours),
                       "plain_loop_tokens_per_s": _median(plain),
                       "ratio_tracekit_over_plain": _median([o / p for o, p in zip(ours, plain)])}
    print(json.dumps({k: v for k, v in out.items()}, indent=1, default=str)[:3000])
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
