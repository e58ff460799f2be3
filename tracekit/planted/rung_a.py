"""Rung a of the micro ladder (issue 42): does each capability's GRPO adapter beat Base on held-out instances of
its own environment?

For every adapter of a finished run's ``train`` stage, the base policy and the base with that adapter are rolled
out greedily on the same ``--n`` held-out instances of the capability's own library environment (seeds from
10,000,000, disjoint from GRPO's training seeds and the validation seeds), and compared paired
(:func:`tracekit.paired.paired_summary`: the difference, its task-cluster bootstrap 95% CI, fixed / broken, exact
McNemar p). The target's own evaluation has 30 instances per environment; this rung needs the n its discordance
asks for.

    python -m tracekit.planted.rung_a --run outputs/micro/run --n 200 --out benchmarks/results/micro/rung_a_seed0
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from tracekit.agents import LLMAgent
from tracekit.artifacts import Artifact, StageCache, atomic_write_json, atomic_write_text, read_json
from tracekit.llm.backbones import get_spec, load_backbone
from tracekit.llm.hf import HFChatClient
from tracekit.paired import paired_summary
from tracekit.planted.warmstart import library_capabilities
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.runs import adapters_of
from tracekit.synthesis.library_target import LibraryTargetSuite
from tracekit.wiring import backbone_dict

log = logging.getLogger(__name__)


def _train_artifact(run_dir: Path) -> Artifact:
    """The run's ``train`` artifact, verified."""
    arts = read_json(run_dir / "artifacts.json")
    train = [a for a in arts.values() if a["stage"] == "train"]
    if not train:
        raise ValueError(f"{run_dir}: the run has no train stage (run `python -m tracekit experiment=micro` first)")
    path = Path(train[-1]["path"])
    found = StageCache(path.parents[1]).lookup("train", path.name)
    if found is None:
        raise ValueError(f"{run_dir}: its train artifact {path} is missing or incomplete")
    return found


def rung_a(run_dir: Path, out: Path, n: int = 200, device: str = "cpu") -> dict[str, Any]:
    """{capability: paired summary of (base, base + adapter) on ``n`` held-out instances of its environment}."""
    from omegaconf import OmegaConf
    from peft import PeftModel

    train = _train_artifact(run_dir)
    cfg = OmegaConf.load(run_dir / "config.yaml")
    spec = get_spec(backbone_dict(cfg))
    envs = library_capabilities(spec.planted["family"])
    max_steps, max_new = int(cfg.eval.max_steps), int(cfg.agent.max_new_tokens)
    budget = int(cfg.eval.context_budget)
    result: dict[str, Any] = {}
    for cap, art in sorted(adapters_of(train).items()):
        env = envs[cap]
        trajs = {}
        for arm in ("base", "adapter"):
            model, tokenizer = load_backbone(spec, device, None, None)
            if arm == "adapter":
                model = PeftModel.from_pretrained(model, str(art.path / "adapter")).eval()
            client = HFChatClient(model, tokenizer, chat_format=spec.chat_format, max_batch_size=256, seed=0)
            suite = LibraryTargetSuite("rung-a", [env], n_per_env=n)
            try:
                run_rollouts(suite, LLMAgent(client, max_new_tokens=max_new), out / cap / arm, samples=1, seed=0,
                             max_steps=max_steps, context_budget=budget, batch_size=256, progress=False)
            finally:
                suite.close()
            trajs[arm] = read_trajectories(out / cap / arm)
        s = paired_summary(trajs["base"], trajs["adapter"])
        result[cap] = {"env": env, "adapter": f"{art.stage}/{art.key}", **s}  # its cache key, not this machine's path
        log.info("rung a %s: base %.3f -> adapter %.3f, %+.1f points [%+.1f, %+.1f], fixed %d / broken %d",
                 cap, s["mean_a"], s["mean_b"], 100 * s["diff"], 100 * s["ci"][0], 100 * s["ci"][1], s["fixed"],
                 s["broken"])
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = ["| capability | environment | held-out n | Base (%) | adapter (%) | paired diff (points) | 95% CI | "
             "fixed / broken | McNemar p | excludes 0 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cap, s in result.items():
        lines.append(f"| {cap} | {s['env']} | {s['n_episodes']} | {100 * s['mean_a']:.1f} | {100 * s['mean_b']:.1f} | "
                     f"{100 * s['diff']:+.1f} | {100 * s['ci'][0]:+.1f} to {100 * s['ci'][1]:+.1f} | "
                     f"{s['fixed']} / {s['broken']} | {s['mcnemar_p']:.3g} | {'yes' if s['excludes_zero'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracekit.planted.rung_a", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="a finished run directory (its artifacts.json)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n", type=int, default=200, help="held-out instances per environment")
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    if a.n < 1:
        print(f"tracekit.planted.rung_a: error: --n must be >= 1, got {a.n}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    try:
        result = rung_a(a.run, a.out, a.n, a.device)
    except (ValueError, FileNotFoundError) as e:
        print(f"tracekit.planted.rung_a: error: {e}", file=sys.stderr)
        return 2
    atomic_write_json(a.out / "rung_a.json", result)
    atomic_write_text(a.out / "rung_a.md", markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
