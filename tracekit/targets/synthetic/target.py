"""Library-instance targets (``benchmark.kind=synthetic``, e.g. ``conf/benchmark/tau2_mini.yaml``, the embedded
default): held-out instances of built-in library environments (:mod:`tracekit.targets.synthetic.suite`),
their own reward; pass rate per environment. Reference analysis: the environments' family's (its analysis kind in
:data:`tracekit.target_index.FAMILIES`: tau^2's labels them from each instance's ground-truth calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import DictConfig

from tracekit.config import _check
from tracekit.ranges import Choice
from tracekit.synthesis.library import library_env
from tracekit.targets.synthetic.suite import LibraryTargetSuite
from tracekit.target_index import KINDS, kind_of_env, resolve
from tracekit.targets.base import ClientFor, Target
from tracekit.targets.registry import env_names
from tracekit.targets.tau2.target import Tau2Target


@dataclass
class LibrarySettings:
    """``benchmark.<kind>`` of a library target (synthetic, micro): which environments, at which level."""

    envs: list[str] = field(default_factory=list)  # library environments (benchmark.limit: instances per env)
    difficulty: int = 0  # the environments' difficulty level

    RANGES: ClassVar[dict[str, str]] = {"difficulty": ">= 0"}
    CHOICES: ClassVar[dict[str, Choice]] = {"envs": env_names}


class LibraryTarget(Target):
    kind = "synthetic"
    settings = LibrarySettings
    summary = "held-out instances of library environments (their own reward)"
    metric = "pass_rate"
    columns = ("overall",)
    extra_envs: dict[str, Any] = {}  # environments beyond the library this target evaluates on, by name

    def env_class(self, name: str) -> Any:
        return self.extra_envs[name] if name in self.extra_envs else library_env(name)

    def validate(self, cfg: DictConfig) -> None:
        b, own, at = cfg.benchmark, self.own(cfg.benchmark), f"benchmark.{self.mount_name()}"
        _check(len(own.envs) > 0, f"{at}.envs", list(own.envs), f"a non-empty list with benchmark.kind={self.kind}")
        _check(b.limit is not None, "benchmark.limit", b.limit, ">= 1 (instances per environment)")
        for env in own.envs:
            levels = list(self.env_class(env).difficulty_levels)
            _check(own.difficulty in levels, f"{at}.difficulty", own.difficulty, f"a difficulty level of {env} ({levels})")

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        b, own = cfg.benchmark, self.own(cfg.benchmark)
        llm_user = ({"user_client": client_for(cfg, cfg.user.endpoint), "user_temperature": cfg.user.temperature}
                    if cfg.user.kind == "llm" else {})
        # split "validation": the instances synthesis validates on (seeds 0..n, the planted bands'), not the held-out
        validation = {"seed_offset": 0} if split == "validation" else {}
        return LibraryTargetSuite(b.name, list(own.envs), difficulty=own.difficulty, n_per_env=b.limit,
                                  user=cfg.user.kind, extra_envs=self.extra_envs, **validation, **llm_user)

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        return None  # instances from the training seeds, disjoint from the held-out ones and from validation's

    def train_spec(self, cfg: DictConfig, spec: dict[str, Any], n_per_env: int | None, limit: int | None) -> dict[str, Any]:
        return {**spec, "n_per_env": int(n_per_env or 1)}

    def train_split_label(self, spec: dict[str, Any]) -> str:
        return "library environments' training seeds"

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        """Instances of the same library environments at the target's difficulty from the training seeds
        (``seed_offset`` on)."""
        b, own = cfg.benchmark, self.own(cfg.benchmark)
        llm_user = ({"user_client": client_for(cfg, cfg.user.endpoint), "user_temperature": cfg.user.temperature}
                    if cfg.user.kind == "llm" else {})
        return LibraryTargetSuite(f"{b.name}-train", list(own.envs), difficulty=own.difficulty,
                                  n_per_env=int(spec["n_per_env"]), seed_offset=seed_offset,
                                  user=cfg.user.kind, extra_envs=self.extra_envs, **llm_user)

    def train_envs(self, cfg: DictConfig) -> int:
        return max(1, len(self.own(cfg.benchmark).envs))

    def _tau2_family(self, b: DictConfig) -> bool:
        envs = self.own(b).envs
        return bool(envs) and kind_of_env(envs[0]) == Tau2Target.kind  # the family tau^2's analysis reads

    def paper_tasks_of(self, b: DictConfig) -> str | None:
        """A stand-in for tau^2-Bench (``tau2_mini``): compared with (a cut of) tau^2's task set."""
        return Tau2Target.paper_tasks if self._tau2_family(b) else None

    def describe_tasks(self, b: DictConfig) -> str:
        return f"{b.name} (synthetic: {len(self.own(b).envs)} library environments x {b.limit} held-out instances)"

    def paper_user_applies(self, cfg: DictConfig) -> bool:
        return self._tau2_family(cfg.benchmark)  # tau^2's environments: tau^2's LLM user is the paper's

    def family_reads(self) -> tuple[str, ...]:
        return (f"benchmark.{self.mount_name()}.envs",)

    def synthesis_family(self, cfg: DictConfig) -> str:
        return library_env(self.own(cfg.benchmark).envs[0]).target  # the family of the library environments it is made of

    def analysis_target(self, cfg: DictConfig) -> Target:
        """The target whose reference analysis reads these episodes: the one the environments' family names
        (:data:`tracekit.target_index.FAMILIES`)."""
        return resolve(KINDS[kind_of_env(self.own(cfg.benchmark).envs[0])].target)()

    def gold_agent(self) -> Any:
        return Tau2Target().gold_agent()
