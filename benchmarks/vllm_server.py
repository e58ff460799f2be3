"""The real vLLM server in tracekit's loop (issue 41): the checks, then rollout throughput beside tracekit's decoder.

One process, one GPU. ``vllm serve`` (``--server vllm``; ``--server standin``: ``tests/vllm_standin.py``, the same
API on the CPU, to try this script here) is started through tracekit's own :class:`~tracekit.rl.vllm_client.VLLMServer`
on each target's backbone as an HF folder:

- ``micro``: the micro world's warm start stored in ``tests/assets/micro_warmstart`` (Qwen3, 4.5M parameters,
  its own 2,048-token BPE), on 2-turn-or-more tasks of the micro world (``experiment=micro``);
- ``gain``: the bundled SmolLM2-135M exported as tracekit exports it (``export_smollm2``: float32 safetensors and
  the tool template), on the gain target's tau^2 library tasks (``experiment=gain``).

Both engines roll out through the same chat layer (:class:`~tracekit.rl.engines.PolicyChat`: prompts rendered to
token ids here, completions parsed here, no grammar), so their episodes can be compared token for token:

1. ``version``: the server's ``GET /version`` is the release the client supports (checked as it starts).
2. ``greedy``: the base model's greedy episodes through vLLM and through tracekit's decoder (``HFEngine``: the fast
   decoder, bf16, CUDA graphs), on the same tasks. Where an episode differs, the first differing token is located
   and the float32 model's log-prob gap between the two picks there is reported: a near-tie (bf16 rounding decides
   it) or not.
3. ``adapter``: a seeded random LoRA (r 8, every projection) loaded at runtime against the same adapter merged into
   the weights (peft ``merge_and_unload``) and served by a second server: greedy first turns and their log-probs.
4. ``grpo`` (micro): two GRPO iterations of tracekit's trainer with ``VLLMEngine`` (adapter-only sync) on
   ``micro_finish_all_writes``: iteration 1 rolls out with the adapter iteration 0 trained, and after training the
   served adapter's log-probs are the trainer's final policy's (not the initial one's).
5. ``throughput``: episodes/s and generated tokens/s, vLLM and tracekit's decoder, each with the base model and with
   the random adapter, ``--repeats`` interleaved repeats (ABBA), medians with min-max; per arm the time in the
   engine (``generate``: the server's answers, or the decoder) and the rest (environments, prompt rendering, parsing).
   The LoRA-MoE stays on tracekit's decoder (vLLM serves one adapter per request): its row is
   ``benchmarks/rollout_throughput.py --moe``.

Sections, one per GPU command: ``TARGET:checks`` (1-3), ``TARGET:throughput`` (5), ``micro:grpo`` (4), each with
its own server(s) and a fresh work folder under ``--work`` (a cut run's adapters never collide with the next run's).
``--json`` is rewritten atomically after every step; ``--resume`` reads it and skips the sections it holds, so a
call cut at its limit is followed by one that runs only what is missing. ``--stop-after S`` starts no section
after S seconds. Every exit (an error, Ctrl-C / SIGINT, SIGTERM) ends the servers' process groups
(:class:`~tracekit.rl.vllm_client.VLLMServer`), and a SIGKILL leaves their group ids in ``TRACEKIT_SERVER_PIDS``.

    python benchmarks/vllm_server.py --json /root/vwork/vllm.json --resume --sections micro:checks micro:throughput
    python benchmarks/vllm_server.py --server standin --sections micro:checks --micro-limit 6 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.artifacts import atomic_write_text  # noqa: E402
from tracekit.cli import compose_config  # noqa: E402

MICRO_FIXTURE = ROOT / "tests" / "assets" / "micro_warmstart"
STANDIN = ROOT / "tests" / "vllm_standin.py"
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NEAR_TIE = 0.1  # nats: below this float32 log-prob gap, bf16 rounding of the logits can swap the two picks


# --------------------------------------------------------------------------------------------
# The targets: model folder, tokenizer, tasks and decoding


class Target:
    def __init__(self, name: str, limit: int, max_new: int | None = None):
        from tracekit.llm.templates import TEMPLATES
        from tracekit.wiring import build_suite

        self.name = name
        if name == "micro":
            self.model_dir = MICRO_FIXTURE
            cfg = compose_config(["experiment=micro"])
            self.chat_format = "qwen3"
        elif name == "gain":
            from tracekit.llm.backbones import export_smollm2

            self.model_dir = export_smollm2()
            # benchmark.limit counts instances per environment: enough of each for `limit` tasks in all
            envs = len(compose_config(["experiment=gain"]).benchmark.synthetic.envs)
            cfg = compose_config(["experiment=gain", f"benchmark.limit={-(-limit // envs)}"])
            self.chat_format = "smollm2"
        else:
            raise SystemExit(f"unknown target {name!r} (micro | gain)")
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.tokenizer.chat_template = TEMPLATES[self.chat_format]
        self.suite = build_suite(cfg)
        self.tasks = self.suite.tasks()[:limit]
        if len(self.tasks) < limit:
            raise SystemExit(f"the {name} target has {len(self.tasks)} tasks, fewer than the {limit} asked for")
        self.max_new = max_new or cfg.agent.max_new_tokens
        self.max_steps = cfg.eval.max_steps
        self.max_model_len = int(json.loads((self.model_dir / "config.json").read_text())["max_position_embeddings"])
        self.max_model_len = min(self.max_model_len, 4096)

    def model(self, dtype: str = "bfloat16"):
        import torch
        from transformers import AutoModelForCausalLM

        device = "cuda" if torch.cuda.is_available() else "cpu"
        return AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=getattr(torch, dtype)).to(device).eval()

    def episodes(self, client, seed: int = 0) -> list[Any]:
        from tracekit.rl.episodes import EpisodeSpec, run_episodes

        specs = [EpisodeSpec(task=t, seed=seed, sample=0, group=i) for i, t in enumerate(self.tasks)]
        return run_episodes(client, self.suite, specs, temperature=0.0, max_new_tokens=self.max_new,
                            max_steps=self.max_steps, sample_seed=seed)

    def close(self) -> None:
        getattr(self.suite, "close", lambda: None)()


def random_adapter(model, out: Path, seed: int = 0) -> Path:
    """A seeded LoRA (r 8, alpha 16, every projection, B ~ N(0, 0.02)) on ``model``, saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_MODULES, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    peft_model.save_pretrained(out)
    return out


def merged_folder(target: Target, adapter: Path, out: Path) -> Path:
    """The adapter merged into a float32 copy of the backbone (peft ``merge_and_unload``), saved as an HF folder."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(target.model("float32").cpu(), str(adapter)).merge_and_unload()
    model.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out


# --------------------------------------------------------------------------------------------
# Engines


def server_settings(args, model_dir: Path, *, eager: bool, concurrency: int, max_model_len: int):
    from tracekit.rl.vllm_client import VLLMSettings

    if args.server == "standin":
        command = (sys.executable, str(STANDIN), "--model", "{model}", "--host", "{host}", "--port", "{port}")
        return VLLMSettings(model_path=str(model_dir), command=command, concurrency=concurrency, startup_timeout_s=300)
    extra = ("--enforce-eager",) if eager else ()
    return VLLMSettings(model_path=str(model_dir), max_lora_rank=16, gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=max_model_len, concurrency=concurrency, startup_timeout_s=600,
                        extra_args=(*extra, "--max-num-seqs", str(max(concurrency, 16)), "--seed", "0"))


def vllm_engine(args, target: Target, work: Path, model_dir: Path | None = None, *, eager: bool = False):
    from tracekit.rl.vllm_client import VLLMEngine

    from tracekit.llm.base import EndpointError

    def start(eager: bool):
        settings = server_settings(args, model_dir or target.model_dir, eager=eager, concurrency=args.concurrency,
                                   max_model_len=target.max_model_len)
        return VLLMEngine(settings, target.tokenizer, work, chat_format=target.chat_format,
                          max_prompt_tokens=target.max_model_len - target.max_new)

    t0 = time.perf_counter()
    try:
        engine = start(eager)
    except EndpointError as e:  # a compiled start that fails is worth an eager one (the log says why; noted)
        if eager or args.server != "vllm":
            raise
        print(f"  [{target.name}] compiled vLLM start failed ({e}); retrying with --enforce-eager", flush=True)
        eager = True
        engine = start(eager)
    print(f"  [{target.name}] vLLM server up in {time.perf_counter() - t0:.1f} s ({'eager' if eager else 'compiled'})", flush=True)
    engine.eager = eager
    return engine, round(time.perf_counter() - t0, 1)


def hf_engine(target: Target, model, args):
    from tracekit.rl.engines import HFEngine

    return HFEngine(model, target.tokenizer, chat_format=target.chat_format, batch_size=args.concurrency,
                    max_prompt_tokens=target.max_model_len - target.max_new)


# --------------------------------------------------------------------------------------------
# Comparing episodes


def turn_ids(traj) -> list[list[int]]:
    return [t["completion_ids"] for t in traj.info.get("turns") or []]


def first_difference(a, b) -> tuple[int, int, list[int], list[int]] | None:
    """(turn, position, prompt ids + the shared prefix, [id_a, id_b]) where two episodes' tokens first differ."""
    ta, tb = a.info.get("turns") or [], b.info.get("turns") or []
    for k, (x, y) in enumerate(zip(ta, tb)):
        if x["prompt_ids"] != y["prompt_ids"]:
            return k, -1, [], []
        cx, cy = x["completion_ids"], y["completion_ids"]
        for i, (p, q) in enumerate(zip(cx, cy)):
            if p != q:
                return k, i, x["prompt_ids"] + cx[:i], [p, q]
        if len(cx) != len(cy):
            i = min(len(cx), len(cy))
            return k, i, x["prompt_ids"] + cx[:i], [(cx + [-1])[i], (cy + [-1])[i]]
    return None if len(ta) == len(tb) else (min(len(ta), len(tb)), -1, [], [])


def logprob_gap(model32, context: list[int], picks: list[int]) -> float | None:
    """The float32 model's log-prob of one pick minus the other's after ``context`` (None: a length difference)."""
    import torch

    if -1 in picks or not context:
        return None
    with torch.no_grad():
        ids = torch.tensor([context], device=next(model32.parameters()).device)
        logp = torch.log_softmax(model32(input_ids=ids).logits[0, -1].float(), -1)
    return round(abs(float(logp[picks[0]] - logp[picks[1]])), 4)


def compare(name_a: str, eps_a, name_b: str, eps_b, model32) -> dict[str, Any]:
    """How many episodes are the same token for token (and the same messages and reward); for the others the first
    differing token and the float32 gap there; the log-prob difference over the tokens both produced identically."""
    same, diffs, lp_diffs = 0, [], []
    for a, b in zip(eps_a, eps_b):
        d = first_difference(a, b)
        for x, y in zip(a.info.get("turns") or [], b.info.get("turns") or []):
            n = 0
            for p, q in zip(x["completion_ids"], y["completion_ids"]):
                if p != q:
                    break
                n += 1
            lp_diffs += [abs(u - v) for u, v in zip(x["completion_logprobs"][:n], y["completion_logprobs"][:n])]
            if n < max(len(x["completion_ids"]), len(y["completion_ids"])):
                break
        if d is None and a.reward == b.reward:
            same += 1
            continue
        turn, pos, ctx, picks = d if d is not None else (-1, -1, [], [])
        gap = logprob_gap(model32, ctx, picks) if pos >= 0 else None
        diffs.append({"task": a.task_id, "turn": turn, "token": pos, "picks": picks, "gap_f32": gap,
                      "near_tie": gap is not None and gap < NEAR_TIE, "reward": [a.reward, b.reward]})
    rewards = [statistics.mean(t.reward for t in eps) if eps else 0.0 for eps in (eps_a, eps_b)]
    return {"pair": [name_a, name_b], "episodes": len(eps_a), "identical": same, "differing": diffs,
            "differing_not_near_tie": sum(not d["near_tie"] for d in diffs),
            "mean_reward": {name_a: round(rewards[0], 4), name_b: round(rewards[1], 4)},
            "logprob_abs_diff_on_shared_tokens": {"n": len(lp_diffs), "max": round(max(lp_diffs), 5) if lp_diffs else None,
                                                  "mean": round(statistics.mean(lp_diffs), 6) if lp_diffs else None}}


# --------------------------------------------------------------------------------------------
# Throughput


class Timed:
    """Wraps a PolicyChat's ``generate`` (the engine's part) to count its seconds."""

    def __init__(self, client):
        self.client, self.inner, self.seconds = client, client.generate, 0.0

    def __enter__(self):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return self.inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        self.client.generate = timed
        return self

    def __exit__(self, *exc):
        self.client.generate = self.inner


def timed_rollout(target: Target, client) -> dict[str, Any]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with Timed(client) as t:
        t0 = time.perf_counter()
        eps = target.episodes(client)
        wall = time.perf_counter() - t0
    tokens = sum(len(ids) for e in eps for ids in turn_ids(e))
    return {"seconds": wall, "engine_s": t.seconds, "rest_s": wall - t.seconds, "episodes": len(eps), "tokens": tokens,
            "turns": sum(len(turn_ids(e)) for e in eps), "mean_reward": statistics.mean(e.reward for e in eps)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    secs = [r["seconds"] for r in rows]
    med = statistics.median(secs)
    r0 = rows[0]
    return {"seconds": [round(s, 3) for s in secs], "median_s": round(med, 3), "min_s": round(min(secs), 3),
            "max_s": round(max(secs), 3), "episodes_per_s": round(r0["episodes"] / med, 2),
            "tokens_per_s": round(r0["tokens"] / med, 1), "episodes": r0["episodes"], "turns": r0["turns"],
            "generated_tokens": r0["tokens"], "mean_reward": round(r0["mean_reward"], 4),
            "engine_s_median": round(statistics.median(r["engine_s"] for r in rows), 3),
            "rest_s_median": round(statistics.median(r["rest_s"] for r in rows), 3)}


def throughput(target: Target, arms: dict[str, Any], repeats: int) -> dict[str, Any]:
    """``arms``: name -> a function giving the arm's client. Every arm once untimed (shapes, CUDA graphs, compiled
    kernels met once), then ``repeats`` interleaved repeats."""
    order = list(arms)
    for arm in order:
        timed_rollout(target, arms[arm]())
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in order}
    for i in range(repeats):
        for arm in (order if i % 2 == 0 else order[::-1]):
            r = timed_rollout(target, arms[arm]())
            runs[arm].append(r)
            print(f"  [{target.name}] repeat {i} {arm:>10}: {r['seconds']:6.2f} s, {r['episodes'] / r['seconds']:7.1f} eps/s, "
                  f"engine {r['engine_s']:.2f} s", flush=True)
    out: dict[str, Any] = {"arms": {a: summarize(rs) for a, rs in runs.items()}}
    for base, other in (("hf_base", "vllm_base"), ("hf_lora", "vllm_lora")):
        if base in runs and other in runs:
            ratio = [a["seconds"] / b["seconds"] for a, b in zip(runs[base], runs[other])]
            out[f"speedup_{other}_over_{base}"] = {"median": round(statistics.median(ratio), 3), "min": round(min(ratio), 3),
                                                   "max": round(max(ratio), 3)}
    return out


# --------------------------------------------------------------------------------------------
# GRPO with adapter-only sync


def grpo_two_iterations(args, target: Target, work: Path) -> dict[str, Any]:
    import torch

    from tracekit.rl.settings import GRPOSettings, LoraSettings
    from tracekit.rl.trainer import GRPOTrainer
    from tracekit.rl.vllm_client import VLLMEngine
    from tracekit.runs import TRAIN_SEED_OFFSET
    from tracekit.targets.synthetic.suite import LibraryTargetSuite

    settings = GRPOSettings(iterations=2, groups=8, group_size=8, lr=1e-3, max_new_tokens=48, max_steps=8,
                            max_prompt_tokens=target.max_model_len - 48, num_minibatches=1,
                            lora=LoraSettings(rank=8, alpha=16), seed=0, rollout_batch_size=64, checkpoint_every=100,
                            old_logprobs="recompute", gradient_checkpointing=False)
    engines: list[VLLMEngine] = []

    def factory(model, tok):
        s = server_settings(args, target.model_dir, eager=True, concurrency=64, max_model_len=target.max_model_len)
        engines.append(VLLMEngine(s, tok, work / "vllm", chat_format=target.chat_format, max_prompt_tokens=settings.max_prompt_tokens))
        return engines[-1]

    model = target.model("float32")
    train = LibraryTargetSuite("train", ["micro_finish_all_writes"], n_per_env=8 * 2, seed_offset=TRAIN_SEED_OFFSET)
    loads: list[str] = []
    metrics: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    try:
        trainer = GRPOTrainer(model, target.tokenizer, train, settings, work / "grpo", engine_factory=factory,
                              chat_format=target.chat_format, callbacks=[lambda m: metrics.append(dict(m))])
        engine = engines[0]
        load = engine._load
        engine._load = lambda name, path: (loads.append(name), load(name, path))[1]
        trainer.train()
        # the trained adapter synced once more (the trainer syncs before each iteration's rollouts, so the served one
        # is a step behind): the server's log-probs must be the final policy's, not the base model's
        engine.sync(settings.iterations, trainer.save_adapter)
        from tracekit.llm.base import ChatRequest
        from tracekit.types import Message

        req = [ChatRequest(messages=[Message(role="user", content=t.instruction or "go")], temperature=1.0,
                           max_new_tokens=16, seed=s, return_tokens=True) for s, t in enumerate(target.tasks[:16])]
        resps = engine.client.chat(req)
        policy = trainer.model.eval()
        dist = {"final": [], "base": []}
        with torch.no_grad():
            for r in resps:
                ids = torch.tensor([r.prompt_token_ids + r.completion_token_ids], device=next(policy.parameters()).device)
                n, served_lp = len(r.prompt_token_ids), torch.tensor(r.completion_logprobs)
                for which in dist:
                    if which == "base":
                        with policy.disable_adapter():
                            logits = policy(input_ids=ids).logits
                    else:
                        logits = policy(input_ids=ids).logits
                    lp = torch.log_softmax(logits[0].float(), -1)[n - 1:-1].gather(1, ids[0, n:, None]).squeeze(1).cpu()
                    dist[which] += (lp - served_lp).abs().tolist()
        served = engine.lora_name
    finally:
        train.close()
        for e in engines:
            e.close()
    return {"seconds": round(time.perf_counter() - t0, 1), "adapter_loads": loads, "served_after_training": served,
            "iterations": metrics,
            "served_logprob_abs_diff": {w: {"n": len(d), "max": round(max(d), 4), "mean": round(statistics.mean(d), 5)}
                                        for w, d in dist.items()},
            }


# --------------------------------------------------------------------------------------------


SECTIONS = ("micro:checks", "micro:throughput", "micro:grpo", "gain:checks", "gain:throughput")


def run_section(args, section: str, work: Path, result: dict[str, Any], save) -> None:
    """One section of one target (its servers started and ended here), into ``result[target][what]``."""
    from peft import PeftModel

    name, what = section.split(":")
    limit = {"micro": args.micro_limit, "gain": args.gain_limit}[name]
    target = Target(name, limit)
    out = result.setdefault(name, {})
    out.update(tasks=len(target.tasks), model_dir=str(target.model_dir))
    try:
        if what == "grpo":
            out["grpo"] = grpo_two_iterations(args, target, work / "grpo")
            print(f"  [micro] GRPO through vLLM: adapters loaded {out['grpo']['adapter_loads']}", flush=True)
            return
        adapter = random_adapter(target.model("float32").cpu(), work / "adapter")
        engine, startup = vllm_engine(args, target, work / "vllm", eager=what == "checks" and args.eager_checks)
        part = out.setdefault(what, {})
        part["server_start_s"], part["server_mode"] = startup, "eager" if engine.eager else "compiled (CUDA graphs)"
        part["vllm_version"] = engine.server.check_version()
        try:
            hf_base = hf_engine(target, target.model(), args)
            lora_model = PeftModel.from_pretrained(target.model(), str(adapter)).eval()
            hf_lora = hf_engine(target, lora_model, args)
            if what == "checks":
                base32 = target.model("float32")
                engine.use_base()
                part["greedy_base"] = compare("vllm", target.episodes(engine.client), "tracekit", target.episodes(hf_base.client), base32)
                print(f"  [{name}] greedy base: {part['greedy_base']['identical']}/{part['greedy_base']['episodes']} identical", flush=True)
                save()
                del base32
                engine.sync(0, lambda p: __import__("shutil").copytree(adapter, p))
                lora32 = PeftModel.from_pretrained(target.model("float32"), str(adapter)).eval()
                runtime = target.episodes(engine.client)
                part["greedy_lora_runtime_vs_tracekit"] = compare("vllm_runtime_lora", runtime, "tracekit_lora",
                                                                  target.episodes(hf_lora.client), lora32)
                print(f"  [{name}] runtime adapter vs tracekit: {part['greedy_lora_runtime_vs_tracekit']['identical']}/"
                      f"{len(runtime)} identical", flush=True)
                save()
                engine.close()  # the merged model's server takes its place on the GPU
                merged, part["merged_server_start_s"] = vllm_engine(
                    args, target, work / "merged", merged_folder(target, adapter, work / "merged-model"), eager=True)
                try:
                    merged.use_base()
                    part["greedy_lora_runtime_vs_merged"] = compare("vllm_runtime_lora", runtime, "vllm_merged",
                                                                    target.episodes(merged.client), lora32)
                finally:
                    merged.close()
                print(f"  [{name}] runtime adapter vs merged: {part['greedy_lora_runtime_vs_merged']['identical']}/"
                      f"{len(runtime)} identical", flush=True)
            else:
                engine.sync(0, lambda p: __import__("shutil").copytree(adapter, p))
                part.update(throughput(target, {"hf_base": lambda: hf_base.client, "vllm_base": lambda: served(engine, True),
                                                "hf_lora": lambda: hf_lora.client, "vllm_lora": lambda: served(engine, False)},
                                       args.repeats))
            part["done"] = True
            hf_base.close()
            hf_lora.close()
        finally:
            engine.close()
    finally:
        target.close()


def served(engine, base: bool):
    """The server's client, its requests naming the base model (``base``) or the loaded adapter."""
    engine.serve_base = base
    return engine.client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", choices=("vllm", "standin"), default="vllm")
    ap.add_argument("--sections", nargs="*", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--micro-limit", type=int, default=270)
    ap.add_argument("--gain-limit", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--eager-checks", action="store_true", help="the checks' server without CUDA graphs (a faster start)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--resume", action="store_true", help="keep --json's sections and run only those it lacks")
    ap.add_argument("--stop-after", type=float, default=None, help="start no section after this many seconds")
    ap.add_argument("--work", default=None, help="a folder for the servers' logs and the adapters (default: a temporary one)")
    args = ap.parse_args()
    import signal

    import torch

    # SIGTERM as an exception, so that the servers' process groups are ended (finally blocks, atexit) as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    result: dict[str, Any] = {}
    if args.resume and args.json and Path(args.json).is_file():
        result = json.loads(Path(args.json).read_text())
    result.update(server=args.server, device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                  torch=torch.__version__)
    result.setdefault("runs", []).append({k: v for k, v in vars(args).items()})

    def save() -> None:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(args.json), json.dumps(result, indent=1))

    def done(section: str) -> bool:
        name, what = section.split(":")
        got = result.get(name, {}).get(what)
        return isinstance(got, dict) and (got.get("done") or what == "grpo") and "error" not in got

    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for section in args.sections:
            if done(section):
                print(f"  [{section}] in {args.json} already: skipped", flush=True)
                continue
            if args.stop_after is not None and time.perf_counter() - t_start > args.stop_after:
                print(f"  [{section}] not started: past --stop-after {args.stop_after:.0f} s", flush=True)
                continue
            # a fresh work folder for every run of a section: a cut run's files never meet the next run's
            work = Path(args.work or tmp) / f"{section.replace(':', '-')}-{time.strftime('%H%M%S')}-{os.getpid()}"
            name, what = section.split(":")
            t0 = time.perf_counter()
            try:
                run_section(args, section, work, result, save)
            except Exception as e:  # the next section still runs; the server logs say why (vllm_server.log under --work)
                result.setdefault(name, {}).setdefault(what, {})["error"] = f"{type(e).__name__}: {e}"
                print(f"  [{section}] FAILED: {type(e).__name__}: {e}", flush=True)
            result[name].setdefault(what, {})["section_s"] = round(time.perf_counter() - t0, 1)
            save()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)[:6000])


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
