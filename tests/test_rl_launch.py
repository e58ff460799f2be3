"""Launchers: local in-process training, DeepSpeed ZeRO in a torchrun subprocess (CPU, gloo)."""

from __future__ import annotations

import dataclasses
import glob

import pytest
import torch

from tracekit.rl.launch import (
    Factory,
    LauncherSettings,
    TrainSpec,
    deepspeed_config,
    launch_command,
    train,
)
from tracekit.rl.settings import LoraSettings
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer


def _spec(out, **kw) -> TrainSpec:
    s = dict(
        iterations=1, groups=4, group_size=8, max_new_tokens=16, max_steps=2, lr=1e-2, num_minibatches=1,
        lora=LoraSettings(rank=8, alpha=16), save_rollouts="full", seed=0,
    )  # fmt: skip
    s.update(kw)
    return TrainSpec(
        model=Factory("tracekit.rl.toy:tiny_policy", {"seed": 0}),
        env=Factory("tracekit.rl.toy:keyword_suite", {"turns": 2}),
        out_dir=str(out),
        grpo=GRPOSettings(**s),
    )


def test_deepspeed_config_and_commands(tmp_path):
    s = GRPOSettings(lr=3e-5, max_grad_norm=0.5)
    c2 = deepspeed_config(2, s, bf16=False)
    assert c2["zero_optimization"]["stage"] == 2
    assert c2["optimizer"] == {
        "type": "AdamW",
        "params": {"lr": 3e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
    }
    assert c2["gradient_clipping"] == 0.5 and c2["bf16"] == {"enabled": False}
    assert c2["gradient_accumulation_steps"] == 1
    c3 = deepspeed_config(3, GRPOSettings(max_grad_norm=0.0), bf16=True)
    assert c3["zero_optimization"]["stage"] == 3 and "gradient_clipping" not in c3 and c3["bf16"]["enabled"]
    cmd = launch_command(tmp_path / "spec.json", LauncherSettings(kind="deepspeed_zero2", nproc=2, master_port=29511))
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nnodes=1"]
    assert "--nproc_per_node=2" in cmd and "--master_port=29511" in cmd
    assert cmd[-4:] == ["--spec", str(tmp_path / "spec.json"), "--zero-stage", "2"]
    ds = launch_command(tmp_path / "s.json", LauncherSettings(kind="deepspeed_zero3", nproc=4, command="deepspeed", master_port=1))
    assert ds[:2] == ["deepspeed", "--num_gpus=4"] and ds[-1] == "3"
    with pytest.raises(ValueError, match="launcher.kind"):
        LauncherSettings(kind="fsdp")


def test_spec_roundtrip_and_factory_errors(tmp_path):
    spec = _spec(tmp_path)
    back = TrainSpec.from_json(spec.to_json())
    assert back == spec
    with pytest.raises(ValueError, match="module:function"):
        Factory("tracekit.rl.toy").build()
    with pytest.raises(ValueError, match="cannot be imported"):
        Factory("tracekit.rl.toy:nope").build()


def test_local_launcher_trains_in_process(tmp_path):
    seen = []
    adapter = train(_spec(tmp_path, groups=2, group_size=4, max_new_tokens=8), LauncherSettings(kind="local"), callbacks=[seen.append])
    assert (adapter / "adapter_model.safetensors").exists()
    assert [m["iteration"] for m in seen] == [0]
    assert glob.glob(str(tmp_path / "rollouts" / "iter_00000.jsonl"))


@pytest.mark.slow
def test_zero2_two_cpu_processes_match_a_single_process_update(tmp_path):
    """ZeRO-2 over gloo, 2 ranks x 2 groups: one iteration, then the same batch in one process."""
    from safetensors.torch import load_file

    from tracekit.artifacts import read_jsonl
    from tracekit.rl.toy import KeywordSuite, tiny_policy
    from tracekit.types import Trajectory

    seen = []
    spec = _spec(tmp_path / "ds")
    adapter = train(spec, LauncherSettings(kind="deepspeed_zero2", nproc=2), callbacks=[seen.append], timeout_s=1200)
    assert [m["iteration"] for m in seen] == [0]
    files = sorted(glob.glob(str(tmp_path / "ds" / "rollouts" / "iter_00000.rank*.jsonl")))
    assert len(files) == 2  # each rank rolled out its own groups
    trajs = [t for f in files for t in read_jsonl(f, Trajectory)]
    assert len(trajs) == 4 * 8
    kept = [t for t in trajs if "advantage" in t.info]
    assert kept and seen[0]["trajectories_kept"] == len(kept), "no informative group: nothing was trained"

    model, tok = tiny_policy(seed=0)
    single = GRPOTrainer(model, tok, KeywordSuite(turns=2), spec.grpo, tmp_path / "single")
    init = single.adapter_state()
    m = single.update_on(kept, 0)
    assert m["grad_norm"] == pytest.approx(seen[0]["grad_norm"], rel=1e-4)
    got = single.adapter_state()
    ds = load_file(str(adapter / "adapter_model.safetensors"))
    assert ds.keys() == got.keys()
    moved = max((got[k] - init[k]).abs().max().item() for k in got)
    diff = max((got[k] - ds[k]).abs().max().item() for k in got)
    assert moved > 1e-3  # the update did something
    assert diff < 1e-5, (diff, moved)
    assert all(torch.isfinite(v).all() for v in ds.values())


@pytest.mark.slow
def test_subprocess_failure_is_one_clear_error(tmp_path):
    spec = _spec(tmp_path)
    spec.env = Factory("tracekit.rl.toy:missing_env")
    with pytest.raises(RuntimeError, match=r"deepspeed_zero2 training exited with code \d+: .*full log"):
        train(spec, LauncherSettings(kind="deepspeed_zero2", nproc=1), timeout_s=600)


def test_agent_engine_samples_with_the_agents_constrained_client(tmp_path):
    # grpo.engine=agent: the rollout engine is the evaluated agent's chat client (its grammar) on the live model
    from tracekit.rl.engines import ClientEngine
    from tracekit.rl.launch import _engine_factory, run_training
    from tracekit.rl.model import Dist

    options = {"kind": "agent", "constrained_tool_calls": False, "tool_choice": "auto", "copy_ids": False,
               "max_batch_size": 4}
    spec = _spec(tmp_path, groups=2, group_size=2, max_new_tokens=8, old_logprobs="recompute")
    spec.engine = options
    factory = _engine_factory(spec, Dist())
    model, tok = spec.model.build()
    engine = factory(model, tok)
    assert isinstance(engine, ClientEngine) and engine.client.model is model and engine.client.max_batch_size == 4
    assert (run_training(spec) / "adapter_model.safetensors").exists()  # one GRPO iteration through the client
    spec.engine = {**options, "constrained_tool_calls": True}
    spec.grpo = dataclasses.replace(spec.grpo, old_logprobs="rollout")
    with pytest.raises(ValueError, match="old_logprobs=recompute"):  # masked log-probs are not the policy's
        _engine_factory(spec, Dist())
