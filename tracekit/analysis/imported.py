"""The TRACE authors' labeling runs (ScalingIntelligence/TRACE ``pipeline/run_NN.json``) as tracekit labels.

A run file holds one labeling run of the analysis agent over the base agent's tasks::

    {"attempt": 1, "totals": {"total_failed": 110, "total_passed": 54},
     "labels": {"<capability>": {"lacking_failed": ["airline:2", ...], "present_failed": [...], "na_failed": [...],
                                 "lacking_passed": [...], "present_passed": [...], "na_passed": [...]}}}

Each task id sits in one list per capability, which says its label (LACKING / PRESENT / NA) and the episode's outcome
(``_failed`` / ``_passed``). :func:`import_runs` turns the run files of a folder into :class:`~tracekit.types.Label`
rows (``run`` = the file's ``attempt``, ``trajectory`` = the task id), so :func:`tracekit.analysis.select.select`,
the threshold sweeps and the tables run on them unchanged. A task a run does not list for a capability is a missing
label (``value=None``, counted, never guessed), as with an LLM label that could not be obtained.

Refused, with one line naming the file and the first offending entry (``ValueError``): a file that is not such an
object; a run whose capabilities are not the candidates; a task counted twice within one capability of a run; a task
failed in one place and passed in another (its outcome is one episode's: the same across capabilities and runs);
``totals`` that disagree with the tasks the run lists; two files of one ``attempt``.

Where tracekit's statistics differ from the official ``pipeline/aggregate_capabilities.py`` on the same files:

- Cov's denominator: |D-| = failed tasks with a label for c; theirs is ``totals.total_failed``. The same when every
  capability lists every task (their committed runs do; a missing label is the only difference).
- an undefined ER- (no applicable failure) makes Delta undefined, not ER- = 0; an undefined ER+ is 0 in both (the
  ``thresholds.undefined_er_pos=zero`` default); mean Delta is over the runs where Delta is defined.
- the thresholds compare with a 1e-9 slack (an exact 0.2 stays 0.2 in binary floating point).

:func:`compare_selections` sets tracekit's selection beside theirs (``selected_capabilities.json``);
``python -m tracekit.analysis.imported <folder>`` prints it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.select import Thresholds, select
from tracekit.artifacts import file_sha256
from tracekit.types import Label, LabelValue

RUN_GLOB = "run_*.json"
CANDIDATES_FILE = "candidate_capabilities.json"
THEIR_SELECTION_FILE = "selected_capabilities.json"
# list name -> (label, the episode succeeded)
LISTS: dict[str, tuple[LabelValue, bool]] = {
    "lacking_failed": (LabelValue.LACKING, False), "present_failed": (LabelValue.PRESENT, False),
    "na_failed": (LabelValue.NA, False), "lacking_passed": (LabelValue.LACKING, True),
    "present_passed": (LabelValue.PRESENT, True), "na_passed": (LabelValue.NA, True),
}


def run_files(folder: str | Path) -> list[Path]:
    """The ``run_*.json`` files of ``folder``, sorted by name; ValueError when there are none."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder (it should hold the labeling runs, {RUN_GLOB})")
    files = sorted(folder.glob(RUN_GLOB))
    if not files:
        raise ValueError(f"{folder}: no labeling run files ({RUN_GLOB}) in this folder")
    return files


def _task_order(task: str) -> tuple[str, int, str]:
    """airline:2 before airline:10 (the official ids are ``domain:index``)."""
    domain, _, index = task.rpartition(":")
    return (domain, int(index), "") if index.isdigit() else (domain, -1, task)


@dataclass(frozen=True)
class _Seen:
    """Where a task's outcome was first read: to name both places when another list contradicts it."""

    success: bool
    file: str
    where: str


def _load(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("labels"), dict):
        raise ValueError(f'{path}: not a labeling run (an object with "labels": {{capability: {{list: [task, ...]}}}})')
    return obj


def _read_run(path: Path, capabilities: list[str], seen: dict[str, _Seen]) -> tuple[int, dict[str, dict[str, Any]]]:
    """(attempt, {capability: {task: (value, success)}}) of one run file, checked; ``seen`` collects outcomes."""
    obj = _load(path)
    attempt = obj.get("attempt")
    if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
        raise ValueError(f'{path}: "attempt" must be an integer >= 0 (the run index), got {attempt!r}')
    labels: dict[str, Any] = obj["labels"]
    wanted = set(capabilities)
    for cap in labels:
        if cap not in wanted:
            raise ValueError(f"{path}: capability {cap!r} is not among the {len(capabilities)} candidates "
                             f"({', '.join(capabilities)})")
    for cap in capabilities:
        if cap not in labels:
            raise ValueError(f"{path}: candidate {cap!r} has no labels in this run")
    out: dict[str, dict[str, Any]] = {}
    for cap, lists in labels.items():
        if not isinstance(lists, dict):
            raise ValueError(f"{path}: labels.{cap} must be an object of task lists ({', '.join(LISTS)})")
        cells: dict[str, tuple[LabelValue, bool, str]] = {}
        for name, tasks in lists.items():
            if name not in LISTS:
                raise ValueError(f"{path}: labels.{cap} has an unknown list {name!r} (known: {', '.join(LISTS)})")
            if not isinstance(tasks, list):
                raise ValueError(f"{path}: labels.{cap}.{name} must be a list of task ids, got {type(tasks).__name__}")
            value, success = LISTS[name]
            for i, task in enumerate(tasks):
                if not isinstance(task, str) or not task:
                    raise ValueError(f"{path}: labels.{cap}.{name}[{i}] is not a task id: {task!r}")
                if task in cells:
                    raise ValueError(f"{path}: task {task!r} is counted twice in capability {cap!r} "
                                     f"({cells[task][2]} and {name})")
                first = seen.setdefault(task, _Seen(success, path.name, f"{cap}.{name}"))
                if first.success != success:
                    there = "here" if first.file == path.name else f"in {first.file}"
                    raise ValueError(f"{path}: task {task!r} is {'passed' if success else 'failed'} in {cap}.{name} "
                                     f"but {'passed' if first.success else 'failed'} in {first.where} {there} "
                                     f"(one episode: its outcome is the same in every capability and run)")
                cells[task] = (value, success, name)
        out[cap] = {t: (v, s) for t, (v, s, _) in cells.items()}
    totals = obj.get("totals")
    if totals is not None:
        if not isinstance(totals, dict):
            raise ValueError(f'{path}: "totals" must be an object (total_failed, total_passed), got {totals!r}')
        tasks = {t: s for cells in out.values() for t, (_, s) in cells.items()}
        for key, success in (("total_failed", False), ("total_passed", True)):
            listed = sum(s == success for s in tasks.values())
            if key in totals and totals[key] != listed:
                raise ValueError(f"{path}: totals.{key}={totals[key]!r} but the run lists {listed} "
                                 f"{'passed' if success else 'failed'} tasks")
    return attempt, out


def import_runs(folder: str | Path, capabilities: list[str]) -> tuple[list[Label], dict[str, Any]]:
    """The labels of the run files in ``folder`` over ``capabilities`` (the candidates, in dictionary order) and a
    report of what was read; ValueError (one line: the file and the first offending entry) on bad input.

    Every run covers the same tasks: the union of every run's lists. A task a run does not list for a capability is
    a missing label there."""
    if not capabilities:
        raise ValueError("importing labeling runs needs the candidate capabilities, got none")
    files = run_files(folder)
    seen: dict[str, _Seen] = {}
    runs: dict[int, tuple[Path, dict[str, dict[str, Any]]]] = {}
    for path in files:
        attempt, cells = _read_run(path, capabilities, seen)
        if attempt in runs:
            raise ValueError(f"{path}: attempt {attempt} is also {runs[attempt][0].name}'s (each run file is one run)")
        runs[attempt] = (path, cells)
    tasks = sorted(seen, key=_task_order)
    labels: list[Label] = []
    missing: dict[str, int] = {}
    for attempt in sorted(runs):
        path, cells = runs[attempt]
        for task in tasks:
            for cap in capabilities:
                cell = cells[cap].get(task)
                if cell is None:
                    missing[path.name] = missing.get(path.name, 0) + 1
                    labels.append(Label(trajectory=task, capability=cap, run=attempt, value=None,
                                        rationale=f"not listed in {path.name}", success=seen[task].success))
                else:
                    labels.append(Label(trajectory=task, capability=cap, run=attempt, value=cell[0],
                                        success=cell[1]))
    report = {
        "source": str(Path(folder).expanduser().resolve()),
        "files": {runs[a][0].name: {"attempt": a, "sha256": file_sha256(runs[a][0])} for a in sorted(runs)},
        "tasks": len(tasks),
        "failed_tasks": sum(not seen[t].success for t in tasks),
        "passed_tasks": sum(seen[t].success for t in tasks),
        "missing_by_file": missing,
    }
    return labels, report


# --------------------------------------------------------------------------------------------
# tracekit's selection beside the official one


@dataclass(frozen=True)
class SideBySide:
    """One capability in both selections (None: not in that one's table)."""

    name: str
    ours_kept: bool
    ours_runs: int | None
    ours_mean_delta: float | None
    ours_mean_cov: float | None
    theirs_kept: bool
    theirs_runs: int | None
    theirs_mean_delta: float | None
    theirs_mean_cov: float | None


def compare_selections(ours: dict[str, Any], theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """``ours``: a ``selected.json`` (tracekit's :func:`~tracekit.analysis.select.select`); ``theirs``: the official
    ``selected_capabilities.json`` (a list of the kept capabilities: ``skill``, ``n_runs_passed``, ``mean_delta``,
    ``mean_cov``). Returns both kept sets, where they differ, and a row per capability of either."""
    if not isinstance(theirs, list) or any(not isinstance(e, dict) or "skill" not in e for e in theirs):
        raise ValueError('the official selection must be a list of {"skill": ..., ...} entries')
    by_theirs = {e["skill"]: e for e in theirs}
    rows = []
    for cand in ours["candidates"]:
        t = by_theirs.get(cand["name"], {})
        rows.append(SideBySide(cand["name"], cand["selected"], cand["selection_count"], cand["mean_delta"],
                               cand["mean_cov"], bool(t), t.get("n_runs_passed"), t.get("mean_delta"),
                               t.get("mean_cov")))
    known = {c["name"] for c in ours["candidates"]}
    rows += [SideBySide(name, False, None, None, None, True, e.get("n_runs_passed"), e.get("mean_delta"),
                        e.get("mean_cov")) for name, e in by_theirs.items() if name not in known]
    kept_ours = {c["name"] for c in ours["selected"]}
    kept_theirs = set(by_theirs)
    return {"ours": sorted(kept_ours), "theirs": sorted(kept_theirs), "only_ours": sorted(kept_ours - kept_theirs),
            "only_theirs": sorted(kept_theirs - kept_ours), "agree": kept_ours == kept_theirs,
            "rows": [asdict(r) for r in rows]}


def comparison_markdown(cmp: dict[str, Any], n: int, with_theirs: bool = True) -> str:
    """The side-by-side table and a verdict line (without their selection: what tracekit keeps)."""
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| capability | ours: kept | runs | mean Delta | mean Cov | theirs: kept | runs | mean Delta | mean Cov |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in cmp["rows"]:
        runs = lambda v: "-" if v is None else f"{v}/{n}"  # noqa: E731
        lines.append(f"| {r['name']} | {'yes' if r['ours_kept'] else 'no'} | {runs(r['ours_runs'])} | "
                     f"{fmt(r['ours_mean_delta'])} | {fmt(r['ours_mean_cov'])} | {'yes' if r['theirs_kept'] else 'no'} "
                     f"| {runs(r['theirs_runs'])} | {fmt(r['theirs_mean_delta'])} | {fmt(r['theirs_mean_cov'])} |")
    verdict = ("same selection" if cmp["agree"] else
               f"differ: only ours {cmp['only_ours']}, only theirs {cmp['only_theirs']}")
    if not with_theirs:
        verdict = f"tracekit keeps {cmp['ours']} (no official selection to compare)"
    return "\n".join(lines) + f"\n\n{verdict}\n"


def main(argv: list[str] | None = None) -> int:
    """Import a folder of official runs, select with tracekit's rule, print it beside the official selection."""
    p = argparse.ArgumentParser(prog="python -m tracekit.analysis.imported", description=main.__doc__)
    p.add_argument("folder", help=f"the official pipeline/ folder: {RUN_GLOB}, {CANDIDATES_FILE}")
    p.add_argument("--candidates", help=f"default: <folder>/{CANDIDATES_FILE}")
    p.add_argument("--theirs", help=f"their selection; default: <folder>/{THEIR_SELECTION_FILE}")
    p.add_argument("--delta", type=float, default=Thresholds.delta)
    p.add_argument("--rho", type=float, default=Thresholds.rho)
    p.add_argument("--k", type=int, default=Thresholds.k)
    args = p.parse_args(argv)
    folder = Path(args.folder).expanduser()
    try:
        dictionary = load_dictionary(args.candidates or folder / CANDIDATES_FILE)
        labels, _ = import_runs(folder, [c.name for c in dictionary])
        n = len({lab.run for lab in labels})
        ours = select(labels, dictionary, Thresholds(delta=args.delta, rho=args.rho, k=args.k, n=n))
        theirs_path = Path(args.theirs) if args.theirs else folder / THEIR_SELECTION_FILE
        theirs = json.loads(theirs_path.read_text(encoding="utf-8")) if theirs_path.exists() else []
        cmp = compare_selections(ours, theirs)
    except (OSError, ValueError) as e:
        print(f"tracekit.analysis.imported: {e}", file=sys.stderr)
        return 2
    if not theirs:
        print(f"(no official selection at {theirs_path}: ours only)")
    print(comparison_markdown(cmp, n, with_theirs=bool(theirs)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
