"""Rung a of the micro ladder (issue 42): does each capability's GRPO adapter beat Base on held-out instances of
its own environment?

For every adapter of a finished run's ``train`` stage, the base policy and the base with that adapter are rolled
out greedily on the same ``--n`` held-out instances of the capability's own library environment (seeds from
10,000,000, disjoint from GRPO's training seeds and the validation seeds): each arm is the cached rollout
(:func:`tracekit.runs.cached_rollout`, the run's cache) the evaluate stage makes of a target of that one
environment, so a second call, or another rung over the same adapter, rolls nothing out again. The two arms are
compared paired (:func:`tracekit.paired.paired_summary`: the difference, its task-cluster bootstrap 95% CI, fixed /
broken, exact McNemar p). The target's own evaluation has 30 instances per environment; this rung needs the n its
discordance asks for.

    python -m tracekit.planted.rung_a --run outputs/micro/run --n 200 --out benchmarks/results/micro/rung_a_seed0
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, StageCache, atomic_write_json, atomic_write_text, read_json
from tracekit.paired import paired_summary
from tracekit.pipeline import RunRecord
from tracekit.warmstart.planted import PlantedSpec
from tracekit.policy import Policy
from tracekit.runs import adapters_of, read_trajectories_dir, tool_rollout
from tracekit.targets.registry import target_of

log = logging.getLogger(__name__)


def train_artifact(run_dir: Path) -> Artifact:
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


def held_out_config(cfg: DictConfig, env: str, n: int, device: str | None = None) -> DictConfig:
    """The run's config evaluating ``n`` held-out instances of ``env`` alone, greedily: the rollout the evaluate
    stage would make of a target holding that one environment (its cache entry, its seeds from 10,000,000).
    ``device``: the backbone's (None: the run's own, so that its rollouts' keys are the run's)."""
    out = OmegaConf.merge(cfg, {"eval": {"temperature": 0.0}, "benchmark": {"limit": n},
                                **({"backbone": {"device": device}} if device else {})})
    target_of(out).own(out.benchmark).envs = [env]
    return out


def rung_a(run_dir: Path, out: Path, n: int = 200, device: str | None = None) -> dict[str, Any]:
    """{capability: paired summary of (base, base + adapter) on ``n`` held-out instances of its environment}; each
    arm's rollout is a cached ``episodes`` entry of the run's cache (``out/artifacts.json`` records which)."""
    train = train_artifact(run_dir)
    cache = StageCache(train.path.parents[1])  # the cache the run trained in: its rollouts are shared
    cfg = OmegaConf.load(run_dir / "config.yaml")
    record = RunRecord(out)  # out/artifacts.json: every rollout the rung read or made
    envs = PlantedSpec.from_config(cfg.backbone.planted).envs()  # the family a config leaves out: its default
    result: dict[str, Any] = {}
    for cap, art in sorted(adapters_of(train).items()):
        held_out = held_out_config(cfg, envs[cap], n, device)
        arms = {"base": Policy(), "adapter": Policy("adapter", art, "adapter")}
        episodes = {arm: tool_rollout(held_out, policy, cache, record) for arm, policy in arms.items()}
        s = paired_summary(*(read_trajectories_dir(episodes[arm]) for arm in arms))
        result[cap] = {"env": envs[cap], "adapter": f"{art.stage}/{art.key}",  # cache keys, not this machine's paths
                       "episodes": {arm: f"{e.stage}/{e.key}" for arm, e in episodes.items()}, **s}
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
    p.add_argument("--device", default=None, help="the backbone's device (default: the run's backbone.device)")
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
