"""The coding target as an :class:`~tracekit.envs.base.EnvSuite`: a bash tool, a submit action, a test-based reward.

An episode owns a private copy of its task's buggy tree (:class:`tracekit.targets.coding.repo.Workspace`). Tools:

- ``bash(command)``: one fresh sandboxed subprocess in the copy (:mod:`tracekit.coding.sandbox`: CPU, wall, memory,
  process and file-size limits, no network, writes outside the copy refused); the tool message is the output
  (head and tail past ``output_chars``), the exit code and what the sandbox did. Nothing persists between commands
  but the files.
- ``submit(answer?)``: ends the episode; the copy's ``git diff`` against the base is the model patch.

An assistant message without a tool call gets a one-line reminder (counted as a format error); a malformed call
(unknown tool, missing ``command``) is a tool error the agent sees. The outcome: the patch scored by
:func:`tracekit.targets.coding.reward.evaluate_patch` (reward 1 iff FAIL_TO_PASS and PASS_TO_PASS pass), the SWE-bench
prediction record, the commands run and every containment event, counted. ``reward="swe_rl"`` (the SWE-RL baseline's
training suite) replaces the reward by SWE-RL's patch similarity to the gold patch; success stays test-based.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections import Counter
from typing import Any, Literal

from tracekit.targets.coding.repo import Workspace, read_tree
from tracekit.targets.coding.reward import PatchVerdict, evaluate_patch, prediction, swe_rl_reward
from tracekit.targets.coding.interface import TOOLS
from tracekit.coding.runtime import task_hide
from tracekit.coding.sandbox import CommandLimits, isolation
from tracekit.targets.coding.tasks import CodingTask, TaskSet
from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.types import Message, Task

log = logging.getLogger(__name__)

RewardKind = Literal["tests", "swe_rl"]
REMINDER = ("No tool call found. Call `bash` with a command to inspect, edit or test the repository, "
            "or `submit` when the fix is done.")


def system_prompt(task: CodingTask) -> str:
    tests = " ".join(sorted({t.split("::")[0] for t in task.FAIL_TO_PASS}))
    return (f"You are a software engineer fixing a bug in the Python package {task.repo} (its source and its tests "
            "are in the current directory). Use the `bash` tool to read files (cat, grep -n, sed -n), edit them "
            "(sed -i, python scripts, cat > file <<'EOF') and run tests, e.g. `python -m pytest -q "
            f"{tests}`. Make the smallest change that fixes the bug, do not edit the tests, check that the tests "
            "pass, then call `submit`.")


def gold_actions(task: CodingTask) -> list[dict[str, Any]]:
    """The gold agent's script through the agent interface: apply the gold patch, run the failing tests, submit."""
    marker = "TRACEKIT_GOLD_PATCH_EOF"
    apply = f"cat > /tmp/gold.patch <<'{marker}'\n{task.patch}{marker}\ngit apply /tmp/gold.patch && git status --short && git diff --stat"
    test = "python -m pytest -q -p no:cacheprovider " + " ".join(sorted({t.split("::")[0] for t in task.FAIL_TO_PASS}))
    return [{"name": "bash", "arguments": {"command": apply}}, {"name": "bash", "arguments": {"command": test}},
            {"name": "submit", "arguments": {}}]


class CodingEpisode(Episode):
    def __init__(self, suite: CodingSuite, task: CodingTask):
        self.suite, self.task = suite, task
        self.ws: Workspace | None = None
        self.commands: list[dict[str, Any]] = []
        self.format_errors = 0
        self.submitted = False
        self.answer = ""
        self._outcome: Outcome | None = None

    def reset(self) -> Observation:
        self.ws = Workspace(self.suite.taskset.buggy_tree(self.task), prefix="ep-", agent_git=True,
                            disk_bytes=self.suite.limits.disk_bytes, hide=task_hide(self.task.repo))
        weakref.finalize(self, self.ws.close)  # an episode dropped before its outcome leaves no copy behind
        return Observation(messages=[Message(role="system", content=system_prompt(self.task)),
                                     Message(role="user", content=self.task.problem_statement)], tools=TOOLS)

    def step(self, action: Message) -> StepResult:
        if self.ws is None:
            raise RuntimeError("step() before reset()")
        if not action.tool_calls:
            self.format_errors += 1
            return StepResult([Message(role="user", content=REMINDER)])
        out: list[Message] = []
        for call in action.tool_calls:
            if self.submitted:
                out.append(Message(role="tool", content="Error: already submitted.", tool_call_id=call.id,
                                   name=call.name, error=True))
                continue
            args = call.arguments if isinstance(call.arguments, dict) else {}
            if call.name == "submit":
                self.submitted = True
                self.answer = str(args.get("answer", ""))[:500]
                out.append(Message(role="tool", content="Submitted.", tool_call_id=call.id, name=call.name))
            elif call.name == "bash" and isinstance(args.get("command"), str) and args["command"].strip():
                r = self.ws.run(args["command"], self.suite.limits)
                self.commands.append({"command": args["command"][:2000], "returncode": r.returncode,
                                      "events": r.events, "wall_s": r.wall_s})
                if r.contained:
                    log.info("coding episode %s: command contained (%s): %s", self.task.instance_id,
                             ", ".join(r.events), args["command"][:120])
                out.append(Message(role="tool", content=r.for_agent(), tool_call_id=call.id, name=call.name,
                                   error=r.returncode != 0))
            else:
                self.format_errors += 1
                why = (f"Tool '{call.name}' not found (tools: bash, submit)." if call.name not in ("bash", "submit")
                       else "bash needs a non-empty string argument 'command'.")
                out.append(Message(role="tool", content=f"Error: {why}", tool_call_id=call.id, name=call.name,
                                   error=True))
        return StepResult(out, done=self.submitted, termination="submitted" if self.submitted else "")

    def outcome(self) -> Outcome:
        if self._outcome is not None:
            return self._outcome
        patch, final = "", None
        buggy = self.suite.taskset.buggy_tree(self.task)
        try:
            if self.ws is not None:
                patch = self.ws.diff()
                final = read_tree(self.ws.repo) if self.suite.reward == "swe_rl" else None
        finally:
            if self.ws is not None:
                self.ws.close()
        verdict = evaluate_patch(self.task, buggy, patch, self.suite.eval_limits)
        reward = verdict.reward
        if self.suite.reward == "swe_rl":
            changed = None if final is None else {p: final.get(p, "") for p in set(buggy) | set(final)
                                                  if final.get(p, "") != buggy.get(p, "")}
            oracle = {p: self.suite.taskset.pristine.get(p, "") for p in self.task.buggy_files}
            reward = swe_rl_reward(buggy, oracle, changed)
        events = Counter(e for c in self.commands for e in c["events"])
        self._outcome = Outcome(reward=float(reward), success=verdict.resolved, info={
            "prediction": prediction(self.task.instance_id, self.suite.model_name, patch),
            "status": verdict.status, "submitted": self.submitted, "answer": self.answer,
            "tests": _verdict_info(verdict), "commands": self.commands, "sandbox_events": dict(events),
            "format_errors": self.format_errors, "reward_kind": self.suite.reward, "modifier": self.task.modifier,
            "entity": self.task.entity, "gold_patch_lines": _changed_lines(self.task.patch),
            "copy_cut": self.ws.cut if self.ws is not None else []})  # what the patch left out of the copy
        return self._outcome


def _verdict_info(v: PatchVerdict) -> dict[str, Any]:
    """The verdict as the episode records it: what the patch changed that the reward did not take (``dropped``)
    and why the run was not trusted (``tampering``) included."""
    return {"status": v.status, "fail_to_pass": v.fail_to_pass, "pass_to_pass_failed": v.pass_to_pass_failed[:20],
            "detail": v.detail[-400:], "wall_s": v.wall_s, "dropped": v.dropped[:50], "tampering": v.tampering[:20]}


class CodingSuite(EnvSuite):
    """Tasks of one split of a generated :class:`TaskSet` (optionally the first ``limit`` or named ones)."""

    expensive_steps = True  # rollout.env_workers=auto steps its episodes in worker processes (tracekit.envs.pool)

    def __init__(self, name: str, taskset: TaskSet, split: str = "test", limit: int | None = None,
                 task_ids: list[str] | None = None, limits: CommandLimits = CommandLimits(),
                 eval_limits: CommandLimits | None = None, reward: RewardKind = "tests", model_name: str = "tracekit"):
        if reward not in ("tests", "swe_rl"):
            raise ValueError(f"coding suite: reward must be 'tests' or 'swe_rl', got {reward!r}")
        self.name, self.taskset, self.split, self.limits = name, taskset, split, limits
        self.eval_limits = eval_limits or CommandLimits(cpu_seconds=120, wall_seconds=120)
        self.reward, self.model_name = reward, model_name
        chosen = taskset.split(split)
        if task_ids:
            by_id = {t.instance_id: t for t in taskset.tasks}
            missing = [i for i in task_ids if i not in by_id]
            if missing:
                raise ValueError(f"coding suite: unknown task id(s) {missing[:3]} (ids: {', '.join(list(by_id)[:3])}, ...)")
            chosen = [by_id[i] for i in task_ids]
        if limit is not None:
            chosen = chosen[:limit]
        if not chosen:
            raise ValueError(f"coding suite {name}: no task in split {split!r} (generated: {taskset.report.get('splits')})")
        self._tasks = {t.instance_id: t for t in chosen}

    def coding_tasks(self) -> list[CodingTask]:
        return list(self._tasks.values())

    def tasks(self) -> list[Task]:
        return [Task(id=t.instance_id, env=self.name, instruction=t.problem_statement, data={
            "repo": t.repo, "modifier": t.modifier, "entity": t.entity, "FAIL_TO_PASS": t.FAIL_TO_PASS,
            "n_pass_to_pass": len(t.PASS_TO_PASS), "actions": gold_actions(t), "communicate_info": []})
            for t in self._tasks.values()]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        if task.id not in self._tasks:
            raise KeyError(f"coding suite {self.name}: no task {task.id!r}")
        return CodingEpisode(self, self._tasks[task.id])

    def interface(self) -> dict[str, Any]:
        return {"tools": TOOLS, "policy": system_prompt(next(iter(self._tasks.values()))), "isolation": isolation()}


def predictions_jsonl(trajectories: list[Any]) -> str:
    """SWE-bench predictions (one JSON object a line) from rolled-out trajectories' outcome info."""
    rows = [t.info["prediction"] for t in trajectories if isinstance(t.info.get("prediction"), dict)]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _changed_lines(patch: str) -> int:
    return sum(1 for line in patch.splitlines() if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))
