"""What the baselines that learn from the target share: its training tasks, TRACE's matched budget, and the
capabilities block of the system prompt.

Training tasks (never the evaluated ones) are the target's (``tracekit.targets``: ``Target.training_split_problem``,
``train_spec``, ``train_suite``):

- ``tau2``: tau^2's ``train`` split (``split_tasks.json``), the benchmark's own reward and user;
- ``synthetic`` (``tau2_mini``): instances of the same library environments at the target's difficulty from the
  training seeds (``tracekit.runs.TRAIN_SEED_OFFSET`` on), disjoint from the held-out target seeds
  (``LibraryTargetSuite``'s 10,000,000 on) and from validation's ``0..n``;
- ``coding`` / ``swebench``: the local SWE-smith-style train split;
- ``toolsandbox``: the scenarios of ``benchmark.toolsandbox.train_split`` (``heldout``: a seeded category-stratified half of the
  base scenarios that no row evaluates; ``eval``: the evaluated ones, the rows marked so), in
  ``benchmark.toolsandbox.train_domains`` (default the evaluated domains).

A target without one says why (:func:`training_split_problem`), and the methods that need one refuse in
``validate()``.

Matched budget: TRACE's per-capability GRPO runs' episodes summed (``adapters_budget`` over the ``train``
stage's adapters), read from their artifacts: the methods that match it take ``train`` as an input.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, read_json
from tracekit.config import ConfigError
from tracekit.methods.consolidate import adapters_budget
from tracekit.runs import TRAIN_SEED_OFFSET, adapters_of
from tracekit.targets.registry import benchmark_identity, benchmark_reads, target, target_of
from tracekit.pipeline import plain
from tracekit.wiring import client_for

CAPABILITIES_HEADER = ("Capabilities that tasks in this environment require. Exercise each one whenever a task "
                       "calls for it:")


def training_split_problem(cfg: DictConfig) -> str | None:
    """Why the target has no training split to learn from, or None when it has one (the target's own rule)."""
    return target_of(cfg).training_split_problem(cfg)


def refuse_without_training_split(cfg: DictConfig, method: str) -> None:
    problem = training_split_problem(cfg)
    if problem:
        raise ConfigError(f"{method} trains on the target's training split, but {cfg.benchmark.name} has none "
                          f"({problem})")


def train_suite_reads(cfg: DictConfig) -> tuple[str, ...]:
    """Config values the target's training suite is built from."""
    reads = [*benchmark_reads(cfg), "user"]
    if cfg.user.kind == "llm":  # the simulated user's client
        reads += [f"llm.endpoints.{cfg.user.endpoint}", "backbone", "agent.batch_size"]
    return tuple(reads)


def train_suite_spec(cfg: DictConfig, n_per_env: int | None = None, limit: int | None = None) -> dict[str, Any]:
    """The JSON-able description of the target's training suite (an env Factory's kwargs, a cache identity):
    the benchmark without its evaluation subset (split, task_ids, limit), the user and, for an LLM user, its
    endpoint, and the target's size knob (``Target.train_spec``: ``limit``, first n training tasks per domain;
    ``n_per_env`` for synthetic targets, instances per environment)."""
    bench = {k: v for k, v in benchmark_identity(cfg.benchmark).items() if k not in ("split", "task_ids", "limit")}
    spec: dict[str, Any] = {"benchmark": bench, "user": plain(cfg.user)}
    if cfg.user.kind == "llm":
        spec["llm"] = {"endpoints": {cfg.user.endpoint: plain(cfg.llm.endpoints[cfg.user.endpoint])}}
        spec["backbone"] = plain(cfg.backbone)
        spec["agent"] = {"batch_size": cfg.agent.batch_size, "constrained_tool_calls": False}
    return target_of(cfg).train_spec(cfg, spec, n_per_env, limit)


def open_target_train(spec: dict[str, Any], cache_dir: str | None = None) -> Any:
    """The target's training tasks as an EnvSuite (an env Factory: ``tracekit.methods.target_train:open_target_train``),
    built by the target the spec's benchmark names (``Target.train_suite``; ``cache_dir``: the coding target's task
    cache)."""
    cfg = OmegaConf.create(spec)
    return target(cfg.benchmark.kind).train_suite(cfg, spec, cache_dir, client_for, TRAIN_SEED_OFFSET)


def trace_episodes(train: Artifact) -> int:
    """The episodes TRACE's per-capability GRPO runs rolled out, summed (the matched budget)."""
    return adapters_budget(adapters_of(train)).episodes


def ranked_capabilities(select: Artifact, only: set[str] | None = None) -> list[dict[str, str]]:
    """The selected capabilities (name, description), top-ranked first: by mean failure coverage (the paper
    ranks capabilities by the failures they cover), then selection count, then name. ``only``: keep these."""
    sel = read_json(select.path / "selected.json")["selected"]
    ranked = sorted(sel, key=lambda c: (-(c.get("mean_cov") or 0.0), -c.get("selection_count", 0), c["name"]))
    return [{"name": c["name"], "description": c["description"]} for c in ranked if only is None or c["name"] in only]


def capabilities_block(capabilities: list[tuple[str, str]]) -> str:
    """The capabilities block appended to the agent's system prompt: one line per (name, description)."""
    lines = [CAPABILITIES_HEADER]
    for name, description in capabilities:
        lines.append(f"- {name.replace('_', ' ')}: {' '.join(str(description).split())}")
    return "\n".join(lines)

