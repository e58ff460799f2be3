"""The train stage's concurrent capability runs (launcher.concurrent_runs, issue 29): each capability's GRPO run in
its own process gives the same adapters as the serial in-process runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests import procs

ROOT = Path(__file__).resolve().parent.parent


def _tracekit(tmp_path: Path, cache: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(cache), "WANDB_MODE": "offline"}
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", *overrides], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _adapters(cache: Path) -> dict[str, dict]:
    found = {}
    for f in sorted((cache / "adapters").glob("*/adapter/adapter_model.safetensors")):
        found[f.parent.parent.name] = load_file(str(f))
    return found


def test_isolated_training_gives_the_in_process_adapter(tmp_path):
    """One GRPO run in a subprocess of its own (what a concurrent run is) against the same run in process, on the
    toy task where the tiny policy gets reward variance, so the adapter moves. Bit for bit at equal torch thread
    counts (the tests run one thread; as many runs as cores get one each); across thread counts a CPU reduction's
    order changes, and the adapters agree to rounding only."""
    from tests.test_rl_launch import _spec
    from tracekit.rl.launch import LauncherSettings, train

    assert torch.get_num_threads() == 1
    a = train(_spec(tmp_path / "in_process", iterations=2))
    b = train(_spec(tmp_path / "isolated", iterations=2), LauncherSettings(concurrent_runs=os.cpu_count() or 1),
              isolate=True)
    ta, tb = load_file(str(a / "adapter_model.safetensors")), load_file(str(b / "adapter_model.safetensors"))
    assert ta.keys() == tb.keys() and any(t.any() for n, t in ta.items() if "lora_B" in n)
    for name in ta:
        assert ta[name].equal(tb[name]), name
    assert (tmp_path / "in_process" / "metrics.csv").read_text().splitlines()[0] == \
        (tmp_path / "isolated" / "metrics.csv").read_text().splitlines()[0]


@pytest.mark.slow
def test_concurrent_capability_runs_give_the_serial_adapters(tmp_path):
    serial, concurrent = tmp_path / "serial", tmp_path / "concurrent"
    _tracekit(tmp_path, serial, "stages=[synthesize]")  # rollout and analysis once, shared by both arms
    shutil.copytree(serial, concurrent)
    _tracekit(tmp_path, serial, "stages=[train]")
    out = _tracekit(tmp_path, concurrent, "stages=[train]", "launcher.concurrent_runs=2")
    assert "capability GRPO runs, 2 at a time" in out.stdout + out.stderr
    a, b = _adapters(serial), _adapters(concurrent)
    assert len(a) >= 2 and a.keys() == b.keys()  # the same cache keys: isolation is not in the key
    for key in a:
        assert a[key].keys() == b[key].keys()
        for name, t in a[key].items():
            assert t.equal(b[key][name]), f"{key}: {name} differs between serial and concurrent training"
    # (the tiny model's smoke rollouts have no reward variance: the test above covers an adapter that moves)


@pytest.mark.timeout(900)
def test_concurrent_runs_out_of_range_is_one_line(tmp_path):
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "c")}
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", "launcher.concurrent_runs=0"],
                    cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.startswith("tracekit:")]
    assert out.returncode == 2 and len(lines) == 1 and "launcher.concurrent_runs" in lines[0], out.stderr[-2000:]
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").rglob("*.safetensors"))

