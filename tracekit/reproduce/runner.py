"""Run a paper table: every row as a Hydra job of the app (``tracekit.cli.task``) through a Hydra launcher, then the
side-by-side rendering, one W&B run for the table, and a summary.

- Rows are launched with Hydra's own launcher plugins, chosen as in any Hydra app: the basic launcher (one row
  after another, in process: the default), ``hydra/launcher=joblib hydra.launcher.n_jobs=2`` (parallel, local),
  ``hydra/launcher=slurm`` (``conf/hydra/launcher/slurm.yaml``: SLURM through the submitit plugin). Each row's
  run dir is ``<table dir>/rows/<job>/`` (its config, log, artifacts.json, results.json, summary.md).
- Rows share the stage cache: the base rollout, the analysis and the capability adapters are computed by the
  first row that needs them and read by every other; rows whose settings are identical (Table 1's two blocks at
  ``scale=embedded``, where both run the bundled model) are one job.
- Resume: a killed table run, re-run, finds every completed row's artifacts in the cache (its job is all cache
  hits) and resumes a half-done row from its stages' partial work.
- The table files (``table.md``, ``table.csv``, ``table.tex``, ``table.png``, ``results.json``, ``summary.md``)
  are written before W&B is touched: a W&B failure is a warning, never a lost table.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_json, atomic_write_text
from tracekit.cli import task
from tracekit.schema import register_configs
from tracekit.llm.backbones import build_config
from tracekit.moe.counts import count_params, gate_param_count
from tracekit.report.sweep import paired_lines
from tracekit.report.table5 import lora_param_count, meta_causal_lm
from tracekit.reproduce import render
from tracekit.report.paper import cuts_dict, setting_line, setting_markdown
from tracekit.reproduce.render import RowResult, Value
from tracekit.reproduce.spec import (CONF, Composer, Plan, Row, Spec, SpecError, blocked_line, find_spec,
                                     is_hydra_override, load_spec, merge_overrides, override_key, plan, row_name,
                                     spec_paths)

TABLE_FILES = ("table.md", "table.csv", "table.tex", "table.png", "results.json", "summary.md")


class TableRefused(ValueError):
    """The table cannot start: a spec, a row or an override the user must fix (one line)."""


def root_dir() -> Path:
    return Path(os.environ.get("TRACEKIT_ROOT") or os.getcwd())


class Say:
    """Progress lines on the terminal and in ``<table dir>/reproduce.log``."""

    def __init__(self, spec_id: str):
        self.spec_id, self.path = spec_id, None

    def __call__(self, msg: str) -> None:
        line = f"[{self.spec_id}] {msg}"
        print(line, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(f"{datetime.now().isoformat(timespec='seconds')} {line}\n")


# --------------------------------------------------------------------------------------------
# launching rows through Hydra


def launch(plan_: Plan, rows_dir: Path, say: Say, on_job: Any = None) -> dict[int, Any]:
    """Run each distinct job once through the configured Hydra launcher; job index -> its JobReturn.
    ``on_job(returns)`` after each job of the basic launcher (the table so far is written: a killed run leaves
    it, its remaining rows pending)."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.types import HydraContext, RunMode


    jobs = jobs_of(plan_)
    register_configs()
    returns: dict[int, Any] = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="tracekit"):
        hydra = GlobalHydra.instance().hydra
        master = hydra.compose_config("config", overrides=[*plan_.hydra_overrides, f"hydra.sweep.dir={rows_dir}"],
                                      run_mode=RunMode.MULTIRUN)
        context = HydraContext(config_loader=hydra.config_loader, callbacks=Callbacks(master))
        launcher = Plugins.instance().instantiate_launcher(hydra_context=context, task_function=task, config=master)
        kind = type(launcher).__name__
        if kind == "BasicLauncher":  # one job at a time: report each as it ends
            for i, overrides in enumerate(jobs):
                say(f"job {i + 1}/{len(jobs)} ({_job_rows(plan_, i)}): running")
                t0 = time.time()
                (ret,) = launcher.launch([overrides], initial_job_idx=i)
                returns[i] = ret
                say(f"job {i + 1}/{len(jobs)}: {_job_status(ret)} in {time.time() - t0:.1f} s")
                if on_job is not None and i + 1 < len(jobs):
                    on_job(returns)
        else:
            say(f"{len(jobs)} jobs through {kind}")
            for i, ret in enumerate(launcher.launch(jobs, initial_job_idx=0)):
                returns[i] = ret
                say(f"job {i + 1}/{len(jobs)} ({_job_rows(plan_, i)}): {_job_status(ret)}")
    return returns


def jobs_of(plan_: Plan) -> list[list[str]]:
    """The distinct jobs of the runnable rows (rows with identical overrides run once), in row order."""
    jobs: list[list[str]] = []
    for p in plan_.runnable:
        key = [o for o in p.overrides if not o.startswith("name=")]
        if key not in jobs:
            jobs.append(key)
    return [[*j, f"name={plan_.spec.id}-{i}"] for i, j in enumerate(jobs)]


def job_index(plan_: Plan, overrides: Sequence[str]) -> int:
    key = [o for o in overrides if not o.startswith("name=")]
    return [j[:-1] for j in jobs_of(plan_)].index(key)


def _job_rows(plan_: Plan, i: int) -> str:
    return ", ".join(p.row.label for p in plan_.runnable if job_index(plan_, p.overrides) == i)


def _job_status(ret: Any) -> str:
    from hydra.core.utils import JobStatus

    if ret.status == JobStatus.COMPLETED:
        return "done"
    return f"failed ({_one_line(getattr(ret, '_return_value', None))})"


def _one_line(e: Any) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}" if isinstance(e, BaseException) else str(e)


# --------------------------------------------------------------------------------------------
# collecting


def _cache_status(run_dir: Path) -> str:
    path = run_dir / "artifacts.json"
    if not path.is_file():
        return ""
    arts = json.loads(path.read_text()).values()
    computed = sorted({a["stage"] for a in arts if not a["cache_hit"]})
    return "all cached" if not computed else "computed: " + ", ".join(computed)


def collect(plan_: Plan, rows_dir: Path, returns: dict[int, Any], final: bool = True) -> list[RowResult]:
    from hydra.core.utils import JobStatus

    spec = plan_.spec
    out: list[RowResult] = []
    first_of_job: dict[int, int] = {}
    for p in plan_.rows:
        row = p.row
        if p.problem is not None:
            out.append(RowResult(row, "not run", p.problem))
            continue
        j = job_index(plan_, p.overrides)
        ret = returns.get(j)
        run_dir = rows_dir / str(j)
        res = RowResult(row, "ok", run_dir=str(run_dir), job=j, cache=_cache_status(run_dir))
        if j in first_of_job:
            res.notes.append(f"the same setting as row {first_of_job[j] + 1} (one job)")
        first_of_job.setdefault(j, row.index)
        if ret is None and not final:
            res.status, res.reason = "pending", "not run yet"
            out.append(res)
            continue
        if ret is None or ret.status != JobStatus.COMPLETED:
            res.status, res.reason = "failed", _one_line(getattr(ret, "_return_value", "not launched"))
            out.append(res)
            continue
        value = ret.return_value or {}
        res.seconds = value.get("seconds")
        if spec.metric == "selection":
            _collect_selection(res, run_dir)
        elif spec.figure.get("source") == "figure4":
            _collect_figure4(res, run_dir)
        else:
            _collect_results(spec, res, run_dir)
        out.append(res)
    return out


def _collect_results(spec: Spec, res: RowResult, run_dir: Path) -> None:
    path = run_dir / "results.json"
    if not path.is_file():
        res.status, res.reason = "failed", f"no results.json in {run_dir} (see its summary.md)"
        return
    results = json.loads(path.read_text())
    mine = [(label, r) for label, r in results.items() if r.get("method") == res.row.method]
    if not mine:
        res.status, res.reason = "failed", f"no row of method {res.row.method!r} in {path}"
        return
    label, r = mine[0]
    res.values = {c: render.measure(r, spec.column(c)) for c in spec.columns}
    res.budget = r.get("budget")
    if "outcomes" in r:  # paired against Base, the best Single and TRACE in the table's summary
        res.extra["outcomes"] = r["outcomes"]
    if label != res.row.label:
        res.notes.append(f"ours: {label}")
    res.notes += list(r.get("notes", ()))
    if spec.figure.get("x") == "rollouts":
        res.x = float((res.budget or {}).get("episodes", 0))
    else:
        res.x = res.row.x


def figure4_points(spec: Spec, res: RowResult) -> list[RowResult]:
    """Figure 4 from the ``figure4`` stage (``tracekit.report.figure4``): one row per curve point, ours beside the
    paper's points (``paper.points``) at the same (series, x)."""
    ours: dict[tuple[str, float], float] = {}
    data = res.extra.get("figure4")
    if data is not None and spec.figure.get("panel") == "a":
        for pt in data["a"]:
            for key, series in (("trace", "TRACE"), ("gepa", "GEPA"), ("prompt_only", "Prompt only")):
                if pt.get(key) is not None:
                    ours[(series, float(pt["k"]))] = 100 * pt[key]
    elif data is not None:
        for series, pts in data["b"].items():
            for pt in pts:
                ours[(series, float(pt["episodes"]))] = 100 * pt["pass_rate"]
    paper = {(pt["series"], float(pt["x"])): pt["overall"] for pt in spec.paper.get("points", [])}
    keys = sorted(set(ours) | set(paper), key=lambda k: (k[0] != "TRACE", k[0], k[1]))
    out = []
    for i, (series, x) in enumerate(keys):
        row = Row(index=i, block=0, block_label=res.row.block_label, backbone=res.row.backbone,
                  label=f"{series} ({x:,.0f})", method=None, overrides=(), paper=
                  {"overall": paper[(series, x)]} if (series, x) in paper else {}, series=series,
                  x=x if (series, x) in paper else None)
        have = (series, x) in ours
        out.append(RowResult(row, res.status if have or res.status != "ok" else "ok",
                             res.reason if res.status != "ok" else ("" if have else "no such point of ours"),
                             values={"overall": Value(ours[(series, x)])} if have else {},
                             x=x if have else None, seconds=res.seconds, cache=res.cache, run_dir=res.run_dir))
    return out


def _collect_figure4(res: RowResult, run_dir: Path) -> None:
    arts = json.loads((run_dir / "artifacts.json").read_text()).values()
    fig = [a for a in arts if a["stage"] == "figure4"]
    if not fig:
        res.status, res.reason = "failed", "no figure4 artifact"
        return
    res.extra["figure4"] = json.loads((Path(fig[0]["path"]) / "figure4.json").read_text())


def _collect_selection(res: RowResult, run_dir: Path) -> None:
    arts = json.loads((run_dir / "artifacts.json").read_text()).values()
    select = [a for a in arts if a["stage"] == "select"]
    if not select:
        res.status, res.reason = "failed", "no select artifact"
        return
    sel_dir = Path(select[0]["path"])
    res.extra["selection"] = json.loads((sel_dir / "selected.json").read_text())
    res.extra["pngs"] = [str(p) for p in sorted(sel_dir.glob("*.png"))]


# --------------------------------------------------------------------------------------------
# writing


def write_table(spec: Spec, results: list[RowResult], table_dir: Path, summary_head: str) -> list[Path]:
    """table.md/.csv/.tex, the PNG(s), results.json and summary.md; the images (for W&B)."""
    if spec.figure.get("source") == "figure4":  # one stage run: its curves become the rows
        results = figure4_points(spec, results[0])

    if spec.metric == "selection":
        md = render.selection_markdown(spec, results[0])
        images = [render.selection_png(spec, results[0], table_dir / "table.png")]
        for png in results[0].extra.get("pngs", []):  # the select stage's own Figure 3a/3b
            dst = table_dir / Path(png).name
            dst.write_bytes(Path(png).read_bytes())
            images.append(dst)
    else:
        md = render.markdown(spec, results)
        images = [(render.lines_png if spec.kind == "figure" else render.table_png)(spec, results,
                                                                                   table_dir / "table.png")]
    atomic_write_text(table_dir / "table.md", f"# {spec.title}\n\n{md}")
    atomic_write_text(table_dir / "table.csv", render.csv_text(spec, results))
    atomic_write_text(table_dir / "table.tex", render.latex(spec, results) if spec.metric != "selection"
                      else "% Figure 3 is a figure: see table.md and the PNGs\n")
    atomic_write_json(table_dir / "results.json", [_row_json(spec, r) for r in results], sort_keys=False)
    notes = [f"- {r.row.label}: {n}" for r in results for n in [*([r.row.note] if r.row.note else []), *r.notes]]
    paired_text, paired = paired_rows(results)
    if paired:
        atomic_write_json(table_dir / "paired.json", paired, sort_keys=False)
    atomic_write_text(table_dir / "summary.md", "\n".join([
        summary_head, "", "## Table", "", md, *(["## Notes", "", *notes, ""] if notes else []),
        *(["## Paired", "", paired_text.strip(), ""] if paired_text else []),
        "## Rows", "", "| row | status | seconds | cache | run dir |", "|---|---|---|---|---|",
        *[f"| {r.row.label} | {r.status}{': ' + r.reason if r.reason else ''} | "
          f"{'–' if r.seconds is None else f'{r.seconds:.1f}'} | {r.cache or '–'} | {r.run_dir or '–'} |"
          for r in results], "",
        "Files: " + ", ".join(f"`{n}`" for n in TABLE_FILES) + "."]) + "\n")
    return images


def paired_rows(results: list[RowResult]) -> tuple[str, dict[str, Any]]:
    """Each block's rows paired on the same episodes against its Base, best Single and TRACE rows (issue 53:
    :func:`tracekit.report.sweep.paired_lines`), for the rows that kept their outcomes; blocks apart (another backbone's
    episodes are not the same episodes)."""
    blocks: dict[str, dict[str, Any]] = {}
    for r in results:
        if "outcomes" in r.extra:
            blocks.setdefault(r.row.block_label, {})[r.row.label] = {"method": r.row.method,
                                                                      "outcomes": r.extra["outcomes"]}
    text, out = "", {}
    for block, rows in blocks.items():
        lines, summaries = paired_lines(rows)
        if summaries:
            out[block or "rows"] = summaries
            text += (f"\n### {block}\n" if block and len(blocks) > 1 else "") + lines
    return text, out


def _row_json(spec: Spec, r: RowResult) -> dict[str, Any]:
    def v(x: Value) -> dict[str, Any]:
        return {"mean": x.mean, "ci95": x.ci, "total": x.total}

    return {"label": r.row.label, "block": r.row.block_label, "method": r.row.method, "status": r.status,
            "reason": r.reason, "ours": {c: v(r.values.get(c, render.NONE)) for c in spec.columns},
            "paper": r.row.paper, "x": r.x, "x_paper": r.row.x, "budget": r.budget, "seconds": r.seconds,
            "cache": r.cache, "run_dir": r.run_dir, "notes": r.notes,
            **({"selection": r.extra["selection"]} if "selection" in r.extra else {})}


def log_wandb(spec: Spec, results: list[RowResult], table_dir: Path, images: list[Path], logger: Any,
              config: dict[str, Any], say: Say) -> None:
    """One W&B run for the table (a wandb.Table and the images); any failure is a warning: the files stay."""
    if logger is None or logger.kind != "wandb":
        return
    try:
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run = wandb.init(project=logger.project, entity=logger.entity, name=f"{spec.id}-{config['scale']}",
                         dir=str(table_dir), mode=logger.mode, job_type="table", config=config,
                         reinit="finish_previous")
        cols, data = render.wandb_table(spec, results)
        run.log({f"{spec.id}/table": wandb.Table(columns=cols, data=data),
                 **{f"{spec.id}/{p.stem}": wandb.Image(str(p)) for p in images}})
        run.finish()
        say(f"W&B run ({logger.mode}) in {table_dir / 'wandb'}")
    except Exception as e:  # noqa: BLE001 -- W&B never costs the table
        say(f"warning: W&B logging failed ({_one_line(e)}); the table files are in {table_dir}")


# --------------------------------------------------------------------------------------------
# the table


def table_dir_for(spec: Spec, scale: str, out: str | None) -> Path:
    if out:
        return Path(out)
    stamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    return root_dir() / "outputs" / "tables" / f"{stamp}_{spec.id}_{scale}"


def reproduce(name: str, overrides: Sequence[str] = (), partial: bool = False, out: str | None = None,
              log_rows: bool = False) -> tuple[Path, list[RowResult]]:
    """Run one table or figure; (its dir, its rows). TableRefused (one line) before any work when it cannot."""
    spec = load_spec(find_spec(name))
    say = Say(spec.id)
    if spec.kind == "parameters":
        return parameters_table(spec, overrides, out, say)
    try:
        p = plan(spec, overrides, log_rows=log_rows)
    except Exception as e:  # noqa: BLE001 -- the user's overrides do not compose or validate: one line
        raise TableRefused(f"{spec.id}: {_one_line(e)}") from None
    if p.blocked and not partial or not p.runnable:
        raise TableRefused(blocked_line(p))
    table_dir = table_dir_for(spec, p.scale, out)
    table_dir.mkdir(parents=True, exist_ok=True)
    say.path = table_dir / "reproduce.log"
    first = p.runnable[0].cfg
    say(f"{spec.title}: {len(p.runnable)} of {len(p.rows)} rows, scale={p.scale}, in {table_dir}")
    say(setting_line(first))
    for b in p.blocked:
        say(f"not run: {row_name(p, b.row)!r}: {b.problem}")
    t0 = time.time()
    row_cuts = {r.row.label: cuts_dict(r.cfg) for r in p.runnable}

    def head(status: str) -> str:
        return "\n".join([
            f"# {spec.title}", "", "`" + " ".join(["python -m tracekit.reproduce", spec.id, *overrides]) + "`", "",
            f"Spec: `{spec.path}`. {status} ({len(p.runnable)} rows to run, {len(p.blocked)} not run).",
            "", "## Setting relative to the paper", "", setting_markdown(first), *_row_specific_cuts(row_cuts)])

    def so_far(returns: dict[int, Any]) -> None:
        write_table(spec, collect(p, table_dir / "rows", returns, final=False), table_dir,
                    head(f"In progress: {time.time() - t0:.0f} s so far"))

    returns = launch(p, table_dir / "rows", say, on_job=so_far)
    results = collect(p, table_dir / "rows", returns)
    seconds = time.time() - t0
    images = write_table(spec, results, table_dir, head(f"Wall time: {seconds:.0f} s"))
    config = {"table": spec.id, "title": spec.title, "scale": p.scale, "overrides": list(overrides),
              "seconds": seconds, "setting": cuts_dict(first),
              "rows": [{"label": r.row.label, "status": r.status, "overrides": pr.overrides, "reason": r.reason}
                       for r, pr in zip(results, p.rows, strict=True)]}
    log_wandb(spec, results, table_dir, images, p.base_cfg.logger, config, say)
    print(f"\n{spec.title} ({p.scale}, {seconds:.0f} s; {table_dir}):\n" + (table_dir / "table.md").read_text())
    return table_dir, results


def _row_specific_cuts(row_cuts: dict[str, dict[str, Any]]) -> list[str]:
    common = set.intersection(*(set(c["cuts"]) for c in row_cuts.values())) if row_cuts else set()
    lines = [f"- {label}: also {', '.join(sorted(set(c['cuts']) - common))}"
             for label, c in row_cuts.items() if set(c["cuts"]) - common]
    return ["", "Rows that differ further:", "", *lines] if lines else []


def parameters_table(spec: Spec, overrides: Sequence[str], out: str | None, say: Say) -> tuple[Path, list[RowResult]]:
    """Table 5: parameter counts of the paper's backbone on the meta device (no weights, no download), at the
    LoRA settings of the spec's preset; the same at every scale (it costs seconds)."""
    user = [o for o in overrides if not is_hydra_override(o) and override_key(o) != "scale"]
    with Composer() as c:
        cfg = c.compose(merge_overrides([f"experiment={spec.experiment}"], user))
    (block,) = {r.backbone for r in spec.rows}
    t0 = time.time()
    model = meta_causal_lm(build_config(block))
    n_caps = int(spec.capabilities)
    counts = {"backbone": count_params(model),
              "adapter_each": lora_param_count(model, cfg.grpo.lora.rank, list(cfg.grpo.lora.target_modules)),
              "gates_total": gate_param_count(model.config.hidden_size, model.config.num_hidden_layers, n_caps)}
    seconds = time.time() - t0
    results = [RowResult(r, "ok", values={"parameters": Value(float(counts[r.count]))}, seconds=seconds,
                         notes=[f"rank {cfg.grpo.lora.rank} on {', '.join(cfg.grpo.lora.target_modules)}"
                                if r.count == "adapter_each" else
                                f"{model.config.num_hidden_layers} blocks x (d={model.config.hidden_size} x "
                                f"{n_caps} + {n_caps})" if r.count == "gates_total" else "meta device"])
               for r in spec.rows]
    table_dir = table_dir_for(spec, "any", out)
    table_dir.mkdir(parents=True, exist_ok=True)
    say.path = table_dir / "reproduce.log"
    head = "\n".join([f"# {spec.title}", "", f"Counted on the meta device in {seconds:.1f} s "
                      f"({block}, {n_caps} capabilities); the same at every scale.", ""])
    images = write_table(spec, results, table_dir, head)
    log_wandb(spec, results, table_dir, images, cfg.logger, {"table": spec.id, "scale": "any", "counts": counts}, say)
    print(f"\n{spec.title} ({seconds:.1f} s; {table_dir}):\n" + (table_dir / "table.md").read_text())
    return table_dir, results


def check_all(names: Sequence[str], overrides: Sequence[str] = ()) -> list[str]:
    """One line per spec: ``ok``, or the rows that cannot run (and why)."""
    lines = []
    for name in names:
        spec = load_spec(find_spec(name))
        if spec.kind == "parameters":
            lines.append(f"{spec.id}: ok (parameter counts, {len(spec.rows)} rows)")
            continue
        p = plan(spec, overrides)
        lines.append(f"{spec.id}: ok ({len(p.rows)} rows runnable, scale={p.scale})" if not p.blocked
                     else blocked_line(p))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    import argparse


    ap = argparse.ArgumentParser(
        prog="python -m tracekit.reproduce",
        description="Reproduce a paper table or figure: every row of experiments/<name>_*.yaml as a cached Hydra job "
                    "of `python -m tracekit`, rendered beside the paper's numbers (Markdown, CSV, LaTeX, PNG, W&B).",
        epilog="Overrides (key=value, group=option, hydra/launcher=joblib) apply to every row, after the spec's.")
    ap.add_argument("items", nargs="+", help="table1 .. table8, figure3, figure4a, figure4b, figure5, all, or a spec "
                                             "path; then Hydra overrides (scale=embedded, grpo.lr=1e-4, ...)")
    ap.add_argument("--check", action="store_true", help="check the specs (every row composes, or why not); run nothing")
    ap.add_argument("--partial", action="store_true", help="run the rows that can run; show the others as not run")
    ap.add_argument("--out", help="the table's directory (default outputs/tables/<time>_<name>_<scale>)")
    ap.add_argument("--log-rows", action="store_true", help="each row logs its own W&B run too")
    args = ap.parse_intermixed_args(argv)  # overrides may follow the options
    overrides = [a for a in args.items if "=" in a or a.startswith(("~", "+"))]
    names = [a for a in args.items if a not in overrides]
    if names == ["all"]:
        names = [p.stem.split("_", 1)[0] for p in spec_paths()]
    if not names:
        ap.error("name a table or figure (e.g. table1), or all")
    try:
        if args.check:
            lines = check_all(names, overrides)
            print("\n".join(lines))
            return 0
        if len(names) > 1 and args.out:
            raise TableRefused("--out takes one table")
        failed = 0
        for n in names:
            _, results = reproduce(n, overrides, partial=args.partial, out=args.out, log_rows=args.log_rows)
            failed += sum(r.status == "failed" for r in results)
        return 1 if failed else 0
    except (SpecError, TableRefused) as e:
        print(f"tracekit.reproduce: error: {e}", file=sys.stderr)
        return 2
