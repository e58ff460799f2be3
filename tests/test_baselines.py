"""The external baselines (grpo_target, prompt_only, untargeted_synthetic) and the system-prompt suffix: policies
keyed on their prompt, training splits disjoint from the evaluated tasks, matched budgets, refusals in one line,
and (slow) every baseline end to end on smoke beside TRACE with its budget, and Figure 4's images."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import procs
from tracekit.artifacts import StageCache, atomic_write_json, write_jsonl
from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.methods import METHODS
from tracekit.policy import Policy

ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# the system-prompt suffix


def test_a_prompt_policy_keys_on_its_suffix_and_base_keeps_its_key():
    assert Policy().identity() == {"kind": "base", "weights": None, "subdir": ""}  # unchanged: old rollouts hit
    a, b = Policy("prompt", system_prompt_suffix="x"), Policy("prompt", system_prompt_suffix="y")
    assert a.identity()["system_prompt_suffix"] == "x" and a.identity() != b.identity()
    with pytest.raises(ValueError, match="kind 'prompt'"):
        Policy("base", system_prompt_suffix="x")  # would read the base rollout
    with pytest.raises(ValueError, match="kind 'prompt'"):
        Policy("prompt")


def test_the_agent_appends_the_suffix_to_the_system_prompt_in_requests_and_token_counts():
    from tracekit.agents import AgentState, LLMAgent
    from tracekit.llm.base import ChatClient, ChatResponse
    from tracekit.types import Message, Task

    class Recording(ChatClient):
        def __init__(self):
            self.seen = []

        def chat(self, requests):
            self.seen += requests
            return [ChatResponse(message=Message(role="assistant", content="ok"), text="ok") for _ in requests]

    client = Recording()
    msgs = [Message(role="system", content="policy"), Message(role="user", content="hi")]
    state = AgentState(Task(id="t", env="e"), msgs, [], seed=0, turn=0)
    LLMAgent(client, system_prompt_suffix="CAPS").act([state])
    sent = client.seen[0].messages
    assert sent[0].content == "policy\n\nCAPS" and sent[1].content == "hi" and msgs[0].content == "policy"
    LLMAgent(client, system_prompt_suffix="CAPS").act([AgentState(Task(id="t", env="e"), msgs[1:], [], 0, 0)])
    assert [m.role for m in client.seen[1].messages] == ["system", "user"]
    plain = LLMAgent(client).count_tokens(msgs, None)
    assert LLMAgent(client, system_prompt_suffix="CAPS " * 40).count_tokens(msgs, None) > plain


def test_the_capabilities_block_lists_each_capability_top_ranked_first(tmp_path):
    from tracekit.methods.prompt_only import prompt_policy
    from tracekit.methods.target_train import CAPABILITIES_HEADER, ranked_capabilities

    sel = tmp_path / "select"
    sel.mkdir()
    atomic_write_json(sel / "selected.json", {"selected": [
        {"name": "b_cap", "description": "second  by\ncoverage", "mean_cov": 0.2, "selection_count": 3},
        {"name": "a_cap", "description": "first", "mean_cov": 0.5, "selection_count": 3}]})
    caps = ranked_capabilities(SimpleNamespace(path=sel))
    assert [c["name"] for c in caps] == ["a_cap", "b_cap"]
    text = prompt_policy(caps).system_prompt_suffix
    assert text.splitlines() == [CAPABILITIES_HEADER, "- a cap: first", "- b cap: second by coverage"]


# --------------------------------------------------------------------------------------------
# configuration: registry, refusals


def test_every_baseline_validates_on_smoke_and_adp_needs_data(make_cfg, tmp_path):
    for name in ("grpo_target", "prompt_only", "gepa", "untargeted_synthetic"):
        validate(make_cfg("experiment=smoke", f"eval.methods=[base,{name}]"))
    with pytest.raises(ConfigError, match=r"baselines\.adp_sft\.data=\[\] is invalid") as e:
        validate(make_cfg("experiment=smoke", "eval.methods=[adp_sft]"))
    assert "\n" not in str(e.value)
    f = tmp_path / "adp.jsonl"
    f.write_text("{}\n")
    validate(make_cfg("experiment=smoke", "eval.methods=[adp_sft]", f"baselines.adp_sft.data=[{f}]"))
    with pytest.raises(ConfigError, match="is not a file"):
        validate(make_cfg("experiment=smoke", "eval.methods=[adp_sft]", f"baselines.adp_sft.data=[{f}.nope]"))
    with pytest.raises(ConfigError, match=r"baselines\.adp_sft\.lr"):
        validate(make_cfg("experiment=smoke", "baselines.adp_sft.lr=0"))


@pytest.mark.parametrize("method", ["grpo_target", "gepa"])
def test_a_target_without_a_training_split_is_refused_in_one_line(make_cfg, monkeypatch, method):
    with pytest.raises(ConfigError, match="has none .*benchmark.split=train") as e:
        validate(make_cfg("experiment=smoke", f"eval.methods=[{method}]", "benchmark.split=train"))
    assert "\n" not in str(e.value)
    import tracekit.targets.tau2.suite as tau2

    monkeypatch.setattr(tau2, "load_splits", lambda domain: {"test": ("1",), "base": ("1",)})
    with pytest.raises(ConfigError, match=r"no 'train' split in split_tasks.json"):
        validate(make_cfg("experiment=smoke", f"eval.methods=[{method}]"))
    validate(make_cfg("experiment=smoke", "eval.methods=[prompt_only]"))  # no training: no refusal
    with pytest.raises(ConfigError, match="training split"):  # Figure 4 runs GEPA and GRPO on target
        validate(make_cfg("experiment=smoke", "stages=[figure4]"))


def test_untargeted_takes_the_targets_family_or_a_folder_of_packages(make_cfg, tmp_path):
    from tracekit.methods.untargeted import family_environments

    assert family_environments(make_cfg("experiment=smoke")) == [
        "tau2_structured_data_reasoning", "tau2_tool_calling_precision", "tau2_multi_step_task_completion",
        "tau2_precondition_verification"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"envs_dir=.* must be a folder holding environment packages"):
        validate(make_cfg("experiment=smoke", "eval.methods=[untargeted_synthetic]",
                          f"baselines.untargeted_synthetic.envs_dir={tmp_path / 'empty'}"))
    atomic_write_json(tmp_path / "envs" / "one" / "env.json", {"kind": "library", "name": "tau2_tool_calling_precision"})
    validate(make_cfg("experiment=smoke", "eval.methods=[untargeted_synthetic]",
                      f"baselines.untargeted_synthetic.envs_dir={tmp_path / 'envs'}"))


# --------------------------------------------------------------------------------------------
# training tasks and budgets


def test_tau2_training_tasks_are_the_train_split_disjoint_from_the_evaluated_ones(make_cfg):
    from tracekit.targets.tau2.suite import Tau2Suite
    from tracekit.methods.target_train import open_target_train, train_suite_spec

    cfg = make_cfg("experiment=smoke")  # tau2 retail, split test, limit 2
    train = open_target_train(train_suite_spec(cfg))
    test_ids = {t.id for t in Tau2Suite(name="r", domains=["retail"], split="test").tasks()}
    train_ids = {t.id for t in train.tasks()}
    assert len(train_ids) == 74 and not train_ids & test_ids  # split_tasks.json: train 74 / test 40
    assert len(open_target_train(train_suite_spec(cfg, limit=3)).tasks()) == 3
    assert "split" not in train_suite_spec(cfg)["benchmark"]  # the evaluation subset is no part of its identity


def test_synthetic_training_tasks_use_the_training_seeds_never_the_held_out_ones(make_cfg):
    from tracekit.methods.target_train import open_target_train, train_suite_spec
    from tracekit.runs import TRAIN_SEED_OFFSET
    from tracekit.wiring import build_suite

    cfg = make_cfg("experiment=smoke", "benchmark=tau2_mini", "benchmark.limit=2")
    train = open_target_train(train_suite_spec(cfg, n_per_env=3))
    held_out = {t.id for t in build_suite(cfg).tasks()}
    ids = [t.id for t in train.tasks()]
    assert len(ids) == 3 * len(cfg.benchmark.synthetic.envs) and not set(ids) & held_out
    assert all(int(i.rsplit("seed-", 1)[1]) >= TRAIN_SEED_OFFSET for i in ids)


def _adapter(cache: StageCache, key: str, episodes: int, checkpoints=()):
    def compute(work: Path) -> None:
        for it in range(episodes // 2):
            write_jsonl(work / "rollouts" / f"iter_{it:05d}.jsonl", [{"i": 0}, {"i": 1}])
        with open(work / "metrics.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["iteration", "tokens_generated", "optimizer_steps"])
            w.writeheader()
            w.writerow({"iteration": 0, "tokens_generated": 3 * episodes, "optimizer_steps": 1})
        for it in checkpoints:
            (work / "checkpoints" / f"iter_{it:05d}" / "adapter").mkdir(parents=True)
            (work / "checkpoints" / f"iter_{it:05d}" / "adapter" / "adapter_model.safetensors").write_bytes(b"x")

    return cache.get_or_compute("adapters", key, compute)


def test_the_matched_budget_is_tracess_episodes_and_checkpoints_count_their_episodes(make_cfg, tmp_path):
    from tracekit.methods.grpo_target import checkpoint_points
    from tracekit.methods.target_train import trace_episodes
    from tracekit.runs import matched_iterations

    cache = StageCache(tmp_path / "cache")
    caps = {f"cap{i}": _adapter(cache, f"a{i}", 8) for i in range(3)}
    train = cache.get_or_compute("train", "t", lambda w: atomic_write_json(
        w / "adapters.json", {c: {**a.ref(), "content_key": a.content_key} for c, a in caps.items()}))
    cfg = make_cfg("experiment=smoke")  # G x K = 2 x 2: one capability run = 2 iterations = 8 episodes
    assert trace_episodes(train) == 24 and matched_iterations(cfg, 24) == 6
    assert matched_iterations(cfg, 25) == 7  # never fewer episodes than TRACE's
    run = _adapter(cache, "target", 12, checkpoints=(1, 3, 5))
    assert [(c["iteration"], c["episodes"]) for c in checkpoint_points(run)] == [(1, 4), (3, 8), (5, 12)]


def test_the_registry_names_each_baseline_with_its_stage():
    from tracekit.stages import build_pipeline

    stages = build_pipeline().stages
    for name in ("grpo_target", "gepa", "untargeted_synthetic", "adp_sft"):
        assert METHODS[name].inputs(None) == (name,) and name in stages
    assert "figure4" in stages and METHODS["prompt_only"].inputs(None) == ("select",)


def test_figure4_plots_both_panels_from_its_data(tmp_path):
    from tracekit.report.figure4 import plot

    data = {"benchmark": "b", "base": 0.2, "a": [
        {"k": 1, "trace": 0.3, "gepa": 0.25, "prompt_only": 0.22, "trace_label": "TRACE"},
        {"k": 2, "trace": 0.4, "gepa": 0.26, "prompt_only": 0.2, "trace_label": "TRACE"}],
        "b": {"TRACE": [{"episodes": 0, "pass_rate": 0.2}, {"episodes": 8, "pass_rate": 0.4}],
              "GRPO on Target": [{"episodes": 0, "pass_rate": 0.2}, {"episodes": 8, "pass_rate": 0.3}],
              "GEPA": [{"episodes": 0, "pass_rate": 0.2}, {"episodes": 7, "pass_rate": 0.26}]}}
    plot(data, tmp_path)
    for name in ("figure4a.png", "figure4b.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------
# end to end (slow): every baseline on smoke, and Figure 4


def _cli(tmp_path: Path, *overrides: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "offline"}
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", *overrides], cwd=ROOT, env=env,
                    capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _results(tmp_path: Path) -> dict:
    (run,) = sorted((tmp_path / "outputs" / "runs").glob("*"))[-1:]
    return json.loads((run / "results.json").read_text())


@pytest.mark.slow
def test_every_baseline_runs_on_smoke_with_its_budget_and_grpo_target_matches_trace(tmp_path):
    from tests.test_adp import write_adp_sample

    data = write_adp_sample(tmp_path / "adp.jsonl")
    out = _cli(tmp_path, "eval.methods=[base,single_capability,trace,grpo_target,prompt_only,gepa,"
               "untargeted_synthetic,adp_sft]", f"baselines.adp_sft.data=[{data}]")
    results = _results(tmp_path)
    labels = {r["method"]: label for label, r in results.items()}
    assert set(labels) == {"base", "single_capability", "trace", "grpo_target", "prompt_only", "gepa",
                           "untargeted_synthetic", "adp_sft"}
    for label in labels.values():
        assert f"| {label} |" in out.stdout
    trace, target = results["TRACE"]["budget"], results["GRPO on Target"]["budget"]
    untargeted = results["Untargeted synthetic (AWM-style)"]["budget"]
    capability_runs = trace["episodes"]  # the MoE's budget: the capability runs' episodes (+ gate steps)
    assert target["episodes"] == capability_runs == untargeted["episodes"] > 0
    assert 0 < results["GEPA"]["budget"]["episodes"] <= capability_runs
    assert results["ADP SFT"]["budget"]["optimizer_steps"] >= 1 and results["ADP SFT"]["budget"]["episodes"] == 0
    assert "malformed record(s) left out (adp.jsonl:" in out.stdout


@pytest.mark.slow
def test_figure4_is_produced_on_smoke(tmp_path):
    out = _cli(tmp_path, "stages=[figure4]")
    (art,) = (tmp_path / "cache" / "figure4").glob("*/figure4.json")
    data = json.loads(art.read_text())
    assert [p["k"] for p in data["a"]] == list(range(1, len(data["ranking"]) + 1))
    assert set(data["b"]) == {"TRACE", "GRPO on Target", "GEPA"}
    assert all(pts[0]["episodes"] == 0 for pts in data["b"].values())
    for name in ("figure4a.png", "figure4b.png"):
        assert (art.parent / name).stat().st_size > 1000
    assert "Figure 4 (tau2_retail" in out.stdout
