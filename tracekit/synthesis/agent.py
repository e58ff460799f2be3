"""The environment-generation agent (paper section 3.3, Appendix E).

Given a capability (name, description, failed-trajectory excerpts), the target's tool schemas and policy and
one library environment's source as an example, it asks a :class:`ChatClient` for a module implementing the
synthetic environment protocol, extracts the code, validates it in the sandbox, and sends the validation
errors back for repair, up to ``max_repair_rounds`` times. With a ``rollout_fn``, an accepted environment is
calibrated against the current policy and, when too easy or too hard, sent back for a mutation round (up to
``max_mutation_rounds``). Everything is written to ``out_dir``: the accepted module ``env.py``, its
``validation.{json,md}`` (and ``calibration.{json,md}``), every candidate ``rounds/round_<i>.py`` with its
report, the conversation ``transcript.jsonl`` and ``generation.json`` (status, reason, per-round records).
A model that never produces a valid module ends in ``status="failed"`` with the reason, never an exception.
"""

from __future__ import annotations

import ast
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tracekit.artifacts import atomic_write_json, atomic_write_text, write_jsonl
from tracekit.envs.base import EnvSuite
from tracekit.llm.base import ChatClient, ChatRequest, EndpointError
from tracekit.synthesis.calibrate import (CalibrationReport, CalibrationTargets, RolloutFn, calibrate_difficulty,
                                          distance, write_calibration)
from tracekit.synthesis.library import LIBRARY_NAMES, family_environments, library_env, library_source
from tracekit.synthesis.sandbox import SandboxBackend, SandboxError, SandboxLimits
from tracekit.synthesis.suite import SyntheticSuite
from tracekit.synthesis.targets import target_family, target_policy, target_tools
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.validate import ValidationConfig, ValidationReport, validate_source, write_report
from tracekit.types import Capability, Message, stable_hash

log = logging.getLogger(__name__)

PROMPT_DIR = Path(__file__).with_name("prompts")


def load_prompt(name: str, version: str = "v1") -> str:
    path = PROMPT_DIR / f"{name}_{version}.txt"
    if not path.exists():
        raise FileNotFoundError(f"prompt {path.name} not found in {PROMPT_DIR}")
    return path.read_text(encoding="utf-8")


def fill(template: str, **values: str) -> str:
    """Replace ``<<KEY>>`` placeholders (braces in code/JSON need no escaping); a leftover one is an error."""
    for key, value in values.items():
        template = template.replace(f"<<{key}>>", value)
    left = re.findall(r"<<[A-Z_]+>>", template)
    if left:
        raise KeyError(f"unfilled prompt placeholders: {sorted(set(left))}")
    return template


def extract_code(text: str) -> str | None:
    """The module in a model reply: the longest fenced block that defines an env (an unclosed last fence counts,
    for truncated replies), else the whole reply if it parses as Python with a class; None if there is none."""
    blocks = re.findall(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", text, flags=re.DOTALL)
    blocks = [b.strip("\n") for b in blocks if b.strip()]
    if blocks:
        envs = [b for b in blocks if "SyntheticEnv" in b] or blocks
        return max(envs, key=len) + "\n"
    try:
        ast.parse(text)
    except SyntaxError:
        return None
    return text.strip("\n") + "\n" if "class " in text else None


@dataclass
class GenerationSpec:
    """What the agent is asked to build."""

    capability: Capability
    target: str
    failure_excerpts: list[str] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None  # the target's schemas (default: tracekit.synthesis.targets)
    policy: str | None = None  # the target's policy (default: tracekit.synthesis.targets)
    example: str | None = None  # a library env name (default: same capability/target family if any)


@dataclass
class EnvChecks:
    """What every synthesized environment is held to, library and generated alike: validation, the sandbox it runs
    in, and calibration against the current policy (its seeds, samples and target band). Built from the
    ``synthesis`` group (:meth:`of`), which holds each knob's one default."""

    validation: ValidationConfig
    limits: SandboxLimits
    targets: CalibrationTargets
    calibration_seeds: int
    calibration_k: int

    @classmethod
    def of(cls, c: SynthesisConfig) -> EnvChecks:
        band = (c.target_low, c.target_high)
        official = c.acceptance == "official"
        # under the official gate, calibration aims at its constant-group bounds too (a level the gate would refuse
        # is no calibrated level)
        targets = CalibrationTargets(mean_reward=band, success_rate=band, min_informative=c.min_informative,
                                     max_all_success=c.max_all_success if official else None,
                                     max_all_zero=c.max_all_zero if official else None)
        return cls(validation=ValidationConfig(n_seeds=c.validation_seeds),
                   limits=SandboxLimits(cpu_seconds=c.cpu_seconds, wall_seconds=c.wall_seconds,
                                        memory_bytes=c.memory_mb << 20),
                   targets=targets, calibration_seeds=c.calibration_seeds, calibration_k=c.calibration_k)


def default_checks() -> EnvChecks:
    return EnvChecks.of(SynthesisConfig())


@dataclass
class GenerationAgentConfig:
    """The generation agent's own knobs (what it is held to: :class:`EnvChecks`)."""

    prompt_version: str = "v1"
    max_repair_rounds: int = SynthesisConfig.repair_rounds
    max_mutation_rounds: int = SynthesisConfig.mutation_rounds
    temperature: float = 0.7
    max_new_tokens: int = 8192
    seed: int = 0
    max_excerpts: int = 3
    excerpt_chars: int = 1500


class RoundRecord(BaseModel):
    round: int
    kind: Literal["initial", "repair", "mutation"]
    reply_chars: int = 0
    code_hash: str | None = None
    passed: bool = False
    reason: str | None = None
    calibration: str | None = None  # verdict when calibrated


class GenerationResult(BaseModel):
    status: Literal["accepted", "failed"]
    capability: str
    target: str
    prompt_version: str
    reason: str | None = None
    module: str | None = None  # path of the accepted env.py
    rounds: list[RoundRecord] = Field(default_factory=list)
    calibrated: bool | None = None  # None: not calibrated


def pick_example(capability: str, target: str) -> str:
    """A library env to show: the same capability on the same target family if present, else the same family."""
    same = family_environments(target_family(target))
    exact = [n for n in same if library_env(n).capability == capability]
    if exact or same:
        return (exact or same)[0]
    return LIBRARY_NAMES[0]


def build_prompt(spec: GenerationSpec, cfg: GenerationAgentConfig = GenerationAgentConfig()) -> str:
    tools = spec.tools if spec.tools is not None else list(target_tools(spec.target).values())
    policy = spec.policy if spec.policy is not None else target_policy(spec.target)
    example = spec.example or pick_example(spec.capability.name, spec.target)
    excerpts = [e[: cfg.excerpt_chars] for e in spec.failure_excerpts[: cfg.max_excerpts]]
    return fill(
        load_prompt("generate_env", cfg.prompt_version),
        CAPABILITY_NAME=spec.capability.name,
        CAPABILITY_DESCRIPTION=spec.capability.description,
        FAILURE_EXCERPTS="\n\n".join(f"--- excerpt {i + 1} ---\n{e}" for i, e in enumerate(excerpts)) or "(none given)",
        TARGET=spec.target,
        TOOL_SCHEMAS=json.dumps(tools, indent=1),
        POLICY=policy,
        PROTOCOL=load_prompt("protocol", cfg.prompt_version),
        EXAMPLE_NAME=example,
        EXAMPLE_SOURCE=library_source(example),
    )


def _mutation_prompt(report: CalibrationReport, cfg: GenerationAgentConfig, targets: CalibrationTargets) -> str:
    last = report.tried[-1]
    easy = last.verdict == "too_easy"
    s = last.stats
    stats = (f"mean reward {s.mean_reward:.3f}, success rate {s.success_rate:.3f}, informative groups "
             f"{s.informative_rate:.3f}, all-success groups {s.all_success_rate:.3f}, all-zero groups "
             f"{s.all_zero_rate:.3f}")
    return fill(
        load_prompt("mutate", cfg.prompt_version),
        DIRECTION="too easy" if easy else "too hard", K=str(report.k), N_SEEDS=str(len(report.seeds)), STATS=stats,
        LO=str(targets.mean_reward[0]), HI=str(targets.mean_reward[1]),
        MIN_INFORMATIVE=str(targets.min_informative), CHANGE="harder" if easy else "easier",
        HOW=("more distractor records, more constraints or steps, less information given up front" if easy
             else "fewer distractors, fewer steps, the needed information stated more plainly"),
    )


class _Run:
    """State of one generation run (conversation, round records, files)."""

    def __init__(self, client: ChatClient, spec: GenerationSpec, out_dir: Path, cfg: GenerationAgentConfig,
                 checks: EnvChecks):
        self.client, self.spec, self.out, self.cfg, self.checks = client, spec, out_dir, cfg, checks
        self.messages = [Message(role="system", content="You write correct, self-contained Python code."),
                         Message(role="user", content=build_prompt(spec, cfg))]
        self.rounds: list[RoundRecord] = []

    def ask(self, kind: str) -> tuple[str | None, ValidationReport | None, RoundRecord]:
        """One model call + validation of its code."""
        record = RoundRecord(round=len(self.rounds), kind=kind)
        self.rounds.append(record)
        request = ChatRequest(messages=list(self.messages), temperature=self.cfg.temperature,
                              max_new_tokens=self.cfg.max_new_tokens, seed=self.cfg.seed + record.round)
        reply = self.client.chat([request])[0]
        if reply.finish_reason == "error":  # the endpoint refused this request (e.g. prompt over the context)
            raise EndpointError(f"the endpoint answered with an error: {reply.text}")
        text = reply.text or reply.message.content or ""
        self.messages.append(Message(role="assistant", content=text))
        record.reply_chars = len(text)
        code = extract_code(text)
        if code is None:
            record.reason = "the reply contains no Python module (no ```python block, nothing that parses)"
            if reply.finish_reason == "length":
                record.reason += "; the reply was cut at max_new_tokens"
            return None, None, record
        record.code_hash = stable_hash(code)
        atomic_write_text(self.out / "rounds" / f"round_{record.round}.py", code)
        report = validate_source(code, f"generated:{self.spec.capability.name}:round{record.round}",
                                 self.checks.validation, self.checks.limits, expected_target=self.spec.target,
                                 reference_tools=({t["function"]["name"]: t for t in self.spec.tools}
                                                  if self.spec.tools is not None else None))
        write_report(report, self.out / "rounds", f"round_{record.round}")
        record.passed, record.reason = report.passed, report.reason
        return code, report, record

    def valid_module(self, first_kind: str) -> tuple[str, ValidationReport] | None:
        """Ask, then repair until a module passes validation or the repair rounds run out."""
        kind = first_kind
        for _ in range(self.cfg.max_repair_rounds + 1):
            code, report, record = self.ask(kind)
            if code is not None and report is not None and report.passed:
                return code, report
            if report is None:
                errors = [f"- {record.reason}"]
            else:
                errors = [f"- {c.name}: {c.detail}" for c in report.checks if not c.passed]
            self.messages.append(Message(role="user", content=fill(load_prompt("repair", self.cfg.prompt_version),
                                                                   ERRORS="\n".join(errors))))
            kind = "repair"
        return None

    def save_transcript(self) -> None:
        write_jsonl(self.out / "transcript.jsonl", self.messages)


def _calibrate(code: str, checks: EnvChecks, rollout_fn: RolloutFn, name: str, target: str) -> CalibrationReport:
    probe = SandboxBackend(code, checks.limits, target=target)
    levels = probe.describe().difficulty_levels
    probe.close()

    def make_suite(level: int) -> EnvSuite:
        return SyntheticSuite(SandboxBackend(code, checks.limits, level, target), range(checks.calibration_seeds))

    return calibrate_difficulty(make_suite, levels, rollout_fn, list(range(checks.calibration_seeds)),
                                checks.calibration_k, checks.targets, name=name)


def generate_environment(client: ChatClient, spec: GenerationSpec, out_dir: str | Path,
                         cfg: GenerationAgentConfig = GenerationAgentConfig(),
                         rollout_fn: RolloutFn | None = None, checks: EnvChecks | None = None) -> GenerationResult:
    """Run the generation agent for one capability; returns (and writes) the result, accepted or failed.
    ``checks``: what the environment is held to (default: the ``synthesis`` group's defaults)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = _Run(client, spec, out, cfg, checks or default_checks())
    result = GenerationResult(status="failed", capability=spec.capability.name, target=spec.target,
                              prompt_version=cfg.prompt_version)
    accepted: tuple[str, ValidationReport] | None = None
    try:
        accepted = run.valid_module("initial")
        if accepted is None:
            result.reason = (f"no valid module after {len(run.rounds)} round(s); last: "
                             f"{run.rounds[-1].reason if run.rounds else 'no reply'}")
        elif rollout_fn is not None:
            accepted, result.calibrated = _calibrate_and_mutate(run, accepted, cfg, rollout_fn)
    except EndpointError as e:
        result.reason = f"generation endpoint failed: {e}"
    except SandboxError as e:  # e.g. calibration's worker died on the accepted module
        result.reason = f"sandbox failure: {e}"
    if accepted is not None:
        code, report = accepted
        atomic_write_text(out / "env.py", code)
        write_report(report, out)
        result.status, result.module = "accepted", str(out / "env.py")
        if result.calibrated is False:
            result.reason = "accepted, but no version met the calibration targets (closest kept)"
    result.rounds = run.rounds
    run.save_transcript()
    atomic_write_json(out / "generation.json", result.model_dump(mode="json"))
    log.info("generation of %s: %s (%s)", spec.capability.name, result.status, result.reason or "ok")
    return result


def _calibrate_and_mutate(run: _Run, accepted: tuple[str, ValidationReport], cfg: GenerationAgentConfig,
                          rollout_fn: RolloutFn) -> tuple[tuple[str, ValidationReport], bool]:
    """Calibrate; while too easy/hard, ask for a mutation (up to max_mutation_rounds). Keeps the closest version."""
    best = accepted
    best_report: CalibrationReport | None = None
    for mutation in range(cfg.max_mutation_rounds + 1):
        report = _calibrate(accepted[0], run.checks, rollout_fn, run.spec.capability.name, run.spec.target)
        run.rounds[-1].calibration = report.tried[-1].verdict if report.tried else None
        if best_report is None or _closer(report, best_report, run.checks.targets):
            best, best_report = accepted, report
        if report.passed or mutation == cfg.max_mutation_rounds:
            break
        run.messages.append(Message(role="user", content=_mutation_prompt(report, cfg, run.checks.targets)))
        mutated = run.valid_module("mutation")
        if mutated is None:
            break
        accepted = mutated
    write_calibration(best_report, run.out)
    return best, best_report.passed


def _closer(a: CalibrationReport, b: CalibrationReport, targets: CalibrationTargets) -> bool:
    def best_distance(r: CalibrationReport) -> float:
        return min(distance(t.stats, targets) for t in r.tried)

    return best_distance(a) < best_distance(b)
