"""Sweeps on a multi-GPU host (issue 50): each parallel joblib job gets its own GPUs (CUDA_VISIBLE_DEVICES from its
job number, kept by its worker process), and asking for more GPUs per job than the host has is refused in one line.
Device counts are faked: no GPU is needed."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from tracekit import cli
from tracekit.config import ConfigError

JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"


def _hydra(num: int, launcher: str = JOBLIB, mode: str = "MULTIRUN"):
    return OmegaConf.create({"mode": mode, "launcher": {"_target_": launcher, "n_jobs": 4}, "job": {"num": num}})


@pytest.mark.parametrize("host,per_job,expected", [
    (8, 1, [["0"], ["1"], ["2"], ["3"], ["4"], ["5"], ["6"], ["7"], ["0"]]),
    (8, 2, [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"], ["0", "1"]]),
    (4, 3, [["0", "1", "2"], ["0", "1", "2"]]),
])
def test_each_job_number_gets_its_own_slot(host, per_job, expected):
    devices = [str(i) for i in range(host)]
    assert [cli.job_devices(n, per_job, devices) for n in range(len(expected))] == expected


def test_more_devices_per_job_than_the_host_has_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^launcher\.nproc=4: each sweep job needs 4 GPUs and this host has 2 "
                                          r"\(0, 1\): lower launcher\.nproc"):
        cli.job_devices(0, 4, ["0", "1"])


def test_a_worker_sets_cuda_visible_devices_once_from_its_first_job(monkeypatch):
    monkeypatch.setattr(cli, "_WORKER_DEVICES", None)
    cfg = OmegaConf.create({"launcher": {"nproc": 2}})
    env: dict[str, str] = {}
    host = ["2", "3", "5", "7"]  # the sweep started with CUDA_VISIBLE_DEVICES=2,3,5,7
    assert cli.assign_job_devices(cfg, _hydra(1), env, host) == ["5", "7"]
    assert env["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert cli.assign_job_devices(cfg, _hydra(2), env, host) == ["5", "7"]  # a later job of the worker keeps them


def test_nothing_is_assigned_outside_a_parallel_joblib_sweep_or_without_gpus(monkeypatch):
    cfg = OmegaConf.create({"launcher": {"nproc": 1}})
    for hydra_cfg, host in ((_hydra(0, mode="RUN"), ["0", "1"]), (_hydra(0, launcher="BasicLauncher"), ["0", "1"]),
                            (_hydra(0), [])):
        monkeypatch.setattr(cli, "_WORKER_DEVICES", None)
        env: dict[str, str] = {}
        assert cli.assign_job_devices(cfg, hydra_cfg, env, host) is None and env == {}


def test_host_devices_prefer_the_sweeps_own_list(monkeypatch):
    monkeypatch.setenv(cli.HOST_DEVICES_ENV, "4,5,6")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # a job's own setting: not the host's
    assert cli.host_devices() == ["4", "5", "6"]
    monkeypatch.delenv(cli.HOST_DEVICES_ENV)
    assert cli.host_devices() == ["5"]


def test_a_sweep_whose_jobs_need_more_gpus_than_the_host_has_starts_none(monkeypatch, capsys):
    monkeypatch.setattr(cli, "host_devices", lambda: ["0", "1"])
    config = OmegaConf.create({"launcher": {"nproc": 3}, "hydra": {"launcher": {"_target_": JOBLIB},
                                                                   "sweeper": {"_target_": "x"}}})
    with pytest.raises(SystemExit) as e:
        cli.ValidateSweep().on_multirun_start(config)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("tracekit: config error: launcher.nproc=3: each sweep job needs 3 GPUs and this host has 2")
    monkeypatch.delenv(cli.HOST_DEVICES_ENV, raising=False)
    config.launcher.nproc = 1  # fits: the jobs are told the sweep's devices
    cli.ValidateSweep().on_multirun_start(config)
    assert __import__("os").environ[cli.HOST_DEVICES_ENV] == "0,1"
    monkeypatch.delenv(cli.HOST_DEVICES_ENV)
