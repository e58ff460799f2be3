"""Trajectories made by replaying a list of tool calls through the real tau^2 environment.

For checking the reference labeler and for offline benchmarks of the analysis stages: the gold
actions of a task (success by construction) or a perturbed copy (a dropped write, an altered
argument, an extra write). Tool results come from tau^2's own tools on its own database; the
success label is tau^2's reward basis for airline/retail: the final database hash equals the
gold replay's, and every ``communicate_info`` item is in an assistant message.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from tracekit.types import Message, ToolCall, Trajectory


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@cache
def _domain(domain: str) -> tuple[Any, dict[str, Any], Any, str]:
    """(environment module, {task id: tau2 task}, database class, its initial state as JSON)."""
    mod = importlib.import_module(f"tau2.domains.{domain}.environment")
    db = mod.get_environment().tools.db
    return mod, {str(t.id): t for t in mod.get_tasks(None)}, type(db), db.model_dump_json()


def tau2_task(domain: str, task_id: str) -> Any:
    tasks = _domain(domain)[1]
    if task_id not in tasks:
        raise KeyError(f"tau2 {domain} has no task {task_id!r}")
    return tasks[task_id]


def gold_calls(domain: str, task_id: str) -> list[Call]:
    """The task's assistant-side gold actions as calls."""
    crit = tau2_task(domain, task_id).evaluation_criteria
    return [Call(a.name, dict(a.arguments)) for a in (crit.actions or []) if a.requestor == "assistant"]


def _run(domain: str, calls: Sequence[Call]) -> tuple[list[tuple[str, bool]], str]:
    """Execute calls on a fresh copy of the domain database: ([(result json, is_error)], db hash)."""
    from tau2.data_model.message import ToolCall as Tau2ToolCall

    mod, _, db_cls, db_json = _domain(domain)
    env = mod.get_environment(db=db_cls.model_validate_json(db_json))  # a fresh copy, faster than deepcopy
    out = []
    for i, c in enumerate(calls):
        msg = env.get_response(Tau2ToolCall(id=f"call_{i}", name=c.name, arguments=c.arguments))
        out.append((msg.content, bool(msg.error)))
    return out, env.get_db_hash()


@cache
def _gold_hash(domain: str, task_id: str) -> str:
    return _run(domain, gold_calls(domain, task_id))[1]


def replay_trajectory(
    domain: str,
    task_id: str,
    calls: Sequence[Call] | None = None,
    final_message: str | None = None,
    parse_error_turn: bool = False,
    sample: int = 0,
) -> Trajectory:
    """A trajectory that makes ``calls`` (default: the gold actions) one per assistant turn.

    The user's opening message is the task's user-scenario instructions; the closing assistant
    message is ``final_message`` (default: one that states every ``communicate_info`` item).
    ``parse_error_turn`` inserts an assistant turn whose tool call failed to parse.
    """
    task = tau2_task(domain, task_id)
    crit = task.evaluation_criteria
    gold = gold_calls(domain, task_id)
    calls = gold if calls is None else list(calls)
    info = list(crit.communicate_info or [])
    if final_message is None:
        final_message = "All done. " + " ".join(f"Note: {i}." for i in info)
    results, db_hash = _run(domain, calls)
    gold_hash = db_hash if calls == gold else _gold_hash(domain, task_id)

    instr = task.user_scenario.instructions
    user = instr if isinstance(instr, str) else " ".join(
        str(v) for v in instr.model_dump().values() if isinstance(v, str)
    )
    msgs = [Message(role="system", content=f"tau2 {domain} policy"), Message(role="user", content=user)]
    if parse_error_turn:
        msgs += [
            Message(role="assistant", content='<tool_call>{"name": ', parse_error="unterminated JSON in tool call"),
            Message(role="user", content="Please go on."),
        ]
    for i, (c, (content, err)) in enumerate(zip(calls, results)):
        msgs.append(Message(role="assistant", tool_calls=[ToolCall(id=f"call_{i}", name=c.name, arguments=c.arguments)]))
        msgs.append(Message(role="tool", tool_call_id=f"call_{i}", name=c.name, content=content, error=err))
    msgs.append(Message(role="assistant", content=final_message))
    said = all(i.lower() in final_message.lower().replace(",", "") for i in info)
    success = db_hash == gold_hash and said
    return Trajectory(
        task_id=f"{domain}/{task_id}",  # as the tau^2 adapter names tasks
        env=f"tau2_{domain}",
        sample=sample,
        messages=msgs,
        reward=float(success),
        success=success,
        termination="agent_stop",
        info={"domain": domain, "tau2_task_id": task_id, "replay": json.dumps([c.name for c in calls])},
    )
