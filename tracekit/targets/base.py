"""What tracekit knows about one target, in one place: :class:`Target`.

A target is what ``benchmark.kind`` names (``conf/benchmark/<name>.yaml`` sets it). Its module gives:

- ``validate(cfg)``: the target's own config checks, run by :func:`tracekit.validate.validate` before any work
  (one-line :class:`~tracekit.config.ConfigError`; e.g. ToolSandbox's environment not built);
- ``build_suite(cfg, split, client_for)``: its :class:`~tracekit.envs.base.EnvSuite` (tasks, episodes, reward);
- ``synthesis_family(cfg)``: the interface synthesized environments keep (a name of
  :mod:`tracekit.synthesis.targets`: tool schemas and policy text) and so the capability library family;
- ``reference_dictionary()`` / ``reference_labeler(noise)``: the fixed dictionary and heuristic labeler of
  ``analysis=reference`` (``analysis_target(cfg)``: the target whose analysis reads this one's episodes);
- ``gold_agent()``: the agent of ``agent=gold`` (the wiring check: replays what the target defines as right);
- ``training_split_problem(cfg)`` / ``train_spec(...)`` / ``train_suite(...)``: the tasks the baselines that learn
  from the target train on (never the evaluated ones), through :mod:`tracekit.methods.target_train`;
- ``metric`` and ``columns`` (the :data:`tracekit.reproduce.spec.COLUMNS` its tables use) and
  ``summarize(trajectories)`` / ``markdown_table(results)``: its results and their table, ``protocol(cfg)``: the
  protocol line above it (tau^2: the installed version's task set and the user simulator);
- ``paper_tasks_of(b)`` / ``is_paper_tasks(b)`` / ``describe_tasks(b)`` / ``paper_user_applies(cfg)``: the
  paper's task set of the target and what a benchmark config runs against it (:mod:`tracekit.report.paper`);
- ``patch_reward`` (its training tasks carry gold patches: ``swe_rl``) and ``train_envs(cfg)`` (how many
  environments its training instances are spread over: GEPA's official training seeds are split over them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING, DictConfig

from tracekit.evaluate import markdown_table, summarize
from tracekit.ranges import Choice

ClientFor = Callable[[DictConfig, str], Any]  # tracekit.wiring.client_for(cfg, role)


@dataclass
class BenchmarkSettings:
    """The ``benchmark`` fields every target reads. A target's own settings are its :attr:`Target.settings` class,
    mounted at ``benchmark.<Target.mount>`` (:func:`tracekit.targets.registry.benchmark_schema` assembles the group)."""

    name: str = MISSING  # the conf/benchmark file's name (tau2_airline, micro, ...)
    kind: str = "tau2"  # the target (tracekit.targets registry)
    domains: list[str] = field(default_factory=list)  # the target's domains evaluated (Target.domains)
    split: str = "test"  # train | test | base
    task_ids: list[str] | None = None  # explicit subset (ids as the benchmark names them)
    limit: int | None = None  # first n tasks per domain (library targets: instances per environment)

    RANGES: ClassVar[dict[str, str]] = {"limit": ">= 1"}
    CHOICES: ClassVar[dict[str, Choice]] = {"split": ("train", "test", "base")}


class Target:
    kind: str = ""  # the benchmark.kind value this target answers to
    settings: type | None = None  # its own settings class (None: none), mounted at benchmark.<mount>
    mount: str = ""  # where: "" is its kind (targets sharing settings share a mount: coding and swebench)
    domains: tuple[str, ...] = ()  # the values benchmark.domains may hold with this kind
    summary: str = ""
    metric: str = "pass_rate"
    columns: tuple[str, ...] = ("overall",)
    paper_tasks: str | None = None  # the paper's full task set of this target (None: the paper does not use it)
    patch_reward: bool = False  # training tasks with gold patches (SWE-RL's patch-similarity reward)

    @classmethod
    def mount_name(cls) -> str:
        return cls.mount or cls.kind

    def own(self, b: DictConfig) -> Any:
        """This target's own settings node of a ``benchmark`` config ``b`` (``b.<mount>``)."""
        return b[self.mount_name()]

    def validate(self, cfg: DictConfig) -> None:
        """Raise ConfigError (one line) for a config this target cannot run."""

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        raise NotImplementedError(f"target {self.kind}: no suite is built")

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        """Why the target has no training split to learn from (GRPO on target, GEPA, ...), or None when it has one."""
        return f"benchmark.kind={self.kind}: no training split is known for this target"

    def train_spec(self, cfg: DictConfig, spec: dict[str, Any], n_per_env: int | None, limit: int | None) -> dict[str, Any]:
        """The JSON-able training suite description (``spec``: the benchmark without its evaluation subset, the user)
        with this target's own size knob: ``limit`` (first n training tasks per domain) by default."""
        return {**spec, "limit": limit}

    def train_split_label(self, spec: dict[str, Any]) -> str:
        """What the training tasks of ``spec`` (a :meth:`train_spec`) are, for a row's note."""
        return f"{self.kind} training tasks"

    def train_split_notes(self, spec: dict[str, Any]) -> tuple[str, ...]:
        """Notes a row trained on ``spec`` carries in the table (e.g. ToolSandbox's "trained on the evaluated
        scenarios"); none by default."""
        return ()

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        """The training tasks as an EnvSuite, from ``cfg`` (``spec`` as a config) in a fresh process; ``seed_offset``:
        where generated training instances start (``tracekit.runs.TRAIN_SEED_OFFSET``)."""
        raise NotImplementedError(f"target {self.kind}: {self.training_split_problem(cfg)}")

    def train_envs(self, cfg: DictConfig) -> int:
        """How many environments the training instances are spread over (GEPA splits its training seeds over them)."""
        return 1

    def paper_tasks_of(self, b: DictConfig) -> str | None:
        """The paper's task set a run of benchmark config ``b`` is compared with (None: nothing to compare with)."""
        return self.paper_tasks

    def is_paper_tasks(self, b: DictConfig) -> bool:
        """Whether ``b`` selects exactly :meth:`paper_tasks_of` (before ``limit`` and ``task_ids``)."""
        return False

    def describe_tasks(self, b: DictConfig) -> str:
        """What the benchmark config runs: its name, and how many tasks of what."""
        sel = "+".join(b.domains) + f", {b.split} split"
        if b.task_ids:
            sel += f", {len(b.task_ids)} chosen tasks"
        if b.limit is not None:
            sel += f", first {b.limit} per domain"
        return f"{b.name} ({sel})"

    def paper_user_applies(self, cfg: DictConfig) -> bool:
        """Whether the paper's user simulator (tau^2's LLM user) is a reference value for this run."""
        return False

    def family_reads(self) -> tuple[str, ...]:
        """The benchmark keys :meth:`synthesis_family` reads beyond the common ones (kind, domains, name)."""
        return ()

    def synthesis_family(self, cfg: DictConfig) -> str:
        raise NotImplementedError(f"target {self.kind}: no synthesis interface is known")

    def analysis_target(self, cfg: DictConfig) -> Target:
        """The target whose reference dictionary and labeler read this one's episodes (a library target: its
        environments' family's)."""
        return self

    def reference_dictionary(self) -> list[Any]:
        raise NotImplementedError(f"target {self.kind}: no reference dictionary (use analysis.discovery=llm or pinned)")

    def reference_labeler(self, noise: float) -> Any:
        raise NotImplementedError(f"target {self.kind}: no reference labeler (use analysis.labeler=llm)")

    def gold_agent(self) -> Any:
        raise NotImplementedError(f"target {self.kind}: no gold agent")

    def summarize(self, trajectories: list[Any]) -> dict[str, Any]:
        return summarize(trajectories)

    def markdown_table(self, results: dict[str, Any]) -> str:
        return markdown_table(results)

    def protocol(self, cfg: DictConfig) -> str | None:
        """The benchmark protocol a results table was produced under (task set, user simulator), written above the
        table; None where the target has no versioned protocol to name (issue 50)."""
        return None
