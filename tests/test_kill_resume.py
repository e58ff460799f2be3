"""A run SIGKILLed mid-stage and run again ends with the cache an uninterrupted run leaves, byte for byte.

``python -m tracekit experiment=smoke logger=none agent.batch_size=1`` runs in a subprocess with its own root and
cache (one episode at a time: a rollout's rows are written one by one, seconds apart, so there is a moment with some
written and the stage unfinished; batched, the two smoke episodes end together and their stage completes at once); the
test
waits (on the event, not a clock) until the chosen stage's ``<key>.partial`` work dir holds its progress file
(:data:`PROGRESS`), SIGKILLs the run's whole process group, runs the same command again and compares every file of
the two caches (``.lock`` files included) with an uninterrupted run's.

Compared byte for byte: every file, apart from the timing fields (how long something took, when it finished),
which two runs of one config never share:

- JSON (``*.json``, each line of ``*.jsonl``): the keys in :data:`TIMING_KEYS`, at any depth (``COMPLETE.json``:
  ``seconds``, ``finished``);
- CSV: the columns in :data:`TIMING_COLUMNS` (GRPO's ``metrics.csv``: ``time_rollout_s``, ``time_update_s``,
  ``time_total_s``);
- Markdown: the lines matching :data:`TIMING_LINE` (a synthesized environment's ``validation.md``: ``- time: 0.2s``);
- in ``COMPLETE.json``'s manifest, the ``bytes`` and ``sha256`` of a file that held such fields.

Besides timing, one record of a run's own history differs by design: a rollout's ``episodes/<key>/summary.json``
says how this process got its episodes (:data:`EPISODE_HISTORY_KEYS`: ``resumed`` from the killed run's file,
``ran`` itself, and ``prefix_cache``, its decoder's prefill counts, empty when it decoded nothing). Those are
checked for consistency (``resumed + ran == total``, and something resumed in the resumed cache), not compared.

Anything else that differs fails. Both runs get ``PYTHONHASHSEED=0``: PEFT stores ``target_modules`` as a set and
writes it to ``adapter_config.json`` in the set's order, which follows the interpreter's string-hash seed, so two
processes with random seeds write that list in different orders (a run-to-run difference, not the kill's).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs
from tracekit.artifacts import COMPLETE

ROOT = Path(__file__).resolve().parent.parent

SMOKE = ("experiment=smoke", "logger=none", "agent.batch_size=1")
TIMING_KEYS = frozenset({"seconds", "finished"})
TIMING_COLUMNS = frozenset({"time_rollout_s", "time_update_s", "time_total_s"})
TIMING_LINE = re.compile(r"^- time: [0-9.]+s$", re.M)
EPISODE_HISTORY_KEYS = frozenset({"resumed", "ran", "prefix_cache"})  # top level of episodes/<key>/summary.json


def _is_episode_summary(path: Path) -> bool:
    return path.name == "summary.json" and path.parent.parent.name == "episodes"


def _smoke(root: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "TRACEKIT_ROOT": str(root), "TRACEKIT_CACHE": str(root / "cache"), "WANDB_MODE": "offline",
           "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return procs.popen([sys.executable, "-m", "tracekit", *SMOKE], cwd=ROOT, env=env, stdout=out, stderr=out,
                           start_new_session=True)  # its own group: killed with its workers


def _finish(root: Path, log: Path) -> None:
    p = _smoke(root, log)
    rc = p.wait(timeout=3000)
    assert rc == 0, log.read_text()[-3000:]


def _drop_timing(x):
    if isinstance(x, dict):
        return {k: _drop_timing(v) for k, v in x.items() if k not in TIMING_KEYS}
    if isinstance(x, list):
        return [_drop_timing(v) for v in x]
    return x


def _normalized(path: Path) -> tuple[object, bool]:
    """A file's content without timing fields, and whether it held any."""
    raw = path.read_bytes()
    if path.suffix == ".json":
        data = json.loads(raw)
    elif path.suffix == ".jsonl":
        data = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    elif path.suffix == ".csv":
        rows = list(csv.reader(io.StringIO(raw.decode())))
        keep = [i for i, name in enumerate(rows[0] if rows else []) if name not in TIMING_COLUMNS]
        if rows and len(keep) < len(rows[0]):
            return [[row[i] for i in keep] for row in rows], True
        return raw, False
    elif path.suffix == ".md":
        text = raw.decode()
        kept = TIMING_LINE.sub("", text)
        return (kept, True) if kept != text else (raw, False)
    else:
        return raw, False
    dropped = _drop_timing(data)
    if _is_episode_summary(path):
        dropped = {k: v for k, v in dropped.items() if k not in EPISODE_HISTORY_KEYS}
    return dropped, dropped != data


def cache_view(cache: Path) -> dict[str, object]:
    """Every file of ``cache`` by relative path: its bytes, or its content without timing fields."""
    files = {p.relative_to(cache).as_posix(): p for p in sorted(cache.rglob("*")) if p.is_file()}
    normal = {rel: _normalized(p) for rel, p in files.items()}
    view: dict[str, object] = {}
    for rel, (content, _) in normal.items():
        if rel.endswith("/" + COMPLETE):  # the manifest's size and hash of a file with timing fields differ with them
            here = rel.rsplit("/", 1)[0]
            for name, entry in content.get("files", {}).items():
                if normal.get(f"{here}/{name}", (None, False))[1]:
                    entry.pop("sha256", None)
                    entry.pop("bytes", None)
        view[rel] = content
    return view


def _where(a, b, at: str = "") -> str:
    """The first place two normalized contents differ, with both values (short)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() | b.keys()):
            if a.get(k, "<absent>") != b.get(k, "<absent>"):
                return _where(a.get(k, "<absent>"), b.get(k, "<absent>"), f"{at}.{k}")
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _where(x, y, f"{at}[{i}]")
    return f"{at or '(whole file)'}: {str(a)[:200]!r} vs {str(b)[:200]!r}"


def _diff(a: dict[str, object], b: dict[str, object]) -> list[str]:
    out = [f"only in the uninterrupted cache: {k}" for k in sorted(a.keys() - b.keys())]
    out += [f"only in the resumed cache: {k}" for k in sorted(b.keys() - a.keys())]
    out += [f"differs: {k} at {_where(a[k], b[k])}" for k in sorted(a.keys() & b.keys()) if a[k] != b[k]]
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("uninterrupted")
    _finish(root, root / "run.log")
    return cache_view(root / "cache")


# what shows the stage is mid-way: its first rows of trajectories, or a GRPO checkpoint (iteration 0 of 2)
PROGRESS = {"episodes": "trajectories.jsonl", "adapters": "checkpoints/latest.json"}


def _in_progress(stage_dir: Path, stage: str) -> Path | None:
    """A ``.partial`` work dir of the stage whose progress file holds a whole line (the stage is mid-way), else None."""
    if not stage_dir.is_dir():
        return None
    for work in stage_dir.glob("*.partial"):
        done = work / PROGRESS[stage]
        if done.is_file() and b"\n" in done.read_bytes():  # a whole line (JSONL) or a written file, not a torn one
            return work
    return None


@pytest.mark.slow
@pytest.mark.timeout(5400)
@pytest.mark.parametrize("stage", sorted(PROGRESS))
def test_a_run_killed_mid_stage_resumes_to_the_uninterrupted_cache(tmp_path, uninterrupted, stage):
    cache, log = tmp_path / "cache", tmp_path / "run.log"
    p = _smoke(tmp_path, log)
    try:
        work = procs.wait_for(lambda: _in_progress(cache / stage, stage), f"{stage}/*.partial/{PROGRESS[stage]}",
                              timeout=3000, proc=p)
        os.killpg(p.pid, signal.SIGKILL)  # the run and any process it started
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert work.is_dir() and not (cache / stage / work.name[: -len(".partial")] / COMPLETE).exists()

    _finish(tmp_path, log)  # the same command again: resumes the partial stage, computes the rest
    assert not list(cache.rglob("*.partial")), "the resumed run left a partial work dir"
    summaries = [json.loads(p.read_text()) for p in cache.glob("episodes/*/summary.json")]
    assert summaries and all(s["resumed"] + s["ran"] == s["total"] for s in summaries), summaries
    if stage == "episodes":  # the killed rollout's episodes were taken over, not run again
        assert any(s["resumed"] > 0 for s in summaries), summaries
    problems = _diff(uninterrupted, cache_view(cache))
    assert not problems, "\n".join(problems[:40])
