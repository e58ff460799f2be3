"""Is a micro task kind learnable at this model size? GRPO on the kind itself (issue 53's "learnable" check).

From the committed warm start (``tests/assets/micro_warmstart/``, the bfloat16 copy of ``experiment=micro``'s seed-0
warm start, loaded in float32), one LoRA adapter is trained with GRPO on the kind's training instances (seeds from
100,000: ``--iterations`` x 8 groups x 8 samples, the micro preset's recipe: lr 1e-3, T=1, LoRA r 8 / alpha 16, at
most 8 turns of <= 48 tokens), and the base and the adapter are scored greedily on ``--held-out`` held-out instances
(seeds from 10,000,000). The check passes when the adapter reaches ``--bar`` (0.5).

    python benchmarks/micro_kind_grpo.py --kind micro_combo_refuse_locked__report_value --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "assets" / "micro_warmstart"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", required=True, help="a micro task kind (KINDS) or library environment")
    ap.add_argument("--iterations", type=int, default=160, help="GRPO iterations (160: TRACE's 10,240 episodes)")
    ap.add_argument("--held-out", type=int, default=30)
    ap.add_argument("--bar", type=float, default=0.5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path, required=True, help="a folder for the GRPO run")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    from tracekit.synthesis.library import LIBRARY_NAMES
    from tracekit.targets.micro.library import KINDS

    if a.kind not in KINDS and a.kind not in LIBRARY_NAMES:
        print(f"--kind {a.kind!r} is not a micro kind ({', '.join(KINDS)}) or library environment", file=sys.stderr)
        return 2
    if a.iterations < 1 or a.held_out < 1:
        print(f"--iterations and --held-out must be >= 1, got {a.iterations}, {a.held_out}", file=sys.stderr)
        return 2
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracekit.agents import LLMAgent
    from tracekit.llm.hf import HFChatClient
    from tracekit.llm.templates import TEMPLATES
    from tracekit.rl.settings import GRPOSettings, LoraSettings
    from tracekit.rl.trainer import GRPOTrainer
    from tracekit.rollout import run_rollouts
    from tracekit.runs import TRAIN_SEED_OFFSET
    from tracekit.targets.synthetic.suite import LibraryTargetSuite

    tokenizer = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    tokenizer.chat_template = TEMPLATES["qwen3"]

    def model() -> torch.nn.Module:
        return AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()

    def success(m: torch.nn.Module, folder: str) -> float:
        suite = LibraryTargetSuite("held-out", [a.kind], n_per_env=a.held_out, extra_envs=KINDS)
        try:
            summary = run_rollouts(suite, LLMAgent(HFChatClient(m.to(a.device), tokenizer, max_batch_size=64, seed=0),
                                                   max_new_tokens=48), a.out / folder, max_steps=8,
                                   context_budget=512, batch_size=64, progress=False)
        finally:
            suite.close()
        return summary.success_rate

    t0 = time.time()
    torch.manual_seed(0)
    before = success(model(), "before")
    settings = GRPOSettings(iterations=a.iterations, groups=8, group_size=8, lr=1e-3, max_new_tokens=48, max_steps=8,
                            max_prompt_tokens=512, num_minibatches=1, lora=LoraSettings(rank=8, alpha=16), seed=0,
                            rollout_batch_size=64, checkpoint_every=10**9, gradient_checkpointing=False)  # micro's
    train = LibraryTargetSuite("train", [a.kind], n_per_env=8 * a.iterations, seed_offset=TRAIN_SEED_OFFSET,
                               extra_envs=KINDS)
    try:
        adapter = GRPOTrainer(model(), tokenizer, train, settings, a.out / "grpo", device=a.device).train()
    finally:
        train.close()
    after = success(PeftModel.from_pretrained(model(), str(adapter)).eval(), "after")
    curve = [float(line.split(",")[1]) for line in (a.out / "grpo" / "metrics.csv").read_text().splitlines()[1:]]
    out = {"kind": a.kind, "iterations": a.iterations, "episodes": 64 * a.iterations, "held_out": a.held_out,
           "base": before, "grpo": after, "learnable": after >= a.bar, "bar": a.bar, "device": a.device,
           "train_reward_first_last_10": [curve[:10], curve[-10:]], "seconds": round(time.time() - t0, 1)}
    print(json.dumps(out), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
