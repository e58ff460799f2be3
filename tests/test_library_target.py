"""The synthetic target (``benchmark.kind=synthetic``): held-out library instances as tasks, scored and labeled."""

from __future__ import annotations

import pytest
import torch

from tracekit.agents import Agent, GoldAgent
from tracekit.targets.tau2.labels import ReferenceLabeler, reference_dictionary
from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.targets.synthetic.suite import TARGET_SEED_OFFSET, LibraryTargetSuite
from tracekit.llm.base import ChatResponse
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.runs import TRAIN_SEED_OFFSET, synthesis_target
from tracekit.wiring import build_suite
from tracekit.types import LabelValue, Message

ENVS = ["tau2_tool_calling_precision", "tau2_precondition_verification"]


class ApologizingAgent(Agent):
    """Never calls a tool: the failure mode of a small chat model on tool-use tasks."""

    name = "apologizing"

    def act(self, states):
        text = "I'm sorry, I cannot help with that."
        return [ChatResponse(message=Message(role="assistant", content=text), text=text) for _ in states]


def test_tasks_are_held_out_seeds_of_each_environment():
    suite = LibraryTargetSuite("mini", ENVS, difficulty=0, n_per_env=3)
    tasks = suite.tasks()
    assert [t.id for t in tasks[:3]] == [f"tau2_tool_calling_precision/seed-{TARGET_SEED_OFFSET + i}" for i in range(3)]
    assert [t.env for t in tasks] == [ENVS[0]] * 3 + [ENVS[1]] * 3
    assert TARGET_SEED_OFFSET > TRAIN_SEED_OFFSET + 10_000  # training draws never reach the target's seeds
    assert all(t.data["actions"] for t in tasks)  # the gold agent's script


def test_gold_agent_solves_every_task_and_is_labeled_without_lacking(tmp_path):
    suite = LibraryTargetSuite("mini", ENVS, difficulty=0, n_per_env=2)
    summary = run_rollouts(suite, GoldAgent(), tmp_path / "gold", max_steps=10, progress=False)
    trajs = read_trajectories(tmp_path / "gold")
    assert summary.total == 4 and len(trajs) == 4 and all(t.success for t in trajs)
    labels = ReferenceLabeler().label_runs(trajs, reference_dictionary(), [0], 0, tmp_path).labels
    assert labels and all(lab.value in (LabelValue.PRESENT, LabelValue.NA) for lab in labels)


def test_an_agent_that_never_calls_a_tool_fails_and_lacks_tool_calling(tmp_path):
    suite = LibraryTargetSuite("mini", ENVS[:1], difficulty=0, n_per_env=2)
    run_rollouts(suite, ApologizingAgent(), tmp_path / "sorry", max_steps=4, progress=False)
    trajs = read_trajectories(tmp_path / "sorry")
    assert not any(t.success for t in trajs)
    labels = ReferenceLabeler().label_runs(trajs, reference_dictionary(), [0], 0, tmp_path).labels
    tcp = [lab for lab in labels if lab.capability == "tool_calling_precision"]
    assert len(tcp) == 2 and all(lab.value == LabelValue.LACKING for lab in tcp)


def test_config_builds_the_target_and_checks_it(make_cfg):
    cfg = make_cfg("experiment=embedded", "benchmark=tau2_mini", "benchmark.limit=2")
    validate(cfg)
    suite = build_suite(cfg)
    assert len(suite.tasks()) == 2 * len(cfg.benchmark.synthetic.envs)
    assert synthesis_target(cfg) == "tau2_retail"  # the library environments' family: synthesis keeps its tools
    with pytest.raises(ConfigError, match=r"benchmark\.synthetic\.envs"):
        validate(make_cfg("experiment=embedded", "benchmark=tau2_mini", "benchmark.synthetic.envs=[tau2_nope]"))
    with pytest.raises(ConfigError, match=r"benchmark\.synthetic\.difficulty"):
        validate(make_cfg("experiment=embedded", "benchmark=tau2_mini", "benchmark.synthetic.difficulty=9"))


def test_zero_update_adapter_is_detected_from_its_weights(tmp_path):
    from safetensors.torch import save_file

    from tracekit.runs import is_zero_update

    A = {"m.q_proj.lora_A.weight": torch.randn(4, 8), "m.v_proj.lora_A.weight": torch.randn(4, 8)}
    save_file({**A, "m.q_proj.lora_B.weight": torch.zeros(8, 4), "m.v_proj.lora_B.weight": torch.zeros(8, 4)},
              str(tmp_path / "adapter_model.safetensors"))
    assert is_zero_update(tmp_path)  # peft's initialization: B = 0, so the adapter adds nothing
    B = torch.zeros(8, 4)
    B[3, 1] = 1e-6
    save_file({**A, "m.q_proj.lora_B.weight": torch.zeros(8, 4), "m.v_proj.lora_B.weight": B},
              str(tmp_path / "adapter_model.safetensors"))
    assert not is_zero_update(tmp_path)
