"""The GRPO trainer: frozen backbone, peft adapter, metrics, resume, dynamic sampling, learning."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import procs
from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.rl.settings import LoraSettings
from tracekit.rl.toy import KeywordSuite, tiny_model, tiny_tokenizer
from tracekit.rl.trainer import METRIC_COLUMNS, GRPOSettings, GRPOTrainer
from tracekit.types import Message, Task


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class _VowelEpisode(Episode):
    """Reward = share of vowels among the letters the agent wrote (dense: groups almost never tie)."""

    def __init__(self, dead: bool, turns: int):
        self.dead, self.turns, self.scores = dead, turns, []

    def reset(self) -> Observation:
        return Observation(messages=[Message(role="user", content="Say something with many vowels.")], tools=[])

    def step(self, action: Message) -> StepResult:
        letters = [c for c in (action.content or "") if c.isalpha()]
        self.scores.append(0.0 if self.dead or not letters else sum(c in "aeiouAEIOU" for c in letters) / len(letters))
        done = len(self.scores) >= self.turns
        return StepResult(messages=[] if done else [Message(role="user", content="More.")], done=done)

    def outcome(self) -> Outcome:
        r = sum(self.scores) / self.turns
        return Outcome(reward=r, success=r > 0.5)


class VowelSuite(EnvSuite):
    """Tasks 'live-*' score the reply's vowel share; 'dead-*' always score 0 (zero-variance groups)."""

    def __init__(self, n_live: int = 4, n_dead: int = 0, turns: int = 2):
        self.name = "vowels"
        self._tasks = [Task(id=f"live-{i}", env=self.name) for i in range(n_live)] + [
            Task(id=f"dead-{i}", env=self.name) for i in range(n_dead)
        ]
        self.turns = turns

    def tasks(self) -> list[Task]:
        return self._tasks

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return _VowelEpisode(task.id.startswith("dead"), self.turns)


def _settings(**kw) -> GRPOSettings:
    base = dict(
        iterations=3, groups=2, group_size=4, max_new_tokens=8, max_steps=2, lr=1e-2, num_minibatches=2,
        checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8), seed=0, save_rollouts="none",
        gradient_checkpointing=False,  # the tiny model's plain update (the checkpointed one is compared with it)
    )  # fmt: skip
    base.update(kw)
    return GRPOSettings(**base)


def _trainer(tok, out, suite=None, callbacks=(), **kw) -> GRPOTrainer:
    return GRPOTrainer(tiny_model(len(tok), seed=0), tok, suite or VowelSuite(), _settings(**kw), out, callbacks=callbacks)


def test_backbone_frozen_adapter_trained_and_loadable_by_peft(tok, tmp_path):
    tr = _trainer(tok, tmp_path)
    lm = tr.model.get_base_model()
    before = {k: v.clone() for k, v in lm.state_dict().items() if "lora_" not in k}
    init = tr.adapter_state()
    adapter_dir = tr.train()
    after = {k: v for k, v in lm.state_dict().items() if "lora_" not in k}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-identical backbone
    final = tr.adapter_state()
    assert any(not torch.equal(init[k], final[k]) for k in init)  # the adapter did move
    assert all(not p.requires_grad for n, p in tr.model.named_parameters() if "lora_" not in n)

    from peft import PeftModel

    assert (adapter_dir / "adapter_config.json").exists() and (adapter_dir / "adapter_model.safetensors").exists()
    loaded = PeftModel.from_pretrained(tiny_model(len(tok), seed=0), str(adapter_dir)).eval()
    x = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, tr.model.eval()(input_ids=x).logits, atol=1e-6)

    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [int(r["iteration"]) for r in rows] == [0, 1, 2]
    assert list(rows[0].keys()) == METRIC_COLUMNS
    r0 = rows[0]
    assert int(r0["groups"]) == 2 and int(r0["optimizer_steps"]) >= 1 and float(r0["grad_norm"]) > 0
    assert int(r0["tokens_generated"]) > 0 and float(r0["episode_turns_mean"]) == 2.0
    assert 0.0 <= float(r0["reward_mean"]) <= 1.0 and float(r0["time_rollout_s"]) > 0


class _Kill(Exception):
    pass


def test_kill_and_resume_ends_with_the_same_adapter(tok, tmp_path):
    kw = dict(iterations=4, checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8, dropout=0.1))  # dropout: torch RNG in play
    full = _trainer(tok, tmp_path / "full", **kw)
    full.train()
    want = full.adapter_state()

    def kill_after_2(m):
        if m["iteration"] == 2:  # iteration 2 done, last checkpoint after iteration 1
            raise _Kill()

    with pytest.raises(_Kill):
        _trainer(tok, tmp_path / "cut", callbacks=[kill_after_2], **kw).train()
    assert (tmp_path / "cut" / "checkpoints" / "latest.json").exists()
    resumed = _trainer(tok, tmp_path / "cut", **kw)
    resumed.train()
    assert resumed.start_iteration == 2
    got = resumed.adapter_state()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    rows_full = list(csv.DictReader((tmp_path / "full" / "metrics.csv").open()))
    rows_cut = list(csv.DictReader((tmp_path / "cut" / "metrics.csv").open()))
    assert [r["iteration"] for r in rows_cut] == ["0", "1", "2", "3"]
    assert [r["reward_mean"] for r in rows_cut] == [r["reward_mean"] for r in rows_full]
    assert [r["loss"] for r in rows_cut] == [r["loss"] for r in rows_full]
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["iter_00001", "iter_00003", "latest.json"]


def test_recompute_kl_and_tis_paths(tok, tmp_path):
    tr = _trainer(tok, tmp_path, iterations=1, num_minibatches=1, old_logprobs="recompute", kl_beta=0.1, tis_cap=2.0)
    m = tr.iteration(0)
    # one step on fresh data re-scored by the trainer: rho == 1 exactly, nothing clipped; the adapter
    # starts at B = 0 so the policy equals the frozen base and the KL is 0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["clip_frac"] == 0.0 and m["kl"] == pytest.approx(0.0, abs=1e-7)
    m2 = tr.iteration(1)  # now the adapter differs from the base
    assert m2["kl"] > 0 and m2["optimizer_steps"] == 1


def test_dynamic_resampling_refills_to_g_informative_groups(tok, tmp_path):
    suite = VowelSuite(n_live=1, n_dead=3)
    off = _trainer(tok, tmp_path / "off", suite=suite, groups=4).iteration(0)
    assert off["groups"] == 4 and off["groups_dropped"] >= 1
    assert off["trajectories_kept"] == (4 - off["groups_dropped"]) * 4
    on = _trainer(tok, tmp_path / "on", suite=suite, groups=4, dynamic_resampling=True, max_resample_rounds=10).iteration(0)
    assert on["trajectories_kept"] == 4 * 4  # G informative groups of K
    assert on["resample_rounds"] >= 1 and on["groups"] == 4 + on["groups_dropped"]


def test_gradient_checkpointing_gives_the_same_update(tok, tmp_path):
    plain = _trainer(tok, tmp_path / "a", iterations=1)
    ckpt = _trainer(tok, tmp_path / "b", iterations=1, gradient_checkpointing=True)
    ma, mb = plain.iteration(0), ckpt.iteration(0)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5) and ma["grad_norm"] > 0
    a, b = plain.adapter_state(), ckpt.adapter_state()
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_settings_validation():
    with pytest.raises(ValueError, match="group_size"):
        GRPOSettings(group_size=1)
    with pytest.raises(ValueError, match="tis_cap"):
        GRPOSettings(tis_cap=2.0)  # needs old_logprobs=recompute
    with pytest.raises(ValueError, match="old_logprobs"):
        GRPOSettings(old_logprobs="server")
    assert GRPOSettings(lora={"rank": 8, "alpha": 16}).lora.rank == 8


def test_unknown_lora_target_is_one_clear_error(tok, tmp_path):
    with pytest.raises(ValueError, match=r"\['c_attn'\] match no module"):
        _trainer(tok, tmp_path, lora=LoraSettings(rank=4, alpha=8, target_modules=["q_proj", "c_attn"]))


@pytest.mark.slow
def test_grpo_learning_raises_reward(tok, tmp_path):
    """GRPO on the toy ping environment: mean reward rises clearly above its start on CPU."""
    curve: list[float] = []
    s = dict(iterations=20, groups=4, group_size=8, max_new_tokens=16, lr=1e-2, lora=LoraSettings(rank=8, alpha=16), checkpoint_every=100)
    tr = _trainer(tok, tmp_path, suite=KeywordSuite(turns=2), callbacks=[lambda m: curve.append(m["reward_mean"])], **s)
    tr.train()
    print("reward curve:", [round(r, 3) for r in curve])
    start, end = sum(curve[:3]) / 3, sum(curve[-3:]) / 3
    assert end >= start + 0.25, curve


_KILL_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from tracekit.rl.toy import tiny_model, tiny_tokenizer, KeywordSuite
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer
from tracekit.rl.settings import LoraSettings
tok = tiny_tokenizer()
s = GRPOSettings(iterations=6, groups=4, group_size=8, max_new_tokens=16, max_steps=2, lr=1e-2, num_minibatches=2,
                 checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8, dropout=0.1), seed=0, save_rollouts="none")
GRPOTrainer(tiny_model(len(tok), seed=0), tok, KeywordSuite(turns=2), s, sys.argv[1]).train()
"""


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs.run([sys.executable, str(script), str(tmp_path / "full")], check=True, env=env, capture_output=True)
    p = procs.popen([sys.executable, str(script), str(tmp_path / "cut")], env=env, stderr=subprocess.DEVNULL)
    latest = tmp_path / "cut" / "checkpoints" / "latest.json"
    procs.wait_for_path(latest, timeout=600, proc=p)  # the first checkpoint: an event, not a clock
    time.sleep(0.5)  # somewhere inside the next iterations
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "cut" / "adapter").exists(), "the run finished before it could be killed"
    procs.run([sys.executable, str(script), str(tmp_path / "cut")], check=True, env=env, capture_output=True)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "full" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_on_fused_moe_experts_via_target_parameters():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tracekit.rl.model import build_peft_model

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    moe = Qwen3MoeForCausalLM(cfg)
    with pytest.raises(ValueError, match="target_modules"):  # transformers 5 fuses the experts: no gate_proj module
        build_peft_model(moe, LoraSettings(rank=2, alpha=4), seed=0)
    lora = LoraSettings(rank=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])  # fmt: skip
    pm = build_peft_model(moe, lora, seed=0)
    trainable = sum(p.numel() for p in pm.parameters() if p.requires_grad)
    attn = 2 * (32 + 32) + 2 * (32 + 16) * 2 + 2 * (32 + 32)  # q, k, v, o
    experts = 4 * 2 * (32 + 32) + 4 * 2 * (16 + 32)  # per-expert LoRA on gate_up [4, 32, 32] and down [4, 32, 16]
    assert trainable == attn + experts
    with pytest.raises(ValueError, match="target_parameters"):
        build_peft_model(Qwen3MoeForCausalLM(cfg), LoraSettings(rank=2, alpha=4, target_modules=["q_proj"], target_parameters=["nope"]), 0)
