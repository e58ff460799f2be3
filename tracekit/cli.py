"""The Hydra app: ``python -m tracekit [overrides]`` runs the configured stages.

    python -m tracekit                                # the default experiment (README)
    python -m tracekit stages=[rollout,evaluate]      # a chosen list of stages (+ missing inputs)
    python -m tracekit experiment=smoke               # a preset
    python -m tracekit -m thresholds.delta=0.1,0.2,0.3    # a multirun sweep
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import StageCache, atomic_write_text
from tracekit.config import ConfigError, register_configs, validate

log = logging.getLogger("tracekit")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")

register_configs()


def write_summary(run_dir: Path, cfg: DictConfig, record) -> None:
    """The run's Markdown summary: stages (cache hits or computed) and each stage's report."""
    lines = [f"# tracekit run `{cfg.name}`", "", f"Run dir: `{run_dir}`", "", "## Stages", "",
             "| stage | key | cache | seconds |", "|---|---|---|---|"]
    for a in record.artifacts.values():
        lines.append(f"| {a['stage']} | `{a['key']}` | {'hit' if a['cache_hit'] else 'computed'} | {a['seconds']} |")
    for title, md in record.sections:
        lines += ["", f"## {title}", "", md]
    atomic_write_text(run_dir / "summary.md", "\n".join(lines) + "\n")


def run(cfg: DictConfig) -> int:
    from tracekit.pipeline import RunRecord
    from tracekit.report.logging import RunLogger
    from tracekit.stages import build_pipeline

    run_dir = Path(cfg.paths.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    record = RunRecord(run_dir)
    record.logger = RunLogger(cfg, run_dir)
    exit_code = 1
    try:
        build_pipeline().run(cfg, list(cfg.stages), StageCache(cfg.paths.cache_dir), record)
        exit_code = 0
    finally:
        write_summary(run_dir, cfg, record)
        record.logger.finish(exit_code)
    log.info("summary: %s", run_dir / "summary.md")
    return exit_code


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        validate(cfg)
    except ConfigError as e:
        print(f"tracekit: config error: {e}", file=sys.stderr)
        sys.exit(2)
    run(cfg)
