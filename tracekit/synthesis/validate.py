"""Validation of a synthetic environment, built-in (in-process) or generated (sandboxed).

Checks, in order (a failure stops the later checks that depend on it):

- ``load``: the module imports, defines one environment class, describes itself.
- ``interface``: every exposed tool exists in the target with exactly the target's JSON schema.
- ``deterministic``: a second, fresh backend (a new process for generated code) generating the seeds in
  reverse order yields the same instances and ground truths, compared by hash.
- ``diverse``: distinct instances (hash without the seed field) / seeds >= ``min_distinct`` (0.9).
- ``solvable``: the ground-truth trajectory scores reward 1 (and success) on every seed.
- ``noop_scores_zero``: an empty trajectory (the agent just answers "OK.") scores 0 on every seed.
- ``random_scores_low``: trajectories of schema-valid random tool calls (argument values drawn from the
  instance's own state) score a mean reward < ``max_random_mean`` (0.2).

A :class:`ValidationReport` is written as ``validation.json`` + ``validation.md``.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from tracekit.artifacts import atomic_write_json, atomic_write_text
from tracekit.synthesis.protocol import (EnvBackend, EnvInfo, InProcessBackend, Instance, SyntheticEnv,
                                         ground_truth_actions, noop_actions)
from tracekit.synthesis.sandbox import SandboxBackend, SandboxError, SandboxLimits, isolation
from tracekit.synthesis.targets import schema_mismatch, target_tools
from tracekit.types import Message, ToolCall

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ValidationConfig:
    n_seeds: int = 50
    first_seed: int = 0
    min_distinct: float = 0.9
    random_trials: int = 2  # random trajectories per seed
    random_calls: int = 4  # tool calls per random trajectory
    max_random_mean: float = 0.2

    def seeds(self) -> list[int]:
        return list(range(self.first_seed, self.first_seed + self.n_seeds))


class CheckResult(BaseModel):
    name: str
    passed: bool
    detail: str = ""


class ValidationReport(BaseModel):
    env: str = "?"
    capability: str = "?"
    target: str = "?"
    difficulty: int | None = None
    source: str
    passed: bool = False
    reason: str | None = None  # the first failed check's detail
    checks: list[CheckResult] = Field(default_factory=list)
    stats: dict[str, Any] = Field(default_factory=dict)
    sample: dict[str, Any] = Field(default_factory=dict)
    isolation: dict[str, str] = Field(default_factory=dict)
    seconds: float = 0.0

    def add(self, name: str, passed: bool, detail: str = "") -> bool:
        self.checks.append(CheckResult(name=name, passed=passed, detail=detail))
        if not passed and self.reason is None:
            self.reason = f"{name}: {detail}"
        return passed


# ---------------------------------------------------------------------------------------- random calls


def _harvest(obj: Any, pools: dict[str, list], depth: int = 0) -> None:
    """Collect strings/ints/floats (dict keys included: tau^2 tables are keyed by id) from a JSON value."""
    if depth > 12:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            pools["string"].append(str(k))
            _harvest(v, pools, depth + 1)
    elif isinstance(obj, list):
        for v in obj:
            _harvest(v, pools, depth + 1)
    elif isinstance(obj, bool):
        return
    elif isinstance(obj, int):
        pools["integer"].append(obj)
    elif isinstance(obj, float):
        pools["number"].append(obj)
    elif isinstance(obj, str):
        pools["string"].append(obj)


def _resolve(schema: dict[str, Any], defs: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    for _ in range(8):
        if "$ref" in schema:
            schema = defs.get(schema["$ref"].rsplit("/", 1)[-1], {})
        elif "anyOf" in schema or "oneOf" in schema:
            options = [s for s in schema.get("anyOf", schema.get("oneOf")) if s.get("type") != "null"]
            schema = rng.choice(options) if options else {}
        else:
            break
    return schema


def _random_value(schema: dict[str, Any], defs: dict[str, Any], pools: dict[str, list], rng: random.Random,
                  depth: int = 0) -> Any:
    schema = _resolve(schema, defs, rng)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = rng.choice([k for k in kind if k != "null"] or ["string"])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "integer":
        return rng.choice(pools["integer"] or [0, 1, 2])
    if kind == "number":
        return rng.choice(pools["number"] + pools["integer"] or [0.0, 1.0])
    if kind == "array":
        if depth > 3:
            return []
        return [_random_value(schema.get("items", {}), defs, pools, rng, depth + 1) for _ in range(rng.randint(1, 2))]
    if kind == "object":
        if depth > 3:
            return {}
        return _random_arguments(schema, defs, pools, rng, depth + 1)
    return rng.choice(pools["string"] or ["x"])


def _random_arguments(schema: dict[str, Any], defs: dict[str, Any], pools: dict[str, list], rng: random.Random,
                      depth: int = 0) -> dict[str, Any]:
    required = set(schema.get("required", []))
    return {k: _random_value(v, defs, pools, rng, depth)
            for k, v in schema.get("properties", {}).items() if k in required or rng.random() < 0.3}


def random_actions(tools: list[dict[str, Any]], instance: Instance, rng: random.Random, n_calls: int) -> list[Message]:
    """``n_calls`` schema-valid random tool calls (values from the instance's state and goal), then "OK."."""
    pools: dict[str, list] = {"string": [], "integer": [], "number": []}
    _harvest(instance.state, pools)
    pools["string"] += instance.user_goal.replace(",", " ").replace("?", " ").split()
    for k in pools:  # bounded, order-stable pools
        pools[k] = sorted(set(pools[k]), key=str)[:5000]
    actions = []
    for i in range(n_calls):
        fn = rng.choice(tools)["function"]
        params = fn.get("parameters") or {}
        args = _random_arguments(params, params.get("$defs", {}), pools, rng)
        actions.append(Message(role="assistant", tool_calls=[ToolCall(id=f"rnd-{i}", name=fn["name"], arguments=args)]))
    return actions + [Message(role="assistant", content="OK.")]


# ------------------------------------------------------------------------------------------ the checks


def _check_interface(report: ValidationReport, info: EnvInfo, reference: dict[str, dict] | None,
                     expected_target: str | None) -> bool:
    if expected_target is not None and info.target != expected_target:
        return report.add("interface", False, f"the environment declares target {info.target!r}, "
                                              f"expected {expected_target!r}")
    if not info.tools:
        return report.add("interface", False, "the environment exposes no tools")
    if reference is None:
        try:
            reference = target_tools(info.target)
        except ValueError as e:
            return report.add("interface", False, str(e))
    for tool in info.tools:
        fn = tool.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name is None:
            return report.add("interface", False, f"a tool is not in OpenAI function format: {str(tool)[:120]}")
        if name not in reference:
            return report.add("interface", False, f"tool {name!r} is not a tool of target {info.target}")
        diff = schema_mismatch(tool, reference[name])
        if diff:
            return report.add("interface", False, f"tool {name!r} differs from the target's schema at {diff}")
    return report.add("interface", True, f"{len(info.tools)} tools match target {info.target}")


def run_validation(make_backend: Callable[[], EnvBackend], source: str, cfg: ValidationConfig = ValidationConfig(),
                   reference_tools: dict[str, dict] | None = None, expected_target: str | None = None
                   ) -> ValidationReport:
    """Validate the environment ``make_backend()`` serves (called twice: the second run checks determinism)."""
    t0 = time.time()
    report = ValidationReport(source=source)
    seeds = cfg.seeds()
    backend: EnvBackend | None = None
    try:
        try:
            backend = make_backend()
            info = backend.describe()
        except SandboxError as e:
            report.add("load", False, str(e))
            return report
        report.env, report.capability, report.target = info.name, info.capability, info.target
        report.difficulty = info.difficulty
        report.add("load", True, f"{info.name} (capability {info.capability}, target {info.target}, "
                                 f"difficulty {info.difficulty} of {info.difficulty_levels})")
        if not _check_interface(report, info, reference_tools, expected_target):
            return report
        try:
            instances = backend.generate(seeds)
        except SandboxError as e:
            report.add("deterministic", False, f"generation failed: {e}")
            return report
        _sample(report, info, instances[0])
        _determinism(report, make_backend, seeds, instances)
        distinct = len({inst.content_key() for inst in instances})
        report.stats["distinct_instances"] = distinct
        report.add("diverse", distinct >= cfg.min_distinct * len(seeds),
                   f"{distinct} distinct instances over {len(seeds)} seeds "
                   f"({distinct / len(seeds):.0%}, need >= {cfg.min_distinct:.0%})")
        _scoring(report, backend, info, instances, cfg)
    except SandboxError as e:
        report.add("sandbox", False, str(e))
    finally:
        if backend is not None:
            backend.close()
        report.passed = bool(report.checks) and all(c.passed for c in report.checks)
        report.seconds = round(time.time() - t0, 3)
        log.info("validation of %s (%s): %s in %.1fs", report.env, source,
                 "passed" if report.passed else f"FAILED, {report.reason}", report.seconds)
    return report


def _sample(report: ValidationReport, info: EnvInfo, inst: Instance) -> None:
    tools_json = json.dumps(info.tools)
    report.sample = {
        "seed": inst.seed,
        "system_prompt": inst.system_prompt,
        "user_goal": inst.user_goal,
        "solution_calls": len(inst.solution),
        "prompt_chars": len(inst.system_prompt) + len(inst.user_goal) + len(tools_json),
        "tools_chars": len(tools_json),
    }


def _determinism(report: ValidationReport, make_backend: Callable[[], EnvBackend], seeds: list[int],
                 instances: list[Instance]) -> None:
    again: EnvBackend | None = None
    try:
        again = make_backend()
        second = dict(zip(reversed(seeds), again.generate(list(reversed(seeds)))))
    except SandboxError as e:
        report.add("deterministic", False, f"second generation failed: {e}")
        return
    finally:
        if again is not None:
            again.close()
    for z, inst in zip(seeds, instances):
        other = second[z]
        if inst.key() != other.key():
            part = "ground truth" if inst.solution_key() != other.solution_key() else "instance"
            report.add("deterministic", False, f"seed {z}: the {part} differs between two generations "
                                               f"({inst.key()[:12]} vs {other.key()[:12]})")
            return
    report.add("deterministic", True, f"{len(seeds)} seeds give identical instances in a fresh backend, reverse order")


def _scoring(report: ValidationReport, backend: EnvBackend, info: EnvInfo, instances: list[Instance],
             cfg: ValidationConfig) -> None:
    def score(check: str, jobs: list[tuple[Instance, list[Message]]]) -> list | None:
        try:
            return backend.score(jobs)
        except SandboxError as e:
            report.add(check, False, str(e))
            return None

    exposed = {t["function"]["name"] for t in info.tools}
    for inst in instances:
        hidden = sorted({c.name for c in inst.solution} - exposed)
        if hidden:
            report.add("solvable", False, f"seed {inst.seed}: the ground truth calls tools the environment does not "
                                          f"expose: {hidden}")
            return
    gt = score("solvable", [(inst, ground_truth_actions(inst)) for inst in instances])
    if gt is None:
        return
    bad = [(inst.seed, v) for inst, v in zip(instances, gt) if not (v.reward == 1.0 and v.success)]
    report.add("solvable", not bad,
               f"seed {bad[0][0]}: ground-truth solution scored reward {bad[0][1].reward:g} "
               f"(success={bad[0][1].success}), expected 1" if bad
               else f"ground truth scores 1 on all {len(instances)} seeds")
    noop = score("noop_scores_zero", [(inst, noop_actions()) for inst in instances])
    if noop is None:
        return
    nonzero = [(inst.seed, v.reward) for inst, v in zip(instances, noop) if v.reward != 0.0 or v.success]
    report.add("noop_scores_zero", not nonzero,
               f"seed {nonzero[0][0]}: an empty trajectory scored {nonzero[0][1]:g}" if nonzero
               else "an empty trajectory scores 0 on every seed")
    jobs = [(inst, random_actions(info.tools, inst, random.Random(f"random:{inst.seed}:{t}"), cfg.random_calls))
            for inst in instances for t in range(cfg.random_trials)]
    verdicts = score("random_scores_low", jobs)
    if verdicts is None:
        return
    rewards = [v.reward for v in verdicts]
    mean = sum(rewards) / len(rewards)
    report.stats["random_mean_reward"] = round(mean, 4)
    report.stats["random_success_rate"] = round(sum(r == 1.0 for r in rewards) / len(rewards), 4)
    report.add("random_scores_low", mean < cfg.max_random_mean,
               f"random valid tool calls: mean reward {mean:.3f} over {len(rewards)} trajectories "
               f"(need < {cfg.max_random_mean})")


# ------------------------------------------------------------------------------------------ front doors


def validate_env(env_cls: type[SyntheticEnv], difficulty: int | None = None,
                 cfg: ValidationConfig = ValidationConfig()) -> ValidationReport:
    """Validate a trusted (built-in) environment class in this process."""
    report = run_validation(lambda: InProcessBackend(env_cls(difficulty)), f"builtin:{env_cls.name}", cfg)
    report.isolation = {"mode": "in-process (trusted built-in code)"}
    return report


def validate_source(source: str, label: str = "generated", cfg: ValidationConfig = ValidationConfig(),
                    limits: SandboxLimits = SandboxLimits(), difficulty: int | None = None,
                    reference_tools: dict[str, dict] | None = None, expected_target: str | None = None
                    ) -> ValidationReport:
    """Validate untrusted module source; it only ever runs in sandboxed subprocesses."""
    report = run_validation(lambda: SandboxBackend(source, limits, difficulty, expected_target), label, cfg, reference_tools,
                            expected_target)
    report.isolation = isolation()
    return report


def report_markdown(report: ValidationReport) -> str:
    lines = [f"# Validation of `{report.env}`", "",
             f"- capability: {report.capability}; target: {report.target}; difficulty: {report.difficulty}",
             f"- source: {report.source}",
             f"- result: **{'PASSED' if report.passed else 'FAILED'}**" + (f" ({report.reason})" if report.reason else ""),
             f"- time: {report.seconds:.1f}s", "", "| check | passed | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'yes' if c.passed else 'NO'} | {c.detail.replace('|', '/')} |" for c in report.checks]
    if report.stats:
        lines += ["", "## Statistics", ""] + [f"- {k}: {v}" for k, v in report.stats.items()]
    if report.sample:
        lines += ["", "## Sample instance", "", f"- prompt characters (system + goal + tool schemas): "
                  f"{report.sample['prompt_chars']}", f"- goal: {report.sample['user_goal']}", "",
                  "```", report.sample["system_prompt"], "```"]
    if report.isolation:
        lines += ["", "## Isolation", ""] + [f"- {k}: {v}" for k, v in report.isolation.items()]
    return "\n".join(lines) + "\n"


def write_report(report: ValidationReport, out_dir: str | Path, stem: str = "validation") -> None:
    """``<stem>.json`` and ``<stem>.md`` in ``out_dir`` (atomic writes)."""
    out = Path(out_dir)
    atomic_write_json(out / f"{stem}.json", report.model_dump(mode="json"))
    atomic_write_text(out / f"{stem}.md", report_markdown(report))
