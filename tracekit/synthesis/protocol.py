"""The synthetic verifiable environment protocol (paper Definition 2, section 3.3).

A synthetic environment E_s = (G, P, R, y) is a Python class deriving :class:`SyntheticEnv`:

- ``generate(seed) -> Instance``: the seeded generator G(z). An instance carries the initial world state
  (e.g. a tau^2 database as JSON), the user's goal text, task parameters, the ground-truth solution (a list of
  tool calls) and the results the agent must communicate. Same seed -> same instance (compared by hash).
- ``tools()``: OpenAI function schemas of the tools it exposes; for a tau^2 target exactly the target's.
- ``new_world(instance) -> World``: the transition logic. ``World.call(name, arguments)`` executes one tool
  call against the state (raising on a tool error), ``World.snapshot()`` returns the state as JSON.
- ``verify(instance, final_state, messages) -> (reward in [0, 1], success)``: the automatic verifier, computed
  from tool arguments, state changes and final outputs. The tau^2-style rule is
  ``reward = 1[hash(final_state) == hash(replay(solution))] * 1[every expected output was communicated]``.
- ``difficulty``: a knob (one of ``difficulty_levels``) that calibration can turn.

Everything that crosses the process boundary (instances, verdicts, tool schemas) is JSON, so the same
protocol runs in-process for the trusted built-in library and in a sandboxed subprocess for generated code
(:mod:`tracekit.synthesis.sandbox`). :class:`EnvBackend` is that common surface.
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from tracekit.types import Message, ToolCall, stable_hash

NOOP_TEXT = "OK."


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Call(_Model):
    """One ground-truth tool call."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Instance(_Model):
    """One task instance x = G(z).

    ``expected_outputs`` is a list of groups; the agent communicated the result iff, for every group, at least
    one of its strings occurs (case-insensitive, commas ignored, on word boundaries) in an assistant message.
    ``user_facts`` are what a scripted user reveals when asked (keys such as ``user_id``, ``email``,
    ``order_id``, ``reservation_id``, ``reason``).
    """

    seed: int
    system_prompt: str
    user_goal: str
    user_facts: dict[str, str] = Field(default_factory=dict)
    state: dict[str, Any]
    params: dict[str, Any] = Field(default_factory=dict)
    solution: list[Call]
    expected_outputs: list[list[str]] = Field(default_factory=list)

    def key(self) -> str:
        """Hash of the whole instance (determinism check)."""
        return stable_hash(self.model_dump(mode="json"), length=32)

    def content_key(self) -> str:
        """Hash of everything but the seed field (diversity check: copying the seed in is not diversity)."""
        return stable_hash(self.model_dump(mode="json", exclude={"seed"}), length=32)

    def solution_key(self) -> str:
        return stable_hash(
            {"solution": [c.model_dump(mode="json") for c in self.solution], "expected": self.expected_outputs},
            length=32,
        )


class Verdict(_Model):
    """The verifier's output for one finished episode."""

    reward: float = Field(ge=0.0, le=1.0)
    success: bool
    state_hash: str = ""


class EnvInfo(_Model):
    """What an environment says about itself."""

    name: str
    capability: str
    description: str = ""
    target: str
    policy: str = ""
    difficulty: int
    difficulty_levels: list[int]
    max_turns: int
    tools: list[dict[str, Any]]


class World(ABC):
    """The mutable state of one episode and its transition function."""

    @abstractmethod
    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        """Execute one tool call; raise an exception for a tool error (the agent sees its message)."""

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The current state as JSON (compared by hash against the ground-truth replay)."""


class SyntheticEnv(ABC):
    """Base class of every synthetic environment (built-in or generated)."""

    name: ClassVar[str]
    capability: ClassVar[str]
    description: ClassVar[str] = ""
    target: ClassVar[str]  # "tau2_airline" | "tau2_retail" | "toolsandbox" | ...
    policy: ClassVar[str] = ""  # the (condensed) policy shown as system prompt
    difficulty_levels: ClassVar[tuple[int, ...]] = (0,)
    default_difficulty: ClassVar[int] = 0
    max_turns: ClassVar[int] = 16  # assistant messages per episode
    # the words its requests vary in (entity names): a world tokenizer keeps each one token (llm/world_tokenizer.py)
    atoms: ClassVar[tuple[str, ...]] = ()

    def __init__(self, difficulty: int | None = None):
        level = self.default_difficulty if difficulty is None else int(difficulty)
        if level not in self.difficulty_levels:
            raise ValueError(f"{self.name}: difficulty {level} not in {list(self.difficulty_levels)}")
        self.difficulty = level

    @abstractmethod
    def generate(self, seed: int) -> Instance: ...

    @abstractmethod
    def tools(self) -> list[dict[str, Any]]: ...

    @abstractmethod
    def new_world(self, instance: Instance) -> World: ...

    @abstractmethod
    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        ...

    def format_result(self, value: Any) -> str:
        """A tool's return value as the tool message text (tau^2 style: JSON of pydantic dumps)."""
        return value if isinstance(value, str) else json.dumps(to_jsonable(value), default=str)

    def format_error(self, exc: BaseException) -> str:
        """A tool's exception as the tool message text (tau^2 style)."""
        return f"Error: {exc}"

    def info(self) -> EnvInfo:
        return EnvInfo(
            name=self.name,
            capability=self.capability,
            description=self.description,
            target=self.target,
            policy=self.policy,
            difficulty=self.difficulty,
            difficulty_levels=list(self.difficulty_levels),
            max_turns=self.max_turns,
            tools=self.tools(),
        )


# ---------------------------------------------------------------------------------------------- helpers


def to_jsonable(value: Any) -> Any:
    """pydantic models -> dicts, tuples -> lists, recursively (what a tool result looks like as JSON)."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    return value


def state_hash(snapshot: dict[str, Any]) -> str:
    return stable_hash(snapshot, length=32)


def _normalize_text(text: str) -> str:
    return text.lower().replace(",", "").replace("\u2019", "'")


def mentions(text: str, needle: str) -> bool:
    """``needle`` occurs in ``text`` (lowercased, commas removed) not inside a longer word or number."""
    n = _normalize_text(needle).strip()
    if not n:
        return False
    return re.search(r"(?<![0-9a-z])" + re.escape(n) + r"(?![0-9a-z])", _normalize_text(text)) is not None


def assistant_texts(messages: Iterable[Message]) -> list[str]:
    return [m.content for m in messages if m.role == "assistant" and m.content]


def communicated(messages: Sequence[Message], expected: Sequence[Sequence[str]]) -> bool:
    """tau^2's communicate check with word boundaries: every group has an alternative said by the agent."""
    texts = assistant_texts(messages)
    return all(any(mentions(t, alt) for t in texts for alt in group) for group in expected)


def tool_calls_of(messages: Iterable[Message]) -> list[ToolCall]:
    """The agent's tool calls in order."""
    return [c for m in messages if m.role == "assistant" for c in m.tool_calls]


def replay(env: SyntheticEnv, instance: Instance, calls: Iterable[Call | ToolCall]) -> dict[str, Any]:
    """State after executing ``calls`` on a fresh world; failing calls are skipped, as tau^2 does for gold actions."""
    world = env.new_world(instance.model_copy(deep=True))
    for c in calls:
        try:
            world.call(c.name, copy.deepcopy(dict(c.arguments)))
        except Exception:  # a deliberately failing gold call leaves the state as the target would
            continue
    return world.snapshot()


def db_match(env: SyntheticEnv, instance: Instance, final_state: dict[str, Any]) -> bool:
    """tau^2's DB check: the final state hashes equal to the ground-truth replay's."""
    return state_hash(final_state) == state_hash(replay(env, instance, instance.solution))


def ground_truth_actions(instance: Instance) -> list[Message]:
    """The ground-truth trajectory as assistant actions: one tool call per message, then the expected results."""
    actions = [
        Message(role="assistant", tool_calls=[ToolCall(id=f"gt-{i}", name=c.name, arguments=c.arguments)])
        for i, c in enumerate(instance.solution)
    ]
    final = " ".join(group[0] for group in instance.expected_outputs if group) or NOOP_TEXT
    return actions + [Message(role="assistant", content=final)]


def noop_actions() -> list[Message]:
    """An empty trajectory: the agent answers without doing anything."""
    return [Message(role="assistant", content=NOOP_TEXT)]


def find_env_class(module: Any) -> type[SyntheticEnv]:
    """The environment class a module defines: ``ENV_CLASS`` if set, else its one concrete SyntheticEnv subclass."""
    explicit = getattr(module, "ENV_CLASS", None)
    if explicit is not None:
        if not (isinstance(explicit, type) and issubclass(explicit, SyntheticEnv)):
            raise TypeError("ENV_CLASS is not a SyntheticEnv subclass")
        return explicit
    found = [v for v in vars(module).values()
             if isinstance(v, type) and issubclass(v, SyntheticEnv) and v.__module__ == module.__name__
             and not inspect.isabstract(v)]
    if len(found) != 1:
        names = ", ".join(sorted(c.__name__ for c in found)) or "none"
        raise TypeError(f"the module must define exactly one concrete SyntheticEnv subclass (found: {names}); "
                        "or set ENV_CLASS")
    return found[0]


# ------------------------------------------------------------------------------------------ episode core


class EpisodeCore:
    """Executes tool calls of one episode against a world and scores it; shared by every backend."""

    def __init__(self, env: SyntheticEnv, instance: Instance):
        self.env = env
        self.instance = instance
        self.world = env.new_world(instance.model_copy(deep=True))
        self.tool_names = {t["function"]["name"] for t in env.tools()}

    def execute(self, call: ToolCall) -> Message:
        """The tool message for ``call``; unknown tools and bad arguments become tool errors."""
        error = True
        if call.name not in self.tool_names:
            content = self.env.format_error(ValueError(f"Tool '{call.name}' not found."))
        elif not isinstance(call.arguments, dict):
            content = self.env.format_error(TypeError("tool arguments must be a JSON object"))
        else:
            try:
                content, error = self.env.format_result(self.world.call(call.name, copy.deepcopy(call.arguments))), False
            except MemoryError:
                raise
            except Exception as e:  # the agent sees the error, as in tau^2 and ToolSandbox
                content = self.env.format_error(e)
        return Message(role="tool", content=content, tool_call_id=call.id, name=call.name, error=error)

    def finish(self, messages: list[Message]) -> Verdict:
        snapshot = self.world.snapshot()
        out = self.env.verify(self.instance, snapshot, messages)
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(f"verify must return (reward, success), got {out!r}")
        reward, success = out
        reward = float(reward)
        if math.isnan(reward) or not 0.0 <= reward <= 1.0:
            raise ValueError(f"verify returned reward {reward} outside [0, 1]")
        return Verdict(reward=reward, success=bool(success), state_hash=state_hash(snapshot))


def score_actions(env: SyntheticEnv, instance: Instance, actions: list[Message]) -> Verdict:
    """Run a fixed list of assistant actions (no user) through the env and score it."""
    core = EpisodeCore(env, instance)
    messages: list[Message] = []
    for action in actions:
        messages.append(action)
        messages.extend(core.execute(c) for c in action.tool_calls)
    return core.finish(messages)


# ---------------------------------------------------------------------------------------------- backends


class EnvBackend(ABC):
    """Where an environment's code runs: in this process (trusted) or in a sandbox (generated)."""

    @abstractmethod
    def describe(self) -> EnvInfo: ...

    @abstractmethod
    def generate(self, seeds: list[int]) -> list[Instance]: ...

    @abstractmethod
    def open(self, instance: Instance) -> str:
        """Start an episode on ``instance``; returns its handle."""

    @abstractmethod
    def call(self, handle: str, call: ToolCall) -> Message: ...

    @abstractmethod
    def finish(self, handle: str, messages: list[Message]) -> Verdict:
        """Verify the episode and release it."""

    @abstractmethod
    def score(self, jobs: list[tuple[Instance, list[Message]]]) -> list[Verdict]:
        """Score fixed action lists (ground truth, no-op, random) in one go."""

    def close(self) -> None:
        """Release resources."""


class InProcessBackend(EnvBackend):
    """Runs a trusted environment object in this process."""

    def __init__(self, env: SyntheticEnv):
        self.env = env
        self._episodes: dict[str, EpisodeCore] = {}
        self._next = 0
        self._lock = threading.Lock()

    def describe(self) -> EnvInfo:
        return self.env.info()

    def generate(self, seeds: list[int]) -> list[Instance]:
        out = []
        for z in seeds:
            inst = self.env.generate(int(z))
            if not isinstance(inst, Instance):
                raise TypeError(f"generate({z}) returned {type(inst).__name__}, not Instance")
            out.append(inst)
        return out

    def open(self, instance: Instance) -> str:
        with self._lock:
            self._next += 1
            handle = f"ep{self._next}"
            self._episodes[handle] = EpisodeCore(self.env, instance)
        return handle

    def call(self, handle: str, call: ToolCall) -> Message:
        return self._episodes[handle].execute(call)

    def finish(self, handle: str, messages: list[Message]) -> Verdict:
        with self._lock:
            core = self._episodes.pop(handle)
        return core.finish(messages)

    def score(self, jobs: list[tuple[Instance, list[Message]]]) -> list[Verdict]:
        return [score_actions(self.env, inst, actions) for inst, actions in jobs]
