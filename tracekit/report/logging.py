"""Run logging: W&B (offline by default: no key, no network) or nothing, behind one small interface; tracebacks
kept out of the terminal."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


class RunLogger:
    """Logs scalars, tables and images to W&B when enabled; a no-op sink otherwise."""

    def __init__(self, cfg: DictConfig, run_dir: Path):
        self.run = None
        if cfg.logger.kind != "wandb":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            name=f"{cfg.name}-{run_dir.name}",
            dir=str(run_dir),
            mode=cfg.logger.mode,
            config=OmegaConf.to_container(cfg, resolve=True),
            reinit="finish_previous",
        )
        log.info("W&B run (%s) in %s", cfg.logger.mode, run_dir / "wandb")

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
