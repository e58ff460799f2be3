"""The planted warm start: a base agent with known strengths and gaps (issue 21).

``backbone.planted`` names *strong* capabilities (SFT on ``demos_strong`` ground-truth demonstrations of each
one's library environment) and *weak* ones, the **planted set** (``demos_weak`` demonstrations each: few or
none). The demonstrations are the library environments' own solvers replayed through the episode core
(:func:`gold_episode`): the instance's ground-truth calls, one per assistant turn, with the call ids the chat
client gives, then the report the environment's communicate check expects, answered by the scripted user; each
is kept only when the environment's verifier scores it a success. Each assistant turn becomes an exact token row
(``methods.adp_data.assistant_turns``: the prompt as the chat template renders it, the assistant's tokens masked
in), the SFT recipe (:mod:`tracekit.rl.sft`) trains one LoRA adapter on them, and the adapter is merged into the
weights: the result is a plain backbone folder, cached once per (planted spec, base backbone) under
``<cache_root>/planted/<key>/`` with its record:

- ``planted.json``: the spec (strong, weak, counts, difficulty, seed, SFT settings), the base backbone, the
  demonstration seeds of each environment and how many succeeded, the rows and tokens trained, the SFT losses;
- ``demos.jsonl``: every demonstration (environment, seed, messages);
- ``sft/metrics.csv``: the SFT run's per-step log; ``model/``: the merged backbone and its tokenizer.

Seeds: demonstrations draw instances from ``DEMO_SEED_OFFSET + seed * 1,000,000`` on, disjoint from validation
(0..n), GRPO training (``stages.TRAIN_SEED_OFFSET`` = 100,000 on) and the held-out target
(``targets.synthetic.suite.TARGET_SEED_OFFSET`` = 10,000,000 on). The SFT seed is ``seed`` too.

The folder's key does not hold the device: SFT on a GPU (bf16 matmuls) and on a CPU give slightly different
weights, as every training stage does.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from tracekit.agents import GoldAgent
from tracekit.artifacts import atomic_write_json, read_json, write_jsonl
from tracekit.llm.backbones import (_gguf_key, build_model_from_arch, cache_root, cached_folder, get_spec, load_backbone,
                                     register_backbone_source)
from tracekit.llm.hf import padding_id
from tracekit.llm.templates import TEMPLATES
from tracekit.llm.tools import render_prompt, tool_call_id
from tracekit.llm.world_tokenizer import TOKENIZER_VERSION, byte_tokenizer, train_world_tokenizer
from tracekit.methods.adp_data import assistant_turns
from tracekit.ranges import check_value
from tracekit.rl.settings import LoraSettings
from tracekit.rl.sft import SFTSettings, train_sft
from tracekit.rl.tokens import build_rows
from tracekit.synthesis.library import family_environments, library_env
from tracekit.targets.synthetic.suite import LibraryTargetSuite
from tracekit.types import Message, ToolCall, stable_hash

log = logging.getLogger(__name__)

PLANTED_VERSION = 1
DEMO_SEED_OFFSET = 50_000_000
DEMO_SEED_STRIDE = 1_000_000  # per warm-start seed
TOKENIZER_SEED_OFFSET = 60_000_000  # a world tokenizer's corpus: gold episodes of every environment of the family
TOKENIZER_EPISODES = 64  # per environment and difficulty level
FAMILY = "tau2"  # the library environments the testbed plants deficits in (the tau^2-shaped ones)


def library_capabilities(family: str = FAMILY) -> dict[str, str]:
    """{capability: library environment} of the built-in environments of ``family`` (no import of the envs)."""
    return {n.removeprefix(f"{family}_"): n for n in family_environments(family)}


@dataclass
class WarmStartSFT:
    """The warm start's SFT settings (:class:`tracekit.rl.sft.SFTSettings` subset)."""

    lr: float = 2e-4
    epochs: int = 2
    batch_size: int = 8
    rank: int = 16
    alpha: int = 32
    microbatch_tokens: int = 16384
    max_tokens: int = 6144  # a demonstration row longer than this keeps its first max_tokens tokens
    warmup_ratio: float = 0.0


@dataclass
class PlantedSpec:
    """``backbone.planted``: which capabilities the warm start demonstrates, and how much."""

    strong: list[str]
    weak: list[str]
    demos_strong: int = 48
    demos_weak: int | dict[str, int] = 0  # per weak capability: one count for all, or {capability: count}
    # per weak capability, the fraction of its demonstrations that are the solver's; the others show the
    # environment's flawed solution (``flawed_solution``: e.g. writing a locked item), so the warm start learns the
    # capability as a coin of about this weight: a base success in the calibration band with reward variance in
    # every group. 1.0: solver demonstrations only (the count alone plants the deficit)
    weak_correct: float | dict[str, float] = 1.0
    difficulty: int = 0
    seed: int = 0
    # a world-tokenizer backbone (trained from random initialization by this warm start): its initial weights' seed.
    # None: backbone.seed's (0), the weights of every warm start before the option, key included
    init_seed: int | None = None
    family: str = FAMILY
    sft: WarmStartSFT = field(default_factory=WarmStartSFT)

    # integers, each refused naming backbone.planted.<field> before any work (validate parses the spec); demos_strong's
    # range is checked with demos_weak's below
    RANGES: ClassVar[dict[str, str]] = {"difficulty": ">= 0", "seed": ">= 0", "init_seed": ">= 0"}

    def __post_init__(self) -> None:
        for name in ("demos_strong", *self.RANGES):
            value = getattr(self, name)
            if (not isinstance(value, int) or isinstance(value, bool)) and not (name == "init_seed" and value is None):
                raise ValueError(f"backbone.planted.{name}={value!r} is invalid: must be an integer "
                                 f"{self.RANGES.get(name, '>= 1')}")
            if name in self.RANGES:
                check_value(f"backbone.planted.{name}", value, self.RANGES[name])
        if isinstance(self.sft, dict):
            self.sft = WarmStartSFT(**self.sft)
        self.strong, self.weak = list(self.strong), list(self.weak)
        known = library_capabilities(self.family)
        if not known:
            raise ValueError(f"backbone.planted.family={self.family!r}: no library environments of that family")
        for group in ("strong", "weak"):
            for cap in getattr(self, group):
                if cap not in known:
                    raise ValueError(f"backbone.planted.{group}: the library has no environment for capability "
                                     f"{cap!r} (library capabilities on {self.family}: {', '.join(sorted(known))})")
        envs = [known[cap] for cap in (*self.strong, *self.weak)]
        levels = sorted(set.intersection(*(set(library_env(env).difficulty_levels) for env in envs))) if envs else []
        if envs and self.difficulty not in levels:
            raise ValueError(f"backbone.planted.difficulty={self.difficulty!r} is invalid: must be a level every planted "
                             f"environment has ({levels})")
        if not self.weak:
            raise ValueError("backbone.planted.weak is empty: the planted set needs at least one capability")
        both = sorted(set(self.strong) & set(self.weak))
        if both:
            raise ValueError(f"backbone.planted: {both} both strong and weak")
        if len(set(self.strong)) != len(self.strong) or len(set(self.weak)) != len(self.weak):
            raise ValueError("backbone.planted: a capability is listed twice")
        counts = self.demos_weak.values() if isinstance(self.demos_weak, dict) else [self.demos_weak]
        if any(not isinstance(v, int) or isinstance(v, bool) for v in counts):
            raise ValueError(f"backbone.planted.demos_weak={self.demos_weak!r} is invalid: must be an integer >= 0, "
                             "or {capability: integer} for each weak capability")
        fractions = self.weak_correct.values() if isinstance(self.weak_correct, dict) else [self.weak_correct]
        if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in fractions):
            raise ValueError(f"backbone.planted.weak_correct={self.weak_correct!r} is invalid: must be a fraction in "
                             "[0, 1], or {capability: fraction} for each weak capability")
        if isinstance(self.demos_weak, dict):
            self.demos_weak = {str(k): int(v) for k, v in self.demos_weak.items()}
            if set(self.demos_weak) != set(self.weak):
                raise ValueError(f"backbone.planted.demos_weak: a count for each weak capability ({self.weak}), got "
                                 f"{sorted(self.demos_weak)}")
        if isinstance(self.weak_correct, dict):
            self.weak_correct = {str(k): float(v) for k, v in self.weak_correct.items()}
            unknown = sorted(set(self.weak_correct) - set(known))
            if unknown:
                raise ValueError(f"backbone.planted.weak_correct: unknown capability {unknown[0]!r} (capabilities of "
                                 f"{self.family}: {', '.join(sorted(known))})")
            if set(self.weak_correct) != set(self.weak):
                raise ValueError(f"backbone.planted.weak_correct: a fraction for each weak capability ({self.weak}), "
                                 f"got {sorted(self.weak_correct)}")
        bad = {c: f for c, f in self.correct_fractions().items() if not 0.0 <= f <= 1.0}
        if bad:
            raise ValueError(f"backbone.planted.weak_correct: fractions must be in [0, 1], got {bad}")
        for cap, f in self.correct_fractions().items():
            if f < 1.0:  # flawed demonstrations asked for: the environment must have a flawed form
                env = library_env(known[cap])(self.difficulty)
                if not hasattr(env, "flawed_solution"):
                    raise ValueError(f"backbone.planted.weak_correct: {known[cap]} has no flawed solution, so "
                                     f"{cap} can only be planted by its count (weak_correct 1.0)")
                try:
                    env.flawed_solution(env.generate(0))
                except ValueError as e:
                    raise ValueError(f"backbone.planted.weak_correct: {e}") from None
        weak_counts = self.demos_weak.values() if isinstance(self.demos_weak, dict) else [self.demos_weak]
        if self.demos_strong < 1 or min(weak_counts) < 0:
            raise ValueError(f"backbone.planted: demos_strong must be >= 1 and demos_weak >= 0, got "
                             f"{self.demos_strong}, {self.demos_weak}")
        if self.sft.lr <= 0 or self.sft.epochs < 1 or self.sft.batch_size < 1 or self.sft.rank < 1:
            raise ValueError(f"backbone.planted.sft: {asdict(self.sft)} is invalid (lr > 0, epochs, batch_size, "
                             "rank >= 1)")

    @classmethod
    def from_config(cls, planted: Any) -> PlantedSpec:
        from omegaconf import OmegaConf

        data = OmegaConf.to_container(planted, resolve=True) if OmegaConf.is_config(planted) else dict(planted)
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"backbone.planted: unknown keys {sorted(unknown)}")
        return cls(**data)

    @property
    def planted_set(self) -> list[str]:
        """The capabilities the agent was made to lack: what the analysis should select."""
        return list(self.weak)

    def envs(self) -> dict[str, str]:
        known = library_capabilities(self.family)
        return {c: known[c] for c in [*self.strong, *self.weak]}

    def demo_counts(self) -> dict[str, int]:
        weak = self.demos_weak if isinstance(self.demos_weak, dict) else dict.fromkeys(self.weak, self.demos_weak)
        return {**{c: self.demos_strong for c in self.strong}, **{c: weak[c] for c in self.weak}}

    def correct_fractions(self) -> dict[str, float]:
        """{capability: fraction of its demonstrations that are the solver's} (strong capabilities: 1.0)."""
        weak = (self.weak_correct if isinstance(self.weak_correct, dict)
                else dict.fromkeys(self.weak, float(self.weak_correct)))
        return {**dict.fromkeys(self.strong, 1.0), **weak}

    def demo_seeds(self, n: int) -> range:
        start = DEMO_SEED_OFFSET + self.seed * DEMO_SEED_STRIDE
        return range(start, start + n)


# ------------------------------------------------------------------------------------------ demonstrations


def gold_episode(suite: Any, task: Any, flawed: tuple[list[dict[str, Any]], list[str]] | None = None,
                 ) -> tuple[list[Any], list[dict[str, Any]], Any]:
    """Replay ``task``'s ground-truth calls in ``suite`` (a LibraryTargetSuite), then report its expected
    outputs: (messages, tools, outcome). Call ids are the ones the chat client assigns
    (``llm.tools.tool_call_id``), so the demonstration renders as the agent's own turns would. ``flawed``:
    (calls, outputs) replayed instead (an environment's ``flawed_solution``)."""
    ep = suite.episode(task, 0)
    obs = ep.reset()
    messages = list(obs.messages)
    done = False
    actions, said = flawed if flawed is not None else (task.data["actions"], None)
    for a in actions:
        call = ToolCall(id=tool_call_id(len(messages), 0), name=a["name"], arguments=dict(a["arguments"]))
        msg = Message(role="assistant", tool_calls=[call])
        r = ep.step(msg)
        messages += [msg, *r.messages]
        if r.done:
            done = True
            break
    if not done:
        text = GoldAgent().final_message(task if said is None else
                                         task.model_copy(update={"data": {**task.data, "communicate_info": said}}))
        msg = Message(role="assistant", content=text)
        r = ep.step(msg)
        messages += [msg, *r.messages]
    return messages, list(obs.tools or []), ep.outcome()


def demonstrations(spec: PlantedSpec, tokenizer: Any) -> tuple[list[tuple[list[int], list[int]]], list[dict[str, Any]],
                                                                dict[str, Any]]:
    """The warm start's SFT rows, the demonstrations (for ``demos.jsonl``) and a per-environment record."""
    rows: list[tuple[list[int], list[int]]] = []
    demos: list[dict[str, Any]] = []
    record: dict[str, Any] = {}
    envs = spec.envs()
    correct = spec.correct_fractions()
    for cap, n in spec.demo_counts().items():
        seeds = spec.demo_seeds(n)
        rec = {"env": envs[cap], "seeds": [seeds.start, seeds.stop] if n else [], "requested": n, "succeeded": 0,
               "failed": 0, "flawed": 0, "rows": 0, "truncated_rows": 0, "assistant_tokens": 0}
        record[cap] = rec
        if n == 0:
            continue
        suite = LibraryTargetSuite("planted-demos", [envs[cap]], difficulty=spec.difficulty, n_per_env=n,
                                   seed_offset=seeds.start, user="scripted")
        env = suite.suites[envs[cap]]
        flaw_of = library_env(envs[cap])(spec.difficulty)
        try:
            instances = env.instances(env.seeds)
            for i, (task, inst) in enumerate(zip(suite.tasks(), instances, strict=True)):
                # demonstration i is the solver's when the running share of solver demonstrations steps up
                # (fraction f: evenly spread, floor(n f) of n); the others show the flaw
                solver = math.floor((i + 1) * correct[cap]) > math.floor(i * correct[cap])
                flawed = None if solver else flaw_of.flawed_solution(inst)
                if flawed is not None and list(flawed) == [task.data["actions"], task.data["communicate_info"]]:
                    flawed = None  # an instance the capability does not show on (an unlocked item): no flaw to show
                messages, tools, outcome = gold_episode(suite, task, flawed)
                if flawed is not None:
                    if outcome.success:
                        raise ValueError(f"{envs[cap]}: its flawed solution of {task.id} passes the verifier; a "
                                         "flawed demonstration must fail")
                    rec["flawed"] += 1
                elif not outcome.success:  # a solver replay the verifier rejects is no demonstration
                    rec["failed"] += 1
                    continue
                else:
                    rec["succeeded"] += 1
                for r in build_rows(assistant_turns(messages, tools, tokenizer)):
                    ids, mask = list(r.token_ids), list(r.loss_mask)
                    if len(ids) > spec.sft.max_tokens:
                        ids, mask = ids[: spec.sft.max_tokens], mask[: spec.sft.max_tokens]
                        rec["truncated_rows"] += 1
                    if any(mask):
                        rows.append((ids, mask))
                        rec["rows"] += 1
                        rec["assistant_tokens"] += sum(mask)
                demos.append({"capability": cap, "env": envs[cap], "task": task.id,
                              "messages": [m.model_dump(mode="json", exclude_none=True) for m in messages]})
        finally:
            suite.close()
    if not rows:
        raise ValueError(f"backbone.planted: no demonstration succeeded ({record})")
    return rows, demos, record


# ------------------------------------------------------------------------------------------ the folder


def base_identity(base: Any) -> dict[str, Any]:
    """What the warm start starts from: the base spec's identity (plus the bundled file's key for gguf, the
    tokenizer for a world tokenizer)."""
    ident = {k: getattr(base, k) for k in ("name", "source", "hf_id", "chat_format", "arch", "seed")}
    if base.source == "gguf":
        ident["gguf"] = _gguf_key("smollm2_135m")
    if base.tokenizer != "bundled":
        ident["tokenizer"] = base.tokenizer
    return ident


def initial_base(spec: PlantedSpec, base: Any) -> Any:
    """The backbone the warm start starts from: a world-tokenizer backbone is trained from random initialization by
    the warm start itself, so ``init_seed`` (where set) seeds its initial weights."""
    if spec.init_seed is None:
        return base
    if base.tokenizer != "world":
        raise ValueError(f"backbone.planted.init_seed={spec.init_seed}: only a world-tokenizer backbone is initialized by "
                         f"the warm start; {base.name} brings its own weights")
    return dataclasses.replace(base, seed=spec.init_seed)


def planted_identity(spec: PlantedSpec, base: Any) -> dict[str, Any]:
    """What a planted folder depends on: the spec, the base (its initial weights' seed), a world tokenizer's own
    identity."""
    base = initial_base(spec, base)
    planted = asdict(spec)
    if spec.weak_correct == 1.0:  # solver demonstrations only: the key of every warm start before the option
        del planted["weak_correct"]
    if spec.init_seed is None:  # backbone.seed's weights: likewise (the base identity carries the seed used)
        del planted["init_seed"]
    ident = {"planted": planted, "base": base_identity(base), "version": PLANTED_VERSION}
    if base.tokenizer == "world":  # the world's text and the tokenizer's rules are inputs of the weights
        ident["world_tokenizer"] = world_tokenizer_identity(spec.family, base.chat_format, int(base.arch["vocab_size"]))
    return ident


def world_corpus(family: str, chat_format: str) -> list[str]:
    """The rendered gold episodes a world tokenizer is trained on: ``TOKENIZER_EPISODES`` instances of every library
    environment of ``family`` at each of its difficulty levels (seeds from ``TOKENIZER_SEED_OFFSET``), whatever the
    planted mix, so two planted sets of one world share one vocabulary."""
    renderer = byte_tokenizer(TEMPLATES[chat_format])
    texts = []
    for env in library_capabilities(family).values():
        for level in library_env(env).difficulty_levels:
            suite = LibraryTargetSuite("tokenizer-corpus", [env], difficulty=level, n_per_env=TOKENIZER_EPISODES,
                                       seed_offset=TOKENIZER_SEED_OFFSET, user="scripted")
            try:
                for task in suite.tasks():
                    messages, tools, _ = gold_episode(suite, task)
                    texts.append(render_prompt(renderer, messages, tools, add_generation_prompt=False))
            finally:
                suite.close()
    return texts


def world_atoms(family: str) -> list[str]:
    return sorted({a for env in library_capabilities(family).values() for a in library_env(env).atoms})


def world_tokenizer_identity(family: str, chat_format: str, vocab_size: int) -> dict[str, Any]:
    """Everything a world tokenizer depends on (its cache key; part of the key of a warm start that uses it)."""
    return {"family": family, "envs": sorted(library_capabilities(family).values()), "chat_format": chat_format,
            "vocab_size": vocab_size, "atoms": world_atoms(family),
            "episodes": TOKENIZER_EPISODES, "seeds": TOKENIZER_SEED_OFFSET, "version": TOKENIZER_VERSION}


def world_tokenizer(family: str, chat_format: str, vocab_size: int, cache_dir: str | Path | None = None) -> Any:
    """The world tokenizer of ``family`` (trained once on :func:`world_corpus`, cached under
    ``<cache_root>/tokenizers/world-<family>-<key>``), with ``chat_format``'s template."""
    from transformers import AutoTokenizer

    atoms = world_atoms(family)
    key = stable_hash(world_tokenizer_identity(family, chat_format, vocab_size), length=16)

    def build(tmp: Path) -> dict[str, Any]:
        tok = train_world_tokenizer(world_corpus(family, chat_format), vocab_size, TEMPLATES[chat_format], atoms)
        tok.save_pretrained(tmp)
        return {"family": family, "vocab": len(tok), "atoms": atoms}

    path = cached_folder(cache_root(cache_dir) / "tokenizers" / f"world-{family}-{key}", build)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tokenizer.chat_template = TEMPLATES[chat_format]
    return tokenizer


def longest_gold_episode(suite: Any, tokenizer: Any, per_env: int = 8) -> tuple[int, str]:
    """(tokens, task id) of the longest gold episode, prompt and tool schemas included, over the first ``per_env``
    tasks of each environment of ``suite`` (a LibraryTargetSuite): what a world's episodes need of the context."""
    seen: dict[str, int] = {}
    longest = (0, "")
    for task in suite.tasks():
        if seen.setdefault(task.env, 0) >= per_env:
            continue
        seen[task.env] += 1
        messages, tools, _ = gold_episode(suite, task)
        text = render_prompt(tokenizer, messages, tools, add_generation_prompt=False)
        longest = max(longest, (len(tokenizer(text, add_special_tokens=False)["input_ids"]), task.id))
    return longest


def world_base(base: Any, family: str, cache_dir: str | Path | None = None) -> tuple[Any, Any]:
    """(random-init model, world tokenizer) of a ``tokenizer=world`` backbone: the tokenizer of ``family`` with the
    architecture's vocabulary size as its ceiling, the model seeded by ``base.seed``."""
    tokenizer = world_tokenizer(family, base.chat_format, int(base.arch["vocab_size"]), cache_dir)
    return build_model_from_arch(base, device="cpu", dtype="float32"), tokenizer


def planted_key(spec: PlantedSpec, base: Any) -> str:
    return stable_hash(planted_identity(spec, base), length=16)


def planted_dir(backbone: Any, device: str = "cpu", cache_dir: str | Path | None = None) -> Path:
    """The planted backbone folder of ``backbone`` (a BackboneSpec with ``planted`` set), built once."""
    spec = PlantedSpec.from_config(backbone.planted)
    base = dataclasses.replace(backbone, planted=None)
    final = cache_root(cache_dir) / "planted" / f"{backbone.name}-{planted_key(spec, base)}"
    return cached_folder(final, lambda tmp: build_planted(spec, base, tmp, device, cache_dir))


# backbone.planted's source: load_backbone builds a spec with ``planted`` set with planted_dir. Registered here, on
# import (the hook of tracekit.llm.backbones), so the edge is this module's real import of llm, never a name of this
# module written in llm/.
register_backbone_source("planted", planted_dir)


def build_planted(spec: PlantedSpec, base: Any, out: Path, device: str = "cpu",
                  cache_dir: str | Path | None = None) -> dict[str, Any]:
    """SFT ``base`` on the demonstrations, merge, and write the folder (see the module docstring)."""
    import torch
    from peft import PeftModel


    t0 = time.time()
    world = base.tokenizer == "world"
    base = initial_base(spec, base)
    model, tokenizer = world_base(base, spec.family, cache_dir) if world else load_backbone(base, device, "float32", cache_dir)
    rows, demos, record = demonstrations(spec, tokenizer)
    log.info("planted warm start: %d rows from %d demonstrations (%s)", len(rows), len(demos),
             ", ".join(f"{c}: {r['succeeded']}" + (f" + {r['flawed']} flawed" if r["flawed"] else "")
                       for c, r in record.items()))
    s = spec.sft
    settings = SFTSettings(lr=s.lr, epochs=s.epochs, batch_size=s.batch_size, microbatch_tokens=s.microbatch_tokens,
                           dtype="float32", seed=spec.seed, lora=LoraSettings(rank=s.rank, alpha=s.alpha),
                           checkpoint_every=10**9, warmup_ratio=s.warmup_ratio, full_parameters=world)
    pad = padding_id(tokenizer)
    summary = train_sft(model, pad, rows, settings, out / "sft", device=device)
    del model
    if world:  # every weight trained from random init: the SFT's model is the backbone
        shutil.move(summary.pop("model"), out / "model")
    else:
        merged, _ = load_backbone(base, "cpu", "float32", cache_dir)
        merged = PeftModel.from_pretrained(merged, summary.pop("adapter")).merge_and_unload()
        merged.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    shutil.rmtree(out / "sft" / "checkpoints", ignore_errors=True)  # the adapter and metrics stay
    write_jsonl(out / "demos.jsonl", demos)
    info = {"planted_set": spec.planted_set, "spec": asdict(spec), "base": base_identity(base),
            "demonstrations": record, "rows": len(rows), "sft": summary,
            "device": str(device), "torch": torch.__version__, "seconds": round(time.time() - t0, 1)}
    atomic_write_json(out / "planted.json", info)
    return {"planted_set": spec.planted_set, "seconds": info["seconds"]}


def planted_record(backbone: Any, cache_dir: str | Path | None = None) -> dict[str, Any] | None:
    """``planted.json`` of an already built planted backbone, None when it is not built (nothing is trained)."""
    backbone = get_spec(backbone)
    spec = PlantedSpec.from_config(backbone.planted)
    base = dataclasses.replace(backbone, planted=None)
    path = cache_root(cache_dir) / "planted" / f"{backbone.name}-{planted_key(spec, base)}" / "planted.json"
    return read_json(path) if path.is_file() else None
