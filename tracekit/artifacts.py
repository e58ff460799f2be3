"""Atomic file writes, JSONL io and the content-addressed stage cache.

A stage artifact lives at ``<cache_root>/<stage>/<key>/`` and is complete iff it holds the
``COMPLETE.json`` marker. Work happens in ``<key>.partial/`` (kept across a kill so that a stage
may resume from what it already wrote), and the finished directory is renamed into place in one
``os.replace``: a killed job never leaves anything that looks complete. A per-key file lock makes
concurrent jobs (Hydra multirun with a parallel launcher) compute each artifact once.

``COMPLETE.json`` carries a manifest of the artifact's files (size, sha256, JSONL row count). A
lookup verifies it before the artifact is trusted: sizes and row counts always, hashes of files up to
``HASH_ALWAYS_BYTES`` always and of larger ones when ``TRACEKIT_VERIFY=full``; a file the manifest does not list
is a mismatch too. A mismatch raises :class:`CorruptArtifact`, naming the artifact and how to recompute it; nothing
is computed from it.
Artifacts refer to each other by ``{"stage", "key"}`` (:func:`ref`), never by path, so a cache can be
copied or moved.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from filelock import FileLock, Timeout
from pydantic import BaseModel

from tracekit.types import stable_hash

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE.json"
MANIFEST_VERSION = 1
HASH_ALWAYS_BYTES = 64 << 20  # files up to this size are hashed on every lookup; larger ones on TRACEKIT_VERIFY=full
ORPHAN_PARTIAL_DAYS = 7.0  # a .partial dir untouched (and unlocked) this long is a dead run's: removed
M = TypeVar("M", bound=BaseModel)


class CorruptArtifact(ValueError):
    """A cached artifact that fails its manifest check, or refers to one that is gone (one-line message)."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()  # what open() would give: the cache is meant to be shared, mkstemp gives 0600


def _named(e: OSError, path: Path) -> OSError:
    """``e`` naming ``path`` when it names no file (a write or fsync on a full disk: ``No space left on device``)."""
    if e.filename is None:
        e.filename = str(path)
    return e


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same directory and a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise _named(e, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


WRITE_PROBE_BYTES = 64 << 10


def unwritable(directory: str | Path) -> str | None:
    """Why files cannot be written under ``directory`` (made when absent), or None: a file where a directory must
    be, a read-only file system, no permission, or no space. Writes (and removes) one small probe file in the
    directory, or in its nearest existing ancestor when it does not exist yet."""
    directory = Path(directory)
    d = directory
    while not d.is_dir():
        if d.exists() or d.is_symlink():
            return f"{d} is not a directory" if d == directory else f"{d} is a file, not a directory"
        if d.parent == d:
            return f"{d} does not exist"
        d = d.parent
    try:
        fd, probe = tempfile.mkstemp(dir=d, prefix=".tracekit-write-test.", suffix=".tmp")
    except OSError as e:
        return _why_unwritable(d, e)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * WRITE_PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return _why_unwritable(d, e)
    finally:
        Path(probe).unlink(missing_ok=True)
    return None


def _why_unwritable(d: Path, e: OSError) -> str:
    if e.errno == errno.EROFS:
        return f"{d} is on a read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{d} is not writable (permission denied)"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{d} has no space left ({e.strerror})"
    return f"cannot write in {d} ({e.strerror or e})"


LOW_FREE_BYTES = 64 << 20  # a large write (a checkpoint, a model) that fails with less free than this: a full disk


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system holding ``path`` (its nearest existing ancestor); None when unknown."""
    d = Path(path)
    while not d.exists() and d.parent != d:
        d = d.parent
    try:
        return shutil.disk_usage(d).free
    except OSError:
        return None


@contextmanager
def full_disk_named(path: str | Path) -> Iterator[None]:
    """Around large writes under ``path`` (checkpoints, adapters, safetensors): a failure while the disk holding it
    is full is raised as ``OSError(ENOSPC)`` naming ``path`` and the free space left, the library's own error after
    it. torch's zip writer says only ``unexpected pos 8512 vs 8406``, safetensors an I/O error; the CLI's one line
    for a full disk (:func:`tracekit.cli.disk_error`) reads this one."""
    try:
        yield
    except Exception as e:
        free = free_bytes(path)
        said = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
        if not said and (free is None or free >= LOW_FREE_BYTES):
            raise
        left = "unknown" if free is None else f"{free / 2**20:.1f} MiB"
        raise OSError(errno.ENOSPC, f"No space left on device ({left} free on its disk; {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:200]})", str(path)) from e


def atomic_write_json(path: str | Path, obj: Any, sort_keys: bool = True) -> None:
    """``sort_keys=False`` keeps the order of a mapping that is itself data (the rows of a results table)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=sort_keys, default=str) + "\n")


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
        try:
            self._f.write(line + "\n")
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise _named(e, self.path)

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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _is_temp_leftover(name: str) -> bool:
    """Names of the atomic writers' temp files and dirs (``.<name>.<rand>.tmp``, ``.<name>.tmp-<id>``,
    ``.<name>.old-<id>``): never part of an artifact; a kill can leave one behind."""
    return name.startswith(".") and any(t in name for t in (".tmp", ".old"))


def build_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file under ``directory`` (but the marker): size, sha256 and, for JSONL, its row count.
    Temp leftovers of killed atomic writes are removed first."""
    for p in sorted(directory.rglob("*"), reverse=True):  # children before parents
        if _is_temp_leftover(p.name) and p.exists():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if not p.is_file() or rel == COMPLETE:
            continue
        entry: dict[str, Any] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        if p.suffix == ".jsonl":
            entry["rows"] = _count_rows(p)
        files[rel] = entry
    return files


def _count_rows(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def verify_manifest(directory: Path, files: dict[str, dict[str, Any]], full: bool) -> str | None:
    """The first way ``directory`` differs from its manifest (a listed file missing or changed, or a file it does
    not list), or None."""
    for rel, want in files.items():
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{rel} has {size} bytes, the manifest says {want['bytes']}"
        if "rows" in want and (n := _count_rows(p)) != want["rows"]:
            return f"{rel} has {n} rows, the manifest says {want['rows']}"
        if (full or size <= HASH_ALWAYS_BYTES) and file_sha256(p) != want["sha256"]:
            return f"{rel} differs from its recorded sha256 (same size: changed in place)"
    extra = sorted(rel for p in directory.rglob("*")
                   if p.is_file() and (rel := p.relative_to(directory).as_posix()) != COMPLETE and rel not in files)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"{extra[0]}{more} is not in its manifest (added after it completed)"
    return None


def _full_verify() -> bool:
    return os.environ.get("TRACEKIT_VERIFY", "") == "full"


@dataclass(frozen=True)
class Artifact:
    """A completed stage artifact: where it is, its cache key and its content key."""

    stage: str
    key: str
    path: Path
    content_key: str
    hit: bool

    def ref(self) -> dict[str, str]:
        """How another artifact refers to this one: cache-relative, so the cache can move."""
        return {"stage": self.stage, "key": self.key}

    def resolve(self, ref: dict[str, str]) -> Artifact:
        """The artifact ``ref`` (written by :meth:`ref`) names, in the same cache as this one (verified)."""
        found = StageCache(self.path.parents[1]).lookup(ref["stage"], ref["key"])
        if found is None:
            raise CorruptArtifact(f"{self.stage}/{self.key} refers to {ref['stage']}/{ref['key']}, which is not in "
                                  f"the cache {self.path.parents[1]}; recompute: rm -r {self.path}")
        return found


class StageCache:
    """Content-addressed cache of stage artifacts under ``root``."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / stage / key

    def lookup(self, stage: str, key: str) -> Artifact | None:
        """The verified artifact, None when absent; :class:`CorruptArtifact` when it fails its manifest."""
        path = self.final_dir(stage, key)
        marker = path / COMPLETE
        if not marker.exists():
            return None
        try:
            meta = read_json(marker)
        except (OSError, ValueError) as e:
            raise CorruptArtifact(f"artifact {stage}/{key}: unreadable {COMPLETE} ({e}); recompute: rm -r {path}") from None
        files = meta.get("files")
        if meta.get("manifest") != MANIFEST_VERSION or not isinstance(files, dict):
            raise CorruptArtifact(f"artifact {stage}/{key} has no manifest (written by an older tracekit) and cannot "
                                  f"be verified; recompute: rm -r {path}")
        problem = verify_manifest(path, files, full=_full_verify())
        if problem:
            raise CorruptArtifact(f"artifact {stage}/{key} is corrupt: {problem}; recompute: rm -r {path}")
        return Artifact(stage, key, path, meta["content_key"], hit=True)

    def _fresh(self, stage: str, key: str, stale: Callable[[Artifact], str | None] | None,
               say: bool = True) -> Artifact | None:
        """The verified artifact unless absent or ``stale``."""
        hit = self.lookup(stage, key)
        if hit and stale and (why := stale(hit)):
            if say:
                log.warning("artifact %s/%s is computed again: %s", stage, key, why)
            return None
        return hit

    def clean_orphans(self, stage: str, max_age_days: float = ORPHAN_PARTIAL_DAYS) -> list[Path]:
        """Remove ``<key>.partial`` dirs of ``stage`` that no live job holds and nobody touched in
        ``max_age_days`` (a killed run's leftovers; a younger one is kept so that a re-run resumes it)."""
        removed = []
        stage_dir = self.root / stage
        for work in stage_dir.glob("*.partial") if stage_dir.is_dir() else ():
            if time.time() - _newest_mtime(work) < max_age_days * 86400:
                continue
            lock = FileLock(str(stage_dir / f"{work.name[:-len('.partial')]}.lock"))
            try:
                lock.acquire(timeout=0)
            except Timeout:
                continue  # a live job is working in it
            try:
                shutil.rmtree(work, ignore_errors=True)
                removed.append(work)
            finally:
                lock.release()
        if removed:
            log.info("cache: removed %d orphan partial dir(s) of %s older than %.0f days", len(removed), stage,
                     max_age_days)
        return removed

    def get_or_compute(
        self,
        stage: str,
        key: str,
        compute: Callable[[Path], None],
        meta: dict[str, Any] | None = None,
        identity_files: Iterable[str] = (),
        stale: Callable[[Artifact], str | None] | None = None,
    ) -> Artifact:
        """Return the artifact for (stage, key), computing it once under a file lock if absent.

        ``compute(work_dir)`` writes the artifact's files into ``work_dir`` (which survives a kill,
        so it can resume). ``identity_files`` name files whose contents define the artifact's
        *content key*: downstream stages key on it, so two configs that produce the same content
        (e.g. two thresholds selecting the same capabilities) share everything downstream.
        ``stale(hit)``: why a complete artifact must be computed again though it verifies (a sub-artifact it
        used is gone: computing it again makes that one and reuses the rest), or None; it is then replaced.
        """
        hit = self._fresh(stage, key, stale)
        if hit:
            return hit
        stage_dir = self.root / stage
        stage_dir.mkdir(parents=True, exist_ok=True)
        self.clean_orphans(stage)
        lock = FileLock(str(stage_dir / f"{key}.lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.warning("waiting for another job computing %s/%s (lock %s)", stage, key, lock.lock_file)
            lock.acquire()
        try:
            hit = self._fresh(stage, key, stale, say=False)  # another process finished it while we waited
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
                "manifest": MANIFEST_VERSION,
                "files": build_manifest(work),
            }
            atomic_write_json(work / COMPLETE, marker)
            final = self.final_dir(stage, key)
            if final.exists():  # an incomplete leftover (no marker), or a stale artifact: replace it
                (final / COMPLETE).unlink(missing_ok=True)  # first: a kill mid-removal leaves no complete-looking dir
                shutil.rmtree(final)
            os.replace(work, final)
            log.info("stage %s computed in %.1fs -> %s", stage, marker["seconds"], final)
            return Artifact(stage, key, final, content_key, hit=False)
        finally:
            lock.release()


def _newest_mtime(directory: Path) -> float:
    return max((p.stat().st_mtime for p in directory.rglob("*")), default=directory.stat().st_mtime)
