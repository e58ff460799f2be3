"""Issue 49's check of the coding reward: every gold patch of the default task set (conf/benchmark/coding_toolz.yaml)
under :func:`tracekit.targets.coding.reward.evaluate_patch`, and the hostile patches of ``tests/test_hostile_patches.py``;
a Markdown report on stdout (benchmarks/results/coding_reward_issue49.md).

    python benchmarks/coding_reward_check.py --cache /tmp/coding-cache > benchmarks/results/coding_reward_issue49.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests import test_hostile_patches as H  # noqa: E402
from tracekit.targets.coding import reward as rw  # noqa: E402
from tracekit.coding import sandbox  # noqa: E402
from tracekit.targets.coding.tasks import TaskGenConfig, load_or_generate  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", required=True, help="where the default task set is generated (or found)")
    args = ap.parse_args()
    c = yaml.safe_load((ROOT / "conf/benchmark/coding_toolz.yaml").read_text())["coding"]
    cfg = TaskGenConfig(package=c["package"], seed=c["seed"], modifiers=tuple(c["modifiers"]),
                        max_per_modifier=c["max_per_modifier"],
                        max_candidates_per_modifier=c["max_candidates_per_modifier"],
                        heldout_fraction=c["heldout_fraction"], test_wall_seconds=c["test_wall_seconds"],
                        test_cpu_seconds=c["test_cpu_seconds"])
    limits = sandbox.CommandLimits(cpu_seconds=120, wall_seconds=120)
    t0 = time.monotonic()
    ts = load_or_generate(cfg, Path(args.cache))
    gen_s = time.monotonic() - t0
    print("# The coding reward after issue 49\n")
    print(f"Command: `python benchmarks/coding_reward_check.py --cache <dir>`; default task set "
          f"`{ts.root.name}` ({len(ts.tasks)} tasks, {ts.report['package']}; found or generated in {gen_s:.0f} s); "
          f"isolation: {sandbox.isolation()['mode']}, {sandbox.isolation()['accounting']}.\n")
    print("## Gold patches of the default task set\n")
    print("| task | split | reward | status | dropped | tampering | wall s |\n|---|---|---|---|---|---|---|")
    n_ok, total = 0, 0.0
    for t in ts.tasks:
        s = time.monotonic()
        v = rw.evaluate_patch(t, ts.buggy_tree(t), t.patch, limits)
        dt = time.monotonic() - s
        total += dt
        n_ok += v.reward == 1.0
        print(f"| {t.instance_id} | {t.split} | {v.reward} | {v.status} | {len(v.dropped)} | {len(v.tampering)} | "
              f"{dt:.1f} |")
    print(f"\n{n_ok} of {len(ts.tasks)} resolved; {total:.1f} s in all.\n")
    print("## Hostile patches (the bug left in; tests/test_hostile_patches.py's `calc` task)\n")
    print("| patch | reward | status | first reason recorded |\n|---|---|---|---|")
    for name, (changes, _) in {**H.ONLY_DROPPED, **H.TAMPERING}.items():
        v = rw.evaluate_patch(H.CalcTask(), H.BUGGY, H.patch_of(changes), limits)
        why = (v.tampering or ["; ".join(v.dropped)])[0].replace("|", "/")
        why = why.replace(str(sandbox.work_root()), "<work root>")
        print(f"| {name} | {v.reward} | {v.status} | {why[:160]} |")
    fix = rw.evaluate_patch(H.CalcTask(), H.BUGGY, H.patch_of({H.CORE: H.FIXED_CORE}), limits)
    print(f"| (the genuine fix) | {fix.reward} | {fix.status} | |")


if __name__ == "__main__":
    main()
