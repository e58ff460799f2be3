"""What the baselines that learn from the target share: its training tasks, TRACE's matched budget, and the
capabilities block of the system prompt.

Training tasks (never the evaluated ones):

- ``benchmark.kind=tau2``: tau^2's ``train`` split (``split_tasks.json``), the benchmark's own reward and user.
- ``benchmark.kind=synthetic`` (``tau2_mini``): instances of the same library environments at the target's
  difficulty from the training seeds (``tracekit.stages.TRAIN_SEED_OFFSET`` on), disjoint from the held-out
  target seeds (``LibraryTargetSuite``'s 10,000,000 on) and from validation's ``0..n``.

A target with neither has no training split: :func:`training_split_problem` says why, and the methods that
need one refuse in ``validate()``.

Matched budget: TRACE's per-capability GRPO runs' episodes summed (``adapters_budget`` over the ``train``
stage's adapters), read from their artifacts: the methods that match it take ``train`` as an input.
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, read_json

CAPABILITIES_HEADER = ("Capabilities that tasks in this environment require. Exercise each one whenever a task "
                       "calls for it:")


def training_split_problem(cfg: DictConfig) -> str | None:
    """Why the target has no training split to learn from, or None when it has one."""
    b = cfg.benchmark
    if b.kind == "synthetic":
        return None
    if b.kind in ("coding", "swebench"):  # the local SWE-smith-style train split (SWE-bench Verified: the disjoint one)
        return "benchmark.split=train: the evaluated tasks are the training tasks" if b.split == "train" else None
    if b.kind == "tau2":
        if b.split == "train":
            return "benchmark.split=train: the evaluated tasks are tau^2's training tasks"
        from tracekit.envs.tau2 import load_splits

        missing = [d for d in b.domains if not load_splits(d).get("train")]
        return f"tau^2 domain(s) {missing} have no 'train' split in split_tasks.json" if missing else None
    return f"benchmark.kind={b.kind}: no training split is known for this target"


def refuse_without_training_split(cfg: DictConfig, method: str) -> None:
    from tracekit.config import ConfigError

    problem = training_split_problem(cfg)
    if problem:
        raise ConfigError(f"{method} trains on the target's training split, but {cfg.benchmark.name} has none "
                          f"({problem})")


def train_suite_reads(cfg: DictConfig) -> tuple[str, ...]:
    """Config values the target's training suite is built from."""
    reads = ["benchmark", "user"]
    if cfg.user.kind == "llm":  # the simulated user's client
        reads += [f"llm.endpoints.{cfg.user.endpoint}", "backbone", "agent.batch_size"]
    return tuple(reads)


def train_suite_spec(cfg: DictConfig, n_per_env: int | None = None, limit: int | None = None) -> dict[str, Any]:
    """The JSON-able description of the target's training suite (an env Factory's kwargs, a cache identity):
    the benchmark without its evaluation subset (split, task_ids, limit), the user and, for an LLM user, its
    endpoint. ``limit``: tau2, first n train tasks per domain; ``n_per_env``: synthetic, instances per env."""
    bench = {k: v for k, v in _plain(cfg.benchmark).items() if k not in ("split", "task_ids", "limit")}
    spec: dict[str, Any] = {"benchmark": bench, "user": _plain(cfg.user)}
    if cfg.user.kind == "llm":
        spec["llm"] = {"endpoints": {cfg.user.endpoint: _plain(cfg.llm.endpoints[cfg.user.endpoint])}}
        spec["backbone"] = _plain(cfg.backbone)
        spec["agent"] = {"batch_size": cfg.agent.batch_size, "constrained_tool_calls": False}
    if bench["kind"] == "tau2":
        spec["limit"] = limit
    elif bench["kind"] in ("coding", "swebench"):  # issue 20: the coding train split (tracekit/coding/config.py)
        spec["benchmark"]["kind"] = "coding"
        spec["limit"] = limit
    else:
        spec["n_per_env"] = int(n_per_env or 1)
    return spec


def open_target_train(spec: dict[str, Any], cache_dir: str | None = None) -> Any:
    """The target's training tasks as an EnvSuite (an env Factory: ``tracekit.methods.target_train:open_target_train``).
    ``cache_dir``: where the coding target's generated tasks are cached (default ``$TRACEKIT_CACHE`` or
    ``outputs/cache`` under ``$TRACEKIT_ROOT`` / the working directory, as ``paths.cache_dir``)."""
    from tracekit.stages import TRAIN_SEED_OFFSET, build_user, client_for

    cfg = OmegaConf.create(spec)
    b = cfg.benchmark
    if b.kind == "coding":
        import os

        from tracekit.coding.config import build_suite as coding_suite

        root = cache_dir or os.environ.get("TRACEKIT_CACHE") or os.path.join(
            os.environ.get("TRACEKIT_ROOT", os.getcwd()), "outputs", "cache")
        return coding_suite(b, root, split="train", reward=spec.get("reward", "tests"), limit=spec.get("limit"))
    if b.kind == "tau2":
        from tracekit.envs.tau2 import Tau2Suite

        return Tau2Suite(name=f"{b.name}-train", domains=list(b.domains), split="train", limit=spec.get("limit"),
                         user=build_user(cfg), max_errors=b.max_errors, agent_can_stop=b.agent_can_stop)
    if b.kind == "synthetic":
        from tracekit.synthesis.library_target import LibraryTargetSuite

        llm_user = ({"user_client": client_for(cfg, cfg.user.endpoint), "user_temperature": cfg.user.temperature}
                    if cfg.user.kind == "llm" else {})
        return LibraryTargetSuite(f"{b.name}-train", list(b.envs), difficulty=b.difficulty,
                                  n_per_env=int(spec["n_per_env"]), seed_offset=TRAIN_SEED_OFFSET,
                                  user=cfg.user.kind, **llm_user)
    raise ValueError(f"benchmark.kind={b.kind!r}: no training split is known for this target")


def trace_episodes(train: Artifact) -> int:
    """The episodes TRACE's per-capability GRPO runs rolled out, summed (the matched budget)."""
    from tracekit.methods.consolidate import adapters_budget
    from tracekit.stages import adapters_of

    return adapters_budget(adapters_of(train)).episodes


def matched_iterations(cfg: DictConfig, episodes: int) -> int:
    """GRPO iterations of ``grpo.groups x grpo.group_size`` episodes that spend ``episodes`` (rounded up)."""
    return max(1, math.ceil(episodes / (cfg.grpo.groups * cfg.grpo.group_size)))


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


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
