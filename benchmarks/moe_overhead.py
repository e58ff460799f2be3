"""Forward-time overhead of the LoRA-MoE composition (issue 7).

Compares, on one random-init backbone (Qwen3-1.7B shape by default, bf16 on GPU):
  backbone          the plain model
  peft_1            the backbone with one unmerged peft LoRA adapter (PeftModel with peft's defaults:
                    autocast_adapter_dtype keeps the LoRA factors in fp32 on a bf16 backbone)
  moe_grouped       the composed model: 4 adapters, per-block gates, top-1, pairs sorted by expert on
                    the device once per block (the library default; on CUDA bf16 it runs the same
                    torch._grouped_mm backend as moe_grouped_mm, elsewhere a loop over experts)
  moe_grouped_mm    gather, torch._grouped_mm x2 with device-side offsets, back to token order by
                    index_add_ (or, over INDEX_ADD_MAX_PAIRS tokens, by the inverse permutation); no host sync
  moe_masked_dense  every expert computed, non-chosen weights zeroed (reference)
for prefill (one forward over batch x seq tokens, last-position logits only, as generate's prefill)
and decode (per-step time of single-token forwards on a KV cache). Adapters: rank --rank on all
seven projections, random factors, written in peft's save_pretrained format; the MoE bank is
held in the backbone dtype. Variants are timed round-robin within each repeat. Gates are random
(--gate-std) so tokens really spread over the experts; the measured expert usage is printed.

Target (issue 7): moe <= 1.15 x peft_1 on the eager forward (how tracekit's hf client serves the model);
the --cuda-graph rows show the GPU work alone and carry no target.

    python benchmarks/moe_overhead.py --device cuda --out benchmarks/results/moe_overhead_h200.json
    python benchmarks/moe_overhead.py --smoke          # tiny model on CPU, seconds
    python benchmarks/moe_overhead.py --replot benchmarks/results/moe_overhead_h200.json \
        --plot benchmarks/results/moe_overhead_h200.png  # the figure from a results file
"""

from __future__ import annotations

import argparse
import copy
import inspect
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
from tracekit.moe.layer import RoutingSpec  # noqa: E402
from tracekit.moe.model import MoEConfig, build_lora_moe  # noqa: E402

MOE_IMPLS = ("grouped", "grouped_mm", "masked_dense")
TARGET = 1.15  # issue 7: composed model time / peft_1 time
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
QWEN3_1_7B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1000000.0, tie_word_embeddings=True)  # fmt: skip
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip


def write_random_adapter(model: torch.nn.Module, directory: Path, rank: int, seed: int, targets: list[str] | None = None) -> None:
    """A peft-format LoRA adapter (adapter_config.json + adapter_model.safetensors) with random factors on the
    ``nn.Linear`` modules named ``targets`` (default TARGETS); the config lists only the names the model has
    as linears (peft maps gate/up/down_proj onto fused 3-D experts otherwise)."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    targets = list(targets or TARGETS)
    linear = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = [t for t in targets if t in linear]
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rpartition(".")[2] in targets:
            a = torch.randn(rank, mod.in_features, generator=g) / math.sqrt(mod.in_features)
            b = torch.randn(mod.out_features, rank, generator=g) / math.sqrt(rank) * 0.1
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets).save_pretrained(str(directory))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _cache_kw(model: torch.nn.Module) -> str:
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"  # transformers >= 5.2x renamed it


def _cache_of(out) -> object:
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


@torch.no_grad()
def time_prefill(model, ids: torch.Tensor, device: str) -> float:
    """Seconds for one prefill forward (last-position logits only, as generate's prefill)."""
    _sync(device)
    t = time.perf_counter()
    model(input_ids=ids, use_cache=False, logits_to_keep=1)
    _sync(device)
    return time.perf_counter() - t


@torch.no_grad()
def time_decode(model, prompt: torch.Tensor, steps: int, kw: str, device: str) -> float:
    """Seconds per decode step (batch = prompt rows), greedy, on a cache prefilled with ``prompt`` (not timed).

    ``kw`` is the cache keyword of the HF forward (passed through PeftModel / LoRAMoEModel)."""
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache, tok = _cache_of(out), out.logits[:, -1:].argmax(-1)
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=tok, use_cache=True, **{kw: cache})
        cache, tok = _cache_of(out), out.logits[:, -1:].argmax(-1)
    _sync(device)
    return (time.perf_counter() - t) / steps


@torch.no_grad()
def time_decode_graphed(model, prompt: torch.Tensor, steps: int, kw: str, device: str) -> float:
    """Seconds per decode step with the step captured in one CUDA graph (transformers' StaticCache):
    the GPU work of each variant without the host's per-kernel launch cost, which dominates the eager
    numbers at these sizes. Prefill (not timed) and capture run first; each replay is one greedy step."""
    from transformers import StaticCache

    b, s = prompt.shape
    cache = StaticCache(config=model.config, max_cache_len=s + steps + 4)
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1, cache_position=torch.arange(s, device=device), **{kw: cache})
    tok = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([s], device=device)

    def step() -> torch.Tensor:
        return model(input_ids=tok, use_cache=True, cache_position=pos, **{kw: cache}).logits

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # lazy kernel initialisation must not happen during capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = step()
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        graph.replay()
        tok.copy_(logits[:, -1:].argmax(-1))
        pos.add_(1)
    _sync(device)
    return (time.perf_counter() - t) / steps


def worst_ratios(rows: list[dict]) -> list[tuple[str, str, float, bool | None]]:
    """(impl, "eager" / "CUDA-graph decode", worst ratio to peft_1, target met or None) per implementation.

    The target is the eager forward, as the hf client serves the composed model; graph rows (GPU work alone)
    carry none. A group with a failed variant in any row is left out."""
    out = []
    for impl in MOE_IMPLS:
        for label, phases in (("eager", ("prefill", "decode")), ("CUDA-graph decode", ("decode_graph",))):
            ratios = [r.get(f"moe_{impl}/peft_1") for r in rows if r["phase"] in phases]
            if ratios and all(x is not None for x in ratios):
                worst = max(ratios)
                out.append((impl, label, worst, worst <= TARGET if label == "eager" else None))
    return out


def plot(result: dict, path: str) -> None:
    """Bar chart of each variant's time / peft_1 per measured row, with the 1.15 target line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = ["backbone", *(f"moe_{i}" for i in MOE_IMPLS)]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [r.get(f"{name}/peft_1") or 0.0 for r in rows], width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(TARGET, color="red", ls="--", lw=1, label=f"target {TARGET} (eager)")
    ax.set_xticks(range(len(rows)), [f"{r['phase']}\n{r['batch']}x{r['seq']}" for r in rows])
    ax.set_ylabel("forward time / peft_1")
    ax.set_title(f"LoRA-MoE overhead, {result['device']}, {result['adapters']} adapters r={result['rank']}, top-1")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU (float32)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--gate-std", type=float, default=None, help="default: 4/sqrt(hidden)")
    ap.add_argument("--prefill", default=None, help="batch x seq list, e.g. 1x2048,8x2048")
    ap.add_argument("--decode", default=None, help="decode batches, e.g. 1,16,64")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="decode steps per timing run")
    ap.add_argument("--cuda-graph", action="store_true", help="also time decode steps captured in CUDA graphs (CUDA)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--plot", default=None, help="write a PNG of the ratios to peft_1 here")
    ap.add_argument("--replot", default=None, help="only draw --plot from this results JSON")
    args = ap.parse_args()
    if args.replot:
        if not args.plot:
            ap.error("--replot needs --plot")
        from tracekit.artifacts import read_json

        plot(read_json(args.replot), args.plot)
        return
    from transformers import AutoModelForCausalLM, Qwen3Config

    device = "cpu" if args.smoke else args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    shape = TINY if args.smoke else QWEN3_1_7B
    prefill_spec = args.prefill or ("2x32" if args.smoke else "1x2048,8x2048")
    prefill = [tuple(map(int, s.split("x"))) for s in prefill_spec.split(",")]
    decode = [int(b) for b in (args.decode or ("1,4" if args.smoke else "1,16,64")).split(",")]
    prompt_len = args.prompt_len or (16 if args.smoke else 512)
    steps = args.steps or (8 if args.smoke else 32)
    gate_std = args.gate_std if args.gate_std is not None else 4.0 / math.sqrt(shape["hidden_size"])

    if args.smoke:
        torch.set_num_threads(1)  # tiny matmuls: thread hand-off costs more than the work
    torch.manual_seed(args.seed)
    config = Qwen3Config(**shape)
    with torch.device(device):
        base = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    from peft import PeftModel

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for i in range(args.adapters):
            dirs[f"cap{i}"] = Path(tmp) / f"cap{i}"
            write_random_adapter(base, dirs[f"cap{i}"], args.rank, args.seed + 1 + i)
        peft_1 = PeftModel.from_pretrained(copy.deepcopy(base), str(dirs["cap0"])).eval()
        moe = build_lora_moe(copy.deepcopy(base), dirs, MoEConfig(top_k=1, gate_init_std=gate_std, seed=args.seed))
    # name -> (model, routing of the composed model or None)
    variants = {"backbone": (base, None), "peft_1": (peft_1, None)}
    variants.update({f"moe_{impl}": (moe, RoutingSpec(1, False, impl)) for impl in MOE_IMPLS})
    cache_kw = _cache_kw(base)
    g = torch.Generator().manual_seed(args.seed)

    def measure(row: dict, fn) -> None:
        """Median over repeats, variants interleaved round-robin so machine-load drift hits all alike."""
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.warmup + args.repeats):
            for name, (model, spec) in variants.items():
                if name in row.get("errors", {}):
                    continue
                if spec is not None:
                    moe.set_routing(spec)
                try:
                    t = fn(model)
                except Exception as e:  # noqa: BLE001 - e.g. grouped_mm unsupported here: report it, time the rest
                    row.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:300]
                    continue
                if rep >= args.warmup:
                    times[name].append(t)
        for name, ts in times.items():
            row[name] = statistics.median(ts) * 1e3 if ts else None

    rows = []
    for b, s in prefill:
        ids = torch.randint(0, shape["vocab_size"], (b, s), generator=g).to(device)
        row = {"phase": "prefill", "batch": b, "seq": s}
        measure(row, lambda m: time_prefill(m, ids, device))
        with torch.no_grad():
            moe(input_ids=ids[:, :256])
        top = moe.gate_probs()[0].argmax(-1)
        row["usage"] = [round(float(x), 3) for x in torch.bincount(top, minlength=args.adapters) / top.numel()]
        rows.append(row)
    decode_modes = [("decode", time_decode)] + ([("decode_graph", time_decode_graphed)] if args.cuda_graph else [])
    for phase, timer in decode_modes:
        for b in decode:
            prompt = torch.randint(0, shape["vocab_size"], (b, prompt_len), generator=g).to(device)
            row = {"phase": phase, "batch": b, "seq": prompt_len}
            measure(row, lambda m: timer(m, prompt, steps, cache_kw, device))
            rows.append(row)
    for row in rows:
        for name in ["backbone", *(f"moe_{i}" for i in MOE_IMPLS)]:
            if row[name] is not None and row["peft_1"] is not None:
                row[f"{name}/peft_1"] = row[name] / row["peft_1"]

    dev_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else platform.processor() or "cpu"
    print(f"LoRA-MoE overhead: {dev_name}, {dtype}, {'tiny' if args.smoke else 'Qwen3-1.7B-shape'} random init, "
          f"{args.adapters} adapters r={args.rank} on {len(TARGETS)} projections, top-1; ms per forward/step "
          f"(median of {args.repeats}); x = ratio to peft_1")  # fmt: skip
    names = list(variants)
    head = f"{'phase':<8}{'batch':>6}{'seq':>6}" + "".join(f"{n:>20}" for n in names)
    print(head)
    print("-" * len(head))
    for r in rows:
        cells = []
        for n in names:
            if r[n] is None:
                cells.append(f"{'error':>20}")
            else:
                ratio = r.get(f"{n}/peft_1")
                cells.append(f"{r[n]:>11.3f}" + (f" ({ratio:.3f}x)" if ratio is not None else " " * 9))
        print(f"{r['phase']:<8}{r['batch']:>6}{r['seq']:>6}" + "".join(cells))
    for impl, label, worst, met in worst_ratios(rows):
        verdict = "no target" if met is None else f"target <= {TARGET}: {'met' if met else 'NOT met'}"
        print(f"moe_{impl}, {label}: worst ratio to peft_1 = {worst:.3f} ({verdict})")
    for r in rows:
        for name, err in r.get("errors", {}).items():
            print(f"{r['phase']} {r['batch']}: {name} failed: {err}")
    usage = {f"{r['batch']}x{r['seq']}": r["usage"] for r in rows if "usage" in r}
    print("prefill expert usage (block 0, top-1 share per adapter):", usage)
    import peft
    import transformers

    result = {
        "command": " ".join(sys.argv),
        "device": dev_name,
        "dtype": str(dtype),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
        "shape": shape,
        "adapters": args.adapters,
        "rank": args.rank,
        "rows": rows,
    }
    if args.out:
        atomic_write_json(args.out, result)
        print(f"wrote {args.out}")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
