"""DeepSpeed ZeRO backend details and the multi-GPU ZeRO benchmark's helpers (issue 8)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from tests import procs
from benchmarks.zero_multi_gpu import (
    ParitySuite,
    compare,
    first_word_id,
    fixed_batch,
    grpo_settings,
    main as bench_main,
    scored_fixed_batch,
    summarize,
    word_tokenizer,
)
from tracekit.llm.tools import encode_prompt
from tracekit.rl.launch import DeepSpeedBackend
from tracekit.types import Message, stable_hash

ROOT = Path(__file__).resolve().parents[1]


def test_backward_clears_zero_flags_before_each_backward():
    """The engine's forward() would clear the ZeRO optimizer's backward flags (ZeRO-3 counts
    micro-steps there); our forward bypasses it, so backward must do it first."""
    calls = []

    class Opt:
        def clear_backward_seen_flag(self):
            calls.append("clear")

    class Engine:
        optimizer = Opt()

        def set_gradient_accumulation_boundary(self, b):
            calls.append(("boundary", b))

        def backward(self, loss):
            calls.append("backward")

    b = DeepSpeedBackend.__new__(DeepSpeedBackend)
    b.engine = Engine()
    b.backward(torch.tensor(1.0), boundary=False)
    b.backward(torch.tensor(1.0), boundary=True)
    assert calls == ["clear", ("boundary", False), "backward", "clear", ("boundary", True), "backward"]


def test_word_tokenizer_roundtrips_every_id():
    tok = word_tokenizer(64)
    assert len(tok) == 64 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|im_end|>"
    ids = list(range(first_word_id(), 64))
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids
    prompt = encode_prompt(tok, [Message(role="system", content="w10 w11 w12"), Message(role="user", content="w13")], None)
    # <|im_start|> system w10 w11 w12 <|im_end|> <|im_start|> user w13 <|im_end|> <|im_start|> assistant
    assert prompt[2:5] == [10, 11, 12] and prompt[8] == 13 and len(prompt) == 12
    with pytest.raises(ValueError, match="no room"):
        word_tokenizer(9)


def test_parity_suite_is_seeded_and_scores_reply_hash_parity():
    suite = ParitySuite(vocab_size=64, prompt_words=20, turns=2)
    task = suite.tasks()[0]
    a, b, c = suite.episode(task, seed=1), suite.episode(task, seed=1), suite.episode(task, seed=2)
    pa = a.reset().messages[0].content
    assert pa == b.reset().messages[0].content != c.reset().messages[0].content and len(pa.split()) == 20
    replies = ["w20 w21", "w30"]
    r1 = a.step(Message(role="assistant", content=replies[0]))
    assert not r1.done and r1.messages[0].role == "user"
    assert a.step(Message(role="assistant", content=replies[1])).done
    want = [int(stable_hash(t, 8), 16) % 2 for t in replies]
    assert a.outcome().reward == pytest.approx(sum(want) / 2)
    # over many replies both outcomes occur: groups have reward variance
    scores = {int(stable_hash(f"w{i}", 8), 16) % 2 for i in range(20)}
    assert scores == {0, 1}


def test_fixed_batch_is_seeded_and_in_bounds():
    x, y = fixed_batch(8, 40, 16, 64, seed=3), fixed_batch(8, 40, 16, 64, seed=3)
    assert [t.info for t in x] == [t.info for t in y]
    assert [t.info for t in fixed_batch(8, 40, 16, 64, seed=4)] != [t.info for t in x]
    for t in x:
        turn = t.info["turns"][0]
        assert 20 <= len(turn["prompt_ids"]) <= 40 and 8 <= len(turn["completion_ids"]) <= 16
        assert all(first_word_id() <= i < 64 for i in turn["prompt_ids"] + turn["completion_ids"])
        assert -1.5 <= t.info["advantage"] <= 1.5


def test_compare_hand_computed(tmp_path):
    from safetensors.torch import save_file

    def put(d, init, after, grad):
        d.mkdir()
        for name, v in (("adapter_init", init), ("adapter_after", after), ("grads", grad)):
            save_file({"a": torch.tensor(v)}, str(d / f"{name}.safetensors"))

    put(tmp_path / "one", [0.0, 0.0], [1.0, -1.0], [3.0, 4.0])
    put(tmp_path / "two", [0.0, 0.0], [1.0, 1.0], [3.0, 4.5])
    c = compare(tmp_path / "one", tmp_path / "two")
    assert c["grad_rel_l2"] == pytest.approx(0.5 / 5.0)  # ||(0, 0.5)|| / ||(3, 4)||
    assert c["grad_max_abs_diff"] == pytest.approx(0.5) and c["grad_max_abs"] == pytest.approx(4.0)
    assert c["adapter_max_abs_diff"] == pytest.approx(2.0)
    assert c["update_rel_l2"] == pytest.approx(2.0 / math.sqrt(2.0))  # ||(0, 2)|| / ||(1, -1)||
    assert c["update_sign_disagree_frac"] == pytest.approx(0.5) and c["init_max_abs_diff"] == 0.0


def test_scaling_efficiency():
    keys = ("rollout_tokens_per_s", "update_tokens_per_s", "iteration_tokens_per_s")
    runs = {3: {1: dict(zip(keys, (100.0, 200.0, 50.0))), 2: dict(zip(keys, (150.0, 400.0, 60.0)))}}
    summarize(runs, 2)
    assert runs[3]["scaling_efficiency"] == pytest.approx({keys[0]: 0.75, keys[1]: 1.0, keys[2]: 0.6})
    failed = {2: {1: {"error": "x"}, 2: dict(zip(keys, (1.0, 1.0, 1.0)))}}
    summarize(failed, 2)
    assert "scaling_efficiency" not in failed[2]


def test_worker_refuses_to_run_outside_torchrun():
    r = procs.run(
        [sys.executable, str(ROOT / "benchmarks" / "zero_multi_gpu.py"), "--worker", "--stage", "3", "--run-dir", "/tmp/x", "--smoke"],
        capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode != 0 and "RANK is not set: run this under torchrun or deepspeed" in r.stderr


@pytest.mark.slow
def test_zero_gradients_match_a_local_update_with_several_microbatches(tmp_path):
    """ZeRO-2 and ZeRO-3, 1 and 2 gloo ranks, microbatches small enough that every rank accumulates
    several backward passes: the full gradient equals LocalBackend's on the same batch."""
    from safetensors.torch import load_file

    from tracekit.rl.tokens import pack_microbatches
    from tracekit.rl.trainer import GRPOTrainer, LocalBackend
    from benchmarks.zero_multi_gpu import random_qwen3

    argv = ["--smoke", "--microbatch-tokens", "96", "--work-dir", str(tmp_path), "--job-timeout", "900"]
    res = bench_main(argv)
    import argparse

    args = argparse.Namespace(lora_rank=8, lr=1e-5, groups=2, group_size=4, max_new_tokens=8, turns=2, microbatch_tokens=96,
                              fixed_trajs=6, fixed_prompt=40, fixed_gen=16)  # fmt: skip
    grads = {}

    class Probe(LocalBackend):
        def step(self):
            grads.update({n: p.grad.detach().clone() for n, p in names.items()})
            return super().step()

    model = random_qwen3("tiny", torch.device("cpu"), torch.float32, seed=0)
    tr = GRPOTrainer(model, word_tokenizer(384), ParitySuite(384, 24, 2), grpo_settings(args), tmp_path / "local", backend_factory=Probe)
    names = {n: p for n, p in tr.model.named_parameters() if p.requires_grad}
    batch = scored_fixed_batch(tr, args, 384)
    lengths = [len(t.info["turns"][0]["prompt_ids"]) + len(t.info["turns"][0]["completion_ids"]) for t in batch]
    assert len(pack_microbatches(lengths[1::2], 96)) > 1  # rank 1 of 2 accumulates too
    m = tr.update_on(batch, 0)
    for stage in (2, 3):
        runs = res["stages"][f"zero{stage}"]
        for world in (1, 2):
            assert "error" not in runs[str(world)], runs[str(world)]
            assert runs[str(world)]["fixed"]["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5)
            got = load_file(str(tmp_path / f"zero{stage}_w{world}" / "grads.safetensors"))
            assert got.keys() == grads.keys()
            num = math.sqrt(sum(((got[k] - grads[k]) ** 2).sum().item() for k in grads))
            den = math.sqrt(sum((grads[k] ** 2).sum().item() for k in grads))
            assert den > 0 and num / den < 1e-5, (stage, world, num / den)
        assert runs["fixed_batch_vs_single"]["grad_rel_l2"] < 1e-5
        assert 0 < runs["scaling_efficiency"]["update_tokens_per_s"]


def test_zero3_multi_process_with_hf_rollouts_is_refused_before_launch(tmp_path):
    from tracekit.rl.launch import Factory, LauncherSettings, TrainSpec, check_supported, train

    spec = TrainSpec(model=Factory("tracekit.rl.toy:tiny_policy"), env=Factory("tracekit.rl.toy:keyword_suite"), out_dir=str(tmp_path))
    with pytest.raises(NotImplementedError, match="deepspeed_zero3 with nproc > 1 and grpo.engine=hf is not built"):
        train(spec, LauncherSettings(kind="deepspeed_zero3", nproc=2))
    assert not (tmp_path / "train_spec.json").exists()  # refused before anything was written or launched
    check_supported(spec, 3, 1)
    check_supported(spec, 2, 2)
