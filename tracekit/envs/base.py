"""The environment protocol every target and synthetic environment implements.

An :class:`EnvSuite` is a set of tasks (benchmark tasks, or seeds of a synthetic generator) and a
factory of :class:`Episode` objects. An episode is stepped one assistant message at a time, so a
rollout runner can keep many episodes side by side and batch their model calls:

    ep = suite.episode(task)
    obs = ep.reset()                       # policy/system prompt, tool schemas, first messages
    while not done:
        reply = model(obs.messages + history, tools=obs.tools)
        step = ep.step(reply)              # tool results and/or the user's reply
    outcome = ep.outcome()                 # reward in [0, 1] (or continuous), success label

Rewards may be continuous (ToolSandbox similarity) with success a separate binary label; an episode
may have no simulated user; evaluation may be slow, so suites say nothing about threading and the
runner decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tracekit.types import Message, Task


class InfraError(RuntimeError):
    """The environment's infrastructure failed, not the agent: an env worker died or hung
    (:class:`tracekit.envs.pool.WorkerDied`), the environment server failed
    (:class:`tracekit.targets.toolsandbox.suite.EnvironmentServerError`), the coding sandbox could not run a command
    (``tracekit.coding.sandbox.JailUnavailable``, tagged ``infra = True``). An episode that ends on one is not an
    outcome: the episode core (:func:`tracekit.episodes.drive_episodes`) runs it again from scratch, a bounded number
    of times (``rollout.infra_retries``), and never yields it to a runner: no artifact or training batch holds it."""

    infra = True


# what older trajectories recorded for an infrastructure failure (``Trajectory.error`` starts with ``<name>:``): a
# rollout artifact holding one predates the retries and is refused (tracekit.runs.cached_rollout)
INFRA_ERROR_NAMES = ("InfraError", "WorkerDied", "EnvironmentServerError", "JailUnavailable")


def infra_cause(e: BaseException | None) -> BaseException | None:
    """The infrastructure failure behind ``e`` (``e`` itself, or what it was raised ``from``): an
    :class:`InfraError`, or an exception of a class tagged ``infra = True`` (a module that imports no tracekit code
    tags its own); None when ``e`` is the agent's or the environment's own error."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, InfraError) or getattr(type(e), "infra", False) is True:
            return e
        e = e.__cause__
    return None


@dataclass
class Observation:
    """What the agent sees at the start of an episode."""

    messages: list[Message]  # system (policy) message first, then any opening user message
    tools: list[dict[str, Any]]  # OpenAI function-format tool schemas, exactly as the target defines them
    done: bool = False  # the episode ended before the agent's first action (e.g. the user stopped at once)
    termination: str = ""


@dataclass
class StepResult:
    messages: list[Message]  # new messages after the agent's action: tool results, user reply
    done: bool = False
    termination: str = ""  # why the episode ended (e.g. user_stop, agent_stop, max_steps)


@dataclass
class Outcome:
    reward: float
    success: bool
    info: dict[str, Any] = field(default_factory=dict)


class Episode(ABC):
    """One running episode of an environment."""

    @abstractmethod
    def reset(self) -> Observation: ...

    @abstractmethod
    def step(self, action: Message) -> StepResult:
        """Apply one assistant message (text and/or tool calls).

        Malformed or unknown tool calls must come back as tool error messages the agent can see,
        never as an exception.
        """

    @abstractmethod
    def outcome(self) -> Outcome:
        """Reward and success of the episode so far (called once it is done or cut off)."""


class EnvSuite(ABC):
    """A named environment: its tasks and a factory of episodes."""

    name: str

    @abstractmethod
    def tasks(self) -> list[Task]:
        """The tasks this suite is configured to run (after split/subset selection)."""

    @abstractmethod
    def episode(self, task: Task, seed: int = 0) -> Episode:
        """A fresh episode of ``task``; ``seed`` drives any randomness (e.g. the user simulator)."""

    def reset_batch(self, episodes: list[Episode]) -> list[Observation | Exception]:
        """Reset many episodes; an episode that raises yields its exception, the others are unaffected.

        Suites whose episodes call a model themselves (a simulated user) override this and
        :meth:`step_batch` to batch those calls across episodes.
        """
        return [_capture(ep.reset) for ep in episodes]

    def step_batch(self, episodes: list[Episode], actions: list[Message]) -> list[StepResult | Exception]:
        """Step many episodes with one action each (same exception convention as :meth:`reset_batch`)."""
        return [_capture(ep.step, a) for ep, a in zip(episodes, actions, strict=True)]

    def interface(self) -> dict[str, Any]:
        """Tool schemas and policy text, for interface-preservation checks and generation prompts."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its interface")


def _capture(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - handed back to the runner, which records it on the episode
        return e
