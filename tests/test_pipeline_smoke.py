"""The whole pipeline on the tiny model through the real CLI: runs, caches, and shares work across thresholds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, dict]:
    """One uninterrupted `experiment=smoke` run (the preset as is, from an empty cache), shared by this module's
    tests: each starts from a copy of its cache (the run is most of their time: ~3 min here)."""
    root = tmp_path_factory.mktemp("smoke")
    out, used = _run(root)
    return root / "cache", out, used


def _copy_cache(smoke_run, tmp_path: Path, name: str = "cache") -> Path:
    shutil.copytree(smoke_run[0], tmp_path / name, symlinks=True)
    return tmp_path / name


def _run(tmp_path: Path, *overrides: str, cache: str = "cache") -> tuple[subprocess.CompletedProcess, dict]:
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / cache),
           "WANDB_MODE": "offline"}
    before = set((tmp_path / "outputs" / "runs").glob("*")) if (tmp_path / "outputs" / "runs").exists() else set()
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", *overrides], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (run_dir,) = set((tmp_path / "outputs" / "runs").glob("*")) - before
    return out, json.loads((run_dir / "artifacts.json").read_text())


def test_smoke_pipeline_runs_then_hits_the_cache(smoke_run, tmp_path):
    _, first, used = smoke_run
    _copy_cache(smoke_run, tmp_path)  # the first run's cache, here
    for row in ("| Base |", "| Single Capability GRPO (", "| TRACE |"):
        assert row in first.stdout
    stages = {a["stage"] for a in used.values()}
    assert {"rollout", "discover", "label", "select", "synthesize", "train", "adapters", "compose", "evaluate",
            "episodes"} <= stages
    assert not any(a["cache_hit"] for a in used.values())

    _, again = _run(tmp_path)  # same config: everything is a cache hit
    assert again.keys() == used.keys() and all(a["cache_hit"] for a in again.values())

    # a threshold that keeps the same capabilities recomputes only `select`; everything after it is shared
    # (the tiny model fails every task, so each capability's Delta is 0 or 1 and delta=0.3 keeps the set)
    _, swept = _run(tmp_path, "thresholds.delta=0.3")
    names = {p.read_text() for p in (tmp_path / "cache" / "select").glob("*/selected_names.json")}
    assert len(names) == 1, "the precondition of this check: both thresholds select the same capabilities"
    computed = {a["stage"] for a in swept.values() if not a["cache_hit"]}
    assert computed == {"select"}, computed

    # a moved cache is a full hit on its own files (artifacts refer to each other by key, not path)
    written = "".join(p.read_text() for p in (tmp_path / "cache").rglob("*.json"))
    assert str(smoke_run[0]) not in written and str(tmp_path / "cache") not in written
    shutil.move(tmp_path / "cache", tmp_path / "moved")
    moved_out, moved = _run(tmp_path, cache="moved")
    assert moved.keys() == used.keys() and all(a["cache_hit"] for a in moved.values())
    assert all(a["path"].startswith(str(tmp_path / "moved")) for a in moved.values())
    assert _table(moved_out.stdout) == _table(first.stdout)

    # a COMPLETE artifact truncated mid-line is named in one line; nothing is computed from it
    (episodes,) = {Path(a["path"]) for a in moved.values() if a["stage"] == "episodes" and
                   (Path(a["path"]) / "summary.json").read_text().count('"kind": "base"')}
    data = (episodes / "trajectories.jsonl").read_bytes()
    (episodes / "trajectories.jsonl").write_bytes(data[: len(data) // 2])
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "moved")}
    bad = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke"], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=300)
    lines = [line for line in bad.stderr.splitlines() if line.startswith("tracekit:")]
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr[-2000:]
    assert f"artifact episodes/{episodes.name} is corrupt: trajectories.jsonl has" in lines[0] and "rm -r" in lines[0]


def _table(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("|")]


@pytest.mark.slow  # ~100 s; test_threshold_sweep_reads_the_upstream_from_the_cache runs the same sweep fast
def test_threshold_sweep_multirun_from_a_plain_working_directory(tmp_path):
    # no TRACEKIT_ROOT: the sweep dir must resolve before Hydra's runtime config exists
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_ROOT"}
    env.update(TRACEKIT_CACHE=str(tmp_path / "cache"), WANDB_MODE="offline")
    out = procs.run([sys.executable, "-m", "tracekit", "-m", "sweep=thresholds", "experiment=smoke", "logger=none",
                     "thresholds.delta=0.1,0.3", "thresholds.rho=0.1"], cwd=tmp_path, env=env,
                    capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching 2 jobs" in out.stdout + out.stderr
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*_sweep_thresholds")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    assert not (tmp_path / "cache" / "train").exists()  # the sweep preset stops at `select`


def test_threshold_sweep_reads_the_upstream_from_the_cache(smoke_run, tmp_path):
    """The same sweep on a copy of the smoke run's cache (the fast test; the one above, from an empty cache, is
    slow): rollout ... label are hits and each job computes `select` only."""
    cache = _copy_cache(smoke_run, tmp_path)
    before = sorted(p.relative_to(cache).as_posix() for p in cache.glob("*/*/COMPLETE.json"))
    env = {k: v for k, v in os.environ.items() if k != "TRACEKIT_ROOT"}
    env.update(TRACEKIT_CACHE=str(cache), WANDB_MODE="offline")
    out = procs.run([sys.executable, "-m", "tracekit", "-m", "sweep=thresholds", "experiment=smoke", "logger=none",
                     "thresholds.delta=0.1,0.3", "thresholds.rho=0.1"], cwd=tmp_path, env=env,
                    capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching 2 jobs" in out.stdout + out.stderr
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*_sweep_thresholds")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1"]
    new = sorted(set(p.relative_to(cache).as_posix() for p in cache.glob("*/*/COMPLETE.json")) - set(before))
    assert new and {n.split("/")[0] for n in new} == {"select"}, new  # the sweep preset stops at `select`


def test_a_consolidation_sweep_over_the_cached_upstream_gives_one_table(smoke_run, tmp_path):
    """Two strategies (the smoke run's own, moe, and a merge) over a copy of the smoke run's cache: the sweep, its
    side-by-side table and the shared upstream, fast; every strategy from an empty cache is the slow test below."""
    cache = _copy_cache(smoke_run, tmp_path)
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(cache), "WANDB_MODE": "offline"}
    out = procs.run([sys.executable, "-m", "tracekit", "-m", "sweep=consolidation", "experiment=smoke",
                     "consolidation=moe,merge_linear"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Launching 2 jobs" in out.stdout + out.stderr
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*_sweep_consolidation")
    rows = json.loads((sweep_dir / "results.json").read_text())
    labels = {r["method"]: [] for r in rows.values()}
    for label, r in rows.items():
        labels[r["method"]].append(label)
    from tracekit.methods.consolidate import STRATEGIES

    assert labels["base"] == ["Base"] and len(labels["single_capability"]) == 1
    assert sorted(labels["trace"]) == sorted(STRATEGIES[s].label for s in ("moe", "merge_linear"))
    assert all(set(r["budget"]) == {"episodes", "generated_tokens", "optimizer_steps"} for r in rows.values())
    assert (sweep_dir / "results.md").is_file()
    # every row paired against Base and against TRACE on the same episodes
    paired = json.loads((sweep_dir / "paired.json").read_text())
    merge = STRATEGIES["merge_linear"].label
    assert set(paired["vs_base"]) == set(rows) - {"Base"} and set(paired["vs_trace"]) == set(rows) - {"TRACE"}
    assert paired["vs_trace"][merge]["n_episodes"] == rows["TRACE"]["overall"]["total"]
    assert paired["vs_trace"]["Base"]["diff"] == pytest.approx(-paired["vs_base"]["TRACE"]["diff"])
    md = (sweep_dir / "results.md").read_text()
    assert "Paired vs Base (" in md and "Paired vs TRACE (" in md and f"- {merge}: " in md
    assert len(list((cache / "train").glob("*/COMPLETE.json"))) == 1  # the upstream: the smoke run's, read
    assert len(list((cache / "compose").glob("*/COMPLETE.json"))) == 2


@pytest.mark.slow  # ~4.5 min; test_a_consolidation_sweep_over_the_cached_upstream_gives_one_table is the fast one
def test_consolidation_sweep_gives_one_table_with_a_row_per_strategy(tmp_path):
    from tracekit.methods.consolidate import STRATEGIES

    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    out = procs.run([sys.executable, "-m", "tracekit", "-m", "sweep=consolidation", "experiment=smoke"], cwd=ROOT,
                    env=env, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    (sweep_dir,) = (tmp_path / "outputs" / "multirun").glob("*_sweep_consolidation")
    rows = json.loads((sweep_dir / "results.json").read_text())
    labels = {r["method"]: [] for r in rows.values()}
    for label, r in rows.items():
        labels[r["method"]].append(label)
    assert labels["base"] == ["Base"] and len(labels["single_capability"]) == 1
    assert sorted(labels["trace"]) == sorted(s.label for s in STRATEGIES.values())  # one row per strategy
    assert all(set(r["budget"]) == {"episodes", "generated_tokens", "optimizer_steps"} for r in rows.values())
    assert "| On Policy Distillation |" in out.stdout and (sweep_dir / "results.md").is_file()
    # the upstream was computed once: one rollout/train artifact for nine jobs
    assert len(list((tmp_path / "cache" / "train").glob("*/COMPLETE.json"))) == 1
    assert len(list((tmp_path / "cache" / "compose").glob("*/COMPLETE.json"))) == len(STRATEGIES)
