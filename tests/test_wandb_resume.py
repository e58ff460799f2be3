"""One W&B run across restarts (issue 50): the run id derives from the run directory, resuming is allowed, and
`--resume` of a run whose config differs is refused in one line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import procs
from tracekit.cli import resume_args
from tracekit.config import ConfigError
from tracekit.report.logging import RunLogger, check_resumed_config, wandb_run_id

ROOT = Path(__file__).resolve().parent.parent


def test_the_run_id_is_the_run_directorys(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    assert wandb_run_id(a) == wandb_run_id(tmp_path / "x" / ".." / "a") != wandb_run_id(b)
    assert wandb_run_id(a).startswith("tk-") and len(wandb_run_id(a)) == 19


def test_the_logger_resumes_the_directorys_run(make_cfg, tmp_path, monkeypatch):
    import wandb

    seen = {}

    class FakeRun:
        id, resumed = "x", True

        def finish(self, exit_code=0):
            seen["finished"] = exit_code

    monkeypatch.setattr(wandb, "init", lambda **kw: seen.update(kw) or FakeRun())
    logger = RunLogger(make_cfg("experiment=smoke", "logger=wandb"), tmp_path)
    assert seen["id"] == wandb_run_id(tmp_path) and seen["resume"] == "allow" and seen["mode"] == "offline"
    logger.finish()
    assert seen["finished"] == 0
    RunLogger(make_cfg("experiment=smoke", "logger=wandb"), tmp_path, continues=False)  # another config there
    assert seen["id"].startswith(wandb_run_id(tmp_path) + "-") and len(seen["id"]) == len(wandb_run_id(tmp_path)) + 9


def test_a_resumed_run_with_another_config_is_refused_in_one_line(make_cfg, tmp_path):
    cfg = make_cfg("experiment=smoke")
    assert check_resumed_config(cfg, tmp_path, resuming=True)  # a new run dir: nothing to compare
    (tmp_path / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    assert check_resumed_config(cfg, tmp_path, resuming=True)  # the same config: resumed
    moved = make_cfg("experiment=smoke", "grpo.lr=0.5", f"paths.cache_dir={tmp_path}/elsewhere")
    # not --resume (a table's rows dir run again with another row): allowed, on a W&B run of its own
    assert check_resumed_config(moved, tmp_path, resuming=False) is False
    with pytest.raises(ConfigError) as e:
        check_resumed_config(moved, tmp_path, resuming=True)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"--resume {tmp_path}: that run (W&B run {wandb_run_id(tmp_path)}) "
                                                "was started with another config (grpo.lr: 0.001 -> 0.5)")
    assert "paths" not in text  # where it caches is not what it computes


def test_resume_becomes_the_run_or_sweep_dir(tmp_path):
    run, sweep = tmp_path / "run", tmp_path / "sweep"
    (run).mkdir()
    (run / "config.yaml").write_text("seed: 0\n")
    (sweep / "0").mkdir(parents=True)
    (sweep / "0" / "config.yaml").write_text("seed: 0\n")
    assert resume_args(["--resume", str(run), "seed=1"]) == [f"hydra.run.dir={run}", "hydra.mode=RUN", "seed=1"]
    assert resume_args([f"--resume={sweep}"]) == [f"hydra.sweep.dir={sweep}", "hydra.mode=MULTIRUN"]
    assert resume_args(["seed=1"]) == ["seed=1"]
    with pytest.raises(ValueError, match="no earlier run there"):
        resume_args(["--resume", str(tmp_path)])
    with pytest.raises(ValueError, match="not a directory"):
        resume_args(["--resume", str(tmp_path / "nope")])


def test_the_cli_refuses_a_resume_of_another_config_before_any_work(tmp_path):
    env = {"TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    run = tmp_path / "run"
    run.mkdir()
    cfg = OmegaConf.create({"seed": 0, "name": "smoke"})
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", "--resume", str(run), "stages=[rollout]"],
                    capture_output=True, text=True, timeout=300, cwd=ROOT, env={**__import__("os").environ, **env})
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = [ln for ln in out.stderr.splitlines() if ln.startswith("tracekit:")]
    assert line.startswith(f"tracekit: error: --resume {run}: that run (W&B run {wandb_run_id(run)}) was started "
                           "with another config")
    assert not (run / "summary.md").exists()  # refused before the run wrote anything of its own
