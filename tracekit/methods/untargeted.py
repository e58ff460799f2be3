"""``untargeted_synthetic``: GRPO on synthetic environments chosen *without* the contrastive analysis, the
runnable control for AWM (Agent World Model: RL in benchmark-independent synthetic environments; paper
Tables 1 and 3). AWM's own environments come from its dataset, out of reach here.

Environments: every built-in library environment of the target's family (``tau2`` targets: the four tau^2
library environments), uniformly (``tracekit.synthesis.mixture``: equal instances per environment, each
GRPO group from one), at ``synthesis.difficulty``; or, with ``baselines.untargeted_synthetic.envs_dir``, every
environment package (``<dir>/<name>/env.json``, as the synthesize stage writes them) in that folder, e.g.
converted AWM environments. Budget: TRACE's per-capability GRPO episodes summed by default (``train`` is then
an input), the same ``grpo`` recipe. In this repo the library holds the paper's own capability
environments, so the control differs from TRACE in the *selection* (none) and the *mixture* (all, uniform),
not in the environments' provenance: the row is named for what it is.
"""

from __future__ import annotations

from pathlib import Path

from dataclasses import dataclass
from typing import ClassVar

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.config import ConfigError
from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.target_train import trace_episodes
from tracekit.pipeline import Stage
from tracekit.policy import Policy, grpo_budget
from tracekit.ranges import Choice
from tracekit.rl.launch import Factory
from tracekit.runs import GRPO_RUN_READS, grpo_run, matched_iterations, package_identity, synthesis_target, train_seeds
from tracekit.synthesis.library import LIBRARY_NAMES, library_env
from tracekit.synthesis.targets import target_family
from tracekit.synthesis.stage import PACKAGE
from tracekit.targets.registry import family_reads


@dataclass
class UntargetedSettings:
    """untargeted_synthetic: GRPO on every library environment of the target's family, uniformly (AWM-style control)."""

    episodes: int | None = None  # None: TRACE's per-capability GRPO episodes summed (matched)
    # a folder of environment packages (<dir>/<name>/env.json; e.g. converted AWM environments) to use instead of
    # the library
    envs_dir: str | None = None

    RANGES: ClassVar[dict[str, str]] = {"episodes": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"envs_dir": r".+"}  # a folder of environment packages (checked in validate())


LABEL = "Untargeted synthetic (AWM-style)"
RESULT = "untargeted.json"


def family_environments(cfg) -> list[str]:
    """The library environments of the target's family (no analysis: all of them), by name."""
    family = target_family(synthesis_target(cfg))
    return [n for n in LIBRARY_NAMES if target_family(library_env(n).target) == family]


def stage_reads(cfg):
    reads = [*GRPO_RUN_READS, "baselines.untargeted_synthetic"]
    if cfg.baselines.untargeted_synthetic.envs_dir is None:  # the library: the target's family, the difficulty
        reads += [*family_reads(cfg), "synthesis.difficulty"]
    return tuple(reads)


def stage_inputs(cfg):
    return ("train",) if cfg.baselines.untargeted_synthetic.episodes is None else ()


def _write_library_packages(cfg, root: Path) -> list[Path]:
    pkgs = []
    for name in family_environments(cfg):
        cls = library_env(name)
        difficulty = cfg.synthesis.difficulty if cfg.synthesis.difficulty in cls.difficulty_levels \
            else cls.default_difficulty
        pkg = root / name
        atomic_write_json(pkg / PACKAGE, {"kind": "library", "name": cls.name, "capability": cls.capability,
                                          "target": cls.target, "difficulty": difficulty})
        pkgs.append(pkg)
    return pkgs


def user_packages(envs_dir: str) -> list[Path]:
    root = Path(envs_dir).expanduser()
    return sorted(p for p in root.iterdir() if (p / PACKAGE).is_file()) if root.is_dir() else []


def packages_content(cfg):
    """The user folder's packages' content (part of the stage's key: editing a package recomputes)."""
    d = cfg.baselines.untargeted_synthetic.envs_dir
    return {p.name: package_identity(p) for p in user_packages(d)} if d else None


def untargeted_stage(ctx) -> None:
    cfg, s = ctx.cfg, ctx.cfg.baselines.untargeted_synthetic
    pkgs = user_packages(s.envs_dir) if s.envs_dir else _write_library_packages(cfg, ctx.work_dir / "envs")
    if not pkgs:
        raise RuntimeError(f"untargeted_synthetic: no environment package in {s.envs_dir or 'the library'}")
    matched = trace_episodes(ctx.inputs["train"]) if s.episodes is None else None
    episodes = s.episodes if s.episodes is not None else matched
    iterations = matched_iterations(cfg, episodes)
    env = Factory("tracekit.synthesis.mixture:open_mixture",
                  {"pkg_dirs": [str(p) for p in pkgs], "seeds": train_seeds(cfg, iterations)})
    art = grpo_run(ctx, "untargeted_synthetic", env, {"mixture": {p.name: package_identity(p) for p in pkgs}},
                   iterations=iterations)
    atomic_write_json(ctx.work_dir / RESULT, {
        "adapter": {**art.ref(), "content_key": art.content_key}, "environments": [p.name for p in pkgs],
        "source": s.envs_dir or "library", "iterations": iterations, "matched_episodes": matched,
        "requested_episodes": episodes, "budget": grpo_budget(art).to_dict()})


def untargeted_report(art: Artifact, ctx) -> None:
    r = read_json(art.path / RESULT)
    ctx.record.section("Untargeted synthetic RL", (
        f"GRPO on the uniform mixture of {len(r['environments'])} environments ({', '.join(r['environments'])}; "
        f"source: {r['source']}) for {r['iterations']} iterations: {r['budget']['episodes']:,} episodes."))


class UntargetedSynthetic(Method):
    settings = UntargetedSettings
    name = "untargeted_synthetic"
    summary = "GRPO on every synthetic environment of the target's family, uniformly, no analysis (AWM-style)"
    stages = (Stage("untargeted_synthetic", reads=stage_reads, inputs=stage_inputs, compute=untargeted_stage,
                    report=untargeted_report, key_extra=packages_content),)

    def inputs(self, cfg):
        return ("untargeted_synthetic",)

    def validate(self, cfg):
        d = cfg.baselines.untargeted_synthetic.envs_dir
        if d is not None and not user_packages(d):
            raise ConfigError(f"baselines.untargeted_synthetic.envs_dir={d!r} is invalid: must be a folder holding "
                              "environment packages (<dir>/<name>/env.json)")
        if d is None and not family_environments(cfg):
            raise ConfigError(f"untargeted_synthetic: the library has no environment of {cfg.benchmark.name}'s family "
                              "(set baselines.untargeted_synthetic.envs_dir)")

    def rows(self, ctx):
        art = ctx.inputs["untargeted_synthetic"]
        r = read_json(art.path / RESULT)
        adapter = art.resolve(r["adapter"])
        budget = grpo_budget(adapter)
        matched = (f"TRACE's per-capability runs: {r['matched_episodes']:,}" if r["matched_episodes"] is not None
                   else "set by baselines.untargeted_synthetic.episodes")
        return [PolicyRow(LABEL, Policy("adapter", adapter, "adapter"), budget, (
            f"GRPO on {len(r['environments'])} environments uniformly ({', '.join(r['environments'])}), no "
            f"capability analysis: {budget.episodes:,} episodes ({matched})",))]
