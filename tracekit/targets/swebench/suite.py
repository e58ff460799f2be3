"""SWE-bench Verified adapter: instances, predictions in the official format, and the official harness.

- :func:`load_instances`: from the hub dataset (``princeton-nlp/SWE-bench_Verified``, split ``test``, 500 rows;
  needs ``datasets`` and network) or from a local ``.jsonl``/``.json`` file in the same schema (``instance_id``,
  ``repo``, ``base_commit``, ``patch``, ``test_patch``, ``problem_statement``, ``version``, ``FAIL_TO_PASS``,
  ``PASS_TO_PASS`` (JSON-encoded lists, as on the hub), ``environment_setup_commit``, ...). A malformed row is
  skipped and counted with its reason, never a crash.
- :func:`write_predictions`: ``{"instance_id", "model_name_or_path", "model_patch"}`` per line, what
  ``python -m swebench.harness.run_evaluation --predictions_path`` reads.
- :func:`run_harness`: that command (Docker, x86_64); :func:`docker_problem` says why it cannot run here (on these
  machines: no Docker engine), and the caller prints that one line.
- :class:`SweBenchSuite`: the agent interface of the local target (bash tool, submit) on a checkout of each
  instance's repository at its base commit (``repos_dir/<owner>__<name>``, a clone the user made); each episode's
  patch is scored by the harness.

What a user needs for SWE-bench Verified proper: Docker (x86_64; the harness builds an image per instance, 100+ GB for the 500), network
to the hub (or the JSONL), ``pip install swebench datasets``, clones of the 12 repositories under ``repos_dir``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_text
from tracekit.targets.coding.repo import Workspace
from tracekit.targets.coding.reward import prediction
from tracekit.coding.sandbox import CommandLimits
from tracekit.targets.coding.interface import TOOLS
from tracekit.targets.coding.suite import CodingEpisode
from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome
from tracekit.types import Message, Task

log = logging.getLogger(__name__)

REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "FAIL_TO_PASS", "PASS_TO_PASS")
LIST_FIELDS = ("FAIL_TO_PASS", "PASS_TO_PASS")


@dataclass
class SweBenchInstance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    patch: str = ""
    test_patch: str = ""
    version: str = ""
    environment_setup_commit: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Loaded:
    instances: list[SweBenchInstance]
    skipped: dict[str, str]  # row (instance id or line number) -> why


def parse_instance(row: dict[str, Any]) -> SweBenchInstance:
    """One row of the SWE-bench schema (ValueError naming the problem)."""
    if not isinstance(row, dict):
        raise ValueError(f"not an object ({type(row).__name__})")
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    values = dict(row)
    for k in LIST_FIELDS:
        v = values[k]
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                raise ValueError(f"{k} is neither a list nor a JSON-encoded list") from None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{k} must be a list of test names")
        values[k] = v
    for k in ("instance_id", "repo", "base_commit", "problem_statement"):
        if not isinstance(values[k], str) or not values[k]:
            raise ValueError(f"{k} must be a non-empty string")
    if "/" not in values["repo"]:
        raise ValueError(f"repo {values['repo']!r} is not owner/name")
    known = {f for f in SweBenchInstance.__dataclass_fields__ if f != "extra"}
    return SweBenchInstance(**{k: values[k] for k in known if k in values},
                            extra={k: v for k, v in values.items() if k not in known})


def load_instances(source: str, split: str = "test", limit: int | None = None,
                   ids: list[str] | None = None) -> Loaded:
    """Instances from a local JSONL/JSON file or a hub dataset id (see the module docstring)."""
    path = Path(source).expanduser()
    rows: list[tuple[str, Any]] = []
    if path.suffix in (".jsonl", ".json") or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"SWE-bench instances: no file {path}")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            data = json.loads(text)
            rows = [(f"item {i}", r) for i, r in enumerate(data if isinstance(data, list) else [data])]
        else:
            for i, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"line {i}", json.loads(line)))
                except json.JSONDecodeError as e:
                    rows.append((f"line {i}", ValueError(f"not JSON ({e.msg})")))
    else:
        try:
            import datasets
        except ImportError:
            raise RuntimeError(f"SWE-bench instances from the hub ({source}) need `pip install datasets` "
                               "(or give benchmark.coding.dataset a local .jsonl)") from None
        try:
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # noqa: BLE001 - no network, unknown dataset: one line
            raise RuntimeError(f"SWE-bench instances: cannot load {source}[{split}] from the hub: "
                               f"{' '.join(str(e).split())[:300]}") from None
        rows = [(f"row {i}", dict(r)) for i, r in enumerate(ds)]
    out, skipped = [], {}
    for where, row in rows:
        try:
            if isinstance(row, Exception):
                raise row
            inst = parse_instance(row)
        except ValueError as e:
            key = row.get("instance_id", where) if isinstance(row, dict) else where
            skipped[str(key)] = str(e)
            continue
        out.append(inst)
    if skipped:
        log.warning("SWE-bench instances: %d malformed row(s) skipped: %s", len(skipped),
                    "; ".join(f"{k}: {v}" for k, v in list(skipped.items())[:3]))
    if ids:
        wanted = set(ids)
        out = [i for i in out if i.instance_id in wanted]
    return Loaded(out[:limit] if limit is not None else out, skipped)


def write_predictions(path: str | Path, predictions: list[dict[str, Any]]) -> Path:
    """The predictions file the official harness reads (one JSON object a line, atomically)."""
    lines = []
    for p in predictions:
        bad = [k for k in ("instance_id", "model_name_or_path", "model_patch") if not isinstance(p.get(k), str)]
        if bad:
            raise ValueError(f"prediction {p.get('instance_id')!r}: {', '.join(bad)} must be strings")
        lines.append(json.dumps(prediction(p["instance_id"], p["model_name_or_path"], p["model_patch"])))
    path = Path(path)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return path


def docker_problem() -> str | None:
    """Why the official harness cannot run here, or None when it can."""
    try:
        import swebench  # noqa: F401
    except ImportError:
        return "the swebench package is not installed (pip install swebench)"
    if shutil.which("docker") is None:
        return "no docker client on PATH (the swebench harness runs every instance's tests in a Docker container)"
    try:
        r = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                           timeout=20)
    except (OSError, subprocess.SubprocessError) as e:
        return f"docker info failed: {e}"
    if r.returncode != 0:
        return f"no Docker engine answers (docker info: {r.stderr.strip()[:200]})"
    return None


def run_harness(predictions_path: Path, dataset: str, run_id: str, max_workers: int = 4,
                instance_ids: list[str] | None = None, timeout_s: int = 6 * 3600) -> dict[str, Any]:
    """``python -m swebench.harness.run_evaluation`` on the predictions; returns its report (``resolved_ids``...)."""
    why = docker_problem()
    if why:
        raise RuntimeError(f"SWE-bench harness skipped: {why}")
    cmd = [sys.executable, "-m", "swebench.harness.run_evaluation", "--dataset_name", dataset,
           "--predictions_path", str(predictions_path), "--max_workers", str(max_workers), "--run_id", run_id]
    if instance_ids:
        cmd += ["--instance_ids", *instance_ids]
    work = predictions_path.parent
    r = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"swebench harness failed (exit {r.returncode}): {r.stderr.strip()[-400:]}")
    model = json.loads(predictions_path.read_text().splitlines()[0])["model_name_or_path"].replace("/", "__")
    report = work / f"{model}.{run_id}.json"
    if not report.exists():
        raise RuntimeError(f"swebench harness wrote no report {report.name} in {work}")
    return json.loads(report.read_text())


def checkout_files(clone: Path, commit: str) -> dict[str, str]:
    """The text files of ``clone`` at ``commit`` (``git archive``; binary files are left out)."""
    r = subprocess.run(["git", "-c", "safe.directory=*", "-C", str(clone), "archive", "--format=tar", commit],
                       capture_output=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"git archive {commit[:12]} in {clone}: {r.stderr.decode(errors='replace').strip()[:200]}")
    files = {}
    with tarfile.open(fileobj=io.BytesIO(r.stdout)) as tar:
        for m in tar.getmembers():
            if m.isfile():
                data = tar.extractfile(m).read()
                try:
                    files[m.name] = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
    return files


class SweBenchSuite(EnvSuite):
    """SWE-bench instances through the coding agent interface; the reward comes from the official harness."""

    expensive_steps = True  # rollout.env_workers=auto steps its episodes in worker processes (tracekit.envs.pool)

    def __init__(self, name: str, instances: list[SweBenchInstance], repos_dir: Path, dataset: str,
                 limits: CommandLimits, model_name: str = "tracekit", max_workers: int = 4):
        self.name, self.instances = name, {i.instance_id: i for i in instances}
        self.repos_dir, self.dataset, self.limits = Path(repos_dir), dataset, limits
        self.model_name, self.max_workers = model_name, max_workers
        if not self.instances:
            raise ValueError(f"{name}: no SWE-bench instance to run")

    @classmethod
    def from_config(cls, bench: Any, limits: CommandLimits) -> SweBenchSuite:
        c = bench.coding
        why = docker_problem()
        if why:
            raise RuntimeError(f"benchmark={bench.name}: SWE-bench Verified is evaluated by the official harness, "
                               f"which cannot run here: {why}. Run Table 2 locally with scale=embedded "
                               "(benchmark coding_toolz), or on a machine with Docker")
        if not c.repos_dir:
            raise RuntimeError(f"benchmark={bench.name}: set benchmark.coding.repos_dir (clones <owner>__<name> of "
                               "the instances' repositories: the agent works in a checkout at each base commit)")
        loaded = load_instances(c.dataset, split="test", limit=bench.limit,
                                ids=list(bench.task_ids) if bench.task_ids else None)
        return cls(bench.name, loaded.instances, Path(c.repos_dir), c.dataset, limits, c.model_name, c.max_workers)

    def tasks(self) -> list[Task]:
        return [Task(id=i.instance_id, env=self.name, instruction=i.problem_statement,
                     data={"repo": i.repo, "FAIL_TO_PASS": i.FAIL_TO_PASS}) for i in self.instances.values()]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return SweBenchEpisode(self, self.instances[task.id])


class SweBenchEpisode(Episode):
    def __init__(self, suite: SweBenchSuite, inst: SweBenchInstance):
        self.suite, self.inst = suite, inst
        self._inner = CodingEpisode(suite, inst)  # type: ignore[arg-type]  # its tool loop, on this checkout

    def reset(self):
        clone = self.suite.repos_dir / self.inst.repo.replace("/", "__")
        if not clone.is_dir():
            raise FileNotFoundError(f"no clone of {self.inst.repo} at {clone}")
        self._inner.ws = Workspace(checkout_files(clone, self.inst.base_commit), prefix="swebench-")
        prompt = (f"You are a software engineer resolving an issue in {self.inst.repo} (checked out in the current "
                  "directory). Use the `bash` tool to read, edit and test the code, then call `submit`.")
        return Observation([Message(role="system", content=prompt),
                            Message(role="user", content=self.inst.problem_statement)], tools=_tools())

    def step(self, action):
        return self._inner.step(action)

    def outcome(self) -> Outcome:
        ws = self._inner.ws
        patch = ws.diff() if ws is not None else ""
        if ws is not None:
            ws.close()
        pred = prediction(self.inst.instance_id, self.suite.model_name, patch)
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"swebench-{self.inst.instance_id}"
        work.mkdir(parents=True, exist_ok=True)
        path = write_predictions(work / "predictions.jsonl", [pred])
        report = run_harness(path, self.suite.dataset, run_id=f"tracekit-{self.inst.instance_id}",
                             max_workers=1, instance_ids=[self.inst.instance_id])
        resolved = self.inst.instance_id in report.get("resolved_ids", [])
        return Outcome(1.0 if resolved else 0.0, resolved, {"prediction": pred, "harness": report,
                                                            "commands": self._inner.commands,
                                                            "submitted": self._inner.submitted})


def _tools():
    return TOOLS
