"""Where the GPU idles during a GRPO update step or a batch of fast decode steps (issue 9 diagnostics).

Profiles one call (CPU ops with Python stacks + CUDA kernels), takes the union of kernel intervals as
"GPU busy", and attributes every idle gap >= --min-gap-ms to the Python frames running on the host at
the gap's midpoint (the innermost frames from tracekit/ and benchmarks/, then the innermost torch op).
Prints busy/wall and the frames holding the most idle time.

    python benchmarks/gpu_idle.py --device cuda --arch qwen3_1_7b --what update --update-variant fast_selective_compile
    python benchmarks/gpu_idle.py --device cuda --arch qwen3_1_7b --what decode --decode-variant bmm+compile --batch 64
    python benchmarks/gpu_idle.py --smoke      # tiny shape on CPU: runs the analysis on CPU op intervals
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpo_step  # noqa: E402


def busy_intervals(events: list[dict], device_events: bool) -> list[tuple[float, float]]:
    """Merged [start, end) intervals (us) of kernels (or, on CPU, of top-level aten ops)."""
    cats = ("kernel", "gpu_memcpy", "gpu_memset") if device_events else ("cpu_op",)
    iv = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events if e.get("cat") in cats and e.get("dur"))
    merged: list[list[float]] = []
    for s, e in iv:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def gaps(busy: list[tuple[float, float]], min_us: float) -> list[tuple[float, float]]:
    """Idle stretches between consecutive busy intervals, at least ``min_us`` long."""
    return [(a[1], b[0]) for a, b in zip(busy, busy[1:]) if b[0] - a[1] >= min_us]


def attribute(events: list[dict], idle: list[tuple[float, float]]) -> dict[str, float]:
    """Idle us per host frame label: the innermost repo frames + the innermost op at each gap's midpoint."""
    frames = [e for e in events if e.get("cat") in ("python_function", "cpu_op") and e.get("dur")]
    frames.sort(key=lambda e: e["ts"])
    out: dict[str, float] = defaultdict(float)
    for s, e in idle:
        mid = (s + e) / 2
        live = [f for f in frames if f["ts"] <= mid <= f["ts"] + f["dur"]]
        live.sort(key=lambda f: f["dur"])  # innermost first
        repo = [f["name"] for f in live if f.get("cat") == "python_function" and ("tracekit/" in f["name"] or "benchmarks/" in f["name"])]
        op = next((f["name"] for f in live if f.get("cat") == "cpu_op"), None)
        label = " < ".join(repo[:3]) + (f" | {op}" if op else "")
        out[label or "(no host frame)"] += e - s
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def profile(fn, device: torch.device) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with tprofile(activities=acts, with_stack=True) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def report(events: list[dict], device: torch.device, min_gap_ms: float, top: int) -> dict:
    busy = busy_intervals(events, device.type == "cuda")
    if not busy:
        raise SystemExit("the profile holds no device activity")
    wall = busy[-1][1] - busy[0][0]
    busy_us = sum(e - s for s, e in busy)
    idle = gaps(busy, min_gap_ms * 1e3)
    by_frame = attribute(events, idle)
    print(f"span {wall / 1e3:.1f} ms, busy {busy_us / 1e3:.1f} ms ({100 * busy_us / wall:.1f}%), "
          f"{len(idle)} gaps >= {min_gap_ms} ms totalling {sum(e - s for s, e in idle) / 1e3:.1f} ms")  # fmt: skip
    for label, us in list(by_frame.items())[:top]:
        print(f"  {us / 1e3:8.2f} ms  {label[:220]}")
    return {"span_ms": wall / 1e3, "busy_ms": busy_us / 1e3, "gaps": len(idle), "idle_by_frame_ms": {k: v / 1e3 for k, v in by_frame.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arch", default="qwen3_1_7b")
    ap.add_argument("--what", default="update,decode")
    ap.add_argument("--update-variant", default="fast_selective_compile")
    ap.add_argument("--update-batch", type=int, default=4)
    ap.add_argument("--update-len", type=int, default=4096)
    ap.add_argument("--decode-variant", default="bmm+compile")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--min-gap-ms", type=float, default=0.05)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.smoke:
        args.device, args.arch, args.update_len, args.batch, args.prompt_len, args.gen_len = "cpu", "tiny", 64, 2, 16, 4
    dev = torch.device(args.device)
    tmp = tempfile.TemporaryDirectory()
    tr, cfg = grpo_step.build_trainer(args.arch, dev, tmp.name, lora_rank=32, microbatch_tokens=16384, logprob_chunk=4096,
                                      max_len=args.update_len)  # fmt: skip
    result = {}
    if "update" in args.what:
        name, path, lowp, ckpt, comp = next(v for v in grpo_step.UPDATE_VARIANTS if v[0] == args.update_variant)
        lm = grpo_step.causal_lm_of(tr.model)
        grpo_step.set_fused_update_kernels(lm, lowp)
        gen = args.update_len // 2
        batch = grpo_step.synthetic_batch(args.update_batch, args.update_len, gen, cfg.vocab_size, seed=3)
        grpo_step.fill_rollout_logprobs(tr, batch)
        grpo_step.set_activation_checkpointing(lm, ckpt != "off", "full" if ckpt == "off" else ckpt, compile=comp)
        for _ in range(2):  # compile, allocator warm-up
            tr.update_on(batch, 0)
        print(f"update {name}, {args.update_batch} x {args.update_len}:")
        result["update"] = report(profile(lambda: tr.update_on(batch, 0), dev), dev, args.min_gap_ms, args.top)
    if "decode" in args.what:
        attention, _, comp = args.decode_variant.partition("+")
        dec = grpo_step.FastDecoder(tr.model, attention=attention, compile_layers=comp == "compile")
        prompts = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1)).tolist()

        def run():
            return grpo_step.sample_completions(dec, prompts, max_new_tokens=args.gen_len, temperature=1.0, seed=0)

        for _ in range(2):
            run()
        print(f"decode {args.decode_variant}, batch {args.batch}, {args.gen_len} new tokens after {args.prompt_len}:")
        result["decode"] = report(profile(run, dev), dev, args.min_gap_ms, args.top)
    if args.out:
        grpo_step.atomic_write_json(args.out, result)
    tmp.cleanup()


if __name__ == "__main__":
    main()
