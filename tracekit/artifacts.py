"""Atomic file writes, JSONL io and the content-addressed stage cache.

A stage artifact lives at ``<cache_root>/<stage>/<key>/`` and is complete iff it holds the
``COMPLETE.json`` marker. Work happens in ``<key>.partial/`` (kept across a kill so that a stage
may resume from what it already wrote), and the finished directory is renamed into place in one
``os.replace``: a killed job never leaves anything that looks complete. A per-key file lock makes
concurrent jobs (Hydra multirun with a parallel launcher) compute each artifact once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock
from pydantic import BaseModel

from tracekit.types import stable_hash

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE.json"
M = TypeVar("M", bound=BaseModel)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_jsonl(path: str | Path, rows: Iterable[BaseModel | dict]) -> None:
    """Atomically write all rows (models or dicts) as JSON lines."""
    lines = [r.model_dump_json() if isinstance(r, BaseModel) else json.dumps(r, sort_keys=True) for r in rows]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


class JsonlAppender:
    """Append rows to a JSONL file one flushed+fsynced line at a time (incremental, resumable output).

    A torn last line (the process was killed mid-write) is dropped by :func:`read_jsonl` with
    ``skip_torn_tail=True``, so a resumed stage re-does exactly the unfinished row.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _truncate_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def append(self, row: BaseModel | dict) -> None:
        line = row.model_dump_json() if isinstance(row, BaseModel) else json.dumps(row, sort_keys=True)
        self._f.write(line + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> JsonlAppender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _truncate_torn_tail(path: Path) -> None:
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(cut)


def iter_jsonl(path: str | Path, model: type[M] | None = None, skip_torn_tail: bool = True) -> Iterator[Any]:
    """Yield rows of a JSONL file, validated into ``model`` when given.

    A last line without its newline is a write torn by a kill: skipped when ``skip_torn_tail``.
    Any other malformed line raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    torn = lines[-1] != ""
    for i, line in enumerate(lines[:-1] if not torn or skip_torn_tail else lines, start=1):
        if not line.strip():
            continue
        try:
            yield model.model_validate_json(line) if model else json.loads(line)
        except Exception as e:  # pydantic.ValidationError or json.JSONDecodeError
            raise ValueError(f"{path}:{i}: malformed row: {str(e).splitlines()[0]}") from e


def read_jsonl(path: str | Path, model: type[M] | None = None) -> list[Any]:
    return list(iter_jsonl(path, model))


@dataclass(frozen=True)
class Artifact:
    """A completed stage artifact: where it is, its cache key and its content key."""

    stage: str
    key: str
    path: Path
    content_key: str
    hit: bool


class StageCache:
    """Content-addressed cache of stage artifacts under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, stage: str, key: str) -> Artifact | None:
        path = self.final_dir(stage, key)
        marker = path / COMPLETE
        if not marker.exists():
            return None
        meta = read_json(marker)
        return Artifact(stage, key, path, meta["content_key"], hit=True)

    def get_or_compute(
        self,
        stage: str,
        key: str,
        compute: Callable[[Path], None],
        meta: dict[str, Any] | None = None,
        identity_files: Iterable[str] = (),
    ) -> Artifact:
        """Return the artifact for (stage, key), computing it once under a file lock if absent.

        ``compute(work_dir)`` writes the artifact's files into ``work_dir`` (which survives a kill,
        so it can resume). ``identity_files`` name files whose contents define the artifact's
        *content key*: downstream stages key on it, so two configs that produce the same content
        (e.g. two thresholds selecting the same capabilities) share everything downstream.
        """
        hit = self.lookup(stage, key)
        if hit:
            return hit
        stage_dir = self.root / stage
        stage_dir.mkdir(parents=True, exist_ok=True)
        with FileLock(str(stage_dir / f"{key}.lock")):
            hit = self.lookup(stage, key)  # another process finished it while we waited
            if hit:
                return hit
            work = stage_dir / f"{key}.partial"
            work.mkdir(exist_ok=True)
            t0 = time.time()
            compute(work)
            idents = sorted(identity_files)
            content_key = (
                stable_hash({f: (work / f).read_text(encoding="utf-8") for f in idents}) if idents else key
            )
            marker = {
                "stage": stage,
                "key": key,
                "content_key": content_key,
                "seconds": round(time.time() - t0, 3),
                "finished": time.strftime("%Y-%m-%dT%H:%M:%S"),
                **(meta or {}),
            }
            atomic_write_json(work / COMPLETE, marker)
            final = self.final_dir(stage, key)
            if final.exists():  # an incomplete leftover (no marker): replace it
                shutil.rmtree(final)
            os.replace(work, final)
            log.info("stage %s computed in %.1fs -> %s", stage, marker["seconds"], final)
            return Artifact(stage, key, final, content_key, hit=False)
