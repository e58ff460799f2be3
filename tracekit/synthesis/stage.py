"""The synthesize stage: one environment package per selected capability, and loading a package back.

A package is a directory ``<out_dir>/<capability>/`` with ``env.json`` (what to run), ``validation.{json,md}``
and, when calibrated, ``calibration.{json,md}``; a generated package also holds the module ``env.py`` and the
generation agent's records. ``environments.json`` in ``out_dir`` lists every capability with its status
(``ready`` or ``skipped`` with the reason), so a capability without an environment is a counted, reported skip.

- ``source="library"`` (offline default): the built-in environment for the capability on the target's family,
  validated in-process; with a ``rollout_fn`` its difficulty knob is calibrated.
- ``source="generate"``: the generation agent writes, validates (sandbox), repairs and, with a ``rollout_fn``,
  mutates a module.

With ``settings.acceptance`` (``synthesis.acceptance=official``) every ready package then faces the official TRACE
calibration gate (:func:`tracekit.synthesis.calibrate.accept`): the base policy samples G rollouts on each validation
seed of the package as training will open it; ``acceptance.json`` records the figures, the manifest entry carries
them, and an environment outside the bands becomes a skip whose reason is the one-line refusal with its numbers.

With ``settings.chains`` (``synthesis.chains``, beyond the paper: issue 53) each chain of two ready packages is run as
one conversation (:mod:`tracekit.synthesis.chain`) and sampled by ``chain_fn`` (the base policy) under
``chains/<a>+<b>/``; the manifest's ``chains`` lists each, ready or skipped with the reason. The capability packages
and the manifest's ``environments`` are as without chaining.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_json, read_json
from tracekit.llm.base import ChatClient
from tracekit.synthesis.agent import (EnvChecks, GenerationAgentConfig, GenerationSpec, default_checks,
                                      generate_environment)
from tracekit.synthesis.calibrate import OfficialAcceptance, RolloutFn, accept, calibrate_difficulty, write_calibration
from tracekit.synthesis.chain import CHAINS, ROLLOUTS, ChainedSuite, ChainSampler, chain_name, parse_chain, write_chain
from tracekit.synthesis.library import find_library_env, library_env
from tracekit.synthesis.protocol import InProcessBackend
from tracekit.synthesis.sandbox import SandboxBackend, SandboxLimits
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.suite import SyntheticSuite, UserKind
from tracekit.synthesis.targets import TARGETS
from tracekit.synthesis.validate import validate_env, write_report
from tracekit.types import Capability, Trajectory

log = logging.getLogger(__name__)

MANIFEST = "environments.json"
PACKAGE = "env.json"
ACCEPTANCE = "acceptance.json"
# a chain's instances: disjoint from validation (0..n), GRPO training (100,000 on), the held-out target (10,000,000 on)
# and the warm start's demonstrations (50,000,000 on)
CHAIN_SEED_OFFSET = 5_000_000


def official_acceptance(c: SynthesisConfig, group_size: int | None = None) -> OfficialAcceptance:
    """The official gate's rule as the ``synthesis`` group sets it (``synthesis.acceptance=official``'s), at
    ``group_size`` samples per seed (None: ``synthesis.acceptance_group_size``)."""
    band = (c.target_low, c.target_high)
    return OfficialAcceptance(group_size=c.acceptance_group_size if group_size is None else group_size,
                              mean_reward=band, success_rate=band, min_reward_std=c.min_reward_std,
                              max_all_success=c.max_all_success, max_all_zero=c.max_all_zero,
                              min_informative=c.min_informative)


@dataclass
class SynthesisSettings:
    """What :func:`synthesize` runs with: built from the ``synthesis`` group in one call (:meth:`of`), the
    generation agent's knobs and the checks every environment is held to nested."""

    source: str = SynthesisConfig.source  # library | generate
    difficulty: int | None = None  # library default when None
    checks: EnvChecks = field(default_factory=default_checks)
    agent: GenerationAgentConfig = field(default_factory=GenerationAgentConfig)
    acceptance: OfficialAcceptance | None = None  # the official gate on every ready package (None: no gate)
    chains: list[tuple[str, str]] = field(default_factory=list)  # (first, second) capabilities, run as one episode
    chain_seeds: list[int] = field(default_factory=list)  # the instances each chain is sampled on
    chain_samples: int = SynthesisConfig.chain_samples  # base-policy samples per instance

    @classmethod
    def of(cls, c: SynthesisConfig, seed: int | None) -> SynthesisSettings:
        """From the ``synthesis`` group; ``seed``: the stage's, which only the generate source reads (the library
        source draws nothing)."""
        if c.source == "generate" and seed is None:
            raise ValueError("synthesis.source=generate samples the generation LLM: it needs the stage's seed")
        acceptance = official_acceptance(c) if c.acceptance == "official" else None
        agent = GenerationAgentConfig(max_repair_rounds=c.repair_rounds, max_mutation_rounds=c.mutation_rounds,
                                      seed=seed if c.source == "generate" else 0)
        seeds = list(range(CHAIN_SEED_OFFSET, CHAIN_SEED_OFFSET + c.chain_seeds))
        return cls(source=c.source, difficulty=c.difficulty, checks=EnvChecks.of(c), agent=agent,
                   acceptance=acceptance, chains=[parse_chain(e) for e in c.chains], chain_seeds=seeds,
                   chain_samples=c.chain_samples)


def trajectory_excerpt(traj: Trajectory, max_chars: int = 1500) -> str:
    """A failed trajectory as compact text for the generation prompt (tool calls and results included)."""
    lines = []
    for m in traj.messages:
        if m.role == "system":
            continue
        if m.tool_calls:
            lines += [f"assistant -> {c.name}({c.arguments})" for c in m.tool_calls]
        if m.content:
            lines.append(f"{m.role}: {' '.join(m.content.split())[:300]}")
    text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 20] + "\n[... truncated]"


def _capabilities(selected: list[dict[str, Any]] | list[Capability]) -> list[tuple[Capability, list[str]]]:
    out = []
    for c in selected:
        if isinstance(c, Capability):
            out.append((c, []))
        else:
            out.append((Capability(name=c["name"], description=c["description"]),
                        list(c.get("example_failed_trajectories", []))))
    return out


def synthesize(selected: list[dict[str, Any]] | list[Capability], target: str, out_dir: str | Path,
               settings: SynthesisSettings = SynthesisSettings(), trajectories: dict[str, Trajectory] | None = None,
               client: ChatClient | None = None, rollout_fn: RolloutFn | None = None,
               acceptance_fn: RolloutFn | None = None, chain_fn: ChainSampler | None = None) -> dict[str, Any]:
    """Build, validate (and calibrate) one environment per capability of ``selected`` (``selected.json``
    entries or Capability objects), then put each ready one to ``settings.acceptance`` with ``acceptance_fn`` (the
    base policy's rollouts), and sample each chain of ``settings.chains`` with ``chain_fn``; returns and writes the
    manifest."""
    out = Path(out_dir)
    if settings.source == "generate" and client is None:
        raise ValueError("synthesis.source=generate needs a generation ChatClient")
    if settings.acceptance is not None and acceptance_fn is None:
        raise ValueError("synthesis.acceptance=official needs a rollout function (the base policy's samples)")
    if settings.chains and chain_fn is None:
        raise ValueError("synthesis.chains needs a rollout function (the base policy's samples of each chain)")
    if settings.source == "generate" and target not in TARGETS:
        raise ValueError(f"generation needs a concrete target, one of {', '.join(TARGETS)}; got {target!r}")
    entries = []
    for cap, failed_uids in _capabilities(selected):
        pkg = out / cap.name
        if settings.source == "library":
            entry = _library_package(cap, target, pkg, settings, rollout_fn)
        else:
            excerpts = [trajectory_excerpt(trajectories[u]) for u in failed_uids if trajectories and u in trajectories]
            entry = _generated_package(cap, target, pkg, settings, client, rollout_fn, excerpts)
        if entry["status"] == "ready" and settings.acceptance is not None:
            entry = _accepted_package(entry, pkg, settings, settings.acceptance, acceptance_fn)
        entries.append(entry)
        log.info("synthesize %s: %s%s", cap.name, entry["status"], f" ({entry['reason']})" if entry.get("reason") else "")
    manifest = {"source": settings.source, "target": target, "environments": entries,
                "ready": sum(e["status"] == "ready" for e in entries),
                "skipped": sum(e["status"] == "skipped" for e in entries)}
    if settings.chains:  # only then: a manifest without chaining is as before
        ready = {e["capability"] for e in entries if e["status"] == "ready"}
        manifest[CHAINS] = [_chain(pair, ready, out, settings, chain_fn) for pair in settings.chains]
    atomic_write_json(out / MANIFEST, manifest)
    return manifest


def _chain(pair: tuple[str, str], ready: set[str], out: Path, settings: SynthesisSettings,
           chain_fn: ChainSampler) -> dict[str, Any]:
    """One chain's manifest entry: sampled by ``chain_fn`` when both capabilities have a ready package."""
    name = chain_name(*pair)
    missing = [c for c in pair if c not in ready]
    if missing:
        return {"chain": name, "status": "skipped",
                "reason": f"no ready environment for {', '.join(missing)} (a chain needs both capabilities selected "
                          "and synthesized)"}
    parts = [open_package(out / cap, settings.chain_seeds, limits=settings.checks.limits) for cap in pair]
    try:
        try:
            suite = ChainedSuite(parts[0], parts[1], settings.chain_seeds)
        except ValueError as e:  # generated environments whose tools conflict: no episode is run
            log.info("synthesize chain %s: skipped (%s)", name, e)
            return {"chain": name, "status": "skipped", "reason": str(e)}
        trajectories = chain_fn(suite, settings.chain_seeds, settings.chain_samples, out / CHAINS / name / ROLLOUTS)
    finally:
        for p in parts:
            p.close()
    outcomes = [bool(t.success) for t in trajectories]
    record = {"chain": name, "parts": list(pair), "env": suite.name, "seeds": [settings.chain_seeds[0],
              settings.chain_seeds[-1] + 1], "samples": settings.chain_samples, "episodes": len(outcomes),
              "successes": sum(outcomes), "rollouts": ROLLOUTS, "tools": suite.tools}
    write_chain(out / CHAINS / name, record)
    log.info("synthesize chain %s: %d of %d base-policy episodes succeed", name, record["successes"], len(outcomes))
    return {"chain": name, "status": "ready", "episodes": len(outcomes), "successes": record["successes"]}


def _library_package(cap: Capability, target: str, pkg: Path, settings: SynthesisSettings,
                     rollout_fn: RolloutFn | None) -> dict[str, Any]:
    cls = find_library_env(cap.name, target)
    if cls is None:
        return {"capability": cap.name, "status": "skipped",
                "reason": f"no built-in environment for {cap.name!r} on {target} (use synthesis.source=generate)"}
    difficulty = cls.default_difficulty if settings.difficulty is None else settings.difficulty
    if difficulty not in cls.difficulty_levels:
        difficulty = cls.default_difficulty
    if rollout_fn is not None:
        seeds = list(range(settings.checks.calibration_seeds))
        report = calibrate_difficulty(lambda d: SyntheticSuite.from_env(cls(d), seeds), cls.difficulty_levels,
                                      rollout_fn, seeds, settings.checks.calibration_k, settings.checks.targets, start=difficulty,
                                      name=cls.name)
        write_calibration(report, pkg)
        difficulty = report.chosen_difficulty
    validation = validate_env(cls, difficulty, settings.checks.validation)
    write_report(validation, pkg)
    if not validation.passed:  # a built-in env failing validation is a bug: report it, do not train on it
        return {"capability": cap.name, "status": "skipped", "reason": f"validation failed: {validation.reason}"}
    atomic_write_json(pkg / PACKAGE, {"kind": "library", "name": cls.name, "capability": cap.name,
                                      "target": cls.target, "difficulty": difficulty})
    return {"capability": cap.name, "status": "ready", "kind": "library", "env": cls.name, "difficulty": difficulty}


def _generated_package(cap: Capability, target: str, pkg: Path, settings: SynthesisSettings, client: ChatClient,
                       rollout_fn: RolloutFn | None, excerpts: list[str]) -> dict[str, Any]:
    spec = GenerationSpec(capability=cap, target=target, failure_excerpts=excerpts)
    result = generate_environment(client, spec, pkg, settings.agent, rollout_fn, settings.checks)
    if result.status != "accepted":
        return {"capability": cap.name, "status": "skipped", "reason": result.reason}
    difficulty = None
    if (pkg / "calibration.json").exists():
        difficulty = read_json(pkg / "calibration.json")["chosen_difficulty"]
    atomic_write_json(pkg / PACKAGE, {"kind": "generated", "module": "env.py", "capability": cap.name,
                                      "target": target, "difficulty": difficulty})
    return {"capability": cap.name, "status": "ready", "kind": "generated", "difficulty": difficulty,
            "rounds": len(result.rounds), "calibrated": result.calibrated}


def _accepted_package(entry: dict[str, Any], pkg: Path, settings: SynthesisSettings, rule: OfficialAcceptance,
                      rollout_fn: RolloutFn) -> dict[str, Any]:
    """``entry`` with the official gate's figures; a skip with the refusal line when the package misses a band."""
    seeds = settings.checks.validation.seeds()
    suite = open_package(pkg, seeds, limits=settings.checks.limits)  # as training opens it
    try:
        report = accept(suite, seeds, rollout_fn, rule)
    finally:
        suite.close()
    atomic_write_json(pkg / ACCEPTANCE, report.model_dump(mode="json"))
    figures = {"accepted": report.accepted, **report.figures.model_dump(mode="json")}
    if not report.accepted:
        return {"capability": entry["capability"], "status": "skipped", "reason": report.refusal(),
                "acceptance": figures}
    return {**entry, "acceptance": figures}


def open_package(pkg_dir: str | Path, seeds: list[int] | range, user: UserKind = "scripted",
                 limits: SandboxLimits = SandboxLimits(), **suite_kwargs: Any) -> SyntheticSuite:
    """The EnvSuite of an environment package (generated code runs only in the sandbox)."""
    pkg = Path(pkg_dir)
    meta = read_json(pkg / PACKAGE)
    if meta["kind"] == "library":
        backend = InProcessBackend(library_env(meta["name"])(meta["difficulty"]))
    elif meta["kind"] == "generated":
        backend = SandboxBackend.from_file(pkg / meta["module"], limits, meta.get("difficulty"), meta.get("target"))
    else:
        raise ValueError(f"{pkg / PACKAGE}: unknown package kind {meta['kind']!r}")
    return SyntheticSuite(backend, seeds, user=user, **suite_kwargs)
