"""Evaluation rollouts with and without prompt-prefix reuse (``agent.prefix_cache_mib``), in one run.

The same rollout (a composed config: by default the default experiment's evaluation, 6 episodes of 2 agent
turns on the bundled model) is run ``--repeats`` times per arm, the arms interleaved so machine noise hits
both alike. Prints per arm the wall time, the prompt tokens and the tokens actually prefilled, the ratio
(off / on), and whether both arms produced the same episodes (messages and rewards); exits 1 if not.

    python benchmarks/prefix_cache.py                                  # the default experiment's evaluation
    python benchmarks/prefix_cache.py eval=stochastic                  # 3 sampled episodes per task (Table 6)
    python benchmarks/prefix_cache.py --json benchmarks/results/prefix_cache_embedded.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracekit.cli import compose_config  # noqa: E402


def rollout_once(cfg, prefix_cache_mib: float, out: Path) -> dict[str, Any]:
    """One rollout of the configured benchmark with the base agent; -> seconds, token counts, episodes."""
    from omegaconf import open_dict

    from tracekit.rollout import read_trajectories, run_rollouts
    from tracekit.wiring import build_agent, build_suite

    with open_dict(cfg):
        cfg.agent.prefix_cache_mib = prefix_cache_mib
    suite, agent = build_suite(cfg), build_agent(cfg)
    greedy = cfg.eval.temperature == 0
    t0 = time.perf_counter()
    summary = run_rollouts(suite, agent, out, samples=1 if greedy else len(cfg.eval.seeds),
                           seed=cfg.eval.seeds[0] if greedy else cfg.seed, max_steps=cfg.eval.max_steps,
                           context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size, progress=False)
    seconds = time.perf_counter() - t0
    episodes = {(t.task_id, t.sample): ([m.model_dump(mode="json") for m in t.messages], t.reward)
                for t in read_trajectories(out)}
    return {"seconds": seconds, **summary.prefix_cache, "episodes": episodes}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the composed config (experiment=embedded first)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mib", type=float, default=1024, help="prefix_cache_mib of the 'on' arm")
    ap.add_argument("--json", type=Path, default=None, help="write the measurements here")
    args = ap.parse_args()
    if args.repeats < 1 or args.mib <= 0:
        ap.error("--repeats must be >= 1 and --mib > 0")
    cfg = compose_config(["experiment=embedded", *args.overrides])
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for arm, mib in (("off", 0), ("on", args.mib)):
                runs[arm].append(rollout_once(cfg, mib, Path(tmp) / f"{arm}{i}"))
                r = runs[arm][-1]
                print(f"repeat {i} {arm:>3}: {r['seconds']:7.1f} s", flush=True)
    best = {arm: min(r["seconds"] for r in rs) for arm, rs in runs.items()}
    on = runs["on"][0]
    same = sum(runs["off"][0]["episodes"].get(k) == v for k, v in on["episodes"].items())
    n = len(on["episodes"])
    print(f"\n{'arm':>4} {'best s':>8} {'all s':>24} {'prompt tokens':>14} {'prefilled':>10}")
    for arm, rs in runs.items():
        tokens = f"{rs[0].get('prompt_tokens', '-'):>14} {rs[0].get('prefilled_tokens', '-'):>10}"
        times = " ".join(f"{r['seconds']:.1f}" for r in rs)
        print(f"{arm:>4} {best[arm]:>8.1f} {times:>24} {tokens}")
    saved = 1 - on["prefilled_tokens"] / on["prompt_tokens"] if on.get("prompt_tokens") else 0.0
    print(f"ratio (off / on), best of {args.repeats}: {best['off'] / best['on']:.2f}x; prefill saved {100 * saved:.0f}%")
    print(f"episodes identical in both arms: {same}/{n}")
    if args.json:
        record = {"overrides": args.overrides, "repeats": args.repeats, "mib": args.mib,
                  "seconds": {arm: [round(r["seconds"], 2) for r in rs] for arm, rs in runs.items()},
                  "prompt_tokens": on.get("prompt_tokens"), "prefilled_tokens": on.get("prefilled_tokens"),
                  "ratio_best": round(best["off"] / best["on"], 3), "episodes": n, "identical": same}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0 if same == n else 1


if __name__ == "__main__":
    raise SystemExit(main())
