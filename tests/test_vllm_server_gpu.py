"""The real ``vllm serve`` under tracekit's client (issue 41), on a GPU with vLLM installed (``-m gpu``).

The micro world's warm start (``tests/assets/micro_warmstart``, an HF folder) is served with ``--enable-lora``
through :class:`~tracekit.rl.vllm_client.VLLMEngine`, as ``grpo.engine=vllm`` starts it: the version check, two
greedy episodes of the micro world through the client with the base model, then an adapter swap (two adapters
loaded one after the other at runtime, adapter-only sync), each served adapter's log-probs those of the same
adapter in transformers on the returned tokens, within bf16 kernels' tolerance, and the two adapters' apart.
Skipped, with one line, where vLLM or a GPU is absent. On the lent H200: ``benchmarks/vllm_server.py`` runs the
full checks and the throughput table.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

FIXTURE = Path(__file__).parent / "assets" / "micro_warmstart"
BF16_TOL = 0.25  # nats, max over tokens: the server's bf16 kernels against transformers' float32 on the same ids


def _requirements() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (on the lent H200 it is carried: benchmarks/results/vllm_carry.md)")
    if not torch.cuda.is_available():
        pytest.skip("vllm serve needs a CUDA GPU")


def _adapter(out: Path, seed: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    peft_model.save_pretrained(out)
    return out


def _logprobs(model, resp) -> torch.Tensor:
    ids = torch.tensor([resp.prompt_token_ids + resp.completion_token_ids], device=next(model.parameters()).device)
    n = len(resp.prompt_token_ids)
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)[n - 1 : -1]
    return lp.gather(1, ids[0, n:, None]).squeeze(1).cpu()


def test_real_vllm_server_episodes_and_adapter_swap(tmp_path):
    _requirements()
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracekit.llm.base import ChatRequest
    from tracekit.llm.templates import TEMPLATES
    from tracekit.rl.episodes import EpisodeSpec, run_episodes
    from tracekit.rl.vllm_client import SUPPORTED_VLLM, VLLMEngine, VLLMSettings
    from tracekit.targets.synthetic.suite import LibraryTargetSuite
    from tracekit.types import Message

    tok = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    tok.chat_template = TEMPLATES["qwen3"]
    command = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "{model}", "--host", "{host}", "--port", "{port}",
               "--enable-lora", "--max-lora-rank", "{max_lora_rank}", "--max-loras", "2", "--dtype", "{dtype}",
               "--gpu-memory-utilization", "{gpu_memory_utilization}", "--max-model-len", "{max_model_len}", "--enforce-eager")
    settings = VLLMSettings(model_path=str(FIXTURE), command=command, max_lora_rank=8, max_model_len=512,
                            gpu_memory_utilization=0.2, concurrency=8, startup_timeout_s=600)
    engine = VLLMEngine(settings, tok, tmp_path / "work", max_prompt_tokens=448)
    suite = LibraryTargetSuite("gpu-test", ["micro_finish_all_writes"], n_per_env=2)
    try:
        assert engine.server.check_version() == SUPPORTED_VLLM
        engine.use_base()
        specs = [EpisodeSpec(task=t, seed=0, sample=0, group=i) for i, t in enumerate(suite.tasks())]
        trajs = run_episodes(engine.client, suite, specs, temperature=0.0, max_new_tokens=48, max_steps=8)
        assert len(trajs) == 2 and all(t.info["turns"] and t.termination for t in trajs)

        base = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).cuda().eval()
        req = [ChatRequest(messages=[Message(role="user", content=t.instruction)], temperature=1.0, max_new_tokens=12,
                           seed=s, return_tokens=True) for s, t in enumerate(suite.tasks())]
        served = {}
        for it, seed in enumerate((1, 2)):  # adapter-only sync: save, load under a fresh name, unload the old one
            adapter = _adapter(tmp_path / f"a{seed}", seed)
            engine.sync(it, lambda p, a=adapter: shutil.copytree(a, p))
            policy = PeftModel.from_pretrained(base, str(adapter)).eval()
            served[seed] = [(r, _logprobs(policy, r)) for r in engine.client.chat(req)]
            for r, mine in served[seed]:
                assert float((mine - torch.tensor(r.completion_logprobs)).abs().max()) < BF16_TOL
            base = policy.unload()
        other = PeftModel.from_pretrained(base, str(tmp_path / "a1")).eval()  # adapter 1 on what adapter 2's server sampled
        gaps = [float((_logprobs(other, r) - torch.tensor(r.completion_logprobs)).abs().max()) for r, _ in served[2]]
        assert max(gaps) > BF16_TOL, "the second adapter's log-probs match the first's: the swap did not take"
    finally:
        suite.close()
        engine.close()
