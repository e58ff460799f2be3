"""Config composition, paper defaults and value checks (before any work)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tracekit.config import ConfigError, validate

GROUPS = ["benchmark", "backbone", "agent", "thresholds", "analysis", "synthesis", "grpo", "moe",
          "consolidation", "llm", "eval", "launcher", "logger", "experiment"]
ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(cwd)}
    return subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, env=env)


def test_paper_defaults(make_cfg):
    cfg = make_cfg("~experiment")  # the groups' own values (the default experiment cuts CPU budgets)
    validate(cfg)
    assert (cfg.thresholds.delta, cfg.thresholds.rho, cfg.thresholds.k, cfg.thresholds.n) == (0.20, 0.10, 8, 10)
    assert cfg.grpo.lr == 1e-5 and cfg.grpo.iterations == 40 and cfg.grpo.temperature == 1.0
    assert cfg.moe.lambda_lb == 0.05 and cfg.moe.top_k == 1
    assert cfg.eval.temperature == 0.0 and list(cfg.eval.seeds) == [42]
    assert cfg.eval.max_steps == 50 and cfg.eval.context_budget == 32000
    assert cfg.grpo.groups * cfg.grpo.group_size == 32  # 5,120 rollouts / (4 capabilities x 40 iterations)
    assert make_cfg().name == "embedded"  # `python -m tracekit` runs the embedded default experiment


@pytest.mark.parametrize("override,key", [
    ("thresholds.delta=1.5", "thresholds.delta"),
    ("thresholds.rho=-0.1", "thresholds.rho"),
    ("thresholds.k=11", "thresholds.k"),
    ("grpo.group_size=1", "grpo.group_size"),
    ("grpo.groups=0", "grpo.groups"),
    ("eval.context_budget=10", "eval.context_budget"),
    ("stages=[rollout,nope]", "stages"),
    ("analysis.discovery=pinned", "analysis.dictionary_path"),
    ("moe.impl=sparse", "moe.impl"),
    ("consolidation.method=merge_ties", "consolidation.method"),
])
def test_out_of_range_values_fail_validation(make_cfg, override, key):
    cfg = make_cfg(override)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_cli_rejects_bad_threshold_with_one_line_and_no_artifacts(tmp_path):
    out = _cli("thresholds.delta=1.5", cwd=tmp_path)
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "thresholds.delta" in lines[0] and "[0, 1]" in lines[0]
    assert not (tmp_path / "outputs" / "cache").exists()


def test_cli_rejects_typo_key(tmp_path):
    out = _cli("thresholds.dleta=0.3", cwd=tmp_path)
    assert out.returncode != 0 and "dleta" in out.stderr


def test_cli_help_and_cfg_job(tmp_path):
    help_out = _cli("--help", cwd=tmp_path)
    assert help_out.returncode == 0 and "tracekit" in help_out.stdout
    job = _cli("--cfg", "job", cwd=tmp_path)
    assert job.returncode == 0
    top = {line.split(":")[0] for line in job.stdout.splitlines() if line and not line.startswith(" ")}
    assert set(GROUPS) <= top


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_and_validates(make_cfg, preset):
    validate(make_cfg(f"experiment={preset}"))


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "backbone").glob("*.yaml")), ids=lambda p: p.stem)
def test_backbone_configs_agree_with_the_registry(path):
    """The yaml files carry the architecture numbers for readers; the registry must say the same."""
    import yaml

    from tracekit.llm.backbones import BACKBONES

    y = yaml.safe_load(path.read_text())
    reg = BACKBONES[y["name"]]
    assert (y["source"], y["chat_format"]) == (reg.source, reg.chat_format)
    assert y.get("hf_id") in (None, reg.hf_id)
    assert {k: reg.arch.get(k) for k in y.get("arch") or {}} == (y.get("arch") or {})
