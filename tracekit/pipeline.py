"""The stage graph: cache keys, dependency resolution, and the record of what a run used.

Each stage is a pure function of (the config values it reads, its inputs' content keys) -> an
artifact directory. Its cache key hashes exactly those, so a change recomputes only the stages that
read it (and, through content keys, only when an upstream *result* changed: two thresholds that select
the same capabilities share everything after ``select``). Requested stages are targets: missing
upstream artifacts are computed too, cached ones are reused.

A stage computes on a *view* of the config holding only the values it reads (every other leaf is
MISSING), so a value it uses but does not declare fails loudly instead of being left out of its key.
The master ``seed`` is a value like any other: a stage that uses ``ctx.seed`` declares ``seed``.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from tracekit.artifacts import Artifact, StageCache, atomic_write_json, read_json
from tracekit.types import stable_hash

log = logging.getLogger(__name__)


def plain(node: Any) -> Any:
    """A config node as plain Python containers (resolved); anything else as it is (the one such reader)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node

# how a run executes, not what it computes: visible to every stage, in no key
EXECUTION_KEYS = ("paths", "logger", "launcher", "name", "stages", "experiment", "rollout")

USES = "uses.json"  # the sub-artifacts a stage artifact depends on


def gone_sub_artifact(cache: StageCache, art: Artifact) -> str | None:
    """Why the stage artifact ``art`` must be computed again: a sub-artifact it used (its ``uses.json``) is not in the
    cache (removed, e.g. by the ``rm -r`` a corrupt one's message names); None when all are there. Each is verified:
    a corrupt one raises :class:`~tracekit.artifacts.CorruptArtifact` naming the ``rm -r`` that recomputes it (the
    next run computes this stage again, which makes that sub-artifact and reuses the others)."""
    uses = art.path / USES
    for ref in read_json(uses) if uses.is_file() else ():
        if cache.lookup(ref["stage"], ref["key"]) is None:
            return f"its sub-artifact {ref['stage']}/{ref['key']} is not in the cache"
    return None


def derive_seed(seed: int, *parts: Any) -> int:
    """A deterministic 31-bit seed for a (master seed, stage, item...) combination."""
    return int(stable_hash([seed, *parts], length=8), 16) & 0x7FFFFFFF


@dataclass
class RunRecord:
    """What one run did: artifacts used (hit or computed), results, and Markdown sections."""

    run_dir: Path
    artifacts: dict[str, dict[str, Any]] = field(default_factory=dict)
    sections: list[tuple[str, str]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    logger: Any = None  # tracekit.report.logging.RunLogger

    def used(self, art: Artifact, seconds: float) -> None:
        self.artifacts[f"{art.stage}/{art.key}"] = {
            "stage": art.stage,
            "key": art.key,
            "content_key": art.content_key,
            "path": str(art.path),
            "cache_hit": art.hit,
            "seconds": round(seconds, 3),
        }
        atomic_write_json(self.run_dir / "artifacts.json", self.artifacts)

    def section(self, title: str, markdown: str) -> None:
        self.sections.append((title, markdown))


class UndeclaredRead(RuntimeError):
    """A stage used a config value outside its ``reads``: its cache key would not cover it."""


@dataclass
class StageContext:
    cfg: DictConfig  # while computing: the view of the stage's reads; while reporting: the whole config
    stage: str
    work_dir: Path  # where the stage writes (a resumable partial dir until it completes)
    inputs: dict[str, Artifact]
    cache: StageCache
    record: RunRecord
    stage_seed: int | None = None  # derived from the master seed; None when the stage does not read `seed`
    uses: list[Artifact] = field(default_factory=list)  # sub-artifacts this stage read or made

    @property
    def seed(self) -> int:
        if self.stage_seed is None:
            raise UndeclaredRead(f"stage {self.stage} uses the master seed but does not declare `seed` in its reads")
        return self.stage_seed

    def use(self, art: Artifact, seconds: float) -> None:
        """Record a sub-artifact (e.g. one adapter of ``train``) in the run and in this stage's artifact."""
        self.uses.append(art)
        self.record.used(art, seconds)


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...] | Callable[[DictConfig], tuple[str, ...]]  # dotted config keys the result depends on
    inputs: tuple[str, ...] | Callable[[DictConfig], tuple[str, ...]]  # upstream stages (or a function of cfg)
    compute: Callable[[StageContext], None]
    report: Callable[[Artifact, StageContext], None] | None = None  # runs on hits and misses alike
    identity_files: tuple[str, ...] = ()  # files defining the content key (default: the cache key)
    key_extra: Callable[[DictConfig], Any] | None = None  # e.g. the contents of a file a config value names
    # dotted keys inside ``reads`` that this configuration's result does not depend on (an option that only matters
    # when another is switched on): left out of the key, so that a knob added later keeps the keys of every config
    # that leaves it off, and their caches
    key_neutral: Callable[[DictConfig], tuple[str, ...]] | None = None
    version: str = "1"  # bump when the stage's code changes what it writes


def drop_key(reads: dict[str, Any], path: str) -> None:
    """Remove the dotted ``path`` from ``reads`` (read keys -> their plain values), where one of them holds it."""
    for top, value in reads.items():
        if path.startswith(top + ".") and isinstance(value, dict):
            *parents, leaf = path[len(top) + 1 :].split(".")
            for p in parents:
                value = value.get(p) if isinstance(value, dict) else None
            if isinstance(value, dict):
                value.pop(leaf, None)
            return
    raise KeyError(f"key_neutral {path!r} is inside none of the stage's reads {sorted(reads)}")


class Pipeline:
    def __init__(self, stages: list[Stage]):
        self.stages = {s.name: s for s in stages}

    def inputs(self, cfg: DictConfig, name: str) -> tuple[str, ...]:
        deps = self.stages[name].inputs
        return deps(cfg) if callable(deps) else deps

    def reads(self, cfg: DictConfig, name: str) -> tuple[str, ...]:
        reads = self.stages[name].reads
        return reads(cfg) if callable(reads) else reads

    def order(self, cfg: DictConfig, targets: list[str]) -> list[str]:
        """Targets plus their transitive inputs, in dependency order."""
        seen: list[str] = []

        def visit(name: str) -> None:
            if name not in self.stages:
                raise KeyError(f"unknown stage {name!r}; stages: {', '.join(self.stages)}")
            for dep in self.inputs(cfg, name):
                visit(dep)
            if name not in seen:
                seen.append(name)

        for t in targets:
            visit(t)
        return seen

    def key(self, cfg: DictConfig, stage: Stage, inputs: dict[str, Artifact]) -> str:
        reads = {k: plain(OmegaConf.select(cfg, k, throw_on_missing=True)) for k in sorted(self.reads(cfg, stage.name))}
        for path in stage.key_neutral(cfg) if stage.key_neutral else ():
            drop_key(reads, path)
        return stable_hash(
            {"stage": stage.name, "version": stage.version, "reads": reads,
             "extra": stage.key_extra(cfg) if stage.key_extra else None,
             "inputs": {n: a.content_key for n, a in sorted(inputs.items())}},
            length=20,
        )

    def to_compute(self, cfg: DictConfig, targets: list[str], cache: StageCache) -> list[str]:
        """The stages a run of ``targets`` will compute: each whose inputs are cached and whose own key is not,
        and everything downstream of one (its key waits on content not made yet). Verifies what it finds, the
        sub-artifacts of a hit included, so a corrupt artifact is named before any work; a hit whose sub-artifact
        is gone is computed again."""
        known: dict[str, Artifact] = {}
        misses = []
        for name in self.order(cfg, targets):
            deps = self.inputs(cfg, name)
            hit = (cache.lookup(name, self.key(cfg, self.stages[name], {n: known[n] for n in deps}))
                   if all(n in known for n in deps) else None)
            if hit and gone_sub_artifact(cache, hit):
                hit = None
            if hit:
                known[name] = hit
            else:
                misses.append(name)
        return misses

    def run(self, cfg: DictConfig, targets: list[str], cache: StageCache, record: RunRecord) -> dict[str, Artifact]:
        done: dict[str, Artifact] = {}
        for name in self.order(cfg, targets):
            stage = self.stages[name]
            inputs = {n: done[n] for n in self.inputs(cfg, name)}
            key = self.key(cfg, stage, inputs)
            reads = self.reads(cfg, name)
            ctx = StageContext(cfg, name, cache.final_dir(name, key), inputs, cache, record,
                               derive_seed(cfg.seed, name) if "seed" in reads else None)
            t0 = time.time()

            def compute(work: Path, ctx: StageContext = ctx, stage: Stage = stage, reads=reads) -> None:
                ctx.work_dir = work
                ctx.cfg = read_view(cfg, reads)
                log.info("stage %s: computing", stage.name)
                try:
                    stage.compute(ctx)
                except MissingMandatoryValue as e:
                    missing = getattr(e, "full_key", None) or str(e).splitlines()[0]
                    raise UndeclaredRead(f"stage {stage.name} read config value {missing!r}, which is not in its "
                                         "reads (its cache key would not cover it)") from e
                finally:
                    ctx.cfg = cfg
                atomic_write_json(work / USES, [a.ref() for a in ctx.uses])

            art = cache.get_or_compute(
                name, key, compute,
                meta={"reads": list(reads), "inputs": {n: a.key for n, a in inputs.items()}},
                identity_files=stage.identity_files, stale=lambda hit: gone_sub_artifact(cache, hit),
            )
            ctx.work_dir = art.path
            if art.hit:  # a hit reads its sub-artifacts through it: record them (verified) too
                for sub in read_json(art.path / USES):
                    record.used(art.resolve(sub), 0.0)
            record.used(art, time.time() - t0)
            log.info("stage %s: %s (%s)", name, "cache hit" if art.hit else "computed", art.path)
            if stage.report:
                stage.report(art, ctx)
            done[name] = art
        return done


def read_view(cfg: DictConfig, reads: tuple[str, ...]) -> DictConfig:
    """A copy of ``cfg`` (resolved) in which every leaf outside ``reads`` and :data:`EXECUTION_KEYS` is
    MISSING: reading one raises, naming the key."""
    view = copy.deepcopy(cfg)
    OmegaConf.resolve(view)
    keep = (*reads, *EXECUTION_KEYS)

    def mask(node: DictConfig, prefix: str) -> None:
        for k in list(node.keys()):
            full = f"{prefix}{k}"
            if any(full == r or full.startswith(r + ".") for r in keep):
                continue  # read whole
            child = node._get_node(k)
            if isinstance(child, DictConfig) and any(r.startswith(full + ".") for r in keep):
                mask(child, full + ".")  # partly read
            else:
                node[k] = MISSING

    mask(view, "")
    return view
