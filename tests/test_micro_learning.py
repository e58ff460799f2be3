"""Learning on the micro world (issue 42): GRPO on one micro environment raises held-out success.

NOT YET PASSING, and so marked slow (out of CI) until it does: no warm start small enough for the CI budget has yet
learned to copy an identifier from a request, so the planted environment's base success is 0 and GRPO has no
successful group to learn from (every variant tried: benchmarks/results/micro/VARIANTS.md). It is the acceptance
test issue 42 asks for (<= 90 s, in the fast suite once it passes).

A small warm start of the micro backbone (d=128, 2 layers: the same world tokenizer and warm-start machinery as
``backbone=micro``, cut for the CI budget) is made weak on ``finish_all_writes`` by few demonstrations; GRPO on that
environment's training seeds (the real trainer, engine and LoRA) must raise its greedy success on held-out instances
by a margin. Seeds are fixed, so on one machine kind the numbers are the same every run; the margin leaves room for
another CPU's float rounding. A change that breaks the GRPO loss, the advantage, the rollout engine, the token rows
or the adapter's use at evaluation fails it.
"""

from __future__ import annotations

import pytest
import torch

from tracekit.agents import LLMAgent
from tracekit.llm.backbones import get_spec
from tracekit.llm.hf import HFChatClient
from tracekit.llm.templates import TEMPLATES
from tracekit.planted.warmstart import planted_dir
from tracekit.rl.settings import GRPOSettings, LoraSettings
from tracekit.rl.trainer import GRPOTrainer
from tracekit.rollout import run_rollouts
from tracekit.runs import TRAIN_SEED_OFFSET
from tracekit.synthesis.library_target import LibraryTargetSuite

WEAK_ENV = "micro_finish_all_writes"
HELD_OUT = 48  # held-out instances (seeds from 10,000,000)
MARGIN = 0.15  # points of success GRPO must add

SMALL_MICRO = {
    "name": "micro",
    "arch": {"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 64},
    "planted": {"family": "micro", "strong": ["lookup_by_name", "report_value"], "weak": ["finish_all_writes"],
                "demos_strong": 256, "demos_weak": 6, "seed": 0,
                "sft": {"lr": 3.0e-3, "epochs": 10, "batch_size": 16, "warmup_ratio": 0.05}},
}


def _success(model, tokenizer, out) -> float:
    client = HFChatClient(model, tokenizer, max_batch_size=64, seed=0)
    suite = LibraryTargetSuite("held-out", [WEAK_ENV], n_per_env=HELD_OUT)
    summary = run_rollouts(suite, LLMAgent(client, max_new_tokens=48), out, max_steps=8, context_budget=512,
                           batch_size=64, progress=False)
    return summary.success_rate


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    from transformers import AutoTokenizer

    cache = tmp_path_factory.mktemp("micro-cache")
    path = planted_dir(get_spec(SMALL_MICRO), "cpu", cache) / "model"
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = TEMPLATES["qwen3"]
    return path, tokenizer


@pytest.mark.slow
def test_grpo_on_a_micro_environment_raises_held_out_success(warm_start, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, tokenizer = warm_start
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    before = _success(model, tokenizer, tmp_path / "before")
    settings = GRPOSettings(iterations=8, groups=8, group_size=8, lr=3e-3, max_new_tokens=48, max_steps=8,
                            max_prompt_tokens=512, num_minibatches=1, lora=LoraSettings(rank=8, alpha=16), seed=0,
                            rollout_batch_size=64, checkpoint_every=100)
    train = LibraryTargetSuite("train", [WEAK_ENV], n_per_env=256, seed_offset=TRAIN_SEED_OFFSET)
    adapter = GRPOTrainer(model, tokenizer, train, settings, tmp_path / "grpo").train()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    after = _success(PeftModel.from_pretrained(base, str(adapter)).eval(), tokenizer, tmp_path / "after")
    assert 0.0 < before < 0.7, f"the warm start is not weak on {WEAK_ENV}: {before:.2f}"
    assert after >= before + MARGIN, f"GRPO did not learn: held-out success {before:.2f} -> {after:.2f}"
