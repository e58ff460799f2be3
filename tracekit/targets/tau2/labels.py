"""Reference labeler for tau^2-bench: a documented heuristic, no LLM.

It labels the fixed dictionary ``dictionary.yaml`` (beside it) from a trajectory's tool
calls and the task's gold actions (``evaluation_criteria.actions``, assistant-requested).
Tools are split by tau^2's own tool types: WRITE tools change the database; READ and GENERIC
(``calculate``, ``transfer_to_human_agents``) do not.

Step 1, alignment of the agent's write calls with the gold write actions:
  a. exact pairs: each agent write call, in order, takes the first unpaired gold write with the
     same name whose arguments match (tau^2's rule: ``compare_args`` when given, else every
     argument of either side, compared with ``==``);
  b. wrong-argument pairs: each still-unpaired gold write takes the first unpaired agent write
     call of the same tool;
  c. what is left: gold writes never attempted, and extra agent write calls. A tool result is an
     error when the message is flagged ``error`` or starts with tau^2's ``"Error:"`` prefix; an
     extra call only counts as a state change when its result is not an error.

Step 2, labels (NA when the capability's condition does not arise in the task):
- tool_calling_precision: NA if the task has no gold action. LACKING if a wrong-argument pair
  exists (right write tool, wrong arguments), an assistant message failed to parse as a tool
  call, a call names a tool the domain does not have, or the agent never called a tool (the
  capability was needed and not exercised). Else PRESENT.
- multi_step_task_completion: NA if the task has no gold write. LACKING if some gold write was
  never attempted (this covers a strict prefix of the required writes followed by stopping, and
  a task whose only write never comes after the look-ups). Else PRESENT.
- precondition_verification: NA if neither the gold nor the agent's successful calls contain a
  write. LACKING if an extra write call went through (a state change the correct resolution
  does not contain, i.e. not allowed by policy for this task). Else PRESENT, also when the
  agent changed nothing (the heuristic cannot see whether eligibility was checked).
- structured_data_reasoning: NA if the task has neither a gold write (whose arguments come from
  records: ids, items, payment methods) nor ``communicate_info``. LACKING if
  (i) a wrong-argument pair differs on a value that the gold has and that was in a tool result
  the agent had received before that call but was not said by the user before it (the right
  value was in the retrieved records; a wrong one was used), or
  (ii) the agent got at least one non-error read/generic result, yet some ``communicate_info``
  item (a looked-up or computed value the user must be told) is in no assistant message
  (tau^2's check: case-insensitive, commas removed from the message), or
  (iii) the agent got no non-error read/generic result at all and did not get every gold write
  exactly right and every item told (needed, never exercised). Else PRESENT.
The rules are not mutually exclusive (a wrong data-derived argument is lacking both precision
and data reasoning), like the paper's coverage counts.

Label noise (``noise`` > 0, off by default): the heuristic is deterministic, so its N runs are
identical. To emulate annotator variance, each applicable label (PRESENT/LACKING) is flipped to
the other value with probability ``noise``, independently per (run, trajectory, capability), from
a generator seeded by (seed, run, trajectory, capability). NA decisions are never changed.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.rules import RuleLabeler
from tracekit.synthesis.library import family_environments, library_env
from tracekit.types import Capability, LabelValue, Message, Trajectory

log = logging.getLogger(__name__)

REFERENCE_DICTIONARY_PATH = Path(__file__).with_name("dictionary.yaml")
SDR, TCP, MSC, PV = (
    "structured_data_reasoning",
    "tool_calling_precision",
    "multi_step_task_completion",
    "precondition_verification",
)
DOMAINS = ("airline", "retail", "telecom", "mock")
_MISSING = object()
_STRIP = ".,;:!?()[]{}\"'"


def reference_dictionary() -> list[Capability]:
    """The fixed tau^2 dictionary the reference labeler labels."""
    return load_dictionary(REFERENCE_DICTIONARY_PATH)


@dataclass(frozen=True)
class GoldAction:
    name: str
    arguments: dict[str, Any]
    compare_args: tuple[str, ...] | None = None

    def matches(self, arguments: dict[str, Any]) -> bool:
        """tau^2's action match: ``compare_args`` if given, else all keys of either side, by ``==``."""
        keys = self.compare_args if self.compare_args is not None else set(self.arguments) | set(arguments)
        return all(self.arguments.get(k, _MISSING) == arguments.get(k, _MISSING) for k in keys)


@dataclass(frozen=True)
class GoldSpec:
    """What the reference labeler needs of one tau^2 task."""

    domain: str
    task_id: str
    actions: tuple[GoldAction, ...]
    communicate_info: tuple[str | tuple[str, ...], ...]  # each item, or a group of alternatives, must be told
    write_tools: frozenset[str]
    tools: frozenset[str]

    @property
    def writes(self) -> list[GoldAction]:
        return [a for a in self.actions if a.name in self.write_tools]


def _domain_module(domain: str) -> Any:
    try:
        return importlib.import_module(f"tau2.domains.{domain}.environment")
    except ImportError as e:
        raise ImportError(f"reference labeler: cannot load tau2 domain {domain!r}: {e}") from e


@functools.cache
def domain_tools(domain: str) -> tuple[frozenset[str], frozenset[str]]:
    """(every tool, the write tools) of a tau^2 domain, by tau^2's own tool types (its database loads once)."""
    env = _domain_module(domain).get_environment()
    tools = frozenset(env.tools.tools)
    return tools, frozenset(n for n in tools if env.tools.tool_type(n).value == "write")


def tau2_gold(domains: Iterable[str] = ("airline", "retail")) -> dict[tuple[str, str], GoldSpec]:
    """Gold specs of every task of the given tau^2 domains, keyed by (domain, task id).

    Reads the tasks and tool types straight from the ``tau2`` package (the real benchmark data).
    """
    out: dict[tuple[str, str], GoldSpec] = {}
    for domain in domains:
        tools, writes = domain_tools(domain)
        for task in _domain_module(domain).get_tasks(None):
            crit = task.evaluation_criteria
            acts = [a for a in (crit.actions or []) if a.requestor == "assistant"] if crit else []
            out[(domain, str(task.id))] = GoldSpec(
                domain=domain,
                task_id=str(task.id),
                actions=tuple(
                    GoldAction(a.name, dict(a.arguments), tuple(a.compare_args) if a.compare_args is not None else None)
                    for a in acts
                ),
                communicate_info=tuple((crit.communicate_info or []) if crit else []),
                write_tools=writes,
                tools=tools,
            )
    return out


def _library_tau2_envs() -> tuple[str, ...]:
    return family_environments("tau2")  # the library's tau^2 family (each entry declares its family)


def library_gold(env: str, difficulty: int, seed: int) -> GoldSpec:
    """The gold spec of instance ``seed`` of built-in tau^2 environment ``env``: its ground-truth calls as the
    gold actions (compared on every argument), its expected outputs as the information to communicate, the
    write tools of the tau^2 domain whose tools it keeps."""
    cls = library_env(env)
    domain = cls.target.removeprefix("tau2_")
    inst = cls(difficulty).generate(seed)
    tools, writes = domain_tools(domain)
    return GoldSpec(domain=domain, task_id=f"{env}/seed-{seed}",
                    actions=tuple(GoldAction(c.name, dict(c.arguments)) for c in inst.solution),
                    communicate_info=tuple(tuple(group) for group in inst.expected_outputs),
                    write_tools=writes, tools=tools)


def trajectory_task(traj: Trajectory) -> tuple[str, str]:
    """(tau^2 domain, tau^2 task id) of a trajectory.

    Domain: ``info["domain"]`` if set, else the one domain named in ``env`` (``tau2_retail``).
    Task id: ``info["tau2_task_id"]`` if set, else ``task_id`` without a ``<domain>/`` prefix
    (the tau^2 adapter writes ``retail/5``).
    """
    domain = traj.info.get("domain")
    if not isinstance(domain, str):
        hits = [d for d in DOMAINS if d in traj.env.lower()]
        if len(hits) != 1:
            raise ValueError(f"cannot tell the tau2 domain of env {traj.env!r} (set info['domain'])")
        domain = hits[0]
    task = traj.info.get("tau2_task_id")
    if task is None:
        task = traj.task_id.removeprefix(f"{domain}/")
    return domain, str(task)


# ---------------------------------------------------------------- trajectory side


@dataclass
class AgentCall:
    """One tool call of the agent with its result and what the agent had seen before it."""

    name: str
    arguments: dict[str, Any]
    ok: bool  # a result came back and it is not an error
    seen_values: set[str]  # scalar values in tool results received before this call
    user_text: str  # everything the user said before this call, lowercased


def _is_error(m: Message) -> bool:
    return m.error or (m.content or "").lstrip().startswith("Error:")


def _norm(v: Any) -> str:
    return v.strip().lower() if isinstance(v, str) else json.dumps(v)


def _scalar_values(text: str) -> set[str]:
    """Scalar leaves of a JSON tool result (normalized); words of a non-JSON one."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return {w.strip(_STRIP).lower() for w in text.split()} - {""}
    return {_norm(v) for _, v in _leaves(obj)}


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, scalar) pairs of a nested JSON value; paths like ``flights[0].date``."""
    if isinstance(obj, dict):
        return [leaf for k, v in obj.items() for leaf in _leaves(v, f"{path}.{k}" if path else str(k))]
    if isinstance(obj, list):
        return [leaf for i, v in enumerate(obj) for leaf in _leaves(v, f"{path}[{i}]")]
    return [(path, obj)]


def agent_calls(traj: Trajectory) -> tuple[list[AgentCall], int]:
    """The agent's tool calls in order, and the number of assistant messages with a parse error.

    Results are paired by ``tool_call_id``, else by position among the tool messages that follow.
    """
    calls: list[AgentCall] = []
    parse_errors = 0
    seen: set[str] = set()
    user_text = ""
    msgs = traj.messages
    for i, m in enumerate(msgs):
        if m.role == "user":
            user_text += " " + (m.content or "").lower()
        elif m.role == "tool":
            seen |= _scalar_values(m.content or "")
        elif m.role == "assistant":
            parse_errors += m.parse_error is not None
            results = []
            for r in msgs[i + 1 :]:
                if r.role != "tool":
                    break
                results.append(r)
            by_id = {r.tool_call_id: r for r in results if r.tool_call_id}
            for j, c in enumerate(m.tool_calls):
                res = by_id.get(c.id) or (results[j] if j < len(results) and not results[j].tool_call_id else None)
                calls.append(AgentCall(c.name, dict(c.arguments), res is not None and not _is_error(res), set(seen), user_text))
    return calls, parse_errors


# ---------------------------------------------------------------- the heuristic


@dataclass
class Alignment:
    exact: list[tuple[GoldAction, AgentCall]] = field(default_factory=list)
    wrong_args: list[tuple[GoldAction, AgentCall]] = field(default_factory=list)
    unattempted: list[GoldAction] = field(default_factory=list)
    extra: list[AgentCall] = field(default_factory=list)


def align_writes(gold_writes: Sequence[GoldAction], calls: Sequence[AgentCall]) -> Alignment:
    """Pair agent write calls with gold writes: exact matches first, then same tool (wrong arguments)."""
    free_gold = list(gold_writes)
    al = Alignment()
    rest: list[AgentCall] = []
    for c in calls:
        g = next((g for g in free_gold if g.name == c.name and g.matches(c.arguments)), None)
        if g is None:
            rest.append(c)
        else:
            free_gold.remove(g)
            al.exact.append((g, c))
    for g in free_gold:
        c = next((c for c in rest if c.name == g.name), None)
        if c is None:
            al.unattempted.append(g)
        else:
            rest.remove(c)
            al.wrong_args.append((g, c))
    al.extra = rest
    return al


def _mentioned(value: Any, user_text: str) -> bool:
    """Did the user say this value? Strings by substring, numbers by whole word."""
    if isinstance(value, str):
        return value.strip().lower() in user_text
    return _norm(value) in {w.strip(_STRIP) for w in user_text.split()}


def _data_errors(g: GoldAction, c: AgentCall) -> list[str]:
    """Argument paths where the agent's value differs from a gold value it had retrieved (not been told)."""
    keys = g.compare_args if g.compare_args is not None else sorted(set(g.arguments) | set(c.arguments))
    gold = dict(_leaves({k: g.arguments[k] for k in keys if k in g.arguments}))
    agent = dict(_leaves({k: c.arguments[k] for k in keys if k in c.arguments}))
    return [
        p
        for p, v in gold.items()
        if agent.get(p, _MISSING) != v
        and v is not None
        and _norm(v) in c.seen_values
        and not _mentioned(v, c.user_text)
    ]


def _said(info: str | tuple[str, ...], traj: Trajectory) -> bool:
    """tau^2's communicate check (case-insensitive substring, commas removed); a group: any alternative."""
    alternatives = [info] if isinstance(info, str) else list(info)
    told = [m.content.lower().replace(",", "") for m in traj.messages if m.role == "assistant" and m.content]
    return any(a.lower().replace(",", "") in t for a in alternatives for t in told)


def reference_labels(traj: Trajectory, spec: GoldSpec) -> dict[str, tuple[LabelValue, str]]:
    """{capability: (label, one-line rationale)} for the four reference capabilities (see module doc)."""
    calls, parse_errors = agent_calls(traj)
    writes = [c for c in calls if c.name in spec.write_tools]
    gold_writes = spec.writes
    al = align_writes(gold_writes, writes)
    out: dict[str, tuple[LabelValue, str]] = {}

    # tool calling precision
    unknown = sorted({c.name for c in calls if c.name not in spec.tools})
    if not spec.actions:
        out[TCP] = (LabelValue.NA, "the task needs no tool action")
    elif al.wrong_args or parse_errors or unknown or not calls:
        why = ["never called a tool"] if not calls else []
        why += [f"{g.name} called with wrong arguments" for g, _ in al.wrong_args[:2]]
        why += [f"{parse_errors} unparsable tool call(s)"] if parse_errors else []
        why += [f"unknown tool(s) {unknown}"] if unknown else []
        out[TCP] = (LabelValue.LACKING, "; ".join(why))
    else:
        out[TCP] = (LabelValue.PRESENT, "every required write called with the gold arguments; no malformed calls")

    # multi-step task completion
    if not gold_writes:
        out[MSC] = (LabelValue.NA, "the task has no multi-step state change")
    elif al.unattempted:
        done = len(al.exact) + len(al.wrong_args)
        out[MSC] = (
            LabelValue.LACKING,
            f"attempted {done} of {len(gold_writes)} required writes; never attempted "
            + ", ".join(g.name for g in al.unattempted),
        )
    else:
        out[MSC] = (LabelValue.PRESENT, f"attempted all {len(gold_writes)} required writes")

    # precondition verification
    applied_extra = [c for c in al.extra if c.ok]
    if not gold_writes and not any(c.ok for c in writes):
        out[PV] = (LabelValue.NA, "no state change at stake (no gold write, no agent write)")
    elif applied_extra:
        out[PV] = (
            LabelValue.LACKING,
            "state-changing call(s) outside the correct resolution: " + ", ".join(c.name for c in applied_extra[:3]),
        )
    else:
        out[PV] = (LabelValue.PRESENT, "no state change beyond the correct resolution")

    # structured data reasoning
    if not gold_writes and not spec.communicate_info:
        out[SDR] = (LabelValue.NA, "no write and nothing to report from the records")
    else:
        wrong = [(g.name, p) for g, c in al.wrong_args for p in _data_errors(g, c)]
        had_data = any(c.ok and c.name not in spec.write_tools for c in calls)
        untold = [i for i in spec.communicate_info if not _said(i, traj)]
        all_right = not al.wrong_args and not al.unattempted and not untold
        if wrong or (had_data and untold) or not (had_data or all_right):
            why = [f"{n}: wrong value at {p} though the right one was retrieved" for n, p in wrong[:2]]
            why += [f"looked data up but never told the user {untold[:2]}"] if had_data and untold else []
            why += [] if had_data or all_right else ["never looked up the records the task depends on"]
            out[SDR] = (LabelValue.LACKING, "; ".join(why))
        else:
            out[SDR] = (LabelValue.PRESENT, "values used and reported match the retrieved records")
    return out


# ---------------------------------------------------------------- the labeler


class ReferenceLabeler(RuleLabeler):
    """Labels the tau^2 reference dictionary with :func:`reference_labels` against each task's gold actions."""

    capabilities = (SDR, TCP, MSC, PV)
    dictionary_path = REFERENCE_DICTIONARY_PATH
    unjudged = "no gold actions known for this task"

    def __init__(self, gold: Mapping[tuple[str, str], GoldSpec] | None = None, noise: float = 0.0):
        super().__init__(noise)
        self._gold: dict[tuple[str, str], GoldSpec] = dict(gold or {})
        self._loaded: set[str] = {d for d, _ in self._gold}

    def spec(self, traj: Trajectory) -> GoldSpec | None:
        """The gold spec of a trajectory's task (loading its domain from tau2 on first use); a trajectory of a
        built-in tau^2 synthetic environment (a ``benchmark.kind=synthetic`` target) gets its instance's."""
        if traj.env in _library_tau2_envs():  # one instance per (env, difficulty, seed), built once
            key = (traj.env, f"seed-{traj.info['seed']}@{traj.info['difficulty']}")
            if key not in self._gold:
                self._gold[key] = library_gold(traj.env, int(traj.info["difficulty"]), int(traj.info["seed"]))
            return self._gold[key]
        domain, task = trajectory_task(traj)
        if domain not in self._loaded:
            self._gold.update(tau2_gold([domain]))
            self._loaded.add(domain)
        return self._gold.get((domain, task))

    def rules(self, traj: Trajectory) -> dict[str, tuple[LabelValue, str]] | None:
        spec = self.spec(traj)
        return reference_labels(traj, spec) if spec is not None else None
