"""Run logging: W&B (offline by default: no key, no network) or nothing, behind one small interface; tracebacks
kept out of the terminal."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.config import ConfigError
from tracekit.types import stable_hash

log = logging.getLogger(__name__)


def wandb_run_id(run_dir: Path) -> str:
    """The W&B run id of a run directory: the same directory, the same W&B run, so a restart of a run
    (``python -m tracekit --resume <run dir>``, or any run given that directory again) continues it."""
    return "tk-" + stable_hash(str(Path(run_dir).resolve()), length=16)


def config_changes(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs between two plain configs (``paths`` left out: where a run
    lives and caches is not what it computes)."""
    out = []
    for key in sorted(set(before) | set(after)):
        full = f"{prefix}{key}"
        if full == "paths":
            continue
        a, b = before.get(key, "<absent>"), after.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_changes(a, b, f"{full}.")
        elif a != b:
            out.append(f"{full}: {a} -> {b}")
    return out


RESUMING_ENV = "TRACEKIT_RESUMING"  # set by ``python -m tracekit --resume`` for the run and its sweep jobs


def check_resumed_config(cfg: DictConfig, run_dir: Path, resuming: bool | None = None) -> bool:
    """Whether this run continues the earlier run of its directory (the same config, or no earlier run): then its W&B
    run is that run's. ``--resume`` (``resuming``; default: the environment ``python -m tracekit --resume`` sets) of
    a run whose config differs is refused in one line (ConfigError). Without it, a directory given again with another
    config (a table's rows dir, an experiment's variant dir) runs as before and logs to a W&B run of its own."""
    previous = run_dir / "config.yaml"
    if not previous.is_file():
        return True
    changes = config_changes(OmegaConf.to_container(OmegaConf.load(previous), resolve=False),
                             OmegaConf.to_container(cfg, resolve=True))
    if not changes:
        return True
    if resuming is None:
        resuming = os.environ.get(RESUMING_ENV) == "1"
    if resuming:
        shown = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
        raise ConfigError(f"--resume {run_dir}: that run (W&B run {wandb_run_id(run_dir)}) was started with another "
                          f"config ({shown}): resume it with its own overrides, or start a new run")
    return False


class RunLogger:
    """Logs scalars, tables and images to W&B when enabled; a no-op sink otherwise. The W&B run's id derives from
    the run directory (:func:`wandb_run_id`) and resuming is allowed: a restarted run logs into its first W&B run."""

    def __init__(self, cfg: DictConfig, run_dir: Path, continues: bool = True):
        self.run = None
        if cfg.logger.kind != "wandb":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        plain_cfg = OmegaConf.to_container(cfg, resolve=True)
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            # another config in a directory given again (not --resume): a W&B run of its own, never mixed in
            id=wandb_run_id(run_dir) if continues else f"{wandb_run_id(run_dir)}-{stable_hash(plain_cfg, length=8)}",
            resume="allow",
            name=f"{cfg.name}-{run_dir.name}",
            dir=str(run_dir),
            mode=cfg.logger.mode,
            config=plain_cfg,
            reinit="finish_previous",
        )
        log.info("W&B run %s (%s, resumed: %s) in %s", self.run.id, cfg.logger.mode, bool(self.run.resumed),
                 run_dir / "wandb")

    def scalars(self, values: dict[str, Any], step: int | None = None) -> None:
        if self.run is not None:
            self.run.log(values, step=step)

    def table(self, key: str, columns: list[str], rows: list[list[Any]]) -> None:
        if self.run is not None:
            self.run.log({key: self._wandb.Table(columns=columns, data=rows)})

    def image(self, key: str, path: str | Path) -> None:
        if self.run is not None:
            self.run.log({key: self._wandb.Image(str(path))})

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None


def log_traceback_to_file(logger: logging.Logger, message: str, exc: BaseException) -> str | None:
    """``logger.exception(message)`` into the log file only (the terminal's handlers never see it); the file's
    path (Hydra's ``<run_dir>/<job name>.log``), None when logging writes no file."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    exc_info = (type(exc), exc, exc.__traceback__)
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, message, (), exc_info)
    for handler in files:
        handler.handle(record)
    return files[0].baseFilename if files else None
