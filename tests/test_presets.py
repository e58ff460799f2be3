"""Presets that say what they are: `experiment=paper` is the paper's setting (held against the paper's stated
hyperparameters, written out here), the scale profiles, the README's commands, and a cut run naming its cuts."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from tests import procs
from tracekit.validate import validate
from tracekit.report.paper import cuts, setting_line

ROOT = Path(__file__).resolve().parent.parent
STAGE_GROUPS = ("benchmark", "backbone", "agent", "user", "thresholds", "analysis", "synthesis", "grpo", "moe",
                "consolidation", "llm", "baselines")


def _cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(cwd), "TRACEKIT_CACHE": str(cwd / "cache"), "WANDB_MODE": "offline"}
    return procs.run([sys.executable, "-m", "tracekit", *args], capture_output=True, text=True, timeout=timeout,
                     cwd=ROOT, env=env)


def assert_papers_values(c) -> None:
    """The paper's stated hyperparameters (sec. 3.3, 3.5, 4.1, 4.4, App. A, D), written out from its text."""
    # sec. 4.1: tau^2-Bench's 50 airline + 114 retail tasks, greedy (T=0, seed 42), 32k context, 50 steps
    assert c.benchmark.name == "tau2" and c.benchmark.kind == "tau2"
    assert sorted(c.benchmark.domains) == ["airline", "retail"] and c.benchmark.split == "base"
    assert c.benchmark.limit is None and not c.benchmark.task_ids
    assert c.backbone.hf_id == "Qwen/Qwen3-30B-A3B-Instruct-2507"
    assert c.eval.mode == "greedy" and c.eval.temperature == 0.0 and list(c.eval.seeds) == [42]
    assert c.eval.max_steps == 50 and c.eval.context_budget == 32000
    assert c.agent.kind == "llm" and c.agent.constrained_tool_calls is False and c.user.kind == "llm"
    # sec. 3.3, 4.3: the LLM analysis agent, 10 independent labeling runs, rho 0.10, delta 0.20; K of N = 8 of 10
    assert c.analysis.discovery == "llm" and c.analysis.labeler == "llm"
    assert (c.thresholds.n, c.thresholds.k, c.thresholds.delta, c.thresholds.rho) == (10, 8, 0.20, 0.10)
    assert c.synthesis.source == "generate"  # an LLM-based generation agent synthesizes each environment
    # sec. 4.1, App. A: AdamW lr 1e-5, up to 40 iterations per capability, rollouts at T=1.0
    assert c.grpo.lr == 1e-5 and c.grpo.iterations == 40 and c.grpo.temperature == 1.0
    assert c.grpo.groups * c.grpo.group_size == 5120 // (4 * 40)  # sec. 4.4: 5,120 rollouts, 4 capabilities
    assert c.grpo.max_steps == 50 and c.grpo.max_prompt_tokens == 32000 and c.grpo.gradient_checkpointing
    assert c.grpo.lora.rank == 32  # App. D: ~1.6 B parameters per adapter on Qwen3-30B-A3B
    # sec. 3.5, 4.1, App. D: lambda_LB 0.05, top-1 routing at inference
    assert c.moe.lambda_lb == 0.05 and c.moe.top_k == 1


def test_experiment_paper_cfg_job_shows_the_papers_values(tmp_path):
    out = _cli("experiment=paper", "--cfg", "job", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    c = OmegaConf.create(yaml.safe_load(out.stdout))
    assert_papers_values(c)
    assert c.name == "paper" and c.scale.name == "paper" and list(c.eval.methods) == ["base", "single_capability",
                                                                                      "trace"]


def test_paper_presets_compose_validate_and_cut_nothing(make_cfg):
    paper = make_cfg("experiment=paper")
    validate(paper)
    assert_papers_values(paper)
    assert cuts(paper) == [] and "the paper's setting, no cut" in setting_line(paper)
    stoch = make_cfg("experiment=paper", "eval=stochastic")  # App. G: T=0.7, 3 seeds
    assert stoch.eval.temperature == 0.7 and len(stoch.eval.seeds) == 3 and cuts(stoch) == []
    assert cuts(make_cfg("experiment=paper", "backbone=qwen3_6_27b")) == []  # the second backbone (Table 1)
    for name, domain in (("paper_tau2_airline", "airline"), ("paper_tau2_retail", "retail")):
        c = make_cfg(f"experiment={name}")
        validate(c)
        assert list(c.benchmark.domains) == [domain] and c.benchmark.split == "base" and c.grpo.iterations == 40
        assert [x.key for x in cuts(c)] == ["benchmark"]  # one domain of the paper's two, and nothing else


def test_scale_embedded_is_the_embedded_experiment_and_scale_paper_undoes_it(make_cfg):
    default, cut = make_cfg("experiment=embedded"), make_cfg("experiment=paper", "scale=embedded")
    for group in STAGE_GROUPS:  # the same values: a scale=embedded table shares the default run's cache
        assert OmegaConf.to_container(default[group]) == OmegaConf.to_container(cut[group]), group
    assert default.eval.max_steps == cut.eval.max_steps == 2 and default.scale.name == cut.scale.name == "embedded"
    assert cut.name == "paper" and cut.scale.targets.tau2 == "tau2_mini" and cut.scale.backbone == "smollm2_135m"
    keys = {c.key for c in cuts(cut)}
    assert {"benchmark", "backbone.name", "eval.max_steps", "grpo.iterations", "grpo.lr", "analysis.labeler",
            "user.kind", "agent.copy_ids", "moe.steps"} <= keys
    undone = make_cfg("experiment=embedded", "scale=paper")
    validate(undone)
    assert [c.key for c in cuts(undone)] == ["benchmark"]  # the target stays tau2_mini; every budget is the paper's
    assert undone.grpo.iterations == 40 and undone.agent.tool_choice == "auto" and undone.moe.steps == 200


def test_a_users_explicit_choice_wins_over_the_scale(make_cfg):
    c = make_cfg("experiment=paper", "scale=embedded", "backbone=tiny", "grpo.iterations=3")
    assert c.backbone.name == "tiny" and c.grpo.iterations == 3


def _readme_command(marker: str) -> list[str]:
    """The overrides of the README command whose trailing comment contains ``marker``."""
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("python -m tracekit ") and marker in line.split("#", 1)[-1]:
            return shlex.split(line.split("#", 1)[0])[3:]
    raise AssertionError(f"no README command marked {marker!r}")


def test_readme_paper_setting_command_runs_the_papers_setting(make_cfg):
    overrides = _readme_command("paper setting")
    c = make_cfg(*overrides)
    validate(c)
    assert cuts(c) == [], [str(x) for x in cuts(c)]


def test_readme_gold_replay_command_replays_all_164_tasks(make_cfg):
    from tracekit.wiring import build_suite

    overrides = _readme_command("gold replay")
    c = make_cfg(*overrides)
    validate(c)
    assert c.agent.kind == "gold" and c.eval.max_steps == 50
    assert len(build_suite(c).tasks()) == 164


@pytest.mark.slow
def test_readme_gold_replay_command_scores_one_on_every_task(tmp_path):
    out = _cli(*_readme_command("gold replay"), "logger=none", cwd=tmp_path, timeout=1800)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    arts = json.loads((run / "artifacts.json").read_text())
    episodes = next(Path(a["path"]) for a in arts.values() if a["stage"] == "episodes")
    rows = [json.loads(line) for line in (episodes / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 164 and all(r["reward"] == 1.0 for r in rows)


def test_a_cut_run_says_so_in_its_first_log_line_summary_and_wandb_config(tmp_path):
    # agent.kind=gold: the run only has to exist (its log, summary and W&B config are checked), not to decode
    out = _cli("experiment=smoke", "stages=[rollout]", "benchmark.limit=1", "agent.kind=gold", "logger=wandb",
               cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    logged = [line for line in (out.stdout + out.stderr).splitlines() if "[tracekit" in line]
    first = logged[0]
    assert "experiment=smoke scale=none: CUT relative to the paper" in first
    for cut in ("backbone.name=tiny (paper: qwen3_30b_a3b or qwen3_6_27b)", "eval.max_steps=4 (paper: 50)",
                "thresholds.n=3 (paper: 10)", "grpo.iterations=2 (paper: 40)", "grpo.lr=0.001 (paper: 1e-05)",
                "benchmark=tau2_retail (retail, test split, first 1 per domain)"):
        assert cut in first, cut
    (run,) = (tmp_path / "outputs" / "runs").iterdir()
    summary = (run / "summary.md").read_text()
    assert "Preset: `experiment=smoke`, `scale=none`" in summary and "values differ from the paper's" in summary
    assert "| `eval.max_steps` | 4 | 50 |" in summary
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")  # the offline run's records (config as JSON)
    setting = json.loads(re.search(rb"paper_setting.{1,4}?(\{.*?\}\}\})", wandb_file.read_bytes(), re.S).group(1))
    assert setting["cut"] is True and setting["cuts"]["eval.max_steps"] == {"ours": 4, "paper": 50, "stated": True}
    assert re.search(r"summary: .*summary\.md \(CUT: \d+ values differ", out.stdout + out.stderr)
