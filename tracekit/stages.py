"""The TRACE stages wired into the pipeline: config -> library calls -> artifact files.

Each stage declares the config keys it reads; see :mod:`tracekit.pipeline` for keys and caching.
Heavy objects (models, clients) are built once per process and shared by the stages of a run.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from tracekit.artifacts import Artifact, atomic_write_json, read_json
from tracekit.pipeline import Pipeline, Stage, StageContext
from tracekit.types import stable_hash

log = logging.getLogger(__name__)

def rollout_reads(cfg: DictConfig) -> tuple[str, ...]:
    """Config keys a rollout's result depends on (the agent's adapter or MoE is added per rollout)."""
    reads = ["benchmark", "backbone", "agent", "user", "eval.temperature", "eval.seeds", "eval.max_steps",
             "eval.context_budget"]
    if cfg.user.kind == "llm":
        reads.append(f"llm.endpoints.{cfg.user.endpoint}")
    if cfg.eval.temperature > 0:  # stochastic decoding samples from the master seed
        reads.append("seed")
    return tuple(reads)


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def _select(cfg: DictConfig, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: _plain(OmegaConf.select(cfg, k)) for k in keys}


# --------------------------------------------------------------------------------------------
# models and clients (one per process and configuration)

# In-process (hf) clients leave this cache when a stage loads a backbone of its own (GRPO training,
# composition: ``llm.backbones.load_backbone``), so the run holds one model at a time.
_CLIENTS: dict[str, Any] = {}


def backbone_dict(cfg: DictConfig) -> dict[str, Any]:
    b = _plain(cfg.backbone)
    return {k: b[k] for k in ("name", "source", "hf_id", "chat_format", "arch", "planted") if b.get(k) is not None}


def device(cfg: DictConfig) -> str:
    import torch

    want = cfg.backbone.device
    return ("cuda" if torch.cuda.is_available() else "cpu") if want == "auto" else want


def dtype(cfg: DictConfig) -> str | None:
    want = cfg.backbone.dtype
    if want != "auto":
        return want
    return "bfloat16" if device(cfg) == "cuda" else "float32"


def _client_spec(cfg: DictConfig, role: str, adapter: str | None, moe: str | None) -> dict[str, Any]:
    """The :func:`tracekit.llm.make_client` spec of an LLM role (its identity in the client cache)."""
    if role == "agent":
        ep: dict[str, Any] = {"kind": "hf"}
    else:
        if role not in cfg.llm.endpoints:
            raise KeyError(f"llm.endpoints has no '{role}' endpoint (have: {', '.join(cfg.llm.endpoints)})")
        ep = {k: v for k, v in _plain(cfg.llm.endpoints[role]).items() if v is not None}
    if ep["kind"] == "hf":
        spec = {"kind": "hf", "backbone": backbone_dict(cfg), "device": device(cfg), "dtype": dtype(cfg),
                "adapter": adapter, "moe": moe, "max_batch_size": cfg.agent.batch_size,
                "constrained_tool_calls": cfg.agent.constrained_tool_calls if role == "agent" else False}
        if role == "agent":  # prefixes: only the agent's, which each rollout clears (the other roles' would carry over)
            spec.update(tool_choice=cfg.agent.tool_choice, copy_ids=cfg.agent.copy_ids,
                        prefix_cache_mib=cfg.agent.prefix_cache_mib)
        return spec
    key_env = ep.pop("api_key_env", None)
    spec = {"kind": "openai", "base_url": ep["base_url"], "model": ep["model"], "timeout_s": ep["timeout_s"],
            "max_retries": ep["max_retries"], "max_concurrency": ep["concurrency"]}
    if key_env:
        spec["api_key_env"] = key_env
    return spec


def client_for(cfg: DictConfig, role: str, adapter: str | None = None, moe: str | None = None) -> Any:
    """The chat client of an LLM role (``agent`` or a key of ``llm.endpoints``), built once per process.

    ``adapter``: a peft adapter directory; ``moe``: a composed LoRA-MoE directory (agent only).
    """
    from tracekit.llm import make_client
    from tracekit.llm.backbones import keeping_cached_models, register_model_cache

    spec = _client_spec(cfg, role, adapter, moe)

    if adapter or moe:  # used for one rollout: not kept, so a run over many adapters holds one model at a time
        with keeping_cached_models():  # the cached user client serves the same rollout
            return make_client(spec)
    key = stable_hash(spec)
    if key not in _CLIENTS:
        with keeping_cached_models():  # building one role's client keeps the others' (agent and user)
            _CLIENTS[key] = make_client(spec)
        if spec["kind"] == "hf":  # a model in this process: dropped when a stage loads its own backbone

            def drop_in_process() -> int:
                local = [k for k, c in _CLIENTS.items() if getattr(c, "name", None) == "hf"]
                for k in local:
                    del _CLIENTS[k]
                return len(local)

            register_model_cache("tracekit.stages._CLIENTS", drop_in_process)
    return _CLIENTS[key]


def release_client(cfg: DictConfig, role: str) -> None:
    """Drop ``role``'s cached client and, for an in-process one, free its model: a stage done with a role (GEPA's
    reflection LM) leaves the memory to the next (the agent's evaluation)."""
    from tracekit.llm.backbones import release_memory

    client = _CLIENTS.pop(stable_hash(_client_spec(cfg, role, None, None)), None)
    if client is not None:
        client.close()
        del client
        release_memory()


# --------------------------------------------------------------------------------------------
# environments, agents, rollouts


def build_user(cfg: DictConfig) -> Any:
    """tau^2's simulated user (:func:`tracekit.targets.tau2.build_user`)."""
    from tracekit.targets.tau2 import build_user as tau2_user

    return tau2_user(cfg, client_for)


def build_suite(cfg: DictConfig, split: str | None = None) -> Any:
    """The target's suite (:mod:`tracekit.targets`, by ``benchmark.kind``)."""
    from tracekit.targets import target_of

    return target_of(cfg).build_suite(cfg, split, client_for)


def _user_kind(cfg: DictConfig) -> str | None:
    """``user.kind``, or None where the stage's read view masks the user group (the stage does not read it)."""
    user = cfg.get("user")
    return user.get("kind") if isinstance(user, DictConfig) else None


def suite_from_config(cfg: dict, split: str | None = None) -> Any:
    """An environment worker's suite (:mod:`tracekit.envs.pool`) from a plain config dict."""
    return build_suite(OmegaConf.create(cfg), split)


def suite_spec(cfg: DictConfig, split: str | None = None) -> Any:
    """The picklable spec env workers build ``cfg``'s suite from, or None when its steps call a model in the
    driver (an LLM user)."""
    from tracekit.envs.pool import SuiteSpec

    if cfg.user.kind == "llm":
        log.info("rollout.env_workers: in-process (the LLM user's replies are batched in the driver)")
        return None
    plain: dict[str, Any] = {}
    for k in cfg:  # each top-level group that resolves (a stage's read view masks the ones it does not read)
        try:
            node = cfg[k]
            plain[k] = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
        except Exception:  # noqa: BLE001
            continue
    return SuiteSpec("tracekit.stages:suite_from_config", (plain, split), preload=("tracekit.stages",))


def build_agent(cfg: DictConfig, adapter: str | None = None, moe: str | None = None,
                system_prompt_suffix: str | None = None) -> Any:
    if cfg.agent.kind == "gold":  # the target's own wiring check (tau^2: gold actions; ToolSandbox: its milestones)
        from tracekit.targets import target_of

        return target_of(cfg).gold_agent()
    return llm_agent(cfg, cfg.eval.temperature, adapter, moe, system_prompt_suffix)


def cached_rollout(ctx: StageContext, policy: Any = None, cfg: DictConfig | None = None) -> Artifact:
    """Roll the agent under ``policy`` (a :class:`tracekit.methods.Policy`; None: the base agent) out on the
    benchmark (``cfg``'s, by default the stage's), cached under ``episodes/<key>``: keyed on the policy's content, so
    methods that produce the same weights share one rollout."""
    from tracekit.methods import Policy

    policy = policy or Policy()
    from tracekit.rollout import TRAJECTORIES, run_rollouts

    cfg = ctx.cfg if cfg is None else cfg
    key = stable_hash({"reads": _select(cfg, rollout_reads(cfg)), "policy": policy.identity()}, length=20)

    def compute(work: Path) -> None:
        from tracekit.envs.pool import pooled

        suite = build_suite(cfg)
        try:
            weights = {} if policy.weights is None else {policy.kind: str(policy.weights.path / policy.subdir)}
            agent = build_agent(cfg, **weights, system_prompt_suffix=policy.system_prompt_suffix)
            greedy = cfg.eval.temperature == 0
            workers = OmegaConf.select(cfg, "rollout.env_workers", default="auto")  # execution only: in no key
            with pooled(suite, lambda: suite_spec(cfg), workers) as stepped:
                summary = run_rollouts(
                    stepped, agent, work, samples=1 if greedy else len(cfg.eval.seeds),
                    seed=cfg.eval.seeds[0] if greedy else cfg.seed, max_steps=cfg.eval.max_steps,
                    context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size)
            # the file by name: the work dir's path (a .partial) is not where the artifact will live; scenarios the
            # suite skipped (ToolSandbox's RapidAPI ones without a key) are counted beside the episodes
            atomic_write_json(work / "summary.json", {"policy": policy.identity(), **summary.to_dict(),
                                                      "path": TRAJECTORIES,
                                                      **({"skipped": suite.skipped} if getattr(suite, "skipped", None) else {})})
        finally:
            getattr(suite, "close", lambda: None)()  # an environment server (ToolSandbox) stops with its rollout

    t0 = time.time()
    art = ctx.cache.get_or_compute("episodes", key, compute, meta={"policy": policy.identity()})
    ctx.use(art, time.time() - t0)
    return art


def read_trajectories_dir(art: Artifact) -> list[Any]:
    from tracekit.rollout import read_trajectories

    return read_trajectories(art.path)


def trajectories_of(art: Artifact) -> list[Any]:
    """The base agent's trajectories behind a ``rollout`` stage artifact."""
    return read_trajectories_dir(art.resolve(read_json(art.path / "episodes.json")))


def rollout_stage(ctx: StageContext) -> None:
    atomic_write_json(ctx.work_dir / "episodes.json", cached_rollout(ctx).ref())


def rollout_report(art: Artifact, ctx: StageContext) -> None:
    from tracekit.targets import target_of

    trajs = trajectories_of(art)
    ok = sum(t.success for t in trajs)
    errors = sum(t.termination == "error" for t in trajs)
    target = target_of(ctx.cfg)
    rollout = read_json(art.path / "episodes.json")
    skipped = read_json(art.resolve(rollout).path / "summary.json").get("skipped", {})
    note = "".join(f" Skipped ({why}): {len(names)}." for why, names in skipped.items())
    ctx.record.section("Rollout (base agent)", f"{len(trajs)} episodes, {ok} successful, {errors} errors.{note}\n\n"
                       + target.markdown_table({"Base": target.summarize(trajs)}))


# --------------------------------------------------------------------------------------------
# contrastive capability analysis


def discover_stage(ctx: StageContext) -> None:
    from tracekit.analysis.compact import CompactConfig
    from tracekit.analysis.discovery import DiscoveryConfig, discover, write_dictionary
    from tracekit.targets import target_of_trajectories

    a = ctx.cfg.analysis
    if a.discovery == "reference":  # the fixed dictionary of the target the rollout ran on
        target = target_of_trajectories(trajectories_of(ctx.inputs["rollout"]))
        write_dictionary(target.reference_dictionary(), ctx.work_dir, source="reference")
        return
    pinned = str(Path(a.dictionary_path).expanduser().resolve()) if a.discovery == "pinned" else None
    client = None if pinned else client_for(ctx.cfg, a.endpoint)
    discover(trajectories_of(ctx.inputs["rollout"]), client, DiscoveryConfig(
        min_capabilities=a.min_capabilities, max_capabilities=a.max_capabilities, max_attempts=a.max_retries + 1,
        max_new_tokens=a.max_new_tokens, seed=ctx.seed, compact=CompactConfig(max_chars=a.compact_chars),
        use_response_format=a.use_response_format, pinned=pinned), ctx.work_dir)


def pinned_dictionary(cfg: DictConfig) -> list[dict[str, str]] | None:
    """The pinned dictionary's entries, read as discovery reads them (a malformed file: ConfigError naming it):
    editing them invalidates `discover` and what follows."""
    from tracekit.config import read_pinned_dictionary

    if cfg.analysis.discovery != "pinned":
        return None
    return [c.model_dump() for c in read_pinned_dictionary(cfg)]


def label_stage(ctx: StageContext) -> None:
    from tracekit.analysis.compact import CompactConfig
    from tracekit.analysis.discovery import read_dictionary
    from tracekit.analysis.labeling import LabelingConfig, LLMLabeler
    from tracekit.analysis.stages import label
    from tracekit.targets import target_of_trajectories

    a = ctx.cfg.analysis
    trajectories = trajectories_of(ctx.inputs["rollout"])
    if a.labeler == "reference":  # the heuristic labeler of the target the rollout ran on
        labeler: Any = target_of_trajectories(trajectories).reference_labeler(a.label_noise)
    else:
        labeler = LLMLabeler(client_for(ctx.cfg, a.endpoint), LabelingConfig(
            temperature=a.temperature, capabilities_per_call=a.capabilities_per_call,
            max_attempts=a.max_retries + 1, max_new_tokens=a.max_new_tokens, chunk_size=a.chunk_size,
            on_missing=a.on_missing, show_outcome=a.show_outcome, compact=CompactConfig(max_chars=a.compact_chars),
            use_response_format=a.use_response_format))
    label(trajectories, read_dictionary(ctx.inputs["discover"].path), labeler,
          runs=ctx.cfg.thresholds.n, seed=ctx.seed, out_dir=ctx.work_dir)


def label_report(art: Artifact, ctx: StageContext) -> None:
    rep = read_json(art.path / "labeling_report.json")
    ctx.record.section("Labeling", f"{rep.get('labels', '?')} labels, {rep.get('missing', '?')} missing "
                       f"(labeler: {ctx.cfg.analysis.labeler}, runs: {ctx.cfg.thresholds.n}).")


def select_stage(ctx: StageContext) -> None:
    from tracekit.analysis.discovery import read_dictionary
    from tracekit.analysis.select import Thresholds
    from tracekit.analysis.stages import read_labels, select_stage as run_select

    t = ctx.cfg.thresholds
    run_select(read_labels(ctx.inputs["label"].path), read_dictionary(ctx.inputs["discover"].path),
               Thresholds(delta=t.delta, rho=t.rho, k=t.k, n=t.n, undefined_er_pos=t.undefined_er_pos),
               ctx.work_dir, examples=ctx.cfg.analysis.examples_per_capability)


def select_report(art: Artifact, ctx: StageContext) -> None:
    sel = read_json(art.path / "selected.json")
    rows = ["| capability | selected in runs | mean Delta | mean Cov | kept |", "|---|---|---|---|---|"]
    kept = {c["name"] for c in sel["selected"]}
    for c in sel["candidates"]:
        fmt = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {c['name']} | {c['selection_count']}/{sel['thresholds']['n']} | {fmt(c.get('mean_delta'))} "
                    f"| {fmt(c.get('mean_cov'))} | {'yes' if c['name'] in kept else 'no'} |")
    ctx.record.section("Capability selection", "\n".join(rows))
    log_ = ctx.record.logger
    for png in ("selection_frequency.png", "failure_coverage.png"):
        if (art.path / png).exists():
            log_.image(f"analysis/{png[:-4]}", art.path / png)
    log_.table("analysis/capabilities", ["capability", "selection_count", "mean_delta", "mean_cov", "kept"],
               [[c["name"], c["selection_count"], c.get("mean_delta"), c.get("mean_cov"), c["name"] in kept]
                for c in sel["candidates"]])


# --------------------------------------------------------------------------------------------
# synthetic environments, GRPO adapters, MoE composition


def synthesis_target(cfg: DictConfig) -> str:
    """The environment family synthesized environments must keep the interface of (the target's)."""
    from tracekit.targets import target_of

    return target_of(cfg).synthesis_family(cfg)


# grpo.engine=agent: the HFChatClient options it takes from the agent config (client option: agent key)
_AGENT_ENGINE_KEYS = {"constrained_tool_calls": "constrained_tool_calls", "tool_choice": "tool_choice",
                      "copy_ids": "copy_ids", "max_batch_size": "batch_size", "prefix_cache_mib": "prefix_cache_mib"}
AGENT_ENGINE_READS = tuple(f"agent.{k}" for k in _AGENT_ENGINE_KEYS.values())


def _engine_spec(cfg: DictConfig) -> dict[str, Any]:
    """The GRPO rollout engine: ``agent`` samples with the evaluated agent's client settings."""
    g = cfg.grpo
    if g.engine == "vllm":
        return {"kind": "vllm", **_plain(g.vllm)}
    if g.engine == "agent":
        return {"kind": "agent", **{option: cfg.agent[key] for option, key in _AGENT_ENGINE_KEYS.items()}}
    return {"kind": g.engine}


def synthesize_stage(ctx: StageContext) -> None:
    from tracekit.synthesis.agent import GenerationAgentConfig
    from tracekit.synthesis.calibrate import CalibrationTargets, make_rollout_fn
    from tracekit.synthesis.sandbox import SandboxLimits
    from tracekit.synthesis.stage import SynthesisSettings, synthesize
    from tracekit.synthesis.validate import ValidationConfig

    cfg, sy = ctx.cfg, ctx.cfg.synthesis
    selected = read_json(ctx.inputs["select"].path / "selected.json")["selected"]
    validation = ValidationConfig(n_seeds=sy.validation_seeds)
    limits = SandboxLimits(cpu_seconds=sy.cpu_seconds, wall_seconds=sy.wall_seconds,
                           memory_bytes=sy.memory_mb << 20)
    targets = CalibrationTargets(mean_reward=(sy.target_low, sy.target_high),
                                 success_rate=(sy.target_low, sy.target_high), min_informative=sy.min_informative)
    settings = SynthesisSettings(
        source=sy.source, difficulty=sy.difficulty, validation=validation, limits=limits, targets=targets,
        calibration_seeds=sy.calibration_seeds, calibration_k=sy.calibration_k,
        agent=GenerationAgentConfig(max_repair_rounds=sy.repair_rounds, max_mutation_rounds=sy.mutation_rounds,
                          seed=ctx.seed if sy.source == "generate" else 0,  # the library source draws nothing
                          validation=validation, limits=limits, targets=targets,
                          calibration_seeds=sy.calibration_seeds, calibration_k=sy.calibration_k))
    rollout_fn = None
    if sy.calibrate:  # calibrate against the current (base) policy, sampled as GRPO samples
        agent = llm_agent(cfg, temperature=cfg.grpo.temperature)
        rollout_fn = make_rollout_fn(agent, ctx.work_dir / "calibration_rollouts", max_steps=cfg.grpo.max_steps,
                                     batch_size=cfg.agent.batch_size, progress=False)
    trajectories = {t.uid: t for t in trajectories_of(ctx.inputs["rollout"])} if sy.source == "generate" else None
    client = client_for(cfg, sy.endpoint) if sy.source == "generate" else None
    synthesize(selected, synthesis_target(cfg), ctx.work_dir, settings, trajectories, client, rollout_fn)


def llm_agent(cfg: DictConfig, temperature: float, adapter: str | None = None,
                moe: str | None = None, system_prompt_suffix: str | None = None) -> Any:
    from tracekit.agents import LLMAgent

    return LLMAgent(client_for(cfg, "agent", adapter, moe), temperature=temperature, top_p=cfg.agent.top_p,
                    max_new_tokens=cfg.agent.max_new_tokens, system_prompt_suffix=system_prompt_suffix)


def synthesize_report(art: Artifact, ctx: StageContext) -> None:
    man = read_json(art.path / "environments.json")
    rows = ["| capability | status | environment | difficulty / reason |", "|---|---|---|---|"]
    for e in man["environments"]:
        rows.append(f"| {e['capability']} | {e['status']} | {e.get('env', e.get('kind', ''))} | "
                    f"{e.get('difficulty') if e['status'] == 'ready' else e.get('reason', '')} |")
    ctx.record.section("Synthetic environments", f"{man['ready']} ready, {man['skipped']} skipped "
                       f"(source: {man['source']}, target: {man['target']}).\n\n" + "\n".join(rows))


TRAIN_SEED_OFFSET = 100_000  # training instances never reuse the validation seeds 0..n


def train_stage(ctx: StageContext) -> None:
    """One GRPO adapter per ready environment, each its own cache entry (keyed on the env's content)."""
    from tracekit.synthesis.stage import MANIFEST

    cfg = ctx.cfg
    syn = ctx.inputs["synthesize"]
    man = read_json(syn.path / MANIFEST)
    ready = [env["capability"] for env in man["environments"] if env["status"] == "ready"]
    runs = cfg.launcher.concurrent_runs
    if runs > 1 and len(ready) > 1:  # each capability's run in its own process, `runs` at a time
        from concurrent.futures import ThreadPoolExecutor

        log.info("train: %d capability GRPO runs, %d at a time", len(ready), runs)
        with ThreadPoolExecutor(max_workers=runs) as pool:
            arts = list(pool.map(lambda cap: train_adapter(ctx, cap, syn.path / cap, isolate=True), ready))
    else:
        arts = [train_adapter(ctx, cap, syn.path / cap) for cap in ready]
    adapters = {cap: {**art.ref(), "content_key": art.content_key} for cap, art in zip(ready, arts)}
    if not adapters:
        raise RuntimeError(f"train: no ready synthetic environment in {syn.path / MANIFEST} (every capability skipped)")
    atomic_write_json(ctx.work_dir / "adapters.json", adapters)


def adapters_of(train: Artifact) -> dict[str, Artifact]:
    """The per-capability adapter artifacts behind a ``train`` artifact (verified)."""
    return {cap: train.resolve(ref) for cap, ref in read_json(train.path / "adapters.json").items()}


def package_identity(pkg: Path) -> dict[str, str]:
    """What an environment package runs (env.json + generated source), not the reports beside it (timings)."""
    return {f.name: f.read_text() for f in sorted(pkg.iterdir()) if f.name == "env.json" or f.suffix == ".py"}


def train_seeds(cfg: DictConfig, iterations: int | None = None) -> list[int]:
    """Environment seeds GRPO draws its groups from (never the validation seeds)."""
    n = cfg.grpo.groups * (iterations or cfg.grpo.iterations)
    return list(range(TRAIN_SEED_OFFSET, TRAIN_SEED_OFFSET + n))


def train_adapter(ctx: StageContext, capability: str, pkg: Path, isolate: bool = False) -> Artifact:
    from tracekit.rl.launch import Factory

    env = Factory("tracekit.synthesis.stage:open_package", {"pkg_dir": str(pkg), "seeds": train_seeds(ctx.cfg)})
    return grpo_run(ctx, capability, env, {"env": package_identity(pkg)}, isolate=isolate)


_LOG_LOCK = threading.Lock()  # concurrent runs replay their metrics to the one run logger


def grpo_run(ctx: StageContext, label: str, env: Any, identity: dict[str, Any], iterations: int | None = None,
             isolate: bool = False) -> Artifact:
    """One GRPO adapter (the ``grpo`` settings; ``iterations`` overrides theirs) on the environment ``env``
    (a :class:`tracekit.rl.launch.Factory` of an EnvSuite) whose content is ``identity``: a cache entry
    ``adapters/<key>`` keyed on the settings, engine, backbone and that content. ``isolate`` trains in a
    subprocess (concurrent runs); the key does not depend on it: the adapter is the same."""
    from tracekit.rl.launch import Factory, TrainSpec, train
    from tracekit.rl.settings import LauncherSettings

    cfg = ctx.cfg
    grpo = {**_plain(cfg.grpo), **({"iterations": iterations} if iterations else {})}
    key = stable_hash({"grpo": grpo, "engine": _engine_spec(cfg), "backbone": backbone_dict(cfg), **identity},
                      length=20)

    def compute(work: Path) -> None:
        settings = OmegaConf.to_object(cfg.grpo).settings()
        settings.iterations = grpo["iterations"]
        settings.save_rollouts = "full"  # successful rollouts (with tokens) are the MoE gate's and SFT's data
        spec = TrainSpec(
            model=Factory("tracekit.llm.backbones:load_backbone",
                          {"spec": backbone_dict(cfg), "device": device(cfg), "dtype": dtype(cfg)}),
            env=env, out_dir=str(work), grpo=settings, chat_format=cfg.backbone.chat_format, engine=_engine_spec(cfg),
            # execution only (in no key); an LLM user's replies are batched in the trainer's process
            env_workers=0 if _user_kind(cfg) == "llm" else OmegaConf.select(cfg, "rollout.env_workers", default="auto"))
        launcher = LauncherSettings(**_plain(cfg.launcher))
        logger = ctx.record.logger

        def log_row(row: dict[str, Any]) -> None:
            with _LOG_LOCK:
                logger.scalars({f"train/{label}/{k}": v for k, v in row.items()})

        train(spec, launcher, callbacks=[log_row], isolate=isolate)

    t0 = time.time()
    art = ctx.cache.get_or_compute("adapters", key, compute, meta={"capability": label})
    ctx.use(art, time.time() - t0)
    return art


def train_report(art: Artifact, ctx: StageContext) -> None:
    import csv

    rows = ["| capability | iterations | first reward | last reward | discarded groups (last) |", "|---|---|---|---|---|"]
    for cap, a in adapters_of(art).items():
        metrics = list(csv.DictReader(open(a.path / "metrics.csv")))
        first, last = metrics[0], metrics[-1]
        rows.append(f"| {cap} | {len(metrics)} | {float(first['reward_mean']):.3f} | {float(last['reward_mean']):.3f} "
                    f"| {float(last['frac_groups_dropped']):.2f} |")
    ctx.record.section("GRPO adapters", "\n".join(rows))


def compose_stage(ctx: StageContext) -> None:
    """The configured consolidation strategy over the capability adapters (paper Table 4)."""
    from tracekit.methods.consolidate import STRATEGIES, write_consolidated

    strategy = STRATEGIES[ctx.cfg.consolidation.method]
    write_consolidated(ctx.work_dir, strategy, strategy.consolidate(ctx, adapters_of(ctx.inputs["train"])))


def compose_report(art: Artifact, ctx: StageContext) -> None:
    from tracekit.methods.consolidate import CONSOLIDATED, STRATEGIES

    STRATEGIES[read_json(art.path / CONSOLIDATED)["strategy"]].report(art, ctx)


# --------------------------------------------------------------------------------------------
# evaluation


def is_zero_update(adapter_dir: Path) -> bool:
    """Whether a saved LoRA adapter adds nothing: every ``lora_B`` is zero (its initialization, kept when every
    GRPO group of the run had zero reward variance), so W + s B A = W exactly."""
    from safetensors import safe_open

    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if "lora_B" in n]
        return bool(names) and all(not f.get_tensor(n).any() for n in names)


def policy_trajectories(ctx: StageContext, policy: Any) -> list[Any]:
    """The policy's trajectories on the target's test tasks: one cached rollout per distinct policy. The
    base policy, and an adapter that is the zero update (B = 0: the base model's outputs bit for bit), read
    the base rollout. With ``eval.benchmark`` (another target, Table 8) every policy, the base included, is rolled
    out there."""
    from tracekit.config import eval_benchmark, evaluation_config
    from tracekit.methods import Policy

    base = policy.kind == "base" or (policy.kind == "adapter" and is_zero_update(policy.weights.path / policy.subdir))
    if eval_benchmark(ctx.cfg) is not None:
        return read_trajectories_dir(cached_rollout(ctx, Policy() if base else policy, evaluation_config(ctx.cfg)))
    if base:
        return trajectories_of(ctx.inputs["rollout"])
    return read_trajectories_dir(cached_rollout(ctx, policy))


def evaluate_stage(ctx: StageContext) -> None:
    """One loop over every method's policy rows; each method keeps the rows its table shows."""
    from tracekit.config import evaluation_config
    from tracekit.evaluate import write_results
    from tracekit.methods import METHODS
    from tracekit.targets import target_of

    target = target_of(evaluation_config(ctx.cfg))  # the evaluation target's metric (pass rate; similarity)
    summarize = target.summarize
    results: dict[str, Any] = {}
    for name in ctx.cfg.eval.methods:
        method = METHODS[name]
        rows = method.rows(ctx)
        scored = {row.label: summarize(policy_trajectories(ctx, row.policy)) for row in rows}
        for row in rows:
            if row.label in method.keep(scored):
                results[row.label] = {**scored[row.label], "method": name, "budget": row.budget.to_dict(),
                                      "notes": list(row.notes)}
    write_results(ctx.work_dir, results, table=target.markdown_table(results))


def evaluate_report(art: Artifact, ctx: StageContext) -> None:
    from tracekit.config import evaluation_config
    from tracekit.evaluate import RESULTS, wandb_rows
    from tracekit.targets import target_of

    results = read_json(art.path / RESULTS)
    notes = [f"- {label}: {n}" for label, r in results.items() for n in r.get("notes", ())]
    on = evaluation_config(ctx.cfg)
    from tracekit.evaluate import paired_table

    paired = paired_table({label: r["paired_vs_base"] for label, r in results.items() if "paired_vs_base" in r})
    table = target_of(on).markdown_table(results) + paired + ("\n" + "\n".join(notes) + "\n" if notes else "")
    trained = f" (trained on {ctx.cfg.benchmark.name})" if on is not ctx.cfg else ""
    print(f"\n{on.benchmark.name}{trained} ({ctx.cfg.backbone.name}, eval={ctx.cfg.eval.mode}):\n{table}\n", flush=True)
    ctx.record.section("Evaluation", table)
    atomic_write_json(ctx.record.run_dir / RESULTS, results, sort_keys=False)  # the run's own copy (a multirun's table reads it)
    cols, rows = wandb_rows(results)
    ctx.record.logger.table("eval/results", cols, rows)


def evaluate_inputs(cfg: DictConfig) -> tuple[str, ...]:
    from tracekit.methods import METHODS

    # rollout always: the base and zero-update policies read its episodes
    return tuple(dict.fromkeys(["rollout", *(s for m in cfg.eval.methods for s in METHODS[m].inputs(cfg))]))


_ANALYSIS_CLIENT = ("analysis.max_retries", "analysis.max_new_tokens", "analysis.compact_chars",
                    "analysis.use_response_format")


def discover_reads(cfg: DictConfig) -> tuple[str, ...]:
    a = cfg.analysis
    if a.discovery == "reference":  # a fixed dictionary: nothing else matters
        return ("analysis.discovery",)
    reads = ("analysis.discovery", "analysis.min_capabilities", "analysis.max_capabilities", *_ANALYSIS_CLIENT, "seed")
    if a.discovery == "pinned":
        return (*reads, "analysis.dictionary_path")
    return (*reads, "analysis.endpoint", f"llm.endpoints.{a.endpoint}", "backbone", "agent")


def label_reads(cfg: DictConfig) -> tuple[str, ...]:
    a = cfg.analysis
    if a.labeler == "reference":
        return ("analysis.labeler", "analysis.label_noise", "thresholds.n", "seed")
    return ("analysis.labeler", "analysis.temperature", "analysis.capabilities_per_call", "analysis.on_missing",
            "analysis.chunk_size", "analysis.show_outcome", *_ANALYSIS_CLIENT, "analysis.endpoint",
            f"llm.endpoints.{a.endpoint}", "backbone", "agent", "thresholds.n", "seed")


def synthesize_reads(cfg: DictConfig) -> tuple[str, ...]:
    sy = cfg.synthesis
    reads = ["synthesis", "benchmark.kind", "benchmark.domains", "benchmark.name", "benchmark.envs"]
    if sy.calibrate:  # calibration samples the base agent as GRPO does
        reads += ["backbone", "agent", "grpo.temperature", "grpo.max_steps"]
    if sy.source == "generate":
        reads += [f"llm.endpoints.{sy.endpoint}", "backbone", "agent", "seed"]
    return tuple(dict.fromkeys(reads))


def compose_reads(cfg: DictConfig) -> tuple[str, ...]:
    from tracekit.methods.consolidate import STRATEGIES

    return ("consolidation.method", "backbone", "seed", *STRATEGIES[cfg.consolidation.method].reads(cfg))


def compose_inputs(cfg: DictConfig) -> tuple[str, ...]:
    from tracekit.methods.consolidate import STRATEGIES

    return ("train", *STRATEGIES[cfg.consolidation.method].inputs)


def evaluate_reads(cfg: DictConfig) -> tuple[str, ...]:
    from tracekit.methods import METHODS

    # each policy's rollout reads what the base rollout reads (and, evaluated on another target, its name)
    other = ["eval.benchmark"] if cfg.eval.benchmark is not None else []  # unset: not read (keys as before)
    return tuple(dict.fromkeys(["eval.methods", *other, *rollout_reads(cfg), *(r for m in cfg.eval.methods
                                                                                for r in METHODS[m].reads(cfg))]))


def evaluation_benchmark(cfg: DictConfig) -> Any:
    """The evaluate key's extra: the contents of the benchmark ``eval.benchmark`` names (None when unset)."""
    from tracekit.config import evaluation_config

    return None if cfg.eval.benchmark is None else _plain(evaluation_config(cfg).benchmark)


def build_pipeline() -> Pipeline:
    from tracekit.methods import METHODS

    return Pipeline([
        Stage("rollout", reads=rollout_reads, inputs=(), compute=rollout_stage, report=rollout_report),
        Stage("discover", reads=discover_reads, inputs=("rollout",), compute=discover_stage,
              key_extra=pinned_dictionary),
        Stage("label", reads=label_reads, inputs=("rollout", "discover"), compute=label_stage, report=label_report),
        Stage("select", reads=("thresholds", "analysis.examples_per_capability"), inputs=("label", "discover"),
              compute=select_stage, report=select_report, identity_files=("selected_names.json",)),
        Stage("synthesize", reads=synthesize_reads, inputs=("select", "rollout"), compute=synthesize_stage,
              report=synthesize_report),
        Stage("train", reads=("grpo", "backbone", "launcher.kind", *AGENT_ENGINE_READS), inputs=("synthesize",),
              compute=train_stage, report=train_report),
        Stage("compose", reads=compose_reads, inputs=compose_inputs, compute=compose_stage, report=compose_report,
              version="2"),  # 2: the moe gate holds out a fixed share of its examples (CE before/after on them)
        Stage("evaluate", reads=evaluate_reads, inputs=evaluate_inputs, compute=evaluate_stage,
              report=evaluate_report, key_extra=evaluation_benchmark,
              version="2"),  # 2: each row keeps its per-episode outcomes and its paired comparison with Base
        *(stage for method in METHODS.values() for stage in method.stages),
    ])
