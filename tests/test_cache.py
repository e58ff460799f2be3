"""The stage cache and pipeline keys: compute once, recompute only what a change reads, locks, kills."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests import procs
from tracekit.artifacts import COMPLETE, StageCache, iter_jsonl, JsonlAppender, read_jsonl
from tracekit.pipeline import Pipeline, RunRecord, Stage


def _counting_pipeline(calls: list[str]) -> Pipeline:
    def a(ctx):
        calls.append("a")
        (ctx.work_dir / "a.txt").write_text(str(ctx.cfg.x))

    def b(ctx):
        calls.append("b")
        a_val = (ctx.inputs["a"].path / "a.txt").read_text()
        (ctx.work_dir / "b.txt").write_text(f"{a_val}+{ctx.cfg.y}")

    def sel(ctx):  # its content depends only on whether x is even: a content-keyed stage
        calls.append("sel")
        (ctx.work_dir / "parity.txt").write_text(str(ctx.cfg.x % 2))

    def down(ctx):
        calls.append("down")
        (ctx.work_dir / "d.txt").write_text((ctx.inputs["sel"].path / "parity.txt").read_text())

    return Pipeline([
        Stage("a", reads=("x",), inputs=(), compute=a),
        Stage("b", reads=("y",), inputs=("a",), compute=b),
        Stage("sel", reads=("x",), inputs=(), compute=sel, identity_files=("parity.txt",)),
        Stage("down", reads=("z",), inputs=("sel",), compute=down),
    ])


def _run(tmp_path: Path, calls: list[str], targets=("b", "down"), **cfg):
    conf = OmegaConf.create({"seed": 0, "x": 1, "y": 2, "z": 3, **cfg})
    run_dir = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    run_dir.mkdir()
    record = RunRecord(run_dir)
    out = _counting_pipeline(calls).run(conf, list(targets), StageCache(tmp_path / "cache"), record)
    return out, record


def test_same_config_twice_computes_once(tmp_path):
    calls: list[str] = []
    _run(tmp_path, calls)
    assert sorted(calls) == ["a", "b", "down", "sel"]
    out, record = _run(tmp_path, calls)
    assert sorted(calls) == ["a", "b", "down", "sel"]  # nothing recomputed
    assert all(a["cache_hit"] for a in record.artifacts.values())
    used = json.loads((record.run_dir / "artifacts.json").read_text())
    assert {u["stage"] for u in used.values()} == {"a", "b", "sel", "down"}
    assert (out["b"].path / "b.txt").read_text() == "1+2"


def test_changed_value_recomputes_only_readers(tmp_path):
    calls: list[str] = []
    _run(tmp_path, calls)
    calls.clear()
    _run(tmp_path, calls, y=5)  # only b reads y
    assert calls == ["b"]
    calls.clear()
    _run(tmp_path, calls, x=7)  # a, b (input changed), sel read x; sel's content (parity 1) is unchanged
    assert sorted(calls) == ["a", "b", "sel"]  # down keys on sel's content: shared
    calls.clear()
    _run(tmp_path, calls, x=2)
    assert sorted(calls) == ["a", "b", "down", "sel"]


def test_unknown_stage_is_a_clear_error(tmp_path):
    with pytest.raises(KeyError, match="unknown stage 'nope'"):
        _run(tmp_path, [], targets=("nope",))


_RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tracekit.artifacts import StageCache
    root, log, release = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    def compute(work):
        with open(log, "a") as f:
            f.write("computed\\n")
        while not release.exists():  # the test says when: an event, not a clock
            time.sleep(0.02)
        (work / "out.txt").write_text("done")
    art = StageCache(root).get_or_compute("slow", "k1", compute)
    print(art.path)
""")


def test_two_processes_racing_compute_once(tmp_path):
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    log, release = tmp_path / "log.txt", tmp_path / "release"
    racers = [procs.popen([sys.executable, str(script), str(tmp_path / "c"), str(log), str(release)],
                          stdout=subprocess.PIPE, text=True) for _ in range(2)]
    # one computes and holds the lock until released; the other, whenever it gets there, waits on the lock or hits
    procs.wait_for(lambda: log.exists() or all(p.poll() is not None for p in racers), "a racer to start computing")
    release.touch()
    outs = [p.communicate(timeout=600)[0].strip() for p in racers]
    assert all(p.returncode == 0 for p in racers)
    assert log.read_text().count("computed") == 1
    assert outs[0] == outs[1] and (Path(outs[0]) / "out.txt").read_text() == "done"


def test_killed_mid_write_leaves_nothing_complete(tmp_path):
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    log, release = tmp_path / "log.txt", tmp_path / "release"
    p = procs.popen([sys.executable, str(script), str(tmp_path / "c"), str(log), str(release)])
    procs.wait_for_path(log, proc=p)  # inside compute, which waits for a release that never comes
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    cache = StageCache(tmp_path / "c")
    assert cache.lookup("slow", "k1") is None
    assert not (tmp_path / "c" / "slow" / "k1" / COMPLETE).exists()
    # a rerun completes (the lock died with the killed process)
    release.touch()
    out = procs.run([sys.executable, str(script), str(tmp_path / "c"), str(log), str(release)],
                    capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert cache.lookup("slow", "k1") is not None


def test_jsonl_torn_tail_is_dropped_and_truncated(tmp_path):
    path = tmp_path / "rows.jsonl"
    with JsonlAppender(path) as app:
        app.append({"i": 0})
        app.append({"i": 1})
    with open(path, "a") as f:
        f.write('{"i": 2, "tru')  # a write torn by a kill
    assert [r["i"] for r in iter_jsonl(path)] == [0, 1]
    with JsonlAppender(path) as app:  # resuming truncates the torn tail before appending
        app.append({"i": 2})
    assert [r["i"] for r in read_jsonl(path)] == [0, 1, 2]


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"i": 0}\nnot json\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: malformed row"):
        read_jsonl(path)


# --------------------------------------------------------------------------------------------
# a directory the cache or the run cannot write: said up front, and a write that fails names its file


def test_unwritable_names_a_file_in_the_way_and_passes_a_writable_dir(tmp_path):
    from tracekit.artifacts import unwritable

    assert unwritable(tmp_path) is None and unwritable(tmp_path / "not" / "yet") is None  # made when absent
    (tmp_path / "f").write_text("")
    assert unwritable(tmp_path / "f") == f"{tmp_path / 'f'} is not a directory"
    assert unwritable(tmp_path / "f" / "cache") == f"{tmp_path / 'f'} is a file, not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe file is gone, nothing was made


@pytest.mark.parametrize("err,why", [(28, "has no space left (No space left on device)"),
                                     (30, "is on a read-only file system"),
                                     (13, "is not writable (permission denied)")])
def test_unwritable_says_why_a_directory_cannot_be_written(tmp_path, monkeypatch, err, why):
    import tracekit.artifacts as artifacts

    def fails(fd):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(artifacts.os, "fsync", fails)
    assert artifacts.unwritable(tmp_path) == f"{tmp_path} {why}"
    assert list(tmp_path.iterdir()) == []


def test_a_write_on_a_full_disk_names_its_file(tmp_path, monkeypatch):
    import errno

    import tracekit.artifacts as artifacts
    from tracekit.artifacts import atomic_write_json

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    app = JsonlAppender(tmp_path / "rows.jsonl")
    monkeypatch.setattr(artifacts.os, "fsync", full)
    with pytest.raises(OSError, match=rf"No space left on device: '{tmp_path / 'x.json'}'"):
        atomic_write_json(tmp_path / "x.json", {"a": 1})
    with pytest.raises(OSError, match=rf"No space left on device: '{tmp_path / 'rows.jsonl'}'"):
        app.append({"i": 0})
    app.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.jsonl"]  # no temp file left behind


def test_key_neutral_settings_leave_the_key_as_before_they_existed():
    """An option that only matters when another is on (synthesize's official acceptance gate) keeps the keys of every
    config that leaves it off: the key is the one computed before the option existed; switched on, it moves."""
    stage = Stage("s", reads=("g",), inputs=(), compute=lambda ctx: None,
                  key_neutral=lambda cfg: ("g.gate", "g.gate_size") if cfg.g.gate == "none" else ())
    before = Pipeline([Stage("s", reads=("g",), inputs=(), compute=lambda ctx: None)])
    after = Pipeline([stage])
    old = OmegaConf.create({"g": {"lr": 1}})
    off = OmegaConf.create({"g": {"lr": 1, "gate": "none", "gate_size": 16}})
    on = OmegaConf.create({"g": {"lr": 1, "gate": "official", "gate_size": 16}})
    assert after.key(off, stage, {}) == before.key(old, before.stages["s"], {})
    assert after.key(on, stage, {}) != after.key(off, stage, {})
    bad = Stage("s", reads=("g",), inputs=(), compute=lambda ctx: None, key_neutral=lambda cfg: ("h.x",))
    with pytest.raises(KeyError, match="inside none of the stage's reads"):
        Pipeline([bad]).key(off, bad, {})
