"""Synthesis chaining (issue 53, beyond the paper): two capabilities' environments in one conversation.

TRACE trains one adapter per capability, each in its own environment, and its gate on those adapters' rollouts: no
training episode shows two capabilities in one task ("refuse the locked item, then finish the other writes"). A
chained environment runs environment A, then environment B, in one conversation:

- the opening is A's: the system message holds A's policy (and B's, when it differs), the first user message A's
  request; the tools are the union of both environments' tools;
- when A's part ends the way a finished task ends (the agent reports and the simulated user closes, or with no user
  the agent stops), B's request follows as the next user message and the conversation goes on in B's world (the
  scripted user's closing reply is dropped; an LLM user's last words stay before it);
- A's part cut off by its turn limit, or the chain's own limit (``max_turns``: both parts' by default), ends the
  episode;
- each part is scored by its own verifier on its own part of the conversation; the reward is the product of the
  two rewards and the episode succeeds only when both parts do.

It is generic over the environment protocol: a part is any :class:`~tracekit.synthesis.suite.SyntheticSuite` (a
built-in library environment in-process, a generated one in its sandbox), stepped through its
:class:`~tracekit.envs.base.Episode` interface. Two environments whose tools conflict (one name, two schemas) are
refused in one line (:func:`merged_tools`): a call could not say which one it means.

The synthesize stage (``synthesis.chains``) samples the base policy on each chain and keeps the episodes under
``<synthesize>/chains/<a>+<b>/`` (:func:`write_chain`); the LoRA-MoE gate trains on the successful ones beside the
adapters' rollouts (``tracekit.methods.consolidate.composite``), and their episodes count in TRACE's budget.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracekit.artifacts import atomic_write_json, read_json
from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.rollout import read_trajectories, run_rollouts
from tracekit.synthesis.suite import CLOSING_REPLY, SyntheticEpisode, SyntheticSuite
from tracekit.types import Message, Task

CHAINS = "chains"  # the synthesize artifact's folder of chained environments
CHAIN_RECORD = "chain.json"
ROLLOUTS = "rollouts"
FINISHED = ("user_stop", "agent_stop")  # a part that ended as a finished task hands the conversation on

# samples a chain: (suite, seeds, samples per seed, folder) -> the trajectories, written to the folder (resumable)
ChainSampler = Callable[[EnvSuite, list[int], int, Path], list[Any]]


def chain_sampler(agent: Any, **rollout_kwargs: Any) -> ChainSampler:
    """A :data:`ChainSampler` running :func:`tracekit.rollout.run_rollouts` with ``agent`` (the base policy)."""
    def sample(suite: EnvSuite, seeds: list[int], k: int, folder: Path) -> list[Any]:
        wanted = set(seeds)
        tasks = [t for t in suite.tasks() if t.data.get("seed") in wanted]
        run_rollouts(suite, agent, folder, samples=k, tasks=tasks, **rollout_kwargs)
        return read_trajectories(folder)
    return sample


def chain_name(first: str, second: str) -> str:
    """``synthesis.chains`` entry and folder name of the chain ``first`` then ``second`` (capability names)."""
    return f"{first}+{second}"


def parse_chain(entry: str) -> tuple[str, str]:
    """``"a+b"`` -> ``("a", "b")``; a malformed entry: ValueError naming it."""
    parts = str(entry).split("+")
    if len(parts) != 2 or not all(p.strip() for p in parts) or parts[0].strip() == parts[1].strip():
        raise ValueError(f"synthesis.chains: {entry!r} is not <capability>+<other capability> (two distinct "
                         "capabilities, the first one's environment run first)")
    return parts[0].strip(), parts[1].strip()


def merged_tools(first: str, first_tools: list[dict[str, Any]], second: str,
                 second_tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The union of two environments' tool schemas (first's order, then second's new ones); a tool both define with
    different schemas: ValueError in one line."""
    by_name = {t["function"]["name"]: t for t in first_tools}
    out = list(first_tools)
    for t in second_tools:
        name = t["function"]["name"]
        if name not in by_name:
            out.append(t)
        elif json.dumps(by_name[name], sort_keys=True) != json.dumps(t, sort_keys=True):
            raise ValueError(f"chained environment {first}+{second}: the two capabilities' tools conflict: {name!r} "
                             f"has one schema in {first} and another in {second}")
    return out


def chain_policy(first: str, second: str) -> str:
    """The system message of a chain: one policy when both environments share it, else both."""
    return first if first == second else f"{first}\n\n{second}"


class ChainedEpisode(Episode):
    """Part A's episode, then part B's, as one conversation (see the module docstring)."""

    def __init__(self, suite: ChainedSuite, first: SyntheticEpisode, second: SyntheticEpisode):
        self.suite = suite
        self.parts = (first, second)
        self.phase = 0
        self.turns = 0
        self.done = False
        self.termination = ""
        self._outcome: Outcome | None = None

    def reset(self) -> Observation:
        first, second = self.parts
        first.reset()
        second.reset()  # opened now, so that outcome() releases it whatever happens
        opening = [Message(role="system", content=self.suite.policy),
                   Message(role="user", content=first.instance.user_goal)]
        return Observation(messages=opening, tools=self.suite.tools)

    def step(self, action: Message) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        part = self.parts[self.phase]
        result = part.step(action)
        self.turns += 1
        messages = list(result.messages)
        if result.done:
            if self.phase == 0 and result.termination in FINISHED:
                # A is finished: B's request takes the place of the user's closing reply
                if messages and messages[-1].role == "user" and messages[-1].content == CLOSING_REPLY:
                    messages = messages[:-1]
                self.phase = 1
                messages.append(Message(role="user", content=self.parts[1].instance.user_goal))
            else:
                self._end(result.termination if self.phase == 1 else f"first_{result.termination}")
        if not self.done and self.turns >= self.suite.max_turns:
            self._end("max_steps")
        return StepResult(messages=messages, done=self.done, termination=self.termination)

    def _end(self, why: str) -> None:
        self.done, self.termination = True, why

    def outcome(self) -> Outcome:
        if self._outcome is None:
            first, second = (p.outcome() for p in self.parts)  # both verdicts (and both handles released)
            reached = self.phase == 1
            reward = first.reward * second.reward if reached else 0.0
            success = first.success and second.success and reached
            self._outcome = Outcome(reward=reward, success=success, info={
                "seed": self.parts[0].instance.seed, "difficulty": first.info.get("difficulty"),
                "capability": self.suite.capability, "termination": self.termination or "cut_off",
                "agent_turns": self.turns, "parts": [
                    {"env": p.suite.name, "reward": o.reward, "success": o.success, "reached": i == 0 or reached}
                    for i, (p, o) in enumerate(zip(self.parts, (first, second)))]})
        return self._outcome


class ChainedSuite(EnvSuite):
    """Seeds ``seed-<z>`` of a chain: instance ``z`` of part A, then instance ``z`` of part B, in one conversation."""

    def __init__(self, first: SyntheticSuite, second: SyntheticSuite, seeds: list[int] | range,
                 max_turns: int | None = None):
        a, b = first.info, second.info
        self.tools = merged_tools(a.name, a.tools, b.name, b.tools)  # a conflict: refused before any episode
        self.parts = (first, second)
        self.name = f"chain_{a.name}__{b.name}"
        self.capability = chain_name(a.capability, b.capability)
        self.policy = chain_policy(a.policy, b.policy)
        self.seeds = [int(z) for z in seeds]
        self.max_turns = max_turns or (first.max_turns + second.max_turns)

    def tasks(self) -> list[Task]:
        first, second = self.parts
        return [Task(id=f"seed-{z}", env=self.name, instruction=f"{x.user_goal} / {y.user_goal}", data={"seed": z})
                for z, x, y in zip(self.seeds, first.instances(self.seeds), second.instances(self.seeds), strict=True)]

    def episode(self, task: Task, seed: int = 0) -> ChainedEpisode:
        z = int(task.data["seed"])
        one = [Task(id=f"seed-{z}", env=part.name, instruction="", data={"seed": z}) for part in self.parts]
        return ChainedEpisode(self, self.parts[0].episode(one[0], seed), self.parts[1].episode(one[1], seed))

    def interface(self) -> dict[str, Any]:
        return {"tools": self.tools, "policy": self.policy, "capability": self.capability,
                "parts": [p.name for p in self.parts]}

    def close(self) -> None:
        for part in self.parts:
            part.close()


def write_chain(folder: Path, record: dict[str, Any]) -> None:
    """A chain's record (``chain.json``: the parts, seeds, samples, episodes and successes of the base policy's
    sampling; its trajectories are the rollout folder ``rollouts/``)."""
    atomic_write_json(folder / CHAIN_RECORD, record)


def chain_records(synthesize_dir: Path) -> dict[str, dict[str, Any]]:
    """{chain: its record} of each ready chain of a synthesize artifact (none when chaining was off)."""
    manifest = read_json(synthesize_dir / "environments.json")
    return {c["chain"]: read_json(synthesize_dir / CHAINS / c["chain"] / CHAIN_RECORD)
            for c in manifest.get(CHAINS, []) if c["status"] == "ready"}


def chain_trajectories(synthesize_dir: Path, chain: str, successes_only: bool = True) -> list[Any]:
    """The base policy's trajectories of one chain (its successes by default): what the gate trains on."""
    trajs = read_trajectories(synthesize_dir / CHAINS / chain / ROLLOUTS)
    return [t for t in trajs if t.success or not successes_only]
