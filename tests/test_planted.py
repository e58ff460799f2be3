"""The planted-deficit testbed (issue 21): the planted spec's refusals, the gold demonstrations the warm start
trains on, scoring against the planted set, the gain table's intervals, and the gate's held-out report."""

from __future__ import annotations

import math

import pytest
import torch

from tracekit.planted.score import precision_recall
from tracekit.warmstart.planted import DEMO_SEED_OFFSET, PlantedSpec, library_capabilities

STRONG = ["tool_calling_precision", "structured_data_reasoning"]
WEAK = ["multi_step_task_completion", "precondition_verification"]


def test_library_capabilities_match_the_environment_classes():
    from tracekit.synthesis.library import library_env

    caps = library_capabilities("tau2")
    assert set(caps) == {"structured_data_reasoning", "tool_calling_precision", "multi_step_task_completion",
                         "precondition_verification"}
    assert all(library_env(env).capability == cap for cap, env in caps.items())


@pytest.mark.parametrize("change, match", [
    ({"weak": ["multi_step_task_completion", "flying"]}, "no environment for capability 'flying'"),
    ({"strong": ["permission_error_recovery"]}, "no environment for capability 'permission_error_recovery'"),
    ({"weak": []}, "planted set needs at least one"),
    ({"strong": WEAK[:1]}, "both strong and weak"),
    ({"demos_strong": 0}, "demos_strong must be >= 1"),
])
def test_planted_spec_refuses(change, match):
    with pytest.raises(ValueError, match=match) as e:
        PlantedSpec(**{"strong": STRONG, "weak": WEAK, **change})
    assert "\n" not in str(e.value)


def test_bad_planted_set_is_one_config_error_before_any_work(tmp_path):
    from hydra import compose, initialize_config_dir

    from tracekit.cli import CONF_DIR
    from tracekit.config import ConfigError
    from tracekit.schema import register_configs
    from tracekit.validate import validate

    register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=planted", f"paths.root_dir={tmp_path}",
                                           f"paths.run_dir={tmp_path}/run",
                                           "backbone.planted.weak=[multi_step_task_completion,teleportation]"])
    with pytest.raises(ConfigError, match="teleportation"):
        validate(cfg)
    assert not (tmp_path / "outputs").exists()


def test_gold_demonstrations_render_as_the_agents_own_calls():
    """Every demonstration is a verified success; its masked-in spans are exactly the gold calls (parsed back
    with the agent's parser) and the report, in the chat format the agent decodes."""
    from tracekit.llm.backbones import bundled_tokenizer
    from tracekit.llm.tools import parse_assistant_text
    from tracekit.warmstart.planted import demonstrations

    tok = bundled_tokenizer("smollm2")
    spec = PlantedSpec(strong=["tool_calling_precision"], weak=["multi_step_task_completion"], demos_strong=2,
                       demos_weak=1)
    rows, demos, record = demonstrations(spec, tok)
    assert record["tool_calling_precision"]["succeeded"] == 2 and record["multi_step_task_completion"]["succeeded"] == 1
    assert record["tool_calling_precision"]["seeds"] == [DEMO_SEED_OFFSET, DEMO_SEED_OFFSET + 2]
    assert len(demos) == 3 and len(rows) == 3
    for (ids, mask), demo in zip(rows, demos):
        spans, cur = [], []
        for t, m in zip(ids, mask):
            if m:
                cur.append(t)
            elif cur:
                spans.append(cur)
                cur = []
        if cur:
            spans.append(cur)
        gold = [m for m in demo["messages"] if m["role"] == "assistant"]
        assert len(spans) == len(gold)
        for span, g in zip(spans, gold):
            text = tok.decode(span).removesuffix("<|im_end|>")
            parsed = parse_assistant_text(text, "smollm2", turn=0)
            if g.get("tool_calls"):
                assert [(c.name, c.arguments) for c in parsed.tool_calls] == \
                       [(c["name"], c["arguments"]) for c in g["tool_calls"]]
            else:
                assert text.strip() == g["content"].strip()


def test_precision_recall():
    assert precision_recall(["a", "b"], ["a", "c"]) == (0.5, 0.5)
    assert precision_recall(["a", "c"], ["a", "c"]) == (1.0, 1.0)
    assert precision_recall([], ["a"]) == (None, 0.0)
    with pytest.raises(ValueError):
        precision_recall(["a"], [])


def test_wilson_interval_and_overlap():
    from tracekit.planted.gain import overlap, wilson

    lo, hi = wilson(30, 100)  # textbook value: 0.2189 .. 0.3958
    assert lo == pytest.approx(0.2189, abs=1e-4) and hi == pytest.approx(0.3958, abs=1e-4)
    lo0, hi0 = wilson(0, 50)
    assert lo0 == pytest.approx(0.0, abs=1e-12) and 0 < hi0 < 0.1
    assert overlap([0.1, 0.3], [0.25, 0.5]) is True and overlap([0.1, 0.2], [0.25, 0.5]) is False
    assert overlap(None, [0, 1]) is None


def test_split_heldout_is_fixed_and_disjoint():
    from tracekit.moe.gate import GateExample, split_heldout

    groups = {"a": [GateExample([i, i + 1], [0, 1]) for i in range(10)], "b": [GateExample([99, 1], [0, 1])]}
    train, held = split_heldout(groups, seed=3)
    again_train, again_held = split_heldout(groups, seed=3)
    assert held == again_held and train == again_train
    assert len(held["a"]) == 2 and len(train["a"]) == 8 and held["b"] == [] and len(train["b"]) == 1
    assert not {tuple(e.input_ids) for e in held["a"]} & {tuple(e.input_ids) for e in train["a"]}


def test_routing_usage_counts_response_tokens():
    """Usage is the share of (response token, block) pairs whose top gate slot is each expert: with one gate
    biased to slot 1 in every block, every response token goes to slot 1; padding and prompt tokens are not
    counted."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tracekit.moe.gate import GateExample, routing_usage
    from tracekit.moe.model import MoEConfig, build_lora_moe

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True)
    base = AutoModelForCausalLM.from_config(cfg)
    from peft import LoraConfig, get_peft_model

    dirs = {}
    import tempfile
    from pathlib import Path

    tmp = Path(tempfile.mkdtemp())
    for name in ("x", "y"):
        m = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
        m.save_pretrained(tmp / name)
        dirs[name] = tmp / name
    moe = build_lora_moe(base, dirs, MoEConfig())
    with torch.no_grad():
        for g in moe.gates.values():
            for n, p in g.named_parameters():
                p.zero_()
                if n.endswith("bias"):
                    p[1] = 5.0
    examples = [GateExample([1, 2, 3, 4], [0, 0, 1, 1]), GateExample([5, 6], [0, 1])]
    u = routing_usage(moe, examples, batch_size=2)
    assert u["tokens"] == 3
    assert u["mean"] == {"x": 0.0, "y": 1.0} and len(u["per_block"]) == len(moe.gates)
    assert math.isclose(sum(u["mean"].values()), 1.0)


@pytest.mark.slow
def test_planted_pipeline_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    """experiment=planted on the tiny random backbone, budgets cut: the warm start is built once and recorded,
    the analysis is scored over a grid that recomputes select alone, and the gain report holds the gate's
    held-out CE before/after and the GRPO curves (a tiny random model solves nothing: the numbers are plumbing)."""
    import json

    from tracekit.planted.gain import compose_variant, report, run_variant
    from tracekit.planted.score import run_grid

    monkeypatch.setenv("TRACEKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    ov = ["experiment=planted", "backbone=tiny", "backbone.planted.demos_strong=1", "backbone.planted.demos_weak=1",
          "backbone.planted.sft.epochs=1", "benchmark.limit=1", "eval.seeds=[0,1]", "eval.max_steps=3",
          "agent.max_new_tokens=16", "agent.batch_size=8", "thresholds.n=2", "thresholds.k=1", "grpo.iterations=1",
          "grpo.groups=1", "grpo.group_size=2", "grpo.max_steps=2", "grpo.max_new_tokens=16", "moe.steps=1",
          "moe.trajectories_per_capability=1"]
    rows = run_grid(ov, seeds=[0], deltas=(0.0, 0.2), rhos=(0.0,), run_root=tmp_path / "score")
    assert rows[0]["planted"] == WEAK and rows[1]["computed"] in ([], ["select"])
    assert "rollout" in rows[0]["computed"] and "label" in rows[0]["computed"]
    by_env = rows[0]["base_success_by_env"]
    assert sorted(by_env) == sorted(f"tau2_{c}" for c in STRONG + WEAK)
    assert sum(n for _, n in by_env.values()) == rows[0]["n_trajectories"]
    assert sum(a for a, _ in by_env.values()) == rows[0]["n_success"]
    from tracekit.planted.score import render

    assert "The base agent per environment" in render(rows, tmp_path / "scored")["md"].read_text()
    record = json.loads(next((tmp_path / "cache" / "planted").glob("*/planted.json")).read_text())
    assert record["planted_set"] == WEAK and record["spec"]["seed"] == 0
    assert {c: r["succeeded"] for c, r in record["demonstrations"].items()} == {c: 1 for c in STRONG + WEAK}
    v = run_variant(compose_variant([*ov, "thresholds.delta=0.0", "thresholds.rho=0.0"], tmp_path / "gain"),
                    tmp_path / "gain")
    from tracekit.planted.rung_a import rung_a

    # rung a: each adapter and Base on held-out instances of its environment, cached rollouts of the run's cache
    rung = rung_a(tmp_path / "gain", tmp_path / "rung", n=1)
    computed = json.loads((tmp_path / "rung" / "artifacts.json").read_text())
    assert set(rung) <= set(STRONG + WEAK) and rung and all(r["n_episodes"] == 1 for r in rung.values())
    assert {e for r in rung.values() for e in r["episodes"].values()} == set(computed)
    assert rung_a(tmp_path / "gain", tmp_path / "rung", n=1) == rung
    assert all(a["cache_hit"] for a in json.loads((tmp_path / "rung" / "artifacts.json").read_text()).values())
    table = report({"preset": v}, tmp_path / "out")
    assert {"Base", "TRACE"} <= set(table["preset"]["rows"])
    assert (tmp_path / "out" / "planted_curves.png").is_file() and (tmp_path / "out" / "planted_gain.md").is_file()
    gate = (tmp_path / "out" / "planted_gate.md").read_text()
    assert "before training" in gate and "Routing on held-out response tokens" in gate


def test_gain_plans_each_variant_and_training_seed_as_one_run(tmp_path, monkeypatch):
    """The search's runs, composed before any runs: one per variant and training seed, each its own run directory,
    the seed table's seeds only with one variant; a world-tokenizer backbone reseeds its initial weights too."""
    from tracekit.planted.gain import plan_variants

    monkeypatch.chdir(tmp_path)
    planned, seeds = plan_variants(["experiment=micro"], [], [0, 1], tmp_path)
    assert list(planned) == ["preset seed=0 backbone.planted.seed=0",
                             "preset seed=1 backbone.planted.seed=1 +backbone.planted.init_seed=1"]
    assert seeds == dict(zip(planned, [0, 1]))
    (cfg0, dir0), (cfg1, dir1) = planned.values()
    assert (dir0, dir1) == (tmp_path / "runs" / "variant0-seed0", tmp_path / "runs" / "variant0-seed1")
    assert (cfg0.seed, cfg1.seed, cfg1.backbone.planted.init_seed) == (0, 1, 1)
    planned, seeds = plan_variants(["experiment=micro"], ["grpo.lr=1e-4", "grpo.lr=1e-3"], [0], tmp_path)
    assert [c.grpo.lr for c, _ in planned.values()] == [1e-4, 1e-3] and seeds == {}


def test_gain_refuses_a_bad_variant_before_running_any(tmp_path, monkeypatch, capsys):
    """Every variant is composed and validated before the first runs: a refused second variant costs no time spent
    on the first (which would be GPU time), and the refusal is one line naming the variant."""
    from tracekit.planted import gain

    ran = []
    monkeypatch.setattr(gain, "run_variant", lambda cfg, run_dir: ran.append(run_dir))
    for bad in ("grpo.lr=-1", "grpo.no_such_knob=1"):
        rc = gain.main(["--out", str(tmp_path), "--variant", "grpo.iterations=2", "--variant", bad, "experiment=gain"])
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert rc == 2 and ran == [] and len(err) == 1, err
        assert err[0].startswith("tracekit.planted.gain: error: variant ") and bad.split("=")[0] in err[0]
