"""The stage graph: cache keys, dependency resolution, and the record of what a run used.

Each stage is a pure function of (the config values it reads, its inputs' content keys) -> an
artifact directory. Its cache key hashes exactly those, so a change recomputes only the stages that
read it (and, through content keys, only when an upstream *result* changed: two thresholds that select
the same capabilities share everything after ``select``). Requested stages are targets: missing
upstream artifacts are computed too, cached ones are reused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, StageCache, atomic_write_json, read_json
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

USES = "uses.json"  # the sub-artifacts a stage artifact depends on


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


@dataclass
class StageContext:
    cfg: DictConfig
    stage: str
    work_dir: Path  # where the stage writes (a resumable partial dir until it completes)
    inputs: dict[str, Artifact]
    seed: int
    cache: StageCache
    record: RunRecord
    uses: list[Artifact] = field(default_factory=list)  # sub-artifacts this stage read or made

    def use(self, art: Artifact, seconds: float) -> None:
        """Record a sub-artifact (e.g. one adapter of ``train``) in the run and in this stage's artifact."""
        self.uses.append(art)
        self.record.used(art, seconds)


@dataclass(frozen=True)
class Stage:
    name: str
    reads: tuple[str, ...]  # dotted config keys whose values the artifact depends on
    inputs: tuple[str, ...] | Callable[[DictConfig], tuple[str, ...]]  # upstream stages (or a function of cfg)
    compute: Callable[[StageContext], None]
    report: Callable[[Artifact, StageContext], None] | None = None  # runs on hits and misses alike
    identity_files: tuple[str, ...] = ()  # files defining the content key (default: the cache key)
    key_extra: Callable[[DictConfig], Any] | None = None  # e.g. the contents of a file a config value names
    version: str = "1"  # bump when the stage's code changes what it writes


class Pipeline:
    def __init__(self, stages: list[Stage]):
        self.stages = {s.name: s for s in stages}

    def inputs(self, cfg: DictConfig, name: str) -> tuple[str, ...]:
        deps = self.stages[name].inputs
        return deps(cfg) if callable(deps) else deps

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
        reads = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
                 for k in stage.reads for v in [OmegaConf.select(cfg, k, throw_on_missing=True)]}
        return stable_hash(
            {"stage": stage.name, "version": stage.version, "reads": reads,
             "extra": stage.key_extra(cfg) if stage.key_extra else None,
             "inputs": {n: a.content_key for n, a in sorted(inputs.items())}},
            length=20,
        )

    def run(self, cfg: DictConfig, targets: list[str], cache: StageCache, record: RunRecord) -> dict[str, Artifact]:
        done: dict[str, Artifact] = {}
        for name in self.order(cfg, targets):
            stage = self.stages[name]
            inputs = {n: done[n] for n in self.inputs(cfg, name)}
            key = self.key(cfg, stage, inputs)
            ctx = StageContext(cfg, name, cache.final_dir(name, key), inputs,
                               derive_seed(cfg.seed, name), cache, record)
            t0 = time.time()

            def compute(work: Path, ctx: StageContext = ctx, stage: Stage = stage) -> None:
                ctx.work_dir = work
                log.info("stage %s: computing", stage.name)
                stage.compute(ctx)
                atomic_write_json(work / USES, [{"stage": a.stage, "key": a.key} for a in ctx.uses])

            art = cache.get_or_compute(
                name, key, compute,
                meta={"reads": list(stage.reads), "inputs": {n: a.key for n, a in inputs.items()}},
                identity_files=stage.identity_files,
            )
            ctx.work_dir = art.path
            if art.hit:  # a hit reads its sub-artifacts through it: record them too
                for sub in read_json(art.path / USES):
                    found = cache.lookup(sub["stage"], sub["key"])
                    if found:
                        record.used(found, 0.0)
            record.used(art, time.time() - t0)
            log.info("stage %s: %s (%s)", name, "cache hit" if art.hit else "computed", art.path)
            if stage.report:
                stage.report(art, ctx)
            done[name] = art
        return done
