"""Throughput of one GRPO iteration (rollout + update) on a random-init model (issues 6 and 9).

Builds a random-init Qwen3 of each --arch shape (bf16 on GPU), adds the trainer's LoRA adapter
(rank --lora-rank on q,k,v,o,gate,up,down, B drawn non-zero so the merge is not a no-op) through
:class:`GRPOTrainer`, and measures in one run, for each architecture:

- peaks: a bf16 (fp32 on CPU) matmul of --peak-n^3 and a device-to-device copy (HBM bandwidth);
- rollout, ``fast`` vs ``plain`` at each --rollout-batches: ``sample_completions`` with a
  :class:`FastDecoder` (merged adapter, static KV cache, CUDA-graph decode steps; each
  --decode-variants entry is an attention impl, ``+compile`` adds ``compile_layers``) and with the
  peft model itself (the transformers forward, unmerged LoRA). Prompt --prompt-len, T=1, stopping off.
  ``decode tok/s`` = B x (new tokens - 1) / (total - prefill) where prefill is timed by a run
  with one new token; ``% roofline`` = decode tok/s over B x bandwidth / bytes of weights (each
  decode step must read every weight once; the KV cache read is reported as ``kv_bytes_per_step``
  and not in that roofline). Greedy agreement of fast vs plain is recorded (bf16 tolerance).
- update at --update-batch x --update-len tokens (last --completion-frac generated), each variant
  from the same adapter and a fresh AdamW: ``plain`` = full ``model(...).logits`` then
  log_softmax/gather, peft's float32 LoRA compute, no checkpointing (the baseline); the trainer's
  ``update_on`` with chunked log-probs and the fused update kernels (``tracekit.rl.fused``: bf16
  LoRA addmm, fused RMSNorm) with selective / full / no checkpointing; and the previous default
  (chunked log-probs, peft's LoRA forward, full checkpointing); ``*_compile``: the fused variants
  with every decoder layer ``torch.compile``d (checkpointing inside the compiled region).
  tokens/s, MFU against the measured matmul peak, peak memory, loss and grad norm (equal within
  bf16 tolerance across variants). A torch.profiler table of the selective variants' top kernels.

Compile time is excluded from every tokens/s: each path's untimed warm-up (``warmup_seconds``)
holds its compilation (and, for the fast rollout, its CUDA-graph captures); compile variants of
the update warm up on the timed batch shape itself, so the timed steps reuse the artifact.

Model FLOPs of the update (recompute not counted): per token 4 x N_body (forward + input-grad
backward of frozen linears; no weight grads), per sequence 6 x layers x S^2 x d_q (causal attention
forward + backward), per generated token 4 x H x V (lm_head forward + input grad), and LoRA
6 x r x (in + out) per adapted linear per token.

    python benchmarks/grpo_step.py --device cuda --arch qwen3_1_7b,qwen3_8b --profile --out 'benchmarks/results/grpo_step_{arch}_h200.json'
    python benchmarks/grpo_step.py --plot benchmarks/results/grpo_step_qwen3_1_7b_h200.json,benchmarks/results/grpo_step_qwen3_8b_h200.json
    python benchmarks/grpo_step.py --smoke        # tiny shape on CPU, about a minute
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracekit.artifacts import atomic_write_json  # noqa: E402
from tracekit.llm.decoding import FastDecoder, causal_lm_of  # noqa: E402
from tracekit.rl import grpo  # noqa: E402
from tracekit.rl.engines import sample_completions  # noqa: E402
from tracekit.rl.fused import set_fused_update_kernels  # noqa: E402
from tracekit.rl.tokens import Turn, collate, pack_microbatches, rows_for_trajectory  # noqa: E402
from tracekit.rl.toy import KeywordSuite, tiny_tokenizer  # noqa: E402
from tracekit.rl.trainer import (  # noqa: E402
    GRPOSettings,
    GRPOTrainer,
    LocalBackend,
    LoraSettings,
    set_activation_checkpointing,
)
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
# (name, path, fused update kernels, checkpointing: off | full | selective, compiled decoder layers)
UPDATE_VARIANTS = [
    ("plain", "plain", False, "off", False),
    ("fast_selective", "chunked", True, "selective", False),
    ("fast_full", "chunked", True, "full", False),
    ("fast_nockpt", "chunked", True, "off", False),
    ("old_chunked_full", "chunked", False, "full", False),
    ("fast_selective_compile", "chunked", True, "selective", True),
    ("fast_full_compile", "chunked", True, "full", True),
    ("fast_nockpt_compile", "chunked", True, "off", True),
]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def matmul_peak(dev: torch.device, dtype: torch.dtype, n: int, iters: int = 20) -> float:
    """Measured dense matmul throughput (FLOP/s) for n x n x n in ``dtype`` (random operands)."""
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
    a = torch.randint(0, 255, (mib * 2**20,), dtype=torch.uint8, device=dev)
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
    """Model FLOPs of one update (see the module docstring); recompute not counted."""
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


def plain_update(tr: GRPOTrainer, trajs: list[Trajectory]) -> dict:
    """The obvious path: full [tokens x vocab] logits from model(...), then log_softmax + gather."""
    s = tr.s
    rows = [
        r for i, t in enumerate(trajs) for r in rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], t.info["advantage"], i)
    ]
    tr.model.train()
    loss = 0.0
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
        out = grpo.grpo_loss(logp, old, adv, w, clip_eps=s.clip_eps)
        out.loss.backward()
        loss += float(out.loss.detach())
    norm = tr.backend.step()
    tr.model.eval()
    return {"loss": loss, "grad_norm": norm}


def timed(dev: torch.device, fn) -> tuple[float, float, object]:
    """(seconds, peak GiB allocated during fn (nan on CPU), fn's result)."""
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    _sync(dev)
    t = time.perf_counter()
    out = fn()
    _sync(dev)
    sec = time.perf_counter() - t
    mem = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")
    return sec, mem, out


def _free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def bench_rollout(tr: GRPOTrainer, cfg, args, res: dict, dev: torch.device, weight_bytes: int) -> None:
    g = torch.Generator().manual_seed(1)
    decoders = {}
    for v in args.decode_variants.split(","):
        attention, _, comp = v.partition("+")
        if comp not in ("", "compile"):
            raise SystemExit(f"--decode-variants entry {v!r}: an attention impl, optionally +compile")
        bucket = {"seq_bucket": args.seq_bucket} if args.seq_bucket else {}  # default: FastDecoder's
        decoders["fast_" + v.replace("+", "_")] = FastDecoder(tr.model, attention=attention, compile_layers=comp == "compile", **bucket)
    res["rollout"] = []
    for B in [int(x) for x in args.rollout_batches.split(",")]:
        prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
        roof = B * res["copy_bandwidth_gbs"] * 1e9 / weight_bytes
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
        for path, engine, gen_len in [*((n, d, args.gen_len) for n, d in decoders.items()), ("plain", tr.model, args.plain_gen_len)]:

            def run(n, engine=engine, prompts=prompts):
                return sample_completions(engine, prompts, max_new_tokens=n, temperature=1.0, seed=0)

            warm, _, _ = timed(dev, lambda: run(gen_len if path != "plain" else 4))  # kernels, compile, graph captures
            pre, _, _ = timed(dev, lambda: run(1))
            tot, mem, _ = timed(dev, lambda: run(gen_len))
            dec_tps = B * (gen_len - 1) / max(tot - pre, 1e-9)
            res["rollout"].append({
                "path": path, "batch": B, "new_tokens": gen_len, "seconds": tot, "prefill_seconds": pre, "warmup_seconds": warm,
                "tokens_per_s": B * gen_len / tot, "decode_tokens_per_s": dec_tps, "roofline_tokens_per_s": roof,
                "pct_roofline": 100 * dec_tps / roof, "peak_gib": mem,
                "kv_bytes_per_step_end": B * (args.prompt_len + gen_len) * kv_per_token,
            })  # fmt: skip
        rows = res["rollout"][-len(decoders) - 1 :]
        plain = rows[-1]
        for r in rows[:-1]:
            r["speedup_vs_plain"] = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        best = max(rows[:-1], key=lambda r: r["decode_tokens_per_s"])
        dec = decoders[best["path"]]
        if args.profile and dev.type == "cuda":  # kernels of 16 fast decode steps (prefill included)
            best["profile_top_kernels"] = profile_kernels(
                lambda: sample_completions(dec, prompts, max_new_tokens=16, temperature=1.0, seed=0), top=10
            )
        n = min(16, args.plain_gen_len)
        b = sample_completions(tr.model, prompts[:4], max_new_tokens=n, temperature=0.0)
        for r in rows[:-1]:
            a = sample_completions(decoders[r["path"]], prompts[:4], max_new_tokens=n, temperature=0.0)
            agree = [next((i for i, (x, y) in enumerate(zip(p.ids, q.ids)) if x != y), n) for p, q in zip(a, b)]
            diffs = [abs(x - y) for p, q, k in zip(a, b, agree) for x, y in zip(p.logprobs[:k], q.logprobs[:k])]
            r["greedy_check"] = {"tokens": n, "agreeing_prefix": agree, "max_abs_logprob_diff_on_agreeing": max(diffs, default=0.0)}
    del decoders, dec
    _free(dev)


def bench_update(tr: GRPOTrainer, cfg, args, res: dict, dev: torch.device, save=None) -> None:
    from peft import set_peft_model_state_dict

    gen = max(1, int(args.update_len * args.completion_frac))
    lengths = [args.update_len] * args.update_batch
    flops = update_flops(cfg, lengths, gen * args.update_batch, args.lora_rank)
    res["update_flops"] = flops
    res["update"] = []
    lm = causal_lm_of(tr.model)
    init = tr.adapter_state()
    warm = synthetic_batch(1, min(args.update_len, 256), min(gen, 128), cfg.vocab_size, seed=2)
    batch = synthetic_batch(args.update_batch, args.update_len, gen, cfg.vocab_size, seed=3)
    set_activation_checkpointing(lm, False)
    fill_rollout_logprobs(tr, warm)
    fill_rollout_logprobs(tr, batch)
    names = args.update_variants.split(",") if args.update_variants else [v[0] for v in UPDATE_VARIANTS]
    by_name = {v[0]: v for v in UPDATE_VARIANTS}
    if unknown := [n for n in names if n not in by_name]:
        raise SystemExit(f"unknown --update-variants {unknown}: one of {list(by_name)}")
    for name, path, lowp, ckpt, comp in [by_name[n] for n in names]:  # in the order given
        if comp:
            torch._dynamo.reset()  # each compile variant compiles from scratch: its warm-up time is its own
        set_activation_checkpointing(lm, ckpt != "off", "full" if ckpt == "off" else ckpt, compile=comp)
        set_fused_update_kernels(lm, lowp)

        def step(b, path=path):
            return plain_update(tr, b) if path == "plain" else tr.update_on(b, 0)

        row = {"variant": name, "path": path, "fused_update_kernels": lowp, "checkpointing": ckpt, "compiled_layers": comp}
        try:
            # warm-up (untimed; holds the compilation): a compiled variant on the timed shape, so
            # that the timed steps reuse its artifact instead of recompiling for a new shape
            _free(dev)  # each variant starts from an empty allocator cache; its warm-up step fills it
            row["warmup_seconds"] = timed(dev, lambda: step(batch if comp else warm))[0]
            secs, mems, outs = [], [], []
            for _ in range(args.update_repeats):  # steady state, as in training: the allocator cache stays warm
                set_peft_model_state_dict(tr.model, init)  # every timed step starts from the same adapter
                tr.backend = LocalBackend(tr.model, tr.s)
                sec, mem, out = timed(dev, lambda: step(batch))
                secs.append(sec)
                mems.append(mem)
                outs.append(out)
        except torch.cuda.OutOfMemoryError:
            res["update"].append({**row, "error": "out of memory"})
            tr.backend.opt.zero_grad(set_to_none=True)
            _free(dev)
            continue
        sec = statistics.median(secs)
        row.update({
            "seconds": sec, "seconds_all": secs, "tokens_per_s": sum(lengths) / sec,
            "mfu_pct": 100 * flops / sec / (res["matmul_peak_tflops"] * 1e12), "peak_gib": max(mems),
            "loss": outs[0]["loss"], "grad_norm": outs[0]["grad_norm"],
        })  # fmt: skip
        res["update"].append(row)
        if name.startswith("fast_selective") and args.profile and dev.type == "cuda":
            row["profile_top_kernels"] = profile_kernels(lambda: step(batch))
        if save is not None:
            save(res)  # a run cut short still leaves every finished variant on disk
    set_activation_checkpointing(lm, False)
    set_peft_model_state_dict(tr.model, init)
    base = next((r for r in res["update"] if r["variant"] == "plain" and "error" not in r), None)
    for r in res["update"]:
        if base is not None and "error" not in r:
            r["speedup_vs_plain"] = base["seconds"] / r["seconds"]
            r["memory_ratio_plain_over_this"] = base["peak_gib"] / r["peak_gib"]


def profile_kernels(fn, top: int = 15) -> list[dict]:
    """CUDA kernels of one call of ``fn``, grouped by name, largest total time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]  # kernels (ops' self time is 0)
    total = sum(e.self_device_time_total for e in rows)
    rows.sort(key=lambda e: -e.self_device_time_total)
    return [
        {"name": e.key[:90], "ms": e.self_device_time_total / 1e3, "pct": 100 * e.self_device_time_total / total, "calls": e.count}
        for e in rows[:top]
    ] + [{"name": "TOTAL", "ms": total / 1e3, "pct": 100.0, "calls": sum(e.count for e in rows)}]


def build_trainer(arch: str, dev: torch.device, out_dir: str, *, lora_rank: int, microbatch_tokens: int, logprob_chunk: int,
                  max_len: int = 4096) -> tuple[GRPOTrainer, object]:  # fmt: skip
    """A random-init Qwen3 of shape ``arch`` (bf16 on GPU, fp32 on CPU) under a :class:`GRPOTrainer` with a
    trained-looking LoRA adapter (B != 0, so merging changes the weights) -> (trainer, model config)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = Qwen3Config(**ARCHS[arch], max_position_embeddings=max(40960, max_len + 8))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(default)
    tok = tiny_tokenizer()  # only its pad/stop ids are used: prompts and batches are random ids
    settings = GRPOSettings(
        lora=LoraSettings(rank=lora_rank, alpha=2 * lora_rank, target_modules=TARGETS),
        dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
        num_minibatches=1, microbatch_tokens=microbatch_tokens, logprob_chunk=logprob_chunk, seed=0,
    )  # fmt: skip
    tr = GRPOTrainer(model, tok, KeywordSuite(), settings, out_dir, device=dev)
    tr.engine = None  # the benchmarks build their own decoders
    _free(dev)
    with torch.no_grad():
        gen = torch.Generator(device="cpu").manual_seed(5)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen).to(p) * 1e-3)
    return tr, cfg


def bench_arch(arch: str, args, dev: torch.device, peaks: dict, save=None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tr, cfg = build_trainer(arch, dev, tmp, lora_rank=args.lora_rank, microbatch_tokens=args.microbatch_tokens,
                                logprob_chunk=args.logprob_chunk, max_len=args.update_len)  # fmt: skip
        lora = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        params = sum(p.numel() for p in tr.model.parameters()) - lora
        weight_bytes = sum(p.numel() * p.element_size() for n, p in tr.model.named_parameters() if "lora_" not in n)
        res: dict = {
            "arch": arch, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "dtype": "bfloat16" if dev.type == "cuda" else "float32", "torch": torch.__version__, "lora_rank": args.lora_rank,
            "params": params, "weight_bytes": weight_bytes,
            "command": " ".join(["python", "benchmarks/grpo_step.py", *sys.argv[1:]]), **peaks, "lora_params": lora,
        }  # fmt: skip
        if args.rollout_batches:
            bench_rollout(tr, cfg, args, res, dev, weight_bytes)
            if save is not None:
                save(res)
        if args.update_batch > 0:
            bench_update(tr, cfg, args, res, dev, save)
        del tr
    _free(dev)
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_1_7b", help=f"comma list of {sorted(ARCHS)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--rollout-batches", default="1,64", help="comma list; empty: no rollout")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128, help="new tokens of the fast path")
    ap.add_argument("--plain-gen-len", type=int, default=48, help="new tokens of the plain path (slow)")
    ap.add_argument(
        "--decode-variants", default="sdpa,bmm,sdpa+compile,bmm+compile", help="FastDecoder attention impls to time, +compile: compile_layers"
    )
    ap.add_argument("--seq-bucket", type=int, default=None, help="FastDecoder attended-length granularity of the graphs (default: its own)")
    ap.add_argument("--update-batch", type=int, default=4, help="0: no update")
    ap.add_argument("--update-len", type=int, default=4096)
    ap.add_argument("--completion-frac", type=float, default=0.5)
    ap.add_argument("--update-repeats", type=int, default=2)
    ap.add_argument("--update-variants", default="", help=f"comma list of {[v[0] for v in UPDATE_VARIANTS]}, run in this order (default all)")
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--logprob-chunk", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of the best fast rollout and the selective updates (CUDA)")
    ap.add_argument("--peak-n", type=int, default=8192)
    ap.add_argument("--out", default=None, help="JSON path per arch; '{arch}' is replaced")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with small sizes")
    ap.add_argument("--plot", default=None, help="comma list of result JSONs: draw the bar charts to --plot-out and exit")
    ap.add_argument("--plot-out", default="benchmarks/results/grpo_step_ratios_h200.png")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot.split(","), args.plot_out)
        return []
    if args.smoke:
        args.arch, args.device, args.rollout_batches = "tiny", "cpu", "1,4"
        args.prompt_len, args.gen_len, args.plain_gen_len, args.update_batch, args.update_len = 32, 16, 8, 4, 128
        args.microbatch_tokens, args.peak_n, args.lora_rank, args.logprob_chunk = 256, 256, 8, 64
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 parts stay fp32
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    peaks = {
        "matmul_peak_tflops": matmul_peak(dev, dtype, args.peak_n) / 1e12,
        "copy_bandwidth_gbs": copy_bandwidth(dev, 2048 if dev.type == "cuda" else 64) / 1e9,
    }
    results = []
    for arch in args.arch.split(","):
        if arch not in ARCHS:
            raise SystemExit(f"unknown --arch {arch!r}: one of {sorted(ARCHS)}")
        out = args.out.replace("{arch}", arch) if args.out else None
        res = bench_arch(arch, args, dev, peaks, save=(lambda r, out=out: atomic_write_json(out, r)) if out else None)
        _print(res)
        if out:
            atomic_write_json(out, res)
        results.append(res)
    return results


def _print(res: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    c = Console(width=160)
    c.print(
        f"[bold]{res['arch']}[/] on {res['device']} ({res['dtype']}), {res['params'] / 1e9:.3f}B params, "
        f"LoRA r={res['lora_rank']} ({res['lora_params'] / 1e6:.1f}M trainable); matmul peak "
        f"{res['matmul_peak_tflops']:.1f} TFLOP/s, copy bandwidth {res['copy_bandwidth_gbs']:.0f} GB/s"
    )
    if res.get("rollout"):
        t = Table(title="rollout")
        for col in ("path", "batch", "e2e tok/s", "decode tok/s", "roofline tok/s", "% roofline", "fast/plain", "prefill s", "warm-up s", "peak GiB"):
            t.add_column(col, justify="right")
        for r in res["rollout"]:
            sp = f"{r['speedup_vs_plain']:.1f}x" if "speedup_vs_plain" in r else ""  # fast rows only
            t.add_row(
                r["path"], str(r["batch"]), f"{r['tokens_per_s']:.0f}", f"{r['decode_tokens_per_s']:.0f}",
                f"{r['roofline_tokens_per_s']:.0f}", f"{r['pct_roofline']:.2f}", sp, f"{r['prefill_seconds']:.3f}",
                f"{r['warmup_seconds']:.1f}", _gib(r["peak_gib"]),
            )  # fmt: skip
        c.print(t)
        for r in res["rollout"]:
            if "greedy_check" in r:
                c.print(f"greedy {r['path']} vs plain, batch {r['batch']}: {r['greedy_check']}")
            for k in r.get("profile_top_kernels", []):
                c.print(f"  b{r['batch']} {k['pct']:5.1f}% {k['ms']:8.2f} ms {k['calls']:6d}  {k['name']}")
    if res.get("update"):
        u = Table(title="update (forward + backward + AdamW)")
        for col in ("variant", "tokens/s", "MFU %", "peak GiB", "speed vs plain", "memory plain/this", "loss", "grad norm", "warm-up s"):
            u.add_column(col, justify="right")
        for r in res["update"]:
            if "error" in r:
                u.add_row(r["variant"], r["error"], "", "", "", "", "", "", "")
                continue
            u.add_row(
                r["variant"], f"{r['tokens_per_s']:.0f}", f"{r['mfu_pct']:.1f}", _gib(r["peak_gib"]),
                f"{r.get('speedup_vs_plain', float('nan')):.2f}x", f"{r.get('memory_ratio_plain_over_this', float('nan')):.2f}x",
                f"{r['loss']:.6f}", f"{r['grad_norm']:.6f}", f"{r['warmup_seconds']:.1f}",
            )  # fmt: skip
        c.print(u)
        for r in res["update"]:
            for k in r.get("profile_top_kernels", []):
                c.print(f"  {k['pct']:5.1f}% {k['ms']:8.2f} ms {k['calls']:6d}  {k['name']}")


def plot(paths: list[str], out: str) -> None:
    """Bar charts from result JSONs: rollout speedup fast/plain, update MFU and peak memory by variant."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    labels, vals = [], []
    for r in runs:
        for x in r["rollout"]:
            if "speedup_vs_plain" in x:
                labels.append(f"{r['arch'].replace('qwen3_', '')} {x['path'].replace('fast_', '')} b{x['batch']}")
                vals.append(x["speedup_vs_plain"])
    axes[0].bar(range(len(vals)), vals, color="tab:blue")
    axes[0].set_xticks(range(len(vals)), labels, fontsize=7, rotation=30)
    axes[0].set_ylabel("decode tokens/s, fast / plain peft")
    axes[0].set_title("rollout speedup")
    for i, v in enumerate(vals):
        axes[0].text(i, v, f"{v:.1f}x", ha="center", va="bottom", fontsize=7)
    names = [v[0] for v in UPDATE_VARIANTS]
    width = 0.8 / len(runs)
    for j, r in enumerate(runs):
        rows = {x["variant"]: x for x in r["update"]}
        mfu = [rows[n].get("mfu_pct", 0.0) if n in rows else 0.0 for n in names]
        mem = [rows[n].get("peak_gib", 0.0) if n in rows else 0.0 for n in names]
        xs = [i + j * width for i in range(len(names))]
        axes[1].bar(xs, mfu, width, label=r["arch"])
        axes[2].bar(xs, mem, width, label=r["arch"])
        for x, n in zip(xs, names):
            if n not in rows or "error" in rows[n]:
                axes[1].text(x, 0.5, "OOM" if n in rows else "not run", ha="center", rotation=90, fontsize=7)
    for ax, title in ((axes[1], "update MFU % (vs measured bf16 peak)"), (axes[2], "update peak GiB")):
        ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))], names, rotation=20, fontsize=7)
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[1].axhline(40, color="grey", ls="--", lw=0.8)
    fig.suptitle(f"GRPO step on {runs[0]['device']} (random-init Qwen3 shapes, LoRA r={runs[0]['lora_rank']}, 16k-token update)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _gib(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1f}"


if __name__ == "__main__":
    main()
