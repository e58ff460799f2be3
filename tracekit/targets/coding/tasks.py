"""SWE-smith-style local coding tasks: bugs injected into a real installed package, checked by its own tests.

The package (default ``toolz``, see ``conf/benchmark/coding_toolz.yaml`` for why) is snapshotted from its installed
distribution, its tests included. Bugs come from ``swesmith``'s procedural modifiers, used as a library (no Docker):
``swesmith.bug_gen.adapters.python.get_entities_from_file_py`` finds the functions and classes of every source
file, each modifier of ``swesmith.bug_gen.procedural.python.MODIFIERS_PYTHON`` (re-instantiated with a seed of
ours) rewrites the entities it applies to, and the rewrite is spliced into the file.

A candidate becomes a task only when it is valid (SWE-smith's rule): the whole suite is run on the buggy tree
(in the sandbox: a mutated loop can hang, and is killed at the limit); ``FAIL_TO_PASS`` = tests that pass on the
pristine tree and fail on the buggy one (non-empty), ``PASS_TO_PASS`` = tests that pass on both (non-empty);
and the gold patch (buggy -> pristine, ``git`` format) applied through :func:`tracekit.targets.coding.reward.evaluate_patch`
scores 1. Every candidate's fate is counted per modifier (``report.json``).

Each task is a SWE-smith/SWE-bench-shaped record: ``instance_id``, ``repo``, ``base_commit`` (the pristine tree's
hash), ``patch`` (the gold fix, SWE-bench's convention), ``bug_patch``, ``FAIL_TO_PASS``, ``PASS_TO_PASS``,
``problem_statement`` (written from the failing tests' output), the buggy file(s), the modifier and entity.
Split: by entity (every bug in one function lands in the same split), seeded: ``train`` (analysis, baselines) and
``test`` (held out). Cached under ``<cache>/coding_tasks/<key>/``, key = hash of every setting and the seed.
"""

from __future__ import annotations

import ast
import json
import logging
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from tracekit.artifacts import atomic_write_json, read_json, read_jsonl, write_jsonl
from tracekit.coding import sandbox
from tracekit.targets.coding import repo as R
from tracekit.targets.coding.reward import evaluate_patch
from tracekit.coding.sandbox import CommandLimits
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

GENERATOR_VERSION = 1
SPLITS = ("train", "test")


@dataclass(frozen=True)
class TaskGenConfig:
    package: str = "toolz"
    seed: int = 0
    modifiers: tuple[str, ...] = ()  # swesmith modifier names (pm.name); empty: all Python modifiers
    max_per_modifier: int = 3  # valid tasks kept per modifier
    max_candidates_per_modifier: int = 8  # candidates tried per modifier (each costs one suite run)
    heldout_fraction: float = 0.5  # share of entities whose tasks are held out (split "test")
    test_wall_seconds: float = 60.0  # a suite run past this is killed (the task is dropped as "timeout")
    test_cpu_seconds: int = 60

    def __post_init__(self) -> None:
        if self.max_per_modifier < 1 or self.max_candidates_per_modifier < 1:
            raise ValueError("max_per_modifier and max_candidates_per_modifier must be >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")

    def limits(self) -> CommandLimits:
        return CommandLimits(cpu_seconds=self.test_cpu_seconds, wall_seconds=self.test_wall_seconds,
                             output_chars=4000)


@dataclass
class CodingTask:
    instance_id: str
    repo: str  # "<distribution>==<version>"
    base_commit: str  # hash of the pristine tree (there is no upstream commit: the package comes from the registry)
    patch: str  # the gold fix (buggy -> pristine)
    bug_patch: str  # pristine -> buggy
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    problem_statement: str
    buggy_files: dict[str, str]  # path -> buggy text (the rest of the tree is the pristine snapshot)
    modifier: str
    entity: str  # file::name
    split: str
    test_files: list[str] = field(default_factory=list)
    image_name: str | None = None  # SWE-smith's Docker image field: none, tasks run locally

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class TaskSet:
    """Generated tasks, their pristine tree and the generation report."""

    root: Path
    tasks: list[CodingTask]
    pristine: dict[str, str]
    report: dict[str, Any]

    def split(self, name: str) -> list[CodingTask]:
        if name not in SPLITS:
            raise ValueError(f"coding tasks: unknown split {name!r} (splits: {', '.join(SPLITS)})")
        return [t for t in self.tasks if t.split == name]

    def buggy_tree(self, task: CodingTask) -> dict[str, str]:
        return {**self.pristine, **task.buggy_files}


def python_modifiers(names: tuple[str, ...] = ()) -> list[Any]:
    """swesmith's Python procedural modifiers (optionally only ``names``), in their registry order."""
    try:
        from swesmith.bug_gen.procedural.python import MODIFIERS_PYTHON
    except ImportError as e:  # swesmith's package __init__ imports every language's tree-sitter grammar
        raise RuntimeError(f"coding tasks need swesmith's procedural modifiers: {e} "
                           "(pip install swesmith and the tree-sitter grammars listed in pyproject.toml)") from None
    known = {pm.name: pm for pm in MODIFIERS_PYTHON}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"coding tasks: unknown swesmith modifier(s) {unknown}; known: {', '.join(known)}")
    return [known[n] for n in names] if names else list(MODIFIERS_PYTHON)


def is_test_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return "/tests/" in f"/{path}" or name.startswith("test_") or name == "conftest.py"


def test_files(files: dict[str, str]) -> list[str]:
    return sorted(p for p in files if is_test_file(p) and p.rsplit("/", 1)[-1].startswith("test_"))


def splice(text: str, entity: Any, rewrite: str) -> str:
    """``text`` with the entity's lines replaced by ``rewrite`` at the entity's indentation (swesmith's rule)."""
    lines = text.splitlines(keepends=True)
    indent = " " * (entity.indent_level * entity.indent_size)
    new = [f"{indent}{x}" if x.strip() else x for x in rewrite.splitlines(keepends=True)]
    if new and not new[-1].endswith("\n"):
        new[-1] += "\n"
    return "".join(lines[:entity.line_start - 1] + new + lines[entity.line_end:])


def _entities(tree_dir: Path, files: dict[str, str]) -> list[Any]:
    from swesmith.bug_gen.adapters.python import get_entities_from_file_py

    out: list[Any] = []
    for rel in files:
        if rel.endswith(".py") and not is_test_file(rel):
            found: list[Any] = []
            get_entities_from_file_py(found, str(tree_dir / rel))
            out += found
    return out


def _problem_statement(f2p: list[str], failures: dict[str, str]) -> str:
    shown = "\n".join(f"- {t}" for t in f2p[:8]) + (f"\n- ... and {len(f2p) - 8} more" if len(f2p) > 8 else "")
    first = next((failures[t] for t in f2p if t in failures), "")
    excerpt = "\n".join(first.strip().splitlines()[-25:])
    return (f"After a recent change, {len(f2p)} test(s) of the library's own suite fail that used to pass:\n{shown}\n\n"
            f"Output of the first failure:\n```\n{excerpt}\n```\n\nFix the library code so that these tests pass "
            "again without breaking any other test. Do not modify the tests.")


def _diff(before: dict[str, str], after: dict[str, str]) -> str:
    with R.Workspace(before, prefix="diff-") as ws:
        for rel, text in after.items():
            (ws.repo / rel).write_text(text, encoding="utf-8")
        return ws.diff()


def cache_key(cfg: TaskGenConfig, version: str, pristine: dict[str, str]) -> str:
    return stable_hash({"v": GENERATOR_VERSION, "cfg": asdict(cfg), "version": version,
                        "tree": stable_hash(pristine, 32)}, 24)


def load_or_generate(cfg: TaskGenConfig, cache_root: Path) -> TaskSet:
    """The cached task set for ``cfg`` (generated once, atomically, under a lock)."""
    sandbox.register_cache(cache_root)  # refused here if a command's jail would show it (gold patches, tests)
    version, pristine = R.package_snapshot(cfg.package)
    key = cache_key(cfg, version, pristine)
    root = Path(cache_root) / "coding_tasks"
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    with FileLock(str(root / f"{key}.lock")):
        if not (final / "report.json").exists():
            work = root / f"{key}.partial"
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            tasks, report = generate(cfg, version, pristine)
            atomic_write_json(work / "pristine.json", pristine)
            write_jsonl(work / "tasks.jsonl", [t.to_dict() for t in tasks])
            atomic_write_json(work / "report.json", {**report, "key": key})
            if final.exists():
                shutil.rmtree(final)
            work.replace(final)
    tasks = [CodingTask(**row) for row in read_jsonl(final / "tasks.jsonl")]
    return TaskSet(final, tasks, read_json(final / "pristine.json"), read_json(final / "report.json"))


def generate(cfg: TaskGenConfig, version: str, pristine: dict[str, str]) -> tuple[list[CodingTask], dict[str, Any]]:
    """Inject, validate and keep tasks; the report counts candidates and their fates per modifier."""
    t_start = time.monotonic()
    limits = cfg.limits()
    hide = (cfg.package,)  # the suite runs on the tree given, never on the installed package
    tests = test_files(pristine)
    if not tests:
        raise RuntimeError(f"coding tasks: {cfg.package} ships no test files (test_*.py)")
    with R.Workspace(pristine, prefix="pristine-", hide=hide) as ws:
        base = R.run_tests(ws.repo, tests, limits, hide=hide)
    passing = base.passed()
    if not passing:
        raise RuntimeError(f"coding tasks: no test of {cfg.package}'s suite passes on the pristine tree "
                           f"({base.output.strip()[-300:]})")
    tmp = Path(tempfile.mkdtemp(prefix="tracekit-entities-"))
    try:
        entities = _entities(R.write_tree(pristine, tmp), pristine)
        for e in entities:
            e.file_path = str(Path(e.file_path).relative_to(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    entities.sort(key=lambda e: (e.file_path, e.line_start, e.line_end))
    repo_name = f"{cfg.package}=={version}"
    base_commit = stable_hash(pristine, 40)
    per_modifier: dict[str, dict[str, int]] = {}
    kept: list[tuple[CodingTask, str]] = []
    seen: set[str] = set()
    for proto in python_modifiers(cfg.modifiers):
        name = proto.name
        counts = per_modifier[name] = {"applicable": 0, "tried": 0, "no_change": 0, "unparseable": 0,
                                       "duplicate": 0, "timeout": 0, "no_fail_to_pass": 0,
                                       "no_pass_to_pass": 0, "gold_failed": 0, "valid": 0}
        rng = random.Random(f"{cfg.seed}:{name}")
        pm = type(proto)(likelihood=proto.likelihood, seed=rng.randrange(2**31))
        candidates = [e for e in entities if pm.can_change(e)]
        counts["applicable"] = len(candidates)
        rng.shuffle(candidates)
        for entity in candidates:
            if counts["valid"] >= cfg.max_per_modifier or counts["tried"] >= cfg.max_candidates_per_modifier:
                break
            counts["tried"] += 1
            try:
                bug = pm.modify(entity)
            except Exception:  # noqa: BLE001 - a modifier failing on one entity is that candidate's fate
                bug = None
            if bug is None:
                counts["no_change"] += 1
                continue
            rel = entity.file_path
            buggy_text = splice(pristine[rel], entity, bug.rewrite)
            if buggy_text == pristine[rel]:
                counts["no_change"] += 1
                continue
            try:
                ast.parse(buggy_text)
            except SyntaxError:
                counts["unparseable"] += 1
                continue
            digest = stable_hash({rel: buggy_text}, 12)
            if digest in seen:
                counts["duplicate"] += 1
                continue
            seen.add(digest)
            buggy = {**pristine, rel: buggy_text}
            with R.Workspace(buggy, prefix="cand-", hide=hide) as cws:
                run = R.run_tests(cws.repo, tests, limits, hide=hide)
            if run.timed_out:
                counts["timeout"] += 1
                continue
            after = run.passed()
            f2p, p2p = sorted(passing - after), sorted(passing & after)
            if not f2p:
                counts["no_fail_to_pass"] += 1
                continue
            if not p2p:
                counts["no_pass_to_pass"] += 1
                continue
            task = CodingTask(
                instance_id=f"{cfg.package}.{version}.{name}__{digest[:8]}", repo=repo_name, base_commit=base_commit,
                patch=_diff(buggy, {rel: pristine[rel]}), bug_patch=_diff(pristine, {rel: buggy_text}),
                FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p, problem_statement=_problem_statement(f2p, run.failures),
                buggy_files={rel: buggy_text}, modifier=name, entity=f"{rel}::{entity.name}", split="",
                test_files=tests)
            verdict = evaluate_patch(task, buggy, task.patch, limits)
            if verdict.reward != 1.0:
                counts["gold_failed"] += 1
                log.warning("coding tasks: gold patch of %s scored %s (%s); dropped", task.instance_id,
                            verdict.reward, verdict.status)
                continue
            counts["valid"] += 1
            kept.append((task, digest))
        log.info("coding tasks: %s: %s", name, counts)
    tasks = assign_splits([t for t, _ in kept], cfg)
    n = {s: sum(t.split == s for t in tasks) for s in SPLITS}
    report = {"package": repo_name, "seed": cfg.seed, "tests": len(base.tests), "passing_on_pristine": len(passing),
              "pristine_suite_wall_s": base.wall_s, "entities": len(entities), "per_modifier": per_modifier,
              "valid": len(tasks), "splits": n, "wall_s": round(time.monotonic() - t_start, 1),
              "isolation": sandbox.isolation(), "config": json.loads(json.dumps(asdict(cfg)))}
    return tasks, report


def assign_splits(tasks: list[CodingTask], cfg: TaskGenConfig) -> list[CodingTask]:
    """Held-out entities: a seeded ``heldout_fraction`` of the distinct entities (at least one per split when
    there are two or more entities); every task of an entity shares its split."""
    entities = sorted({t.entity for t in tasks})
    random.Random(f"{cfg.seed}:split").shuffle(entities)
    n_test = round(len(entities) * cfg.heldout_fraction)
    if len(entities) >= 2:
        n_test = min(max(n_test, 1), len(entities) - 1)
    held = set(entities[:n_test])
    for t in tasks:
        t.split = "test" if t.entity in held else "train"
    return tasks
