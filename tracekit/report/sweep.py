"""One side-by-side table over the jobs of a multirun (``-m sweep=consolidation``): a Hydra callback.

Each job writes its evaluation (``results.json``) into its own run dir; when the multirun ends, the rows of
every job are gathered into one table: rows shared by all jobs (Base, best Single: the same cached upstream)
once, then each job's own rows (one per strategy), with the budgets beside the pass rates, and under it each
row's paired difference against Base, the best Single and TRACE (the ``moe`` strategy's row) on the same episodes. Written
to ``<sweep dir>/results.md`` and ``results.json`` with its ladder chart (``ladder.png``), printed, and logged to
W&B as one table; the multirun's last log line names the table and the chart.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import atomic_write_json, atomic_write_text, read_json
from tracekit.evaluate import RESULTS, markdown_table, wandb_rows
from tracekit.paired import interval_text
from tracekit.report.ladder import LADDER_PNG, RESULTS_MD, write_ladder_chart
from tracekit.targets.registry import target_of
from tracekit.paired import base_label, paired_line, summary_of_outcomes

log = logging.getLogger(__name__)


def gather_rows(job_dirs: list[Path]) -> tuple[dict[str, Any], list[str]]:
    """The merged rows (label -> result) of the jobs' results, and notes on jobs that wrote none or disagree."""
    rows: dict[str, Any] = {}
    notes = []
    for job in job_dirs:
        path = job / RESULTS
        if not path.is_file():
            notes.append(f"job {job.name}: no results (it failed or stopped before evaluate; see {job}/summary.md)")
            continue
        for label, result in read_json(path).items():
            if label in rows and _rates(rows[label]) != _rates(result):
                notes.append(f"job {job.name}: row {label!r} differs from an earlier job's")
                label = f"{label} (job {job.name})"
            rows.setdefault(label, result)
    return rows, notes


def paired_against(rows: dict[str, Any], reference: str | None) -> dict[str, Any]:
    """Every other row's paired summary against the row ``reference``. Rows without outcomes, or run on other
    episodes than the reference's (another task limit, say), cannot be paired and are left out
    (:func:`unpaired_with`)."""
    if reference is None or "outcomes" not in rows[reference]:
        return {}
    return {label: summary_of_outcomes(rows[reference]["outcomes"], r["outcomes"])
            for label, r in rows.items() if label != reference and label not in unpaired_with(rows, reference)
            and "outcomes" in r}


def unpaired_with(rows: dict[str, Any], reference: str) -> list[str]:
    """The rows with outcomes on another set of episodes than ``reference``'s: no paired comparison exists."""
    episodes = set(rows[reference].get("outcomes", {}))
    return [label for label, r in rows.items()
            if label != reference and "outcomes" in r and set(r["outcomes"]) != episodes]


def paired_lines(rows: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The paired lines against Base, the best Single and TRACE, and the summaries (``{"vs_base": .., "vs_single": ..,
    "vs_trace": ..}``)."""
    trace = next((label for label, r in rows.items() if r.get("method") == "trace" and label == "TRACE"), None)
    single = next((label for label, r in rows.items() if r.get("method") == "single_capability"), None)
    out, text = {}, ""
    for key, ref in (("vs_base", base_label(rows)), ("vs_single", single), ("vs_trace", trace)):
        summaries = paired_against(rows, ref)
        if summaries:
            out[key] = summaries
            text += f"\nPaired vs {ref} ({interval_text(ref)}):\n" + "\n".join(
                paired_line(label, s) for label, s in summaries.items()) + "\n"
        if ref is not None and (other := unpaired_with(rows, ref)):
            text += f"\nNot paired with {ref} (other episodes): " + ", ".join(other) + "\n"
    return text, out


def _rates(result: dict[str, Any]) -> Any:
    return result["overall"]["solved"], result["overall"]["total"]


class SideBySideTable(Callback):
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
        rows, notes = gather_rows(jobs)
        if not rows:
            log.error("multirun: no job wrote results (%s)", sweep_dir)
            return
        paired_text, paired = paired_lines(rows)
        protocol = target_of(config).protocol(config)  # a versioned benchmark's task set and user simulator
        table = ((f"{protocol}\n\n" if protocol else "") + markdown_table(rows) + "".join(f"\n- {n}" for n in notes)
                 + paired_text)
        atomic_write_json(sweep_dir / RESULTS, rows, sort_keys=False)
        if paired:
            atomic_write_json(sweep_dir / "paired.json", paired, sort_keys=False)
        atomic_write_text(sweep_dir / RESULTS_MD, table + "\n")
        chart = write_ladder_chart(rows, sweep_dir / LADDER_PNG, f"{config.name}: {len(jobs)} jobs over one upstream")
        print(f"\n{config.name}: {len(jobs)} jobs ({sweep_dir})\n{table}\n", flush=True)
        if config.logger.kind == "wandb":
            import wandb

            run = wandb.init(project=config.logger.project, entity=config.logger.entity, name=f"{config.name}-table",
                             dir=str(sweep_dir), mode=config.logger.mode, reinit="finish_previous",
                             config={"jobs": len(jobs), "sweep_dir": str(sweep_dir),
                                     "overrides": OmegaConf.to_container(config.hydra.overrides, resolve=False)})
            cols, data = wandb_rows(rows)
            run.log({"sweep/results": wandb.Table(columns=cols, data=data), "sweep/ladder": wandb.Image(str(chart))})
            run.finish()
        log.info("table: %s | chart: %s", sweep_dir / RESULTS_MD, chart)  # the multirun's last line
