"""GRPO under DeepSpeed ZeRO-2/3: N GPUs against one (issue 8).

For each ZeRO stage in --stages, the same worker runs twice under torchrun: world size 1 and
world size --nproc (one process per GPU; gloo processes on CPU). Each worker builds a seeded
random-init Qwen3 of --arch on its device (bf16 on GPU), wraps it the way ``launcher=deepspeed_zero*``
does (:class:`GRPOTrainer` + ``tracekit.rl.launch.DeepSpeedBackend``, torch AdamW, gradient
checkpointing) and does, in order:

1. fixed batch: --fixed-trajs seeded one-turn trajectories (random ids, advantages in [-1.5, 1.5]),
   old log-probs scored once on the full batch by every rank; rank r trains trajectories
   r, r+W, ... with one ``update_on`` (one optimizer step). The full gradient of every adapter
   tensor (``deepspeed.utils.safe_get_full_grad``, before the step) and the adapter after the step
   are saved, so the driver compares world W against world 1 on the same batch;
2. one GRPO iteration (``GRPOTrainer.iteration``: rollout with the hf engine + update) of
   --groups x --group-size episodes of --turns turns on :class:`ParitySuite`, timed, with the
   peak memory of each GPU.

ParitySuite: a --prompt-words-word system prompt, then --turns assistant turns; a turn scores
1 iff the hash of its reply text is odd (a seeded coin: a random-init model gets non-zero reward
variance, so no group is dropped). The tokenizer is word-level over the model's full vocabulary
(``w<i>`` words), so every sampled id decodes and re-encodes to itself and a prompt of n words is
n tokens. A random-init model practically never samples a stop id, so every turn generates
--max-new-tokens and all ranks run the same number of decode steps (ZeRO-3 gathers parameters
with collectives in every forward: ranks must run forwards in lockstep).

Reported per stage: tokens/s of the iteration (rollout: generated tokens / rollout time; update:
forward tokens / update time; iteration: forward tokens / iteration time), scaling efficiency
``tps(W) / (W * tps(1))``, peak memory per GPU, and the W-vs-1 comparison: relative L2 and max
abs difference of the gradients and of the adapter after the step.

    python benchmarks/zero_multi_gpu.py --device cuda --nproc 2 --arch qwen3_8b --out benchmarks/results/zero_qwen3_8b_2xh200.json
    python benchmarks/zero_multi_gpu.py --smoke   # tiny shape, 2 gloo processes on CPU
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.grpo_step import ARCHS, TARGETS  # noqa: E402
from tracekit.artifacts import atomic_write_json, read_json  # noqa: E402
from tracekit.envs.base import Episode, EnvSuite, Observation, Outcome, StepResult  # noqa: E402
from tracekit.rl.toy import CHAT_TEMPLATE  # noqa: E402
from tracekit.types import Message, Task, Trajectory, stable_hash  # noqa: E402

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<unk>"]
ROLE_WORDS = ["system", "user", "assistant"]
# Keep NVLink multicast off in every worker (the device notes: it can take shared GPUs down).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def word_tokenizer(vocab_size: int):
    """Word-level tokenizer with exactly ``vocab_size`` ids: ChatML specials, role words, ``w<i>`` fillers.

    Whitespace-split words map one-to-one to ids, so decode -> encode returns the sampled ids.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + ROLE_WORDS
    if vocab_size <= len(words):
        raise ValueError(f"vocab_size={vocab_size} leaves no room for filler words")
    vocab = {w: i for i, w in enumerate(words)}
    vocab.update({f"w{i}": i for i in range(len(words), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>", chat_template=CHAT_TEMPLATE
    )


def first_word_id() -> int:
    return len(SPECIALS) + len(ROLE_WORDS)


class _ParityEpisode(Episode):
    def __init__(self, prompt: str, turns: int):
        self.prompt, self.turns, self.scores = prompt, turns, []

    def reset(self) -> Observation:
        return Observation(messages=[Message(role="system", content=self.prompt), Message(role="user", content="w100 w101")], tools=[])

    def step(self, action: Message) -> StepResult:
        self.scores.append(float(int(stable_hash(action.content or "", 8), 16) % 2))
        done = len(self.scores) >= self.turns
        return StepResult(messages=[] if done else [Message(role="user", content="w102 w103")], done=done)

    def outcome(self) -> Outcome:
        return Outcome(reward=sum(self.scores) / self.turns, success=all(s == 1.0 for s in self.scores))


class ParitySuite(EnvSuite):
    """``n_tasks`` tasks, each a seeded ``prompt_words``-word system prompt; ``turns`` turns; coin rewards."""

    def __init__(self, vocab_size: int, prompt_words: int, turns: int, n_tasks: int = 8):
        self.name, self.vocab_size, self.prompt_words, self.turns, self.n_tasks = "parity", vocab_size, prompt_words, turns, n_tasks

    def tasks(self) -> list[Task]:
        return [Task(id=f"parity-{i}", env=self.name, instruction="reply") for i in range(self.n_tasks)]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        g = torch.Generator().manual_seed(int(stable_hash([task.id, seed], 8), 16))
        ids = torch.randint(first_word_id(), self.vocab_size, (self.prompt_words,), generator=g).tolist()
        return _ParityEpisode(" ".join(f"w{i}" for i in ids), self.turns)


def fixed_batch(n: int, prompt_len: int, gen_len: int, vocab: int, seed: int) -> list[Trajectory]:
    """n seeded one-turn trajectories: prompt in [prompt_len/2, prompt_len], completion in
    [gen_len/2, gen_len] tokens, advantage uniform in [-1.5, 1.5]; log-probs filled by the caller."""
    g = torch.Generator().manual_seed(seed)
    lo = first_word_id()
    out = []
    for i in range(n):
        p = int(torch.randint(prompt_len // 2, prompt_len + 1, (1,), generator=g))
        c = int(torch.randint(max(gen_len // 2, 1), gen_len + 1, (1,), generator=g))
        ids = torch.randint(lo, vocab, (p + c,), generator=g).tolist()
        adv = float(torch.rand((), generator=g)) * 3.0 - 1.5
        turn = {"prompt_ids": ids[:p], "completion_ids": ids[p:], "completion_logprobs": [0.0] * c}
        out.append(Trajectory(task_id=f"fixed-{i}", env="bench", info={"turns": [turn], "advantage": adv, "group": i}))
    return out


def random_qwen3(arch: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A seeded random-init Qwen3ForCausalLM of ``ARCHS[arch]`` built directly on ``device`` in ``dtype``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**ARCHS[arch], max_position_embeddings=40960)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def grpo_settings(args: argparse.Namespace):
    """The GRPO settings of every run: one optimizer step per batch, gradient checkpointing on."""
    from tracekit.rl.trainer import GRPOSettings
    from tracekit.rl.settings import LoraSettings

    return GRPOSettings(
        iterations=2, groups=args.groups, group_size=args.group_size, max_new_tokens=args.max_new_tokens, max_steps=args.turns,
        lr=args.lr, num_minibatches=1, microbatch_tokens=args.microbatch_tokens, gradient_checkpointing=True,
        rollout_batch_size=args.groups * args.group_size, save_rollouts="none", seed=0,
        lora=LoraSettings(rank=args.lora_rank, alpha=2 * args.lora_rank, target_modules=TARGETS),
    )  # fmt: skip


def scored_fixed_batch(tr: Any, args: argparse.Namespace, vocab: int) -> list[Trajectory]:
    """:func:`fixed_batch` with old log-probs scored by ``tr``'s current policy on the whole batch
    (every rank scores everything, with the same packing: identical pi_old at any world size)."""
    from tracekit.rl.tokens import Turn, rows_for_trajectory

    batch = fixed_batch(args.fixed_trajs, args.fixed_prompt, args.fixed_gen, vocab, seed=1)
    rows = [rows_for_trajectory([Turn.from_dict(t.info["turns"][0])], 0.0, i)[0] for i, t in enumerate(batch)]
    for t, lp in zip(batch, tr._score(rows, adapter=True)):
        t.info["turns"][0]["completion_logprobs"] = lp.tolist()
    return batch


# --------------------------------------------------------------------------------------------
# Worker (one rank under torchrun)


def _peaks(dev: torch.device) -> dict[str, float]:
    if dev.type != "cuda":
        return {"peak_allocated_gib": float("nan"), "peak_reserved_gib": float("nan")}
    return {
        "peak_allocated_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30,
    }


def worker(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    from tracekit.rl.launch import DeepSpeedBackend, finish_worker, init_worker
    from tracekit.rl.trainer import GRPOTrainer

    t_start = time.time()
    dist, device = init_worker()
    dev = torch.device(device)
    out = Path(args.run_dir)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    class ProbedBackend(DeepSpeedBackend):
        """DeepSpeedBackend that keeps the full gradient of every adapter tensor before its first step."""

        def __init__(self, model, s):
            super().__init__(model, s, args.stage, dist.world)
            self.names = [n for n, p in model.named_parameters() if p.requires_grad]
            self.grads: dict[str, torch.Tensor] | None = None

        def step(self) -> float:
            if self.grads is None:  # every rank: the gather is a collective
                from deepspeed.utils import safe_get_full_grad

                self.grads = {n: safe_get_full_grad(p).detach().float().cpu() for n, p in zip(self.names, self.params)}
            return super().step()

    vocab = ARCHS[args.arch]["vocab_size"]
    tok = word_tokenizer(vocab)
    t0 = time.time()
    model = random_qwen3(args.arch, dev, dtype, seed=0)
    settings = grpo_settings(args)
    suite = ParitySuite(vocab, args.prompt_words, args.turns)
    tr = GRPOTrainer(model, tok, suite, settings, out / "trainer", backend_factory=ProbedBackend, dist=dist, device=dev)
    t_build = time.time() - t0
    init = tr.adapter_state()

    # 1. fixed batch: the same trajectories and old log-probs at any world size
    batch = scored_fixed_batch(tr, args, vocab)
    mine = batch[dist.rank :: dist.world]
    _sync(dev)
    t0 = time.time()
    fixed_metrics = tr.update_on(mine, 0)
    _sync(dev)
    t_fixed = time.time() - t0
    after = tr.adapter_state()
    if dist.rank == 0:
        save_file(init, str(out / "adapter_init.safetensors"))
        save_file(after, str(out / "adapter_after.safetensors"))
        save_file(tr.backend.grads, str(out / "grads.safetensors"))
    peaks_fixed = _peaks(dev)

    # 2. one GRPO iteration (rollout + update), timed, peak memory from here
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    dist.barrier()
    it_metrics = tr.iteration(1)
    _sync(dev)
    if not it_metrics["trajectories_kept"] or not it_metrics["tokens_generated"]:
        raise RuntimeError(f"the iteration trained nothing (episodes failed or every group was dropped): {it_metrics}")
    rank = {
        "rank": dist.rank, "world": dist.world, "device": device, **_peaks(dev), "peak_fixed": peaks_fixed,
        "build_s": t_build, "fixed_update_s": t_fixed, "wall_s": time.time() - t_start,
    }  # fmt: skip
    atomic_write_json(out / f"rank{dist.rank}.json", rank)
    if dist.rank == 0:
        atomic_write_json(
            out / "result.json",
            {
                "fixed": fixed_metrics, "iteration": it_metrics,
                "lora_params": sum(getattr(p, "ds_numel", p.numel()) for p in tr.backend.params),
                "params": sum(getattr(p, "ds_numel", p.numel()) for p in tr.model.parameters()),
            },
        )  # fmt: skip
    tr.engine.close()
    finish_worker()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# --------------------------------------------------------------------------------------------
# Driver


def _worker_args(args: argparse.Namespace) -> list[str]:
    keys = ("arch", "lora_rank", "lr", "groups", "group_size", "turns", "max_new_tokens", "prompt_words", "microbatch_tokens",
            "fixed_trajs", "fixed_prompt", "fixed_gen")  # fmt: skip
    return [a for k in keys for a in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def _launch(args: argparse.Namespace, stage: int, world: int, run_dir: Path, port: int, gpus: str | None) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={world}", f"--master_port={port}",
        str(Path(__file__).resolve()), "--worker", "--stage", str(stage), "--run-dir", str(run_dir), *_worker_args(args),
    ]  # fmt: skip
    env = dict(os.environ, **NO_MULTICAST, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    log = open(run_dir / "log.txt", "wb")
    print(f"[zero] stage {stage} world {world}: {' '.join(cmd)}", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait(p: subprocess.Popen, run_dir: Path, timeout: float) -> str | None:
    """None on success, else one line saying why."""
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        return f"timed out after {timeout:.0f}s"
    if rc != 0:
        tail = (run_dir / "log.txt").read_text(errors="replace").strip().splitlines()[-3:]
        return f"exit code {rc}: {' | '.join(tail)[-400:]}"
    return None


def compare(single: Path, multi: Path) -> dict[str, float]:
    """World-W against world-1 on the fixed batch: gradients and adapter after one step.

    rel = ||a - b||_2 / ||b||_2 over all adapter tensors; update = adapter_after - adapter_init.
    """
    from safetensors.torch import load_file

    out: dict[str, float] = {}
    g1, gw = load_file(str(single / "grads.safetensors")), load_file(str(multi / "grads.safetensors"))
    a1, aw = load_file(str(single / "adapter_after.safetensors")), load_file(str(multi / "adapter_after.safetensors"))
    i1, iw = load_file(str(single / "adapter_init.safetensors")), load_file(str(multi / "adapter_init.safetensors"))
    if g1.keys() != gw.keys() or a1.keys() != aw.keys():
        raise RuntimeError("the runs' adapters have different tensors")
    out["init_max_abs_diff"] = max((i1[k].float() - iw[k].float()).abs().max().item() for k in i1)
    for name, x, y in (("grad", gw, g1), ("adapter", aw, a1)):
        num = math.sqrt(sum(((x[k].double() - y[k].double()) ** 2).sum().item() for k in y))
        den = math.sqrt(sum((y[k].double() ** 2).sum().item() for k in y))
        out[f"{name}_rel_l2"] = num / max(den, 1e-300)
        out[f"{name}_max_abs_diff"] = max((x[k].double() - y[k].double()).abs().max().item() for k in y)
        out[f"{name}_max_abs"] = max(y[k].double().abs().max().item() for k in y)
    d1 = {k: a1[k].double() - i1[k].double() for k in a1}
    dw = {k: aw[k].double() - iw[k].double() for k in aw}
    num = math.sqrt(sum(((dw[k] - d1[k]) ** 2).sum().item() for k in d1))
    den = math.sqrt(sum((d1[k] ** 2).sum().item() for k in d1))
    out["update_rel_l2"] = num / max(den, 1e-300)
    out["update_max_abs"] = max(d1[k].abs().max().item() for k in d1)
    moved = [(d1[k].abs() > 0) | (dw[k].abs() > 0) for k in d1]
    flips = sum(((torch.sign(d1[k]) != torch.sign(dw[k])) & m).sum().item() for k, m in zip(d1, moved))
    out["update_sign_disagree_frac"] = flips / max(sum(m.sum().item() for m in moved), 1)
    return out


def summarize(stage_runs: dict[int, dict[str, Any]], nproc: int) -> None:
    """Per-stage tokens/s, scaling efficiency tps(W) / (W * tps(1)) and the fixed-batch comparison (in place)."""
    for runs in stage_runs.values():
        if nproc == 1 or "error" in runs.get(1, {}) or "error" in runs.get(nproc, {}) or 1 not in runs or nproc not in runs:
            continue
        for key in ("rollout_tokens_per_s", "update_tokens_per_s", "iteration_tokens_per_s"):
            runs.setdefault("scaling_efficiency", {})[key] = runs[nproc][key] / (nproc * runs[1][key])


def _run_record(run_dir: Path, world: int) -> dict[str, Any]:
    res = read_json(run_dir / "result.json")
    it = res["iteration"]
    ranks = [read_json(run_dir / f"rank{r}.json") for r in range(world)]
    return {
        "params": res["params"], "lora_params": res["lora_params"], "fixed": res["fixed"], "iteration": it,
        "rollout_tokens_per_s": it["tokens_generated"] / it["time_rollout_s"],
        "update_tokens_per_s": it["tokens_forward"] / it["time_update_s"],
        "iteration_tokens_per_s": it["tokens_forward"] / it["time_total_s"],
        "ranks": ranks,
    }  # fmt: skip


def driver(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir)
    stages = [int(s) for s in args.stages.split(",")]
    gpu = args.device == "cuda"
    res: dict[str, Any] = {
        "arch": args.arch, "nproc": args.nproc, "device": torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu",
        "torch": torch.__version__, "backend": "nccl" if gpu else "gloo",
        "command": " ".join(["python", "benchmarks/zero_multi_gpu.py", *(args.argv or [])]),
        "settings": {k: getattr(args, k) for k in ("lora_rank", "lr", "groups", "group_size", "turns", "max_new_tokens",
                                                    "prompt_words", "microbatch_tokens", "fixed_trajs", "fixed_prompt", "fixed_gen")},
        "stages": {},
    }  # fmt: skip
    try:
        import deepspeed

        res["deepspeed"] = deepspeed.__version__
    except ImportError as e:
        raise SystemExit(f"deepspeed is not importable: {e}") from e
    port = args.master_port
    jobs: list[list[tuple[int, int, str | None]]] = []  # waves of (stage, world, gpus) run together
    if gpu and args.parallel_single and torch.cuda.device_count() >= len(stages):
        jobs.append([(s, 1, str(i)) for i, s in enumerate(stages)])
    else:
        jobs += [[(s, 1, "0" if gpu else None)] for s in stages]
    if args.nproc > 1:  # --nproc 1: the single-GPU runs alone (no comparison, no scaling)
        jobs += [[(s, args.nproc, None)] for s in stages]
    runs: dict[int, dict[int, Any]] = {s: {} for s in stages}
    for wave in jobs:
        procs = []
        for stage, world, gpus in wave:
            d = work / f"zero{stage}_w{world}"
            procs.append((stage, world, d, _launch(args, stage, world, d, port, gpus)))
            port += 1
        for stage, world, d, p in procs:
            err = _wait(p, d, args.job_timeout)
            runs[stage][world] = {"error": err} if err else _run_record(d, world)
            if len(wave) > 1:  # timings of concurrent single-GPU runs share the host's CPUs
                runs[stage][world]["ran_concurrently_with"] = [f"zero{s} w{w}" for s, w, _ in wave if (s, w) != (stage, world)]
            print(f"[zero] stage {stage} world {world}: {err or 'ok'}", flush=True)
    for stage in stages if args.nproc > 1 else ():
        a, b = work / f"zero{stage}_w1", work / f"zero{stage}_w{args.nproc}"
        if "error" not in runs[stage].get(1, {"error": 1}) and "error" not in runs[stage].get(args.nproc, {"error": 1}):
            runs[stage]["fixed_batch_vs_single"] = compare(a, b)
    summarize(runs, args.nproc)
    res["stages"] = {f"zero{s}": {str(k): v for k, v in runs[s].items()} for s in stages}
    _print(res, args.nproc)
    if args.out:
        atomic_write_json(args.out, res)
    return res


def _print(res: dict[str, Any], nproc: int) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{res['arch']} GRPO iteration, {res['backend']}, {res['device']}")
    for col in ("stage", "world", "rollout tok/s", "update tok/s", "iter tok/s", "peak GiB/GPU", "grad rel L2", "adapter max|d|"):
        t.add_column(col, justify="right")
    for name, runs in res["stages"].items():
        cmp = runs.get("fixed_batch_vs_single", {})
        for w in dict.fromkeys(("1", str(nproc))):
            r = runs.get(w)
            if r is None:
                continue
            if "error" in r:
                t.add_row(name, w, r["error"][:60], "", "", "", "", "")
                continue
            peaks = ", ".join("n/a" if math.isnan(x["peak_allocated_gib"]) else f"{x['peak_allocated_gib']:.1f}" for x in r["ranks"])
            extra = (f"{cmp['grad_rel_l2']:.2e}", f"{cmp['adapter_max_abs_diff']:.2e}") if cmp and w != "1" else ("", "")
            t.add_row(name, w, f"{r['rollout_tokens_per_s']:.0f}", f"{r['update_tokens_per_s']:.0f}", f"{r['iteration_tokens_per_s']:.0f}",
                      peaks, *extra)  # fmt: skip
        eff = runs.get("scaling_efficiency")
        if eff:
            keys = ("rollout_tokens_per_s", "update_tokens_per_s", "iteration_tokens_per_s")
            t.add_row(name, "eff.", *(f"{100 * eff[k]:.0f}%" for k in keys), "", "", "")
    Console(width=160).print(t)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, choices=(2, 3), help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--arch", default="qwen3_8b", choices=sorted(ARCHS))
    ap.add_argument("--lora-rank", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=512)
    ap.add_argument("--microbatch-tokens", type=int, default=8192)
    ap.add_argument("--fixed-trajs", type=int, default=16)
    ap.add_argument("--fixed-prompt", type=int, default=768)
    ap.add_argument("--fixed-gen", type=int, default=256)
    ap.add_argument("--parallel-single", action="store_true", help="run the world-1 runs of all stages at once, one GPU each")
    ap.add_argument("--job-timeout", type=float, default=600.0)
    ap.add_argument("--master-port", type=int, default=29620)
    ap.add_argument("--work-dir", default="/tmp/zero_multi_gpu")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--smoke", action="store_true", help="tiny shape, gloo processes on CPU")
    argv = list(argv if argv is not None else sys.argv[1:])
    if "--smoke" in argv:  # smoke defaults; options given explicitly still win
        ap.set_defaults(device="cpu", arch="tiny", lora_rank=8, groups=2, group_size=4, max_new_tokens=8, prompt_words=24,
                        microbatch_tokens=256, fixed_trajs=6, fixed_prompt=40, fixed_gen=16)  # fmt: skip
    args = ap.parse_args(argv)
    args.argv = argv
    if args.worker:
        worker(args)
        return None
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc {args.nproc} needs {args.nproc} GPUs; {torch.cuda.device_count()} visible")
    return driver(args)


if __name__ == "__main__":
    main()
