"""Stock tau^2 environment creation + evaluation vs tracekit's, on the same episodes, in one run.

For N tasks per domain (split ``base``) two episodes are built: the gold replay (reward 1) and the
gold replay without its last action (usually reward 0), so the reward comparison is not trivially
all-ones. Each episode is run and scored twice, interleaved so machine noise hits both alike:

- stock: ``registry.get_env_constructor(domain)()`` (parses db.json) for the episode, then
  ``evaluate_simulation(..., domain)`` (parses it twice more and hashes two full DBs);
- ours: ``tracekit.targets.tau2.suite.make_environment`` (a copy-on-write view of the DB parsed once) and
  the same ``evaluate_simulation`` through the copy-on-write constructor and cached-JSON hash.

Tool execution is the same code in both and is not timed. Prints per-episode means, the ratio,
and our one-time per-process setup (DB parse + entry-JSON cache); exits 1 if any reward differs.

    python benchmarks/tau2_eval.py --tasks-per-domain 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from tracekit.targets.tau2 import suite as T


def run(tasks_per_domain: int | None) -> dict[str, Any]:
    setup: dict[str, float] = {}
    for d in T.DOMAINS:  # our one-time costs, reported separately
        t0 = time.perf_counter()
        T.base_db(d)
        T._base_entry_json(d)
        T.cow_registry_name(d)
        setup[d] = time.perf_counter() - t0
    rows = []
    for domain in T.DOMAINS:
        tasks = [t for _, t in T.select_tasks([domain], "base", limit=tasks_per_domain)]
        for task in tasks:
            for drop_last in (False, True):
                res = {"domain": domain, "task": task.id, "variant": "drop_last" if drop_last else "gold"}
                for kind in ("stock", "ours"):
                    t0 = time.perf_counter()
                    env = T.stock_environment(domain) if kind == "stock" else T.make_environment(domain)
                    t1 = time.perf_counter()
                    msgs = T.gold_replay_messages(env, task, drop_last)
                    t2 = time.perf_counter()
                    reward = T.evaluate_messages(domain, task, msgs, "user_stop", stock=kind == "stock").reward
                    t3 = time.perf_counter()
                    res[kind] = {"create_s": t1 - t0, "eval_s": t3 - t2, "reward": reward}
                rows.append(res)
    return {"setup_s": setup, "episodes": rows}


def report(result: dict[str, Any]) -> int:
    rows = result["episodes"]
    mismatches = [r for r in rows if r["stock"]["reward"] != r["ours"]["reward"]]
    print(f"{'domain':8} {'episodes':>8} {'stock create':>13} {'ours create':>12} {'stock eval':>11} {'ours eval':>10} "
          f"{'stock total':>12} {'ours total':>11} {'ratio':>7}")
    for domain in [*T.DOMAINS, "all"]:
        sel = [r for r in rows if domain in ("all", r["domain"])]
        if not sel:
            continue
        m = {f"{k}_{p}": statistics.mean(r[k][f"{p}_s"] for r in sel) for k in ("stock", "ours") for p in ("create", "eval")}
        st, ou = m["stock_create"] + m["stock_eval"], m["ours_create"] + m["ours_eval"]
        print(f"{domain:8} {len(sel):>8} {m['stock_create']:>12.4f}s {m['ours_create']:>11.4f}s {m['stock_eval']:>10.4f}s "
              f"{m['ours_eval']:>9.4f}s {st:>11.4f}s {ou:>10.4f}s {st / ou:>6.1f}x")
    total_stock = sum(r["stock"]["create_s"] + r["stock"]["eval_s"] for r in rows)
    total_ours = sum(r["ours"]["create_s"] + r["ours"]["eval_s"] for r in rows)
    setup = sum(result["setup_s"].values())
    print(f"one-time setup (ours, per process): {setup:.3f}s "
          + ", ".join(f"{d} {s:.3f}s" for d, s in result["setup_s"].items()))
    print(f"ratio (stock / ours), per episode: {total_stock / total_ours:.1f}x; "
          f"including our one-time setup: {total_stock / (total_ours + setup):.1f}x")
    rewards = [r["ours"]["reward"] for r in rows]
    print(f"rewards identical on {len(rows) - len(mismatches)}/{len(rows)} episodes "
          f"({sum(x == 1.0 for x in rewards)} with reward 1, {sum(x == 0.0 for x in rewards)} with reward 0)")
    if mismatches:
        print("REWARD MISMATCH:", json.dumps(mismatches[:5], indent=1))
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks-per-domain", type=int, default=20, help="first N base-split tasks per domain (0 = all)")
    ap.add_argument("--json", help="also write the raw timings here")
    args = ap.parse_args(argv)
    result = run(args.tasks_per_domain or None)
    if args.json:
        from tracekit.artifacts import atomic_write_json

        atomic_write_json(args.json, result)
    return report(result)


if __name__ == "__main__":
    sys.exit(main())
