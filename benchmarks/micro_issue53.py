"""Issue 53's tables (benchmarks/results/micro/PREREG_issue53.md, "Metrics"): every variant of a routing sweep, per
training seed, overall and per kind with the world's within-episode kinds and the untouched kind apart, each row
paired against Base, the best Single, TRACE (the paper's gate) and GRPO on the target, on the same episodes.

    python benchmarks/micro_issue53.py --world A --out benchmarks/results/micro/issue53/A-micro_hard \
        --seed 0 <sweep dir of seed 0> <G run dir of seed 0> --seed 1 <sweep dir> <G run dir> ...

A sweep dir is what ``python -m tracekit -m experiment=micro sweep=routing eval.benchmark=micro_hard`` wrote (one job
folder per variant, each with its ``results.json``); a G run dir is that of ``python -m tracekit experiment=micro
benchmark=micro_hard eval.methods=[base,grpo_target]`` at the same seed (its Base must score the same episodes as the
sweep's Base, or the seed is refused); ``-`` for a seed without G (its "vs GRPO on target" cells are left empty). Writes ``tables.md`` and ``tables.json`` atomically.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_json, atomic_write_text, read_json
from tracekit.evaluate import RESULTS
from tracekit.paired import summary_of_outcomes
from tracekit.report.sweep import gather_rows

# the pre-registration's kinds (PREREG_issue53.md, "Worlds" and "Metrics")
WITHIN = {
    "A": ["micro_combo_finish_all_writes__refuse_locked", "micro_combo_lookup_by_name__refuse_locked__finish_all_writes",
          "micro_combo_refuse_locked__finish_all_writes__report_value"],
    "B": ["micro_combo_refuse_locked__report_value", "micro_combo_lookup_by_name__refuse_locked__report_value",
          "micro_combo_refuse_locked__finish_all_writes__report_value"],
}
UNTOUCHED = "micro_combo_finish_all_writes__report_value"
REFERENCES = ("Base", "best Single", "TRACE", "GRPO on target")


def kind_of(episode: str) -> str:
    return episode.split("/", 1)[0]


def restricted(outcomes: dict[str, int], kinds: list[str]) -> dict[str, int]:
    return {k: v for k, v in outcomes.items() if kind_of(k) in kinds}


def rate(outcomes: dict[str, int]) -> float | None:
    return 100.0 * sum(outcomes.values()) / len(outcomes) if outcomes else None


def seed_rows(sweep_dir: Path, g_dir: Path | None) -> dict[str, dict[str, int]]:
    """label -> outcomes for one seed: the sweep's rows (Base, best Single, each variant) and G's row (if run)."""
    jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows, notes = gather_rows(jobs)
    for note in notes:
        print(f"{sweep_dir}: {note}", file=sys.stderr)
    out = {label: r["outcomes"] for label, r in rows.items() if "outcomes" in r}
    if g_dir is not None:
        g_results = read_json(g_dir / RESULTS)
        if g_results.get("Base", {}).get("outcomes") != rows["Base"]["outcomes"]:
            raise SystemExit(f"{g_dir}: its Base scored other episodes (or other outcomes) than {sweep_dir}'s Base: "
                             "not the same seed and tasks, no pairing")
        out["GRPO on target"] = g_results[next(label for label in g_results if label != "Base")]["outcomes"]
    single = [label for label in out if label.startswith("Single Capability")]
    if len(single) != 1:
        raise SystemExit(f"{sweep_dir}: expected one best-Single row, found {single}")
    out["best Single"] = out.pop(single[0])
    trace = [label for label in out if label == "TRACE"]
    if not trace:
        raise SystemExit(f"{sweep_dir}: no 'TRACE' row (the paper's gate, +composition=paper)")
    return out


def compare(rows: dict[str, dict[str, int]], kinds: list[str] | None) -> dict[str, Any]:
    """Each row's rate and its paired summary against each reference, on all episodes or on ``kinds`` only."""
    view = {label: (o if kinds is None else restricted(o, kinds)) for label, o in rows.items()}
    out: dict[str, Any] = {}
    for label, outcomes in view.items():
        entry: dict[str, Any] = {"rate": rate(outcomes), "n": len(outcomes)}
        for ref in REFERENCES:
            if ref != label and ref in view:
                entry[f"vs {ref}"] = summary_of_outcomes(view[ref], outcomes)
        out[label] = entry
    return out


def per_kind(rows: dict[str, dict[str, int]]) -> dict[str, dict[str, float | None]]:
    kinds = sorted({kind_of(k) for o in rows.values() for k in o})
    return {label: {kind: rate(restricted(o, [kind])) for kind in kinds} for label, o in rows.items()}


def short(kind: str) -> str:
    return "+".join(part.split("_")[0] for part in kind.removeprefix("micro_combo_").split("__"))


def cell(s: dict[str, Any]) -> str:
    star = "*" if s["excludes_zero"] else ""
    return f"{100 * s['diff']:+.1f} [{100 * s['ci'][0]:+.1f}, {100 * s['ci'][1]:+.1f}]{star}"


def markdown(world: str, seeds: dict[int, dict[str, Any]], title: str) -> str:
    lines = [f"# {title}", "",
             f"Within-episode kinds of world {world}: {', '.join(short(k) for k in WITHIN[world])}; the untouched kind: "
             f"{short(UNTOUCHED)}. Paired differences in points, task-cluster bootstrap 95% CI; * = excludes 0.", ""]
    for seed, data in seeds.items():
        kinds = sorted(next(iter(data["per_kind"].values())))
        lines += [f"## Training seed {seed}", "", "| row | " + " | ".join(short(k) for k in kinds) + " | overall |",
                  "|---|" + "---|" * (len(kinds) + 1)]
        for label, by_kind in data["per_kind"].items():
            vals = [f"{by_kind[k]:.1f}" for k in kinds]
            lines.append(f"| {label} | " + " | ".join(vals) + f" | {data['overall'][label]['rate']:.1f} |")
        for scope in ("within", "overall"):
            lines += ["", f"Paired, {'within-episode kinds' if scope == 'within' else 'all episodes'}:", "",
                      "| row | rate | " + " | ".join(f"vs {r}" for r in REFERENCES) + " |",
                      "|---|---|" + "---|" * len(REFERENCES)]
            for label, e in data[scope].items():
                lines.append(f"| {label} | {e['rate']:.1f} | "
                             + " | ".join(cell(e[f'vs {r}']) if f"vs {r}" in e else "-" for r in REFERENCES) + " |")
        lines.append("")
    if len(seeds) > 1:
        labels = [label for label in next(iter(seeds.values()))["within"]
                  if all(label in d["within"] for d in seeds.values())]
        lines += ["## Over seeds (within-episode kinds)", "", "| row | mean | sd | seeds with CI > 0 vs Base | "
                  "vs best Single | vs TRACE | vs GRPO on target |", "|---|---|---|---|---|---|---|"]
        for label in labels:
            rates = [d["within"][label]["rate"] for d in seeds.values()]
            wins = [sum(bool(d["within"][label].get(f"vs {r}", {}).get("excludes_zero"))
                        and d["within"][label][f"vs {r}"]["diff"] > 0 for d in seeds.values()) for r in REFERENCES]
            lines.append(f"| {label} | {statistics.mean(rates):.1f} | {statistics.stdev(rates):.1f} | "
                         + " | ".join(f"{w}/{len(seeds)}" for w in wins) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", choices=sorted(WITHIN), required=True)
    ap.add_argument("--seed", nargs=3, action="append", metavar=("SEED", "SWEEP_DIR", "G_RUN_DIR"), required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="tables", help="the output files' stem (<name>.md, <name>.json)")
    ap.add_argument("--title", default=None, help="the Markdown title (default: issue 53, world W, every variant)")
    args = ap.parse_args(argv)
    seeds: dict[int, dict[str, Any]] = {}
    for seed, sweep_dir, g_dir in args.seed:
        rows = seed_rows(Path(sweep_dir), None if g_dir == "-" else Path(g_dir))
        seeds[int(seed)] = {"sweep": sweep_dir, "g_run": g_dir, "per_kind": per_kind(rows),
                            "overall": compare(rows, None), "within": compare(rows, WITHIN[args.world]),
                            "untouched": compare(rows, [UNTOUCHED])}
    args.out.mkdir(parents=True, exist_ok=True)
    title = args.title or f"Issue 53, world {args.world}: every variant per training seed (PREREG_issue53.md)"
    atomic_write_json(args.out / f"{args.name}.json", {"world": args.world, "title": title, "seeds": seeds})
    atomic_write_text(args.out / f"{args.name}.md", markdown(args.world, seeds, title))
    print(f"wrote {args.out / f'{args.name}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
