"""Where a planted warm start's capabilities land: the official TRACE calibration bands, measured (issue 42).

For each capability of ``backbone.planted``, the warm-started base policy is rolled out ``k`` times (T=1, the GRPO
sampling) on ``seeds`` validation instances of the capability's own library environment; the group statistics are
:mod:`tracekit.synthesis.calibrate`'s (success rate, mean reward, informative groups, pass@k). The bands:

- a *planted* (weak) capability: the official calibration gate (:class:`~tracekit.synthesis.calibrate.OfficialAcceptance`,
  ``synthesis.acceptance=official``'s rule, at group size ``k``): mean reward and success rate in [0.2, 0.6], reward
  std >= 0.05, all-success and all-zero groups <= 20% each, informative groups >= 50% (a GRPO run on it starts with
  reward variance to learn from);
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

from tracekit.agents import LLMAgent
from tracekit.artifacts import atomic_write_json, atomic_write_text
from tracekit.cli import compose_config
from tracekit.llm.backbones import get_spec, load_backbone
from tracekit.llm.hf import HFChatClient
from tracekit.planted.warmstart import PlantedSpec, planted_key
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.synthesis.calibrate import (AcceptanceFigures, OfficialAcceptance, acceptance_figures,
                                          acceptance_problems, group_stats)
from tracekit.synthesis.library_target import LibraryTargetSuite
from tracekit.wiring import backbone_dict

log = logging.getLogger(__name__)

STRONG_FLOOR = 0.8


def measure_bands(backbone: dict[str, Any], seeds: int = 16, k: int = 8, device: str = "cpu",
                  cache_dir: str | Path | None = None, work: Path | None = None, max_steps: int = 8,
                  max_new_tokens: int = 48, temperature: float = 1.0) -> dict[str, Any]:
    """{capability: {"role": weak|strong, "env", **group statistics}} of the warm-started ``backbone``."""
    spec = get_spec(backbone)
    planted = PlantedSpec.from_config(spec.planted)
    model, tokenizer = load_backbone(spec, device, None, cache_dir)
    client = HFChatClient(model, tokenizer, chat_format=spec.chat_format, max_batch_size=256, seed=0)
    agent = LLMAgent(client, temperature=temperature, max_new_tokens=max_new_tokens)
    out: dict[str, Any] = {}
    for cap, env in planted.envs().items():
        suite = LibraryTargetSuite("bands", [env], difficulty=planted.difficulty, n_per_env=seeds, seed_offset=0)
        run_dir = (work or Path("outputs/bands")) / f"{spec.name}-{planted_key_of(spec)}-T{temperature}-{cap}"
        run_rollouts(suite, agent, run_dir, samples=k, seed=0, max_steps=max_steps, context_budget=512,
                     batch_size=256, progress=False)
        table: dict[str, list[tuple[float, bool]]] = {}
        for t in read_trajectories(run_dir):
            table.setdefault(t.task_id, []).append((t.reward, t.success))
        stats = group_stats(table).model_dump()
        official = acceptance_figures(table, OfficialAcceptance(group_size=k)).model_dump()
        out[cap] = {"role": "weak" if cap in planted.weak else "strong", "env": env, **stats, "official": official}
        suite.close()
    return out


def planted_key_of(spec: Any) -> str:
    return planted_key(PlantedSpec.from_config(spec.planted), dataclasses.replace(spec, planted=None))


def band_problems(bands: dict[str, Any]) -> list[str]:
    """One phrase per capability outside its band, with the rates measured (empty: every band reached)."""
    bad = []
    for cap, b in bands.items():
        if b["role"] == "weak":  # the official gate's rule, at the group size measured
            fig = AcceptanceFigures(**b["official"])
            missed = acceptance_problems(fig, OfficialAcceptance(group_size=fig.group_size))
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
    p.add_argument("--device", default="cpu")
    p.add_argument("--check", action="store_true", help="exit 2 with one line when a band is not reached")
    p.add_argument("overrides", nargs="*", help="Hydra overrides (e.g. experiment=micro)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s")
    cfg = compose_config([*a.overrides, f"paths.root_dir={Path.cwd()}", f"paths.run_dir={(a.out / 'run').resolve()}"])
    base = backbone_dict(cfg)
    temperature = float(cfg.grpo.temperature if a.temperature is None else a.temperature)
    planted = base["planted"]
    rows: dict[str, Any] = {}
    for n in a.demos_weak or [planted["demos_weak"]]:  # an int, or {capability: count}
        for epochs in a.epochs or [int(planted["sft"]["epochs"])]:
            backbone = {**base, "planted": {**planted, "demos_weak": n, "sft": {**planted["sft"], "epochs": epochs}}}
            # cache_dir None: the warm start's own cache root (~/.cache/tracekit or $TRACEKIT_CACHE), as the app's
            rows[f"{n} demos, {epochs} epochs, T={temperature}"] = measure_bands(
                backbone, a.seeds, a.k, a.device, None, a.out / "runs", temperature=temperature)
        a.out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(a.out / "bands.json", rows)
        atomic_write_text(a.out / "bands.md", markdown(rows))
    print(markdown(rows))
    problems = [f"{n}: {p}" for n, bands in rows.items() for p in band_problems(bands)]
    if a.check and problems:
        print(f"tracekit.planted.bands: the calibration bands are not reached: {'; '.join(problems)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
