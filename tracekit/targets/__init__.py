"""The targets registry: one module per target, keyed by ``benchmark.kind`` (the table of kinds, modules, suites
and metrics: docs/ARCHITECTURE.md's targets registry, held against ``_MODULES`` by tests/test_docs_registries.py).

Adding a target: one module here with a :class:`~tracekit.targets.base.Target` subclass, one entry in
``_MODULES``, one ``conf/benchmark/<name>.yaml`` (``kind: <kind>``). ``tests/test_toolsandbox.py`` holds the
registry against ``conf/benchmark/``.
"""

from __future__ import annotations

import importlib
from functools import cache

from omegaconf import DictConfig

from tracekit.synthesis.library import LIBRARY_NAMES
from tracekit.targets.base import Target

# kind -> (module, class); imported on first use (tau2 imports the benchmark, seconds)
_MODULES = {
    "tau2": ("tau2", "Tau2Target"),
    "synthetic": ("tau2_mini", "LibraryTarget"),
    "toolsandbox": ("toolsandbox", "ToolSandboxTarget"),
    "coding": ("coding", "CodingTarget"),  # issue 20: local SWE-smith-style tasks
    "swebench": ("coding", "SweBenchTarget"),  # issue 20: SWE-bench Verified (the harness in Docker)
    "micro": ("micro", "MicroTarget"),  # issue 42: the micro world (learns on 2 CPU cores)
}


@cache
def target(kind: str) -> Target:
    if kind not in _MODULES:
        raise KeyError(f"no target of kind {kind!r} (built: {', '.join(_MODULES)})")
    module, cls = _MODULES[kind]
    path = module if "." in module else f"{__name__}.{module}"
    return getattr(importlib.import_module(path), cls)()


def target_of(cfg: DictConfig) -> Target:
    """The target ``cfg.benchmark`` names."""
    return target(cfg.benchmark.kind)


def kinds() -> tuple[str, ...]:
    return tuple(_MODULES)


ENV_LIST_KINDS = ("synthetic", "micro")  # the kinds whose benchmark.envs names environments


def env_names() -> tuple[str, ...]:
    """Every environment name ``benchmark.envs`` may hold: the library's and the targets' own
    (:attr:`~tracekit.targets.tau2_mini.LibraryTarget.extra_envs`, e.g. the micro target's two-capability kinds)."""
    extra = [name for kind in ENV_LIST_KINDS for name in getattr(target(kind), "extra_envs", {})]
    return (*LIBRARY_NAMES, *extra)


def train_fields() -> frozenset[str]:
    """The benchmark fields any target's training split reads (:attr:`Target.train_fields`)."""
    return frozenset(f for kind in kinds() for f in target(kind).train_fields)


def kind_of_env(env: str) -> str:
    """The target kind a trajectory's ``env`` belongs to: a library environment's name -> ``synthetic``, ToolSandbox's
    (``toolsandbox``, ``toolsandbox_<variant>``) -> ``toolsandbox``, the micro world's (``micro_*``) -> ``micro``, anything else -> ``tau2``."""
    if env.startswith("micro_"):  # the micro world's library environments and held-out task kinds
        return "micro"
    if env in LIBRARY_NAMES:
        return "synthetic"
    if env == "toolsandbox" or env.startswith("toolsandbox_"):
        return "toolsandbox"
    if env == "coding" or env.startswith("coding_"):  # issue 20: the coding target's suites (conf/benchmark/coding_*)
        return "coding"
    if env.startswith("swebench"):
        return "swebench"
    return "tau2"


def target_of_trajectories(trajectories: list) -> Target:
    """The target the trajectories ran on (reference analysis: its dictionary and labeler); several: ValueError."""
    found = sorted({kind_of_env(t.env) for t in trajectories}) or ["tau2"]
    if len(found) > 1:
        raise ValueError(f"trajectories of several targets ({', '.join(found)}): the reference analysis labels one target")
    return target(found[0])
