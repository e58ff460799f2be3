"""The coding target (issue 20; paper Table 2): ``benchmark.kind=coding`` (local SWE-smith-style tasks injected into
an installed package, this folder), the base of ``benchmark.kind=swebench`` (:mod:`tracekit.targets.swebench.target`). Metric: Pass@1 (a task counts as solved when its FAIL_TO_PASS and PASS_TO_PASS
tests pass on the submitted tree). Reference analysis: :mod:`tracekit.targets.coding.reference` (fault localization,
minimal edit, test before submit); the capability library family ``coding`` (``tracekit/targets/coding/library/*.py``)."""

from __future__ import annotations

import os
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError

from tracekit.agents import GoldAgent
from tracekit.targets.coding.config import CodingSettings, build_suite, check
from tracekit.targets.coding.config import build_suite as coding_suite
from tracekit.targets.coding.reference import CodingReferenceLabeler, reference_dictionary
from tracekit.coding.sandbox import CacheExposed, register_cache
from tracekit.config import ConfigError, _check
from tracekit.targets.base import ClientFor, Target


class CodingTarget(Target):
    kind = "coding"
    settings = CodingSettings
    mount = "coding"  # swebench shares it
    summary = "bugs injected by swesmith's procedural modifiers into an installed package, checked by its own tests"
    metric = "pass_at_1"
    columns = ("pass_at_1",)
    patch_reward = True  # the tasks carry their gold patches (SWE-RL's reward)

    def validate(self, cfg: DictConfig) -> None:
        # a cache or root the jail would show every command (gold patches, hidden tests) is refused before any stage
        # writes there (the task generator registers the cache again when it runs). Paths resolve only in Hydra's
        # app (a sweep's jobs are validated before: their paths are checked when each job starts)
        for key, under in (("paths.cache_dir", ""), ("paths.root_dir", "outputs")):  # a root: where runs write
            try:
                path = OmegaConf.select(cfg, key)
            except InterpolationResolutionError:
                continue
            try:
                register_cache(os.path.join(path, under), key)
            except CacheExposed as e:
                raise ConfigError(str(e)) from None
        for key, value, valid in check(cfg.benchmark):
            _check(False, key, value, valid)

    def build_suite(self, cfg: DictConfig, split: str | None, client_for: ClientFor) -> Any:
        return build_suite(cfg.benchmark, cfg.paths.cache_dir, split)

    def training_split_problem(self, cfg: DictConfig) -> str | None:
        """The local SWE-smith-style train split (for SWE-bench Verified: the disjoint one)."""
        return "benchmark.split=train: the evaluated tasks are the training tasks" if cfg.benchmark.split == "train" else None

    def train_spec(self, cfg: DictConfig, spec: dict[str, Any], n_per_env: int | None, limit: int | None) -> dict[str, Any]:
        return {**spec, "benchmark": {**spec["benchmark"], "kind": "coding"}, "limit": limit}  # swebench trains locally

    def train_split_label(self, spec: dict[str, Any]) -> str:
        return f"local coding train split ({spec['benchmark'].get('coding', {}).get('package', 'the package')})"

    def train_suite(self, cfg: DictConfig, spec: dict[str, Any], cache_dir: str | None, client_for: ClientFor,
                    seed_offset: int) -> Any:
        """``cache_dir``: where the generated tasks are cached (default ``$TRACEKIT_CACHE`` or ``outputs/cache`` under
        ``$TRACEKIT_ROOT`` / the working directory, as ``paths.cache_dir``)."""
        root = cache_dir or os.environ.get("TRACEKIT_CACHE") or os.path.join(
            os.environ.get("TRACEKIT_ROOT", os.getcwd()), "outputs", "cache")
        return coding_suite(cfg.benchmark, root, split="train", reward=spec.get("reward", "tests"),
                            limit=spec.get("limit"))

    def synthesis_family(self, cfg: DictConfig) -> str:
        return "coding"

    def reference_dictionary(self) -> list[Any]:
        return reference_dictionary()

    def reference_labeler(self, noise: float) -> Any:
        return CodingReferenceLabeler(noise=noise)

    def gold_agent(self) -> Any:
        return GoldAgent()  # replays task.data["actions"]: apply the gold patch with bash, run the tests, submit
