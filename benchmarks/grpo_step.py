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

The paper's backbones (issue 22): ``--arch qwen3_30b_a3b`` (Qwen3-MoE, 128 experts, top-8) and
``qwen3_6_27b`` (hybrid Gated DeltaNet / gated attention) are built from their ``conf/backbone`` numbers
(:data:`tracekit.llm.backbones.BACKBONES`), random init. The capability adapter is LoRA r on every
q/k/v/o/gate/up/down ``nn.Linear`` the model has, plus peft ``target_parameters`` on fused 3-D experts
(``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``). For MoE models:

- fast decoders: ``attention[+compile][:moe]`` with ``moe`` = ``fused`` (default: routing, grouped expert
  GEMMs and the experts' LoRA per (token, expert) pair, CUDA-graph captured; ``tracekit.llm.moe_experts``)
  or ``module`` (the block's own forward, peft materialising every adapted expert weight; no graphs;
  decodes --plain-gen-len tokens);
- the roofline counts the bytes a decode step must read: every non-expert weight (lm_head included,
  the input embedding not) plus the experts *touched* (measured: a plain decode of --touched-steps
  steps with the routers observed; the uniform-routing expectation 1 - (1 - k/E)^B beside it) with
  their LoRA factors in the model dtype; ``% roofline+KV`` also counts the KV cache at the mean
  attended length (full-attention layers only; a DeltaNet state is not counted);
- ``--lora-moe``: the composed LoRA-MoE (``tracekit.moe``, 4 random adapters r=--lora-rank on the
  attention linears, top-1) against the backbone with one peft adapter (``peft_1``) and the bare backbone,
  eager forwards as tracekit serves the composed model: prefill (--lora-moe-prefill, last-position
  logits) and decode steps (--lora-moe-decode batches on a 512-token cache), ms medians.

Model FLOPs count active parameters (experts x k/E) and, for the LoRA on experts, k experts per token.
The fused update variants run LoRA on fused experts as grouped GEMMs on the routed pairs
(``tracekit.llm.moe_experts.lora_experts_forward``); ``fast_full_peft_experts`` keeps peft's expert forward
(which materialises ``W + s B A`` per expert) for comparison. ``--lora-moe`` also times ``moe_gather``, the
top-1 decode plan that gathers each token's factors (before issue 22's dense decode plan), and with
``--profile`` per-op host / device time of one decode step of peft_1 and both plans.

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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tracekit.artifacts import atomic_write_json  # noqa: E402
from tracekit.llm.decoding import FastDecoder, causal_lm_of, unsupported_reason  # noqa: E402
from tracekit.llm.moe_experts import touched_experts_fraction  # noqa: E402
from tracekit.rl import grpo  # noqa: E402
from tracekit.rl.engines import sample_completions  # noqa: E402
from tracekit.rl.fused import set_fused_experts, set_fused_update_kernels  # noqa: E402
from tracekit.rl.tokens import Turn, collate, pack_microbatches, rows_for_trajectory  # noqa: E402
from tracekit.rl.toy import KeywordSuite, tiny_tokenizer  # noqa: E402
from tracekit.rl.model import set_activation_checkpointing
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer, LocalBackend
from tracekit.rl.settings import LoraSettings
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
# the paper's backbones by their conf/backbone names (numbers: tracekit.llm.backbones.BACKBONES), and
# scaled-down siblings of the same model types (CPU smoke runs, tests)
PAPER_ARCHS = ("qwen3_30b_a3b", "qwen3_6_27b")
TINY_PAPER = {
    "tiny_moe": ("qwen3_30b_a3b", dict(vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                       num_experts=8, num_experts_per_tok=2)),
    "tiny_hybrid": ("qwen3_6_27b", dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                        linear_key_head_dim=16, linear_value_head_dim=16)),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# (name, path, fused update kernels: True | "linear" (LoRA linears and RMSNorms only, the experts on peft's
# forward: the fast path before the grouped-GEMM experts) | False, checkpointing: off | full | selective,
# compiled decoder layers)
UPDATE_VARIANTS = [
    ("plain", "plain", False, "off", False),
    ("plain_full", "plain", False, "full", False),
    ("fast_selective", "chunked", True, "selective", False),
    ("fast_full", "chunked", True, "full", False),
    ("fast_full_peft_experts", "chunked", "linear", "full", False),
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


def text_config(cfg):
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_counts(model: torch.nn.Module) -> dict:
    """Parameter counts the FLOPs and the roofline need (LoRA factors excluded from the base counts).

    ``body``: decoder-layer weights (>= 2-D) outside the experts; ``experts``: fused expert weights;
    ``active``: body + experts x k / E (the FLOP-bearing weights per token); ``head``: the lm_head;
    ``embed``: the input embedding (read B rows per step: not in the roofline unless tied to the head);
    ``attn_layers``: full-attention layers (the S^2 term, the KV cache); ``lora_per_token``: sum of
    r x (in + out) over adapted linears, k experts' worth for LoRA on experts; ``expert_lora``: LoRA
    factors on experts (read for the touched experts)."""
    lm = causal_lm_of(model)
    cfg = text_config(lm.config)
    k, E = getattr(cfg, "num_experts_per_tok", 0) or 0, getattr(cfg, "num_experts", 0) or 0
    layers = lm.model.layers
    body = experts = 0
    for n, p in layers.named_parameters():
        if "lora_" in n or p.dim() < 2:
            continue
        if ".experts." in f".{n}":
            experts += p.numel()
        else:
            body += p.numel()
    lora_tok = expert_lora = 0
    for m in model.modules():
        if not (hasattr(m, "lora_A") and hasattr(m, "r")):
            continue
        for a in m.lora_A:
            r = m.r[a]
            n_exp = getattr(m, "num_experts", 1) if hasattr(m, "parameter_name") else 1
            if n_exp > 1:
                lora_tok += k * r * (m.in_features + m.out_features)
                expert_lora += n_exp * r * (m.in_features + m.out_features)
            else:
                lora_tok += r * (m.in_features + m.out_features)
    head, embed = lm.get_output_embeddings().weight, lm.get_input_embeddings().weight
    return {
        "body": body, "experts": experts, "active": body + (experts * k // E if E else 0), "k": k, "E": E,
        "head": head.numel(), "embed": 0 if head is embed else embed.numel(), "lora_per_token": lora_tok,
        "expert_lora": expert_lora, "attn_layers": sum(hasattr(layer, "self_attn") for layer in layers),
        "hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "dq": cfg.num_attention_heads * cfg.head_dim,
        "kv_per_token": 2 * cfg.num_key_value_heads * cfg.head_dim,
    }  # fmt: skip


def update_flops(counts: dict, lengths: list[int], generated: int) -> float:
    """Model FLOPs of one update (see the module docstring); recompute not counted."""
    tokens = sum(lengths)
    dense = 4 * counts["active"] * tokens
    attn = sum(6 * counts["attn_layers"] * s * s * counts["dq"] for s in lengths)
    head = 4 * counts["hidden"] * counts["vocab"] * generated
    lora = 6 * counts["lora_per_token"] * tokens
    return float(dense + attn + head + lora)


def decode_step_bytes(counts: dict, touched: float, dtype_bytes: int = 2) -> float:
    """Weight bytes one decode step must read: non-expert weights (the head, not the input embedding)
    plus the touched fraction of the experts and of their LoRA factors (model dtype)."""
    return dtype_bytes * (counts["body"] + counts["head"] + touched * (counts["experts"] + counts["expert_lora"]))


def measure_touched(model: torch.nn.Module, prompts: list[list[int]], steps: int) -> float | None:
    """Mean fraction of each MoE block's experts touched by a decode step at this batch (plain decode
    of ``steps`` steps; the routers' top-k recomputed in a hook). None: no MoE blocks."""
    lm = causal_lm_of(model)
    routers = [layer.mlp.gate for layer in lm.model.layers if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]
    if not routers:
        return None
    B, seen = len(prompts), []
    mlp = next(layer.mlp for layer in lm.model.layers if hasattr(layer.mlp, "experts"))
    top_k = getattr(mlp.gate, "top_k", getattr(mlp, "top_k", None))
    n_exp = getattr(mlp.gate, "num_experts", getattr(mlp, "num_experts", None)) or mlp.gate.weight.shape[0]

    def hook(m, args, _out):
        h = args[0].reshape(-1, args[0].shape[-1])
        if h.shape[0] == B:  # decode steps (prefill calls carry B x prompt tokens)
            seen.append(torch.topk(torch.nn.functional.linear(h, m.weight).float(), top_k, dim=-1).indices)

    handles = [r.register_forward_hook(hook) for r in routers]
    try:
        sample_completions(model, prompts, max_new_tokens=steps + 1, temperature=1.0, seed=0)
    finally:
        for h in handles:
            h.remove()
    return touched_experts_fraction(seen, n_exp)


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


def make_decoders(tr: GRPOTrainer, args, res: dict) -> dict:
    """The --decode-variants FastDecoders (``attention[+compile][:moe]``); none, with the reason in
    ``res['fast_unsupported']``, for a model the fast path does not run (e.g. the hybrid 27B)."""
    reason = unsupported_reason(tr.model)
    if reason is not None:
        res["fast_unsupported"] = reason
        return {}
    decoders = {}
    for v in args.decode_variants.split(","):
        head, _, moe = v.partition(":")
        attention, _, comp = head.partition("+")
        if comp not in ("", "compile") or moe not in ("", "fused", "module"):
            raise SystemExit(f"--decode-variants entry {v!r}: an attention impl, optionally +compile, optionally :fused or :module")
        bucket = {"seq_bucket": args.seq_bucket} if args.seq_bucket else {}  # default: FastDecoder's
        name = "fast_" + v.replace("+", "_").replace(":", "_")
        try:
            decoders[name] = FastDecoder(tr.model, attention=attention, compile_layers=comp == "compile", moe=moe or "auto", **bucket)
        except NotImplementedError as e:
            res.setdefault("decoder_errors", {})[name] = str(e)
    return decoders


def bench_rollout(tr: GRPOTrainer, cfg, args, res: dict, dev: torch.device, counts: dict) -> None:
    # the plain and module rows are transformers + peft: the experts on peft's forward, not the update's grouped path
    lm = causal_lm_of(tr.model)
    fused = set_fused_experts(lm, False)
    try:
        _bench_rollout(tr, cfg, args, res, dev, counts)
    finally:
        if fused:
            set_fused_experts(lm, True)


def _bench_rollout(tr: GRPOTrainer, cfg, args, res: dict, dev: torch.device, counts: dict) -> None:
    g = torch.Generator().manual_seed(1)
    decoders = make_decoders(tr, args, res)
    res["rollout"] = []
    for B in [int(x) for x in args.rollout_batches.split(",")]:
        prompts = torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=g).tolist()
        touched = measure_touched(tr.model, prompts, args.touched_steps) if counts["E"] else None
        frac = 1.0 if touched is None else touched
        step_bytes = decode_step_bytes(counts, frac)
        kv_bytes = B * (args.prompt_len + args.gen_len / 2) * counts["attn_layers"] * counts["kv_per_token"] * 2
        bw = res["copy_bandwidth_gbs"] * 1e9
        roof, roof_kv = B * bw / step_bytes, B * bw / (step_bytes + kv_bytes)
        moe_info = {}
        if counts["E"]:
            moe_info = {"touched_experts_frac": touched, "touched_uniform_expectation": 1 - (1 - counts["k"] / counts["E"]) ** B}
        paths = [(n, d, args.plain_gen_len if n.endswith("_module") else args.gen_len) for n, d in decoders.items()]
        for path, engine, gen_len in [*paths, ("plain", tr.model, args.plain_gen_len)]:

            def run(n, engine=engine, prompts=prompts):
                return sample_completions(engine, prompts, max_new_tokens=n, temperature=1.0, seed=0)

            slow = path == "plain" or path.endswith("_module")
            try:
                warm, _, _ = timed(dev, lambda: run(4 if slow else gen_len))  # kernels, compile, graph captures
                pre, _, _ = timed(dev, lambda: run(1))
                tot, mem, _ = timed(dev, lambda: run(gen_len))
            except torch.cuda.OutOfMemoryError:
                res["rollout"].append({"path": path, "batch": B, "error": "out of memory"})
                _free(dev)
                continue
            dec_tps = B * (gen_len - 1) / (tot - pre) if tot > pre else float("nan")  # nan: timer noise over the run
            res["rollout"].append({
                "path": path, "batch": B, "new_tokens": gen_len, "seconds": tot, "prefill_seconds": pre, "warmup_seconds": warm,
                "tokens_per_s": B * gen_len / tot, "decode_tokens_per_s": dec_tps, "ms_per_step": 1e3 * B / dec_tps,
                "roofline_tokens_per_s": roof, "pct_roofline": 100 * dec_tps / roof,
                "roofline_kv_tokens_per_s": roof_kv, "pct_roofline_kv": 100 * dec_tps / roof_kv, "peak_gib": mem,
                "weight_bytes_per_step": step_bytes, "kv_bytes_per_step_mean": kv_bytes,
                "kv_bytes_per_step_end": B * (args.prompt_len + gen_len) * counts["attn_layers"] * counts["kv_per_token"] * 2, **moe_info,
            })  # fmt: skip
        rows = [r for r in res["rollout"] if r["batch"] == B and "error" not in r]
        plain = next((r for r in rows if r["path"] == "plain"), None)
        for r in rows:
            if plain is not None and r is not plain:
                r["speedup_vs_plain"] = r["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
        fast = [r for r in rows if r["path"] in decoders]
        if not fast:
            continue
        best = max(fast, key=lambda r: r["decode_tokens_per_s"])
        dec = decoders[best["path"]]
        if args.profile and dev.type == "cuda":  # kernels of 16 fast decode steps (prefill included)
            best["profile_top_kernels"] = profile_kernels(
                lambda: sample_completions(dec, prompts, max_new_tokens=16, temperature=1.0, seed=0), top=10
            )
        n = min(16, args.plain_gen_len)
        b = sample_completions(tr.model, prompts[:4], max_new_tokens=n, temperature=0.0)
        for r in fast:
            a = sample_completions(decoders[r["path"]], prompts[:4], max_new_tokens=n, temperature=0.0)
            agree = [next((i for i, (x, y) in enumerate(zip(p.ids, q.ids)) if x != y), n) for p, q in zip(a, b)]
            diffs = [abs(x - y) for p, q, k in zip(a, b, agree) for x, y in zip(p.logprobs[:k], q.logprobs[:k])]
            r["greedy_check"] = {"tokens": n, "agreeing_prefix": agree, "max_abs_logprob_diff_on_agreeing": max(diffs, default=0.0)}
        del dec
    del decoders
    _free(dev)


def bench_update(tr: GRPOTrainer, cfg, args, res: dict, dev: torch.device, counts: dict, save=None) -> None:
    from peft import set_peft_model_state_dict

    gen = max(1, int(args.update_len * args.completion_frac))
    lengths = [args.update_len] * args.update_batch
    flops = update_flops(counts, lengths, gen * args.update_batch)
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
        set_fused_update_kernels(lm, bool(lowp), experts=lowp is True)

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
        except (torch.cuda.OutOfMemoryError, RuntimeError) as e:  # one variant failing (OOM, a kernel refusing) keeps the others
            oom = isinstance(e, torch.cuda.OutOfMemoryError)
            res["update"].append({**row, "error": "out of memory" if oom else f"{type(e).__name__}: {str(e)[:300]}"})
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
        if name in args.profile_update.split(",") and args.profile and dev.type == "cuda":
            row["profile_top_kernels"] = profile_kernels(lambda: step(batch))
        if save is not None:
            save(res)  # a run cut short still leaves every finished variant on disk
    set_activation_checkpointing(lm, False)
    set_peft_model_state_dict(tr.model, init)
    ok = {r["variant"]: r for r in res["update"] if "error" not in r}
    base = ok.get("plain_full", ok.get("plain"))  # the plain path with checkpointing where it ran (paper archs)
    res["update_baseline"] = None if base is None else base["variant"]
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


def _decode_step(model, prompt: torch.Tensor, kw: str):
    """A function running one greedy decode step of ``model`` on a cache prefilled with ``prompt`` (prefilled here,
    once; each call decodes from that same cache position: a DynamicCache grows by one token per call)."""
    import moe_overhead as mo

    with torch.no_grad():
        out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, tok = mo._cache_of(out), out.logits[:, -1:].argmax(-1)

    @torch.no_grad()
    def step():
        model(input_ids=tok, use_cache=True, **{kw: cache})

    return step


def profile_ops(fn, top: int = 25) -> dict:
    """Ops of one call of ``fn`` by host (self CPU) time, with their device time: where an eager step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = list(prof.key_averages())
    ev.sort(key=lambda e: -e.self_cpu_time_total)
    rows = [{"name": e.key[:80], "cpu_ms": e.self_cpu_time_total / 1e3, "device_ms": e.self_device_time_total / 1e3, "calls": e.count}
            for e in ev[:top]]  # fmt: skip
    return {"cpu_ms_total": sum(e.self_cpu_time_total for e in ev) / 1e3, "device_ms_total": sum(e.self_device_time_total for e in ev) / 1e3,
            "ops": rows}  # fmt: skip


def arch_config(arch: str, max_len: int = 4096):
    """The transformers config of ``arch``: a dense Qwen3 shape of ARCHS, a conf/backbone name
    (tracekit.llm.backbones) or a TINY_PAPER sibling."""
    if arch in ARCHS:
        from transformers import Qwen3Config

        return Qwen3Config(**ARCHS[arch], max_position_embeddings=max(40960, max_len + 8))
    from tracekit.llm.backbones import BACKBONES, build_config, get_spec

    if arch in TINY_PAPER:
        name, over = TINY_PAPER[arch]
        return build_config(get_spec({"name": name, "arch": over}))
    if arch in BACKBONES:
        return build_config(arch)
    raise SystemExit(f"unknown --arch {arch!r}: one of {sorted(ARCHS) + sorted(TINY_PAPER) + sorted(BACKBONES)}")


def build_base(arch: str, dev: torch.device, max_len: int = 4096):
    """Random-init model of ``arch`` (bf16 on GPU, fp32 on CPU), built on the device, seeded -> (model, config)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = arch_config(arch, max_len)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model, cfg


def lora_targets(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """(target_modules, target_parameters) of the capability adapter: every TARGETS name the model has as an
    nn.Linear, plus the fused 3-D experts."""
    linear = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    params = [n for n, _ in model.named_parameters()]
    return [t for t in TARGETS if t in linear], [t for t in EXPERT_PARAMS if any(n.endswith("." + t) for n in params)]


def build_trainer(arch: str, dev: torch.device, out_dir: str, *, lora_rank: int, microbatch_tokens: int, logprob_chunk: int,
                  max_len: int = 4096) -> tuple[GRPOTrainer, object]:  # fmt: skip
    """A random-init ``arch`` (bf16 on GPU, fp32 on CPU) under a :class:`GRPOTrainer` with a
    trained-looking LoRA adapter (B != 0, so merging changes the weights) -> (trainer, model config)."""
    model, cfg = build_base(arch, dev, max_len)
    modules, params = lora_targets(model)
    tok = tiny_tokenizer()  # only its pad/stop ids are used: prompts and batches are random ids
    settings = GRPOSettings(
        lora=LoraSettings(rank=lora_rank, alpha=2 * lora_rank, target_modules=modules, target_parameters=params),
        dtype="bfloat16" if dev.type == "cuda" else "float32",
        num_minibatches=1, microbatch_tokens=microbatch_tokens, logprob_chunk=logprob_chunk, seed=0,
        gradient_checkpointing=False,  # the plain update, as measured before the recipe's default turned it on
    )  # fmt: skip
    tr = GRPOTrainer(model, tok, KeywordSuite(), settings, out_dir, device=dev, engine_factory=lambda m, t: None)
    _free(dev)
    with torch.no_grad():
        gen = torch.Generator(device=dev).manual_seed(5)
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen, device=dev) * 1e-3)
    return tr, text_config(cfg)


def bench_lora_moe(arch: str, args, res: dict, dev: torch.device) -> None:
    """The composed LoRA-MoE (4 adapters, top-1, on the attention linears) against peft_1 and the backbone,
    one fresh backbone wrapped in turn (a 30B model has no room for three copies)."""
    import moe_overhead as mo
    from peft import PeftModel

    from tracekit.moe.model import MoEConfig, build_lora_moe

    base, cfg = build_base(arch, dev)
    cfg = text_config(cfg)
    base.eval()
    g = torch.Generator().manual_seed(7)
    prefill = [tuple(map(int, x.split("x"))) for x in args.lora_moe_prefill.split(",") if x]
    decode = [int(x) for x in args.lora_moe_decode.split(",") if x]
    inputs = {("prefill", b, sq): torch.randint(0, cfg.vocab_size, (b, sq), generator=g).to(dev) for b, sq in prefill}
    inputs.update({("decode", b, 512): torch.randint(0, cfg.vocab_size, (b, 512), generator=g).to(dev) for b in decode})
    kw = mo._cache_kw(base)
    rows = {key: {"phase": key[0], "batch": key[1], "seq": key[2]} for key in inputs}

    def measure(model, name: str) -> None:
        for key, ids in inputs.items():
            fn = (lambda: mo.time_prefill(model, ids, dev.type)) if key[0] == "prefill" else (lambda: mo.time_decode(model, ids, args.lora_moe_steps, kw, dev.type))
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = [fn() for _ in range(1 + args.lora_moe_repeats)][1:]  # the first is warm-up
            rows[key][name] = statistics.median(times) * 1e3
            rows[key][name + "_peak_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan")

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for i in range(4):
            dirs[f"cap{i}"] = Path(tmp) / f"cap{i}"
            mo.write_random_adapter(base, dirs[f"cap{i}"], args.lora_rank, 11 + i)
        measure(base, "backbone")
        peft_1 = PeftModel.from_pretrained(base, str(dirs["cap0"])).eval()
        measure(peft_1, "peft_1")
        dkey = next((key for key in inputs if key[0] == "decode"), None)
        profiles = {}
        if args.profile and dev.type == "cuda" and dkey is not None:  # host and device time per op of one decode step
            profiles["peft_1"] = profile_ops(_decode_step(peft_1, inputs[dkey], kw))
        base = peft_1.unload()
        del peft_1
        _free(dev)
        moe = build_lora_moe(base, dirs, MoEConfig(top_k=1, gate_init_std=4.0 / math.sqrt(cfg.hidden_size), seed=0))
        measure(moe, "moe")
        if "peft_1" in profiles:
            profiles["moe"] = profile_ops(_decode_step(moe, inputs[dkey], kw))
        import tracekit.moe.layer as moe_layer

        keep = moe_layer.DENSE_DECODE_MIN_TOKENS
        moe_layer.DENSE_DECODE_MIN_TOKENS = 1 << 30  # the decode plan before issue 22's fix: gathered factors per token
        try:
            measure(moe, "moe_gather")
            if "peft_1" in profiles:
                profiles["moe_gather"] = profile_ops(_decode_step(moe, inputs[dkey], kw))
        finally:
            moe_layer.DENSE_DECODE_MIN_TOKENS = keep
        targets = sorted({n.rsplit(".", 1)[-1] for n, m in base.named_modules() if type(m).__name__ == "LoRAMoELinear"})
    for r in rows.values():
        r["moe/peft_1"] = r["moe"] / r["peft_1"]
        r["moe_gather/peft_1"] = r["moe_gather"] / r["peft_1"]
        r["peft_1/backbone"] = r["peft_1"] / r["backbone"]
    if profiles:
        res["lora_moe_decode_profile"] = profiles
    res["lora_moe"] = {"adapters": 4, "rank": args.lora_rank, "top_k": 1, "targets": targets, "decode_steps": args.lora_moe_steps,
                       "repeats": args.lora_moe_repeats, "rows": list(rows.values())}  # fmt: skip
    del moe, base
    _free(dev)


def bench_arch(arch: str, args, dev: torch.device, peaks: dict, save=None, partial: dict | None = None) -> dict:
    import peft
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tr, cfg = build_trainer(arch, dev, tmp, lora_rank=args.lora_rank, microbatch_tokens=args.microbatch_tokens,
                                logprob_chunk=args.logprob_chunk, max_len=args.update_len)  # fmt: skip
        build_s = time.perf_counter() - t0
        counts = model_counts(tr.model)
        lora = sum(p.numel() for p in tr.model.parameters() if p.requires_grad)
        params = sum(p.numel() for p in tr.model.parameters()) - lora
        weight_bytes = sum(p.numel() * p.element_size() for n, p in tr.model.named_parameters() if "lora_" not in n)
        modules, targets = lora_targets(causal_lm_of(tr.model))
        res: dict = {
            "arch": arch, "model_type": cfg.model_type,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "dtype": "bfloat16" if dev.type == "cuda" else "float32", "torch": torch.__version__,
            "transformers": transformers.__version__, "peft": peft.__version__,
            "experts_implementation": getattr(causal_lm_of(tr.model).config, "_experts_implementation", None),
            "lora_rank": args.lora_rank, "lora_target_modules": tr.s.lora.target_modules, "lora_target_parameters": tr.s.lora.target_parameters,
            "params": params, "active_params": counts["active"] + counts["head"], "weight_bytes": weight_bytes, "counts": counts,
            "build_seconds": build_s, "model_gib_after_build": torch.cuda.memory_allocated(dev) / 2**30 if dev.type == "cuda" else float("nan"),
            "command": " ".join(["python", "benchmarks/grpo_step.py", *sys.argv[1:]]), **peaks, "lora_params": lora,
        }  # fmt: skip
        if partial is not None:
            partial["res"] = res  # what a failure later in this arch still reports
        if args.rollout_batches:
            bench_rollout(tr, cfg, args, res, dev, counts)
            if save is not None:
                save(res)
        if args.update_batch > 0:
            bench_update(tr, cfg, args, res, dev, counts, save)
        del tr
    _free(dev)
    if args.lora_moe:
        bench_lora_moe(arch, args, res, dev)
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="qwen3_1_7b", help=f"comma list of {sorted(ARCHS) + list(PAPER_ARCHS) + sorted(TINY_PAPER)}")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--rollout-batches", default="1,64", help="comma list; empty: no rollout")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=128, help="new tokens of the fast path")
    ap.add_argument("--plain-gen-len", type=int, default=48, help="new tokens of the plain path (slow)")
    ap.add_argument(
        "--decode-variants", default=None,
        help="FastDecoder variants attention[+compile][:fused|:module] (default: sdpa,bmm,sdpa+compile,bmm+compile; MoE models: sdpa,bmm,sdpa:module)",
    )  # fmt: skip
    ap.add_argument("--touched-steps", type=int, default=8, help="plain decode steps observed to count the experts touched (MoE)")
    ap.add_argument("--seq-bucket", type=int, default=None, help="FastDecoder attended-length granularity of the graphs (default: its own)")
    ap.add_argument("--update-batch", type=int, default=4, help="0: no update")
    ap.add_argument("--update-len", type=int, default=4096)
    ap.add_argument("--completion-frac", type=float, default=0.5)
    ap.add_argument("--update-repeats", type=int, default=2)
    ap.add_argument(
        "--update-variants", default="",
        help=f"comma list of {[v[0] for v in UPDATE_VARIANTS]}, run in this order (default all; paper / tiny-paper archs: plain_full,fast_full,fast_selective)",
    )  # fmt: skip
    ap.add_argument("--lora-moe", action="store_true", help="also time the composed LoRA-MoE (4 adapters, top-1) against peft_1")
    ap.add_argument("--lora-moe-prefill", default="8x2048", help="batch x seq list for --lora-moe")
    ap.add_argument("--lora-moe-decode", default="64", help="decode batches for --lora-moe (512-token cache)")
    ap.add_argument("--lora-moe-steps", type=int, default=8, help="decode steps per --lora-moe timing")
    ap.add_argument("--lora-moe-repeats", type=int, default=3)
    ap.add_argument("--microbatch-tokens", type=int, default=16384)
    ap.add_argument("--logprob-chunk", type=int, default=4096)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of the best fast rollout and the --profile-update updates (CUDA)")
    ap.add_argument("--profile-update", default="fast_selective,fast_selective_compile", help="update variants --profile profiles")
    ap.add_argument("--peak-n", type=int, default=8192)
    ap.add_argument("--out", default=None, help="JSON path per arch; '{arch}' is replaced")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on CPU with small sizes")
    ap.add_argument("--plot", default=None, help="comma list of result JSONs: draw the bar charts to --plot-out and exit")
    ap.add_argument("--plot-out", default="benchmarks/results/grpo_step_ratios_h200.png")
    ap.add_argument("--plot-paper", default=None, help="comma list of paper-backbone result JSONs: draw their figure to --plot-out and exit")
    args = ap.parse_args(argv)
    if args.plot:
        plot(args.plot.split(","), args.plot_out)
        return []
    if args.plot_paper:
        plot_paper(args.plot_paper.split(","), args.plot_out)
        return []
    if args.smoke:
        if args.arch not in ("tiny", *TINY_PAPER):
            args.arch = "tiny"
        args.device, args.rollout_batches = "cpu", "1,4"
        args.lora_moe_prefill, args.lora_moe_decode, args.lora_moe_steps, args.lora_moe_repeats = "2x32", "4", 4, 1
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
    decode_default, update_default = args.decode_variants, args.update_variants
    for arch in args.arch.split(","):
        arch_config(arch)  # an unknown name stops here, before any model is built
        paper = arch in PAPER_ARCHS or arch in TINY_PAPER
        moe = bool(getattr(text_config(arch_config(arch)), "num_experts", 0))
        args.decode_variants = decode_default or ("sdpa,bmm,sdpa:module" if moe else "sdpa,bmm,sdpa+compile,bmm+compile")
        args.update_variants = update_default or ("plain_full,fast_full,fast_selective" if paper else "")
        out = args.out.replace("{arch}", arch) if args.out else None
        partial: dict = {}
        try:
            res = bench_arch(arch, args, dev, peaks, save=(lambda r, out=out: atomic_write_json(out, r)) if out else None, partial=partial)
        except Exception as e:  # noqa: BLE001 - one arch failing (e.g. a model type this transformers lacks) must not lose the others
            import traceback

            traceback.print_exc()
            res = {**partial.get("res", {"arch": arch, **peaks}), "error": f"{type(e).__name__}: {e}"[:2000]}
            if out:
                atomic_write_json(out, res)
            results.append(res)
            if "params" in res:
                _print(res)
            _free(dev)
            continue
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
        cols = ("path", "batch", "decode tok/s", "ms/step", "touched", "roofline tok/s", "% roofline", "% roof+KV", "vs plain", "prefill s",
                "warm-up s", "peak GiB")  # fmt: skip
        for col in cols:
            t.add_column(col, justify="right")
        for r in res["rollout"]:
            if "error" in r:
                t.add_row(r["path"], str(r["batch"]), r["error"], *[""] * (len(cols) - 3))
                continue
            sp = f"{r['speedup_vs_plain']:.1f}x" if "speedup_vs_plain" in r else ""  # fast rows only
            touched = f"{100 * r['touched_experts_frac']:.1f}%" if r.get("touched_experts_frac") is not None else "-"
            t.add_row(
                r["path"], str(r["batch"]), f"{r['decode_tokens_per_s']:.0f}", f"{r['ms_per_step']:.1f}", touched,
                f"{r['roofline_tokens_per_s']:.0f}", f"{r['pct_roofline']:.2f}", f"{r['pct_roofline_kv']:.2f}", sp,
                f"{r['prefill_seconds']:.3f}", f"{r['warmup_seconds']:.1f}", _gib(r["peak_gib"]),
            )  # fmt: skip
        c.print(t)
        for r in res["rollout"]:
            if "greedy_check" in r:
                c.print(f"greedy {r['path']} vs plain, batch {r['batch']}: {r['greedy_check']}")
            for k in r.get("profile_top_kernels", []):
                c.print(f"  b{r['batch']} {k['pct']:5.1f}% {k['ms']:8.2f} ms {k['calls']:6d}  {k['name']}")
    for k in ("fast_unsupported", "decoder_errors"):
        if res.get(k):
            c.print(f"{k}: {res[k]}")
    if res.get("update"):
        u = Table(title=f"update (forward + backward + AdamW); ratios against {res.get('update_baseline')}")
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
    if res.get("lora_moe"):
        lm = res["lora_moe"]
        m = Table(title=f"LoRA-MoE forward ({lm['adapters']} adapters r={lm['rank']}, top-1, on {','.join(lm['targets'])}); ms, median of {lm['repeats']}")
        for col in ("phase", "batch x seq", "backbone", "peft_1", "moe", "moe/peft_1", "moe_gather", "gather/peft_1", "peak GiB (moe)"):
            m.add_column(col, justify="right")
        for r in lm["rows"]:
            m.add_row(r["phase"], f"{r['batch']}x{r['seq']}", f"{r['backbone']:.1f}", f"{r['peft_1']:.1f}", f"{r['moe']:.1f}",
                      f"{r['moe/peft_1']:.3f}x", f"{r.get('moe_gather', float('nan')):.1f}", f"{r.get('moe_gather/peft_1', float('nan')):.3f}x",
                      _gib(r["moe_peak_gib"]))  # fmt: skip
        c.print(m)
    for name, p in res.get("lora_moe_decode_profile", {}).items():
        c.print(f"{name} decode step (profiled): host self time {p['cpu_ms_total']:.1f} ms, device {p['device_ms_total']:.1f} ms")
        for o in p["ops"][:12]:
            c.print(f"  cpu {o['cpu_ms']:7.2f} ms  dev {o['device_ms']:7.2f} ms {o['calls']:6d}  {o['name']}")


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


def plot_paper(paths: list[str], out: str) -> None:
    """The paper backbones' figure: decode tok/s per path and batch against the touched-weight roofline,
    update tok/s with peak memory, and the LoRA-MoE forward ratio to peft_1 (1.15 target line)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.loads(Path(p).read_text()) for p in paths]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    labels, vals, roofs = [], [], []
    for r in runs:
        for x in r.get("rollout", []):
            if "error" not in x:
                labels.append(f"{r['arch'].replace('qwen3_', '')}\n{x['path'].replace('fast_', '')} b{x['batch']}")
                vals.append(x["decode_tokens_per_s"])
                roofs.append(x["roofline_tokens_per_s"])
    xs = range(len(vals))
    axes[0].bar(xs, vals, color=["tab:grey" if "plain" in lab or "module" in lab else "tab:blue" for lab in labels])
    axes[0].scatter(xs, roofs, marker="_", s=300, color="red", label="touched-weight roofline")
    axes[0].set_yscale("log")
    axes[0].set_xticks(list(xs), labels, fontsize=6, rotation=45, ha="right")
    axes[0].set_ylabel("decode tokens/s (adapter active)")
    axes[0].legend(fontsize=7)
    for i, (v, rf) in enumerate(zip(vals, roofs)):
        axes[0].text(i, v, f"{100 * v / rf:.0f}%", ha="center", va="bottom", fontsize=6)
    labels, tps, mem = [], [], []
    for r in runs:
        for x in r.get("update", []):
            if "error" not in x:
                labels.append(f"{r['arch'].replace('qwen3_', '')}\n{x['variant']}")
                tps.append(x["tokens_per_s"])
                mem.append(x["peak_gib"])
    xs = range(len(tps))
    axes[1].bar(xs, tps, color="tab:green")
    axes[1].set_xticks(list(xs), labels, fontsize=6, rotation=45, ha="right")
    axes[1].set_ylabel("update tokens/s (4 x 4096, checkpointing)")
    for i, (v, m) in enumerate(zip(tps, mem)):
        axes[1].text(i, v, f"{m:.0f} GiB", ha="center", va="bottom", fontsize=6)
    rows = [(r["arch"], x) for r in runs for x in r.get("lora_moe", {}).get("rows", [])]
    axes[2].bar(range(len(rows)), [x["moe/peft_1"] for _, x in rows], color="tab:purple")
    axes[2].axhline(1.15, color="red", ls="--", lw=1, label="target 1.15")
    axes[2].set_xticks(range(len(rows)), [f"{a.replace('qwen3_', '')}\n{x['phase']} {x['batch']}x{x['seq']}" for a, x in rows], fontsize=7)
    axes[2].set_ylabel("LoRA-MoE (4 adapters, top-1) / peft_1")
    axes[2].legend(fontsize=7)
    fig.suptitle(f"Paper backbones on {runs[0].get('device', '?')} (random init, bf16, LoRA r={runs[0].get('lora_rank')})")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def _gib(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1f}"


if __name__ == "__main__":
    main()
