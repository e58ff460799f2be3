"""Throughput of one GRPO iteration (rollout + update) on a random-init model (issues 6 and 9).

Builds a random-init Qwen3 of the chosen shape (bf16 on GPU), adds the LoRA adapter the trainer
uses (rank --lora-rank on q,k,v,o,gate,up,down) through :class:`GRPOTrainer`, and measures, in one
run:

- peaks: a bf16 (fp32 on CPU) matmul of --peak-n^3 and a device-to-device copy (HBM bandwidth);
- rollout: ``sample_completions`` (the hf engine's sampler: KV cache, per-row stopping, log-probs
  from the sampling logits) at each --rollout-batches, prompt --prompt-len, --gen-len new tokens
  at T=1.0 with stopping disabled; tokens/s and % of the weight-read roofline
  (batch x bandwidth / bytes of weights: every decode step must read all weights once);
- update: ``GRPOTrainer.update_on`` (the trainer's own path: length-bucketed microbatches,
  chunked lm_head log-probs of generated tokens only, eq. (2), backward, AdamW) on --update-batch
  sequences of --update-len tokens whose last --completion-frac are generated; tokens/s, model
  FLOPs utilization vs the measured matmul peak, peak memory; with and without gradient
  checkpointing (--grad-ckpt). ``--plain`` adds the obvious path for comparison: full
  ``model(...).logits`` ([tokens x vocab]) then log_softmax/gather, same loss and optimizer.

Model FLOPs of the update (recompute not counted): per token 4 x N_body (forward + input-grad
backward of frozen linears; no weight grads), per sequence 6 x layers x S^2 x d_q (causal
attention forward + backward), per generated token 4 x H x V (lm_head forward + input grad), and
LoRA 6 x r x (in + out) per adapted linear per token.

    python benchmarks/grpo_step.py --device cuda --arch qwen3_1_7b --plain --out benchmarks/results/grpo_step_qwen3_1_7b_h200.json
    python benchmarks/grpo_step.py --device cuda --arch qwen3_8b
    python benchmarks/grpo_step.py --smoke        # tiny shape on CPU, seconds
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracekit.artifacts import atomic_write_json  # noqa: E402
from tracekit.rl import grpo  # noqa: E402
from tracekit.rl.engines import sample_completions  # noqa: E402
from tracekit.rl.tokens import collate, pack_microbatches, rows_for_trajectory, Turn  # noqa: E402
from tracekit.rl.toy import KeywordSuite, tiny_tokenizer  # noqa: E402
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer, LoraSettings, causal_lm, set_activation_checkpointing  # noqa: E402
from tracekit.types import Trajectory  # noqa: E402

ARCHS = {
    "tiny": dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "qwen3_0_6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_1_7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_4b": dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3_8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def matmul_peak(dev: torch.device, dtype: torch.dtype, n: int, iters: int = 20) -> float:
    """Measured dense matmul throughput (FLOP/s) for n x n x n in ``dtype``."""
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        a @ b
    _sync(dev)
    return 2 * n**3 * iters / (time.perf_counter() - t)


def copy_bandwidth(dev: torch.device, mib: int, iters: int = 10) -> float:
    """Measured memory bandwidth (bytes/s): read + write of a ``mib`` MiB buffer copy."""
    a = torch.empty(mib * 2**20, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    _sync(dev)
    t = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    _sync(dev)
    return 2 * a.numel() * iters / (time.perf_counter() - t)


def body_params(cfg) -> int:
    """Parameters of the decoder's linear layers (attention + MLP), i.e. FLOP-bearing weights per token."""
    H, L = cfg.hidden_size, cfg.num_hidden_layers
    dq, dkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return L * (H * dq + 2 * H * dkv + dq * H + 3 * H * cfg.intermediate_size)


def lora_linear_dims(cfg) -> list[tuple[int, int]]:
    H, I = cfg.hidden_size, cfg.intermediate_size
    dq, dkv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = [(H, dq), (H, dkv), (H, dkv), (dq, H), (H, I), (H, I), (I, H)]
    return per_layer * cfg.num_hidden_layers


def update_flops(cfg, lengths: list[int], generated: int, rank: int) -> float:
    dq = cfg.num_attention_heads * cfg.head_dim
    tokens = sum(lengths)
    dense = 4 * body_params(cfg) * tokens
    attn = sum(6 * cfg.num_hidden_layers * s * s * dq for s in lengths)
    head = 4 * cfg.hidden_size * cfg.vocab_size * generated
    lora = sum(6 * rank * (i + o) for i, o in lora_linear_dims(cfg)) * tokens
    return float(dense + attn + head + lora)


def synthetic_batch(n: int, length: int, gen: int, vocab: int, seed: int) -> list[Trajectory]:
    """n one-turn trajectories of ``length`` tokens, the last ``gen`` generated, advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        turn = {"prompt_ids": ids[: length - gen], "completion_ids": ids[length - gen :], "completion_logprobs": [0.0] * gen}
        out.append(Trajectory(task_id=str(i), env="bench", info={"turns": [turn], "advantage": 1.0 if i % 2 else -1.0, "group": i}))
    return out


def fill_rollout_logprobs(tr: GRPOTrainer, trajs: list[Trajectory]) -> None:
    """Score the batch once with the current policy so that rho starts at 1 (as after a real rollout)."""
    rows = [rows_for_trajectory([Turn.from_dict(t.info["turns"][0])], 0.0, i)[0] for i, t in enumerate(trajs)]
    for t, lp in zip(trajs, tr._score(rows, adapter=True)):
        t.info["turns"][0]["completion_logprobs"] = lp.tolist()


def plain_update(tr: GRPOTrainer, trajs: list[Trajectory]) -> None:
    """The obvious path: full [tokens x vocab] logits from model(...), then log_softmax + gather."""
    s = tr.s
    rows = [
        r for i, t in enumerate(trajs) for r in rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], t.info["advantage"], i)
    ]
    tr.model.train()
    for idx in pack_microbatches([len(r) for r in rows], s.microbatch_tokens):
        b = collate([rows[i] for i in idx], tr.pad_id)
        ids, attn = b.input_ids.to(tr.device), b.attention_mask.to(tr.device)
        logits = tr.model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
        lp_all = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)
        sel = b.loss_mask[:, 1:] > 0
        logp = lp_all[sel.to(tr.device)]
        w = grpo.trajectory_token_weights(b.loss_mask, b.traj_tokens, len(trajs))[:, 1:][sel].to(tr.device)
        adv = grpo.token_advantages(b.advantages, b.loss_mask)[:, 1:][sel].to(tr.device)
        old = b.rollout_logprobs[:, 1:][sel].to(tr.device)
        grpo.grpo_loss(logp, old, adv, w, clip_eps=s.clip_eps).loss.backward()
    tr.backend.step()
    tr.model.eval()


def timed(dev: torch.device, fn) -> tuple[float, float]:
    """(seconds, peak GiB allocated during fn; nan on CPU)."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t = time.perf_counter()
    fn()
    _sync(dev)
    sec = time.perf_counter() - t
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return sec, mem


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_1_7b", choices=sorted(ARCHS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--rollout-batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--update-batch", type=int, default=4)
    ap.add_argument("--update-len", type=int, default=4096)
    ap.add_argument("--completion-frac", type=float, default=0.5)
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--logprob-chunk", type=int, default=1024)
    ap.add_argument("--grad-ckpt", default="both", choices=("on", "off", "both"))
    ap.add_argument("--plain", action="store_true", help="also time the full-logits update path")
    ap.add_argument("--peak-n", type=int, default=8192)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with small sizes")
    args = ap.parse_args(argv)
    if args.smoke:
        args.arch, args.device, args.rollout_batches = "tiny", "cpu", "1,4"
        args.prompt_len, args.gen_len, args.update_batch, args.update_len = 32, 16, 4, 128
        args.microbatch_tokens, args.peak_n, args.lora_rank, args.plain = 256, 256, 8, True

    from transformers import Qwen3Config, Qwen3ForCausalLM

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = Qwen3Config(**ARCHS[args.arch], max_position_embeddings=max(40960, args.update_len + 8))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(default)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    res: dict = {
        "arch": args.arch, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__, "lora_rank": args.lora_rank,
        "params": sum(p.numel() for p in model.parameters()),
        "command": " ".join(["python", "benchmarks/grpo_step.py", *(argv or sys.argv[1:])]),
    }  # fmt: skip
    res["matmul_peak_tflops"] = matmul_peak(dev, dtype, args.peak_n) / 1e12
    res["copy_bandwidth_gbs"] = copy_bandwidth(dev, 2048 if dev.type == "cuda" else 64) / 1e9

    tok = tiny_tokenizer()  # only its pad/stop ids are used: prompts and batches are random ids
    settings = GRPOSettings(
        lora=LoraSettings(rank=args.lora_rank, alpha=2 * args.lora_rank, target_modules=TARGETS),
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        num_minibatches=1, microbatch_tokens=args.microbatch_tokens, logprob_chunk=args.logprob_chunk, seed=0,
    )  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        tr = GRPOTrainer(model, tok, KeywordSuite(), settings, tmp, device=dev)
        res["lora_params"] = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)

        # ---- rollout ----
        g = torch.Generator().manual_seed(1)
        res["rollout"] = []
        for B in [int(x) for x in args.rollout_batches.split(",")]:
            prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
            sample_completions(tr.model, prompts, max_new_tokens=4, temperature=1.0, seed=0)  # warm-up
            sec, mem = timed(dev, lambda: sample_completions(tr.model, prompts, max_new_tokens=args.gen_len, temperature=1.0, seed=0))
            tps = B * args.gen_len / sec
            roof = B * res["copy_bandwidth_gbs"] * 1e9 / weight_bytes
            res["rollout"].append({
                "batch": B, "tokens_per_s": tps, "roofline_tokens_per_s": roof, "pct_roofline": 100 * tps / roof,
                "peak_gib": mem, "seconds": sec,
            })  # fmt: skip

        # ---- update ----
        gen = max(1, int(args.update_len * args.completion_frac))
        lengths = [args.update_len] * args.update_batch
        flops = update_flops(cfg, lengths, gen * args.update_batch, args.lora_rank)
        res["update"] = []
        modes = {"on": [True], "off": [False], "both": [False, True]}[args.grad_ckpt]
        variants = [("chunked", ck) for ck in modes] + ([("plain", ck) for ck in modes] if args.plain else [])
        lm = causal_lm(tr.model)
        for kind, ck in variants:
            set_activation_checkpointing(lm, ck)
            warm = synthetic_batch(1, min(args.update_len, 256), min(gen, 128), cfg.vocab_size, seed=2)
            fill_rollout_logprobs(tr, warm)
            tr.update_on(warm, 0)
            batch = synthetic_batch(args.update_batch, args.update_len, gen, cfg.vocab_size, seed=3)
            fill_rollout_logprobs(tr, batch)
            try:
                sec, mem = timed(dev, (lambda: tr.update_on(batch, 0)) if kind == "chunked" else (lambda: plain_update(tr, batch)))
            except torch.cuda.OutOfMemoryError:
                res["update"].append({"path": kind, "grad_ckpt": ck, "error": "out of memory"})
                tr.backend.opt.zero_grad(set_to_none=True)
                continue
            res["update"].append({
                "path": kind, "grad_ckpt": ck, "tokens_per_s": sum(lengths) / sec,
                "mfu_pct": 100 * flops / sec / (res["matmul_peak_tflops"] * 1e12), "peak_gib": mem, "seconds": sec,
            })  # fmt: skip
    _print(res)
    if args.out:
        atomic_write_json(args.out, res)
    return res


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console()
    c.print(
        f"[bold]{res['arch']}[/] on {res['device']} ({res['dtype']}), {res['params'] / 1e9:.3f}B params, "
        f"LoRA r={res['lora_rank']} ({res['lora_params'] / 1e6:.1f}M trainable); matmul peak "
        f"{res['matmul_peak_tflops']:.1f} TFLOP/s, copy bandwidth {res['copy_bandwidth_gbs']:.0f} GB/s"
    )
    t = Table(title="rollout (decode)")
    for col in ("batch", "tokens/s", "roofline tokens/s", "% roofline", "peak GiB"):
        t.add_column(col, justify="right")
    for r in res["rollout"]:
        t.add_row(
            str(r["batch"]), f"{r['tokens_per_s']:.0f}", f"{r['roofline_tokens_per_s']:.0f}", f"{r['pct_roofline']:.2f}", _gib(r["peak_gib"])
        )
    c.print(t)
    u = Table(title="update (forward + backward + AdamW)")
    for col in ("path", "grad ckpt", "tokens/s", "MFU %", "peak GiB"):
        u.add_column(col, justify="right")
    for r in res["update"]:
        if "error" in r:
            u.add_row(r["path"], str(r["grad_ckpt"]), r["error"], "", "")
        else:
            u.add_row(r["path"], str(r["grad_ckpt"]), f"{r['tokens_per_s']:.0f}", f"{r['mfu_pct']:.1f}", _gib(r["peak_gib"]))
    c.print(u)


def _gib(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1f}"


if __name__ == "__main__":
    main()
