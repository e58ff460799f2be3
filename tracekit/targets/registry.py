"""The targets registry: one folder per target (``tracekit/targets/<kind>/``), found by ``benchmark.kind`` through the
targets' index (:data:`tracekit.target_index.KINDS`; the table of kinds, folders, suites and metrics:
docs/ARCHITECTURE.md's targets registry, held against the index by tests/test_docs_registries.py),
and the ``benchmark`` config group assembled from it: the fields every target reads
(:class:`~tracekit.targets.base.BenchmarkSettings`) plus each target's own settings class at
``benchmark.<mount>`` (:func:`benchmark_schema`). A stage's key holds the common fields and the running target's
own settings only (:func:`benchmark_reads`), so one target's knobs never move another's keys.

Adding a target: one folder ``tracekit/targets/<kind>/`` with a :class:`~tracekit.targets.base.Target` subclass (its
settings class beside it), one line in the index's ``KINDS``, one ``conf/benchmark/<name>.yaml`` (``kind: <kind>``).
``tests/test_toolsandbox.py`` holds the registry against ``conf/benchmark/``.
"""

from __future__ import annotations

from dataclasses import field, fields, make_dataclass
from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from tracekit.config import CONF, _check, eval_benchmark
from tracekit.synthesis.library import LIBRARY_NAMES
from tracekit.target_index import KINDS, kind_of_env, resolve
from tracekit.targets.base import BenchmarkSettings, Target


@cache
def target(kind: str) -> Target:
    """The target of ``benchmark.kind`` ``kind`` (its module imported on first use: tau2's loads the benchmark)."""
    if kind not in KINDS:
        raise KeyError(f"no target of kind {kind!r} (built: {', '.join(KINDS)})")
    return resolve(KINDS[kind].target)()


def target_of(cfg: DictConfig) -> Target:
    """The target ``cfg.benchmark`` names."""
    return target(cfg.benchmark.kind)


def kinds() -> tuple[str, ...]:
    return tuple(KINDS)


def env_names() -> tuple[str, ...]:
    """Every environment name a library target's ``envs`` may hold: the library's and the targets' own
    (:attr:`~tracekit.targets.synthetic.target.LibraryTarget.extra_envs`, e.g. the micro target's two-capability kinds)."""
    extra = [name for kind in kinds() for name in getattr(target(kind), "extra_envs", {})]
    return (*LIBRARY_NAMES, *extra)


def all_domains() -> tuple[str, ...]:
    """Every target's domains (which go with which kind: the target's validate())."""
    return tuple(dict.fromkeys(d for kind in kinds() for d in target(kind).domains))


@cache
def benchmark_schema() -> type:
    """The ``benchmark`` group's schema: :class:`BenchmarkSettings` plus one field per mount, typed by the settings
    class of the targets mounted there (targets sharing a mount share its class)."""
    mounts: dict[str, type] = {}
    for kind in kinds():
        t = target(kind)
        if t.settings is not None:
            mounts.setdefault(t.mount_name(), t.settings)
    choices = {**BenchmarkSettings.CHOICES, "kind": kinds, "domains": all_domains}
    return make_dataclass("BenchmarkConfig", [(m, cls, field(default_factory=cls)) for m, cls in mounts.items()],
                          bases=(BenchmarkSettings,), namespace={"CHOICES": choices})


COMMON_FIELDS = tuple(f.name for f in fields(BenchmarkSettings))


def benchmark_reads(cfg: DictConfig) -> tuple[str, ...]:
    """The benchmark keys a run of ``cfg`` depends on: the common fields and its target's own settings."""
    t = target_of(cfg)
    own = (f"benchmark.{t.mount_name()}",) if t.settings is not None else ()
    return (*(f"benchmark.{f}" for f in COMMON_FIELDS), *own)


def family_reads(cfg: DictConfig) -> tuple[str, ...]:
    """The benchmark keys the target's synthesis family depends on (the synthesize stage, the untargeted control)."""
    return ("benchmark.kind", "benchmark.domains", "benchmark.name", *target_of(cfg).family_reads())


def benchmark_identity(b: DictConfig) -> dict[str, Any]:
    """A ``benchmark`` node as a cache identity: its common fields and its target's own settings (no other
    target's)."""
    t = target(b.kind)
    out = {f: OmegaConf.to_container(b[f], resolve=True) if OmegaConf.is_config(b[f]) else b[f]
           for f in COMMON_FIELDS}
    if t.settings is not None:
        out[t.mount_name()] = OmegaConf.to_container(t.own(b), resolve=True)
    return out


def evaluation_config(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``benchmark`` replaced by ``conf/benchmark/<eval.benchmark>.yaml`` (over the schema's defaults):
    what every evaluation rollout runs on when ``eval.benchmark`` names another target; ``cfg`` itself otherwise.
    An unknown name: ConfigError listing the known ones."""
    name = eval_benchmark(cfg)
    if name is None:
        return cfg
    folder = CONF / "benchmark"
    path = folder / f"{name}.yaml"
    _check(path.is_file(), "eval.benchmark", name, "a conf/benchmark name (" + ", ".join(
        sorted(p.stem for p in folder.glob("*.yaml"))) + ")")
    out = cfg.copy()
    with open_dict(out):
        out.benchmark = OmegaConf.merge(OmegaConf.structured(benchmark_schema()), OmegaConf.load(path))
    return out


def target_of_trajectories(trajectories: list) -> Target:
    """The target whose reference analysis reads the trajectories (its dictionary and labeler: the index's
    :func:`~tracekit.target_index.kind_of_env`); several: ValueError."""
    found = sorted({kind_of_env(t.env) for t in trajectories}) or ["tau2"]
    if len(found) > 1:
        raise ValueError(f"trajectories of several targets ({', '.join(found)}): the reference analysis labels one target")
    return target(found[0])
