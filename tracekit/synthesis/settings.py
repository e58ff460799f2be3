"""The ``synthesis`` config group's owner: :class:`SynthesisConfig` is its schema, the one place each knob has its
default and its rule. What :func:`tracekit.synthesis.stage.synthesize` runs with is built from it in one call
(:meth:`tracekit.synthesis.stage.SynthesisSettings.of`: the generation agent's knobs and the checks every
environment is held to, nested)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from tracekit.ranges import Choice, check_declared
from tracekit.synthesis.chain import merged_tools, parse_chain
from tracekit.synthesis import library  # the module, so a test's stand-in library reaches check_chains

SOURCES = ("library", "generate")  # the built-in capability library | an LLM writes each environment
ACCEPTANCE = ("none", "official")  # no gate | the official TRACE calibration gate on every ready environment


@dataclass
class SynthesisConfig:
    """One training environment per selected capability (paper section 3.4)."""

    source: str = "library"  # library: built-in hand-written reference environments | generate: an LLM writes each
    endpoint: str = "generation"  # source=generate: a key of llm.endpoints
    repair_rounds: int = 3
    mutation_rounds: int = 5
    validation_seeds: int = 50
    calibrate: bool = False
    calibration_seeds: int = 4
    calibration_k: int = 16
    target_low: float = 0.2  # the band of mean reward and success rate (calibration's target, acceptance's gate)
    target_high: float = 0.6
    min_informative: float = 0.5
    # official: the official TRACE calibration gate (pipeline/calibrate_environment.py) on every ready environment:
    # the base policy samples acceptance_group_size (G=16) rollouts per validation seed; kept only if mean reward and
    # success rate lie in [target_low, target_high], reward std >= min_reward_std, all-success and all-zero groups
    # <= max_all_success / max_all_zero (0.2 each) and informative groups >= min_informative (0.5); pass@{1,4,8,16}
    # reported. A refused environment is a skip whose reason gives its numbers (acceptance.json). none: no gate
    acceptance: str = "none"
    acceptance_group_size: int = 16  # official: G, the base policy's samples per validation seed
    min_reward_std: float = 0.05  # official: the rewards' std at least this
    max_all_success: float = 0.2  # official: groups in which every sample succeeds at most this share
    max_all_zero: float = 0.2  # official: groups in which every reward is 0 at most this share
    difficulty: int = 1
    cpu_seconds: int = 30
    wall_seconds: int = 60
    memory_mb: int = 2048
    # beyond the paper (issue 53): chained environments "<a>+<b>" of two selected capabilities (a's environment, then
    # b's, in one conversation: tracekit.synthesis.chain), each sampled by the base policy on chain_seeds instances x
    # chain_samples; the LoRA-MoE gate trains on their successes too. Empty: none (no key changes)
    chains: list[str] = field(default_factory=list)
    chain_seeds: int = 16
    chain_samples: int = 8

    RANGES: ClassVar[dict[str, str]] = {
        "repair_rounds": ">= 0", "mutation_rounds": ">= 0", "validation_seeds": ">= 1", "calibration_seeds": ">= 1",
        "calibration_k": ">= 2", "target_low": "[0, 1]", "target_high": "[0, 1]", "min_informative": "[0, 1]",
        "difficulty": ">= 0", "acceptance_group_size": ">= 2", "min_reward_std": "[0, 1]", "max_all_success": "[0, 1]",
        "max_all_zero": "[0, 1]", "cpu_seconds": ">= 1", "wall_seconds": ">= 1", "memory_mb": ">= 256",
        "chain_seeds": ">= 1", "chain_samples": ">= 1"}  # fmt: skip
    CHOICES: ClassVar[dict[str, Choice]] = {"source": SOURCES, "acceptance": ACCEPTANCE}

    def __post_init__(self) -> None:
        check_declared("synthesis", self)
        if self.target_low > self.target_high:
            raise ValueError(f"synthesis.target_low={self.target_low!r} is invalid: must be <= "
                             f"synthesis.target_high={self.target_high}")
        if self.acceptance == "official":
            self.check_reachable()
        self.check_chains()

    def check_reachable(self) -> None:
        """The official gate's bounds that no environment can meet together, refused before any work (the gate
        would refuse every environment after sampling G rollouts of each). Rewards lie in [0, 1], each seed's group
        holds G of them: a mean m has a reward std of at most sqrt(m (1 - m)); at most a max_all_success share of
        groups succeed throughout, every other has a failure, so the success rate is at most
        1 - (1 - max_all_success) / G."""
        mid = min(max(0.5, self.target_low), self.target_high)  # the band's mean reward closest to 1/2
        widest = math.sqrt(mid * (1 - mid))
        if self.min_reward_std > widest:
            raise ValueError(f"synthesis.min_reward_std={self.min_reward_std!r} is invalid: must be <= {widest:.3f} "
                             f"with synthesis.acceptance=official and a band [{self.target_low}, {self.target_high}] "
                             f"(rewards in [0, 1] with a mean in the band have a std of at most {widest:.3f}): no "
                             "environment can pass the gate")
        most = 1 - (1 - self.max_all_success) / self.acceptance_group_size
        if self.target_low > most:
            raise ValueError(f"synthesis.target_low={self.target_low!r} is invalid: must be <= {most:.3f} with "
                             f"synthesis.acceptance=official, synthesis.max_all_success={self.max_all_success} and "
                             f"G=synthesis.acceptance_group_size={self.acceptance_group_size} (groups that all succeed "
                             f"at most that share, each other one with a failure: a success rate of at most "
                             f"{most:.3f}): no environment can pass the gate")

    def check_chains(self) -> None:
        """Each chain two distinct capabilities; with the built-in library, two whose tools do not conflict (one
        name, two schemas): refused here, before any work. Generated environments are checked when chained."""

        for entry in self.chains:
            first, second = parse_chain(entry)
            envs = ([library.find_library_env(first), library.find_library_env(second)]
                    if self.source == "library" else [])
            if all(envs):
                a, b = (cls(cls.default_difficulty) for cls in envs)
                merged_tools(a.name, a.tools(), b.name, b.tools())
