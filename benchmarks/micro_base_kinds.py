"""The micro base agent's greedy success per task kind (issue 53's "sparse" check), from the committed warm start.

Loads ``tests/assets/micro_warmstart/`` (the bfloat16 copy of ``experiment=micro``'s seed-0 warm start, checked
against its recorded planted key and sha256) in float32 and rolls it out as evaluation does (greedy, at most 8
turns of <= 48 new tokens, context 512) on ``--per-kind`` held-out instances (seeds from 10,000,000) of every kind of
each named benchmark config. No cache is built: it is the cheap stand-in for
``python -m tracekit experiment=micro eval.benchmark=<b> eval.methods=[base]`` when the float32 warm start is not
cached (the bfloat16 rounding may move a task or two; on ``micro`` it gives the committed seed-0 Base, 42.2%).

    python benchmarks/micro_base_kinds.py --json benchmarks/results/micro/issue53_base_kinds.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURE = ROOT / "tests" / "assets" / "micro_warmstart"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--benchmarks", nargs="+", default=["micro", "micro_hard"], help="conf/benchmark/<name>.yaml")
    ap.add_argument("--per-kind", type=int, default=30, help="held-out instances of each kind")
    ap.add_argument("--json", type=Path, default=None, help="write the numbers here")
    a = ap.parse_args(argv)
    if a.per_kind < 1:
        print(f"--per-kind must be >= 1, got {a.per_kind}", file=sys.stderr)
        return 2
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracekit.agents import LLMAgent
    from tracekit.artifacts import file_sha256
    from tracekit.llm.hf import HFChatClient
    from tracekit.llm.templates import TEMPLATES
    from tracekit.rollout import read_trajectories, run_rollouts
    from tracekit.targets.micro.library import KINDS
    from tracekit.targets.synthetic.suite import LibraryTargetSuite

    ident = json.loads((FIXTURE / "identity.json").read_text())
    if file_sha256(FIXTURE / "model.safetensors") != ident["weights_sha256"]:
        print(f"{FIXTURE}/model.safetensors differs from its recorded sha256", file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    tokenizer.chat_template = TEMPLATES["qwen3"]
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    out: dict = {"warm_start": {"fixture": str(FIXTURE.relative_to(ROOT)), **ident}, "per_kind_instances": a.per_kind}
    with tempfile.TemporaryDirectory() as tmp:
        for bench in a.benchmarks:
            envs = list(OmegaConf.load(ROOT / "conf" / "benchmark" / f"{bench}.yaml").micro.envs)
            t0 = time.time()
            suite = LibraryTargetSuite(bench, envs, n_per_env=a.per_kind, extra_envs=KINDS)
            try:
                agent = LLMAgent(HFChatClient(model, tokenizer, max_batch_size=64, seed=0), max_new_tokens=48)
                run_rollouts(suite, agent, Path(tmp) / bench, max_steps=8, context_budget=512, batch_size=64,
                             progress=False)
            finally:
                suite.close()
            per: dict[str, list[bool]] = defaultdict(list)
            for traj in read_trajectories(Path(tmp) / bench):
                per[traj.env].append(traj.success)
            n = sum(len(v) for v in per.values())
            out[bench] = {"per_kind": {e: round(100 * sum(per[e]) / len(per[e]), 1) for e in envs},
                          "overall": round(100 * sum(sum(v) for v in per.values()) / n, 1), "tasks": n,
                          "seconds": round(time.time() - t0, 1)}
            print(bench, json.dumps(out[bench], indent=1), flush=True)
    if a.json is not None:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
