"""Where a planted warm start's capabilities land: the official TRACE calibration bands, measured (issue 42).

For each capability of ``backbone.planted``, the warm-started base policy is rolled out ``k`` times (T=1, the GRPO
sampling) on ``seeds`` validation instances of the capability's own library environment: each one the cached
rollout (:func:`tracekit.runs.cached_rollout`, ``paths.cache_dir``) of the target's ``validation`` split, so a
second call, or a run of the app over the same warm start, rolls nothing out again. The group statistics are
:mod:`tracekit.synthesis.calibrate`'s (success rate, mean reward, informative groups, pass@k). The bands:

- a *planted* (weak) capability: the official calibration gate (:class:`~tracekit.synthesis.calibrate.OfficialAcceptance`,
  ``synthesis.acceptance=official``'s rule as the composed ``synthesis`` group sets it, at group size ``k``; by
  default mean reward and success rate in [0.2, 0.6], reward std >= 0.05, all-success and all-zero groups <= 20%
  each, informative groups >= 50%: a GRPO run on it starts with reward variance to learn from);
- a *strong* capability: success rate >= 0.8.

:func:`band_problems` names every capability outside its band with the rates measured; ``--check`` makes that a
one-line refusal (exit 2). ``--demos-weak`` measures several demonstration mixes in one call (the calibration of
``demos_weak``: each is its own cached warm start).

    python -m tracekit.planted.bands --out outputs/bands --demos-weak 16 32 48 -- experiment=micro
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import StageCache, atomic_write_json, atomic_write_text
from tracekit.cli import compose_config
from tracekit.config import ConfigError
from tracekit.pipeline import RunRecord, plain
from tracekit.warmstart.planted import PlantedSpec
from tracekit.policy import Policy
from tracekit.runs import read_trajectories_dir, tool_rollout
from tracekit.synthesis.calibrate import (AcceptanceFigures, OfficialAcceptance, acceptance_figures,
                                          acceptance_problems, group_stats)
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.stage import official_acceptance
from tracekit.targets.registry import target_of

log = logging.getLogger(__name__)

STRONG_FLOOR = 0.8
VALIDATION = "validation"  # the target's split the bands are measured on (seeds 0..n, as synthesis validates)


def warm_start_config(cfg: DictConfig, demos_weak: Any = None, epochs: int | None = None) -> DictConfig:
    """``cfg`` with another warm-start mix: ``demos_weak`` (a count, or {capability: count}) and SFT ``epochs``
    (None: the config's)."""
    out = OmegaConf.merge(cfg, {})
    if demos_weak is not None:  # replaced, not merged: a count may stand where {capability: count} stood
        OmegaConf.update(out, "backbone.planted.demos_weak", demos_weak, merge=False)
    if epochs is not None:
        OmegaConf.update(out, "backbone.planted.sft.epochs", epochs)
    return out


def band_config(cfg: DictConfig, env: str, difficulty: int, seeds: int, k: int, temperature: float) -> DictConfig:
    """``cfg`` rolling its base agent out as GRPO samples it (``k`` samples at ``temperature``, ``grpo.max_steps``)
    on ``seeds`` instances of ``env`` alone at the warm start's ``difficulty``: a library target of that one
    environment (``benchmark.<kind>.envs``)."""
    out = OmegaConf.merge(cfg, {"benchmark": {"limit": seeds},
                                "eval": {"temperature": temperature, "seeds": list(range(k)),
                                         "max_steps": cfg.grpo.max_steps}})
    own = target_of(out).own(out.benchmark)
    own.envs, own.difficulty = [env], difficulty
    return out


def measure_bands(cfg: DictConfig, seeds: int = 16, k: int = 8, temperature: float = 1.0) -> dict[str, Any]:
    """{capability: {"role": weak|strong, "env", **group statistics, "official": the gate's figures,
    "official_rule": the gate's rule}} of ``cfg``'s warm-started backbone; the rollouts are cached episodes of
    ``paths.cache_dir``, recorded in ``paths.run_dir``."""
    if temperature <= 0:
        raise ValueError(f"the bands sample as GRPO does: the temperature must be > 0, got {temperature}")
    if "envs" not in target_of(cfg).own(cfg.benchmark):
        raise ValueError(f"the bands roll out on a library target's validation instances; benchmark.kind="
                         f"{cfg.benchmark.kind} is not one (benchmark=micro or tau2_mini)")
    planted = PlantedSpec.from_config(cfg.backbone.planted)
    rule = official_acceptance(SynthesisConfig(**plain(cfg.synthesis)), group_size=k)
    cache, record = StageCache(cfg.paths.cache_dir), RunRecord(Path(cfg.paths.run_dir))
    out: dict[str, Any] = {}
    for cap, env in planted.envs().items():
        art = tool_rollout(band_config(cfg, env, planted.difficulty, seeds, k, temperature), Policy(), cache, record,
                           split=VALIDATION)
        table: dict[str, list[tuple[float, bool]]] = {}
        for t in read_trajectories_dir(art):
            table.setdefault(t.task_id, []).append((t.reward, t.success))
        stats = group_stats(table).model_dump()
        official = acceptance_figures(table, rule).model_dump()
        out[cap] = {"role": "weak" if cap in planted.weak else "strong", "env": env, **stats, "official": official,
                    "official_rule": dataclasses.asdict(rule), "episodes": f"{art.stage}/{art.key}"}
    return out


def measure_mixes(cfg: DictConfig, demos_weak: list[Any], epochs: list[int], seeds: int = 16, k: int = 8,
                  temperature: float | None = None, out: Path | None = None) -> dict[str, dict[str, Any]]:
    """{"<n> demos, <e> epochs, T=<t>": bands} for each warm-start mix (empty lists: the config's own count, epochs;
    ``temperature`` None: ``grpo.temperature``); with ``out``, bands.json and bands.md rewritten after each mix (a
    killed calibration keeps what it measured)."""
    if cfg.backbone.get("planted") is None:
        raise ValueError("the bands measure a planted warm start: backbone.planted is unset (experiment=micro or "
                         "experiment=planted)")
    planted = cfg.backbone.planted
    temperature = float(cfg.grpo.temperature if temperature is None else temperature)
    rows: dict[str, Any] = {}
    for n in demos_weak or [plain(planted.demos_weak)]:  # an int, or {capability: count}
        for e in epochs or [int(planted.sft.epochs)]:
            rows[f"{n} demos, {e} epochs, T={temperature}"] = measure_bands(warm_start_config(cfg, n, e), seeds, k,
                                                                            temperature)
            if out is not None:
                atomic_write_json(out / "bands.json", rows)
                atomic_write_text(out / "bands.md", markdown(rows))
    return rows


def band_problems(bands: dict[str, Any]) -> list[str]:
    """One phrase per capability outside its band, with the rates measured (empty: every band reached)."""
    bad = []
    for cap, b in bands.items():
        if b["role"] == "weak":  # the official gate's rule the figures were measured under
            rule = OfficialAcceptance(**{k: tuple(v) if isinstance(v, list) else v
                                         for k, v in b["official_rule"].items()})
            missed = acceptance_problems(AcceptanceFigures(**b["official"]), rule)
            if missed:
                bad.append(f"planted {cap}: {'; '.join(missed)}")
        rate = b["success_rate"]
        if b["role"] == "strong" and rate < STRONG_FLOOR:
            bad.append(f"strong {cap}: success {rate:.2f} (>= {STRONG_FLOOR})")
    return bad


def markdown(rows: dict[str, dict[str, Any]]) -> str:
    lines = ["| warm start | capability | role | success | mean reward | informative groups | all-zero groups | "
             "pass@8 | in band |", "|---|---|---|---|---|---|---|---|---|"]
    for mix, bands in rows.items():
        for cap, b in bands.items():
            ok = not band_problems({cap: b})
            lines.append(f"| {mix} | {cap} | {b['role']} | {b['success_rate']:.2f} | {b['mean_reward']:.2f} | "
                         f"{b['informative_rate']:.2f} | {b['all_zero_rate']:.2f} | "
                         f"{b['pass_at_k'].get('8', b['pass_at_k'].get(8, float('nan'))):.2f} | {'yes' if ok else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tracekit.planted.bands", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/bands"))
    p.add_argument("--demos-weak", type=int, nargs="*", default=[],
                   help="demonstration counts to measure (one count for every weak capability)")
    p.add_argument("--epochs", type=int, nargs="*", default=[], help="warm-start SFT epochs to measure")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: grpo.temperature)")
    p.add_argument("--seeds", type=int, default=16)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--device", default=None, help="the backbone's device (default: backbone.device)")
    p.add_argument("--check", action="store_true", help="exit 2 with one line when a band is not reached")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. experiment=micro)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    a.out.mkdir(parents=True, exist_ok=True)
    try:
        device = [f"backbone.device={a.device}"] if a.device else []  # unset: the config's, and so its keys
        cfg = compose_config([*a.overrides, *device, f"paths.root_dir={Path.cwd()}",
                              f"paths.run_dir={(a.out / 'run').resolve()}"])
        rows = measure_mixes(cfg, a.demos_weak, a.epochs, a.seeds, a.k, a.temperature, a.out)
    except (ConfigError, ValueError) as e:
        print(f"tracekit.planted.bands: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(markdown(rows))
    problems = [f"{n}: {p}" for n, bands in rows.items() for p in band_problems(bands)]
    if a.check and problems:
        print(f"tracekit.planted.bands: the calibration bands are not reached: {'; '.join(problems)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
