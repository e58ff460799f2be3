"""The Hydra app: ``python -m tracekit [overrides]`` runs the configured stages.

    python -m tracekit                                # the default experiment (README)
    python -m tracekit stages=[rollout,evaluate]      # a chosen list of stages (+ missing inputs)
    python -m tracekit experiment=smoke               # a preset
    python -m tracekit -m thresholds.delta=0.1,0.2,0.3    # a multirun sweep
    python -m tracekit.reproduce table1 scale=embedded    # a paper table (tracekit/reproduce/)

Every run's first log line and ``summary.md`` state its preset and each value that differs from the paper's
(:mod:`tracekit.reproduce.paper`), so a cut run never passes for a paper run.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import StageCache, atomic_write_text
from tracekit.config import USER_ERRORS, ConfigError, needed_endpoints, probe_endpoints, register_configs, validate
from tracekit.report.logging import log_traceback_to_file

log = logging.getLogger("tracekit")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


def compose_config(overrides: list[str]) -> DictConfig:
    """The app's config for ``overrides`` through Hydra's compose API (no run dir, no logging), validated: what
    scripts and analyses that drive stages in process start from."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    validate(cfg)
    return cfg


def describe(e: BaseException) -> str:
    """``ExcType: message`` on one line."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def write_summary(run_dir: Path, cfg: DictConfig, record, failure: BaseException | None = None) -> None:
    """The run's Markdown summary: its status, stages (cache hits or computed) and each stage's report."""
    from tracekit.reproduce.paper import setting_markdown

    status = f"failed ({describe(failure)})" if failure else "ok"
    lines = [f"# tracekit run `{cfg.name}`", "", f"Status: {status}", "", f"Run dir: `{run_dir}`", "",
             "## Setting relative to the paper", "", setting_markdown(cfg), "", "## Stages", "",
             "| stage | key | cache | seconds |", "|---|---|---|---|"]
    for a in record.artifacts.values():
        lines.append(f"| {a['stage']} | `{a['key']}` | {'hit' if a['cache_hit'] else 'computed'} | {a['seconds']} |")
    for title, md in record.sections:
        lines += ["", f"## {title}", "", md]
    atomic_write_text(run_dir / "summary.md", "\n".join(lines) + "\n")


def run(cfg: DictConfig) -> None:
    from tracekit.pipeline import RunRecord
    from tracekit.report.logging import RunLogger
    from tracekit.reproduce.paper import cuts, cuts_dict, setting_line
    from tracekit.stages import build_pipeline

    log.info(setting_line(cfg))  # the first line: the preset, and every value that differs from the paper's
    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    record = RunRecord(run_dir)
    failure = None
    try:
        record.logger = RunLogger(cfg, run_dir)
        if record.logger.run is not None:  # a cut run's W&B config says so too
            record.logger.run.config.update({"paper_setting": cuts_dict(cfg)}, allow_val_change=True)
        pipeline, cache = build_pipeline(), StageCache(cfg.paths.cache_dir)
        to_compute = pipeline.to_compute(cfg, list(cfg.stages), cache)  # corrupt artifacts are named here
        log.info("stages to compute: %s", ", ".join(to_compute) or "none (all cached)")
        probe_endpoints(cfg, [role for stage in to_compute for role in needed_endpoints(cfg, stage)])
        pipeline.run(cfg, list(cfg.stages), cache, record)
    except BaseException as e:
        failure = e
        raise
    finally:
        write_summary(run_dir, cfg, record, failure)
        if record.logger is not None:
            record.logger.finish(1 if failure else 0)
    n = len(cuts(cfg))
    log.info("summary: %s (%s)", run_dir / "summary.md",
             f"CUT: {n} values differ from the paper's, named in it" if n else "the paper's setting, no cut")


def discard_rejected_run(run_dir: Path, root_dir: Path) -> None:
    """Remove the run dir Hydra made before validation when it holds only Hydra's own files (its config copies
    and the log), then the parents that leaves empty, up to ``root_dir``."""
    hydra = HydraConfig.get()
    if any(p.name not in (hydra.output_subdir, f"{hydra.job.name}.log") for p in run_dir.iterdir()):
        return
    shutil.rmtree(run_dir)
    for parent in run_dir.parents:
        if root_dir.resolve() not in parent.resolve().parents:
            break
        try:
            parent.rmdir()
        except OSError:  # not empty: another run's
            break


def report_failure(e: Exception) -> int:
    """One line on the terminal, the traceback in the run's log file; the exit status (2: the user's to fix)."""
    log_file = log_traceback_to_file(log, f"run failed: {describe(e)}", e)
    if isinstance(e, USER_ERRORS):
        print(f"tracekit: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(f"tracekit: failed: {describe(e)}" + (f" (traceback: {log_file})" if log_file else ""), file=sys.stderr)
    return 1


def task(cfg: DictConfig) -> dict[str, object]:
    """One run of the app on a composed config, as a Hydra job of a table (``tracekit.reproduce``): validate, run,
    and raise on failure (the traceback in the job's log file); its run dir and seconds."""
    t0 = time.time()
    validate(cfg)
    try:
        run(cfg)
    except Exception as e:
        log_traceback_to_file(log, f"run failed: {describe(e)}", e)
        raise
    return {"run_dir": str(cfg.paths.run_dir), "seconds": time.time() - t0}


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as e:
        discard_rejected_run(Path(cfg.paths.run_dir), Path(cfg.paths.root_dir))
        print(f"tracekit: config error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        run(cfg)
    except Exception as e:
        sys.exit(report_failure(e))
