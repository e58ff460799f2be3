"""tau^2-bench (airline, retail) as a steppable :class:`EnvSuite`, on the real ``tau2`` package.

What comes from tau^2 unchanged: tasks and ``split_tasks.json`` splits, the agent system prompt
(``tau2.agent.llm_agent.SYSTEM_PROMPT`` wrapping the domain policy), tool schemas
(``tool.openai_schema`` in tau^2's order), tool execution and tool error messages
(``Environment.get_response``: an unknown tool or bad arguments come back as ``"Error: ..."``),
the opening agent greeting, the user stop tokens, the ``max_errors`` rule and the reward:
``tau2.evaluator.evaluator.evaluate_simulation`` (DB-state hash after replaying the episode's tool
calls vs. after replaying the gold actions, times the communicate-info check), called verbatim.

What is ours: per-step stepping (tau^2's ``Orchestrator`` runs whole episodes), batched user
replies across episodes, and speed. Stock tau^2 parses ``db.json`` (airline: 7 MB) for every
environment, i.e. three times per episode (the episode plus the evaluator's predicted and gold
environments). Here each domain's DB is parsed once per process and every environment gets a
copy-on-write view of it (:class:`CowDict`): a top-level entry (a flight, user, reservation,
order, product) is deep-copied the first time it is looked up by key, so tools mutate private
copies while untouched entries stay shared. tau^2's DB hash (sha256 of the sorted-key JSON of the
whole DB, ~0.1-0.2 s for airline, twice per evaluation) is computed from cached JSON of the shared
entries plus fresh JSON of the owned ones, which gives the identical digest (:func:`db_hash`).
The evaluator gets these environments through a domain constructor registered in tau^2's registry
(``tracekit_cow_<domain>``), so its code runs unchanged and rewards are identical
(``benchmarks/tau2_eval.py`` checks this and times both).

Termination reasons (``StepResult.termination`` / ``Trajectory.termination``): tau^2's
``user_stop`` (the user sent ###STOP###, ###TRANSFER### or ###OUT-OF-SCOPE###), ``agent_stop``
(an agent text containing ###STOP###), ``too_many_errors`` (``max_errors`` error tool results),
``agent_error`` (an empty agent message), ``user_error`` (an empty user message); the runner adds
``max_steps``, ``context_overflow`` and ``error``. As in tau^2, only user/agent stops are scored;
every other ending has reward 0.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

# tau2 imports litellm, which otherwise fetches a price map over the network at import time.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from loguru import logger as _loguru  # noqa: E402
from pydantic import BaseModel  # noqa: E402

# tau2 logs every tool response at DEBUG through loguru's default stderr sink: silence it.
_loguru.disable("tau2")

from tau2.agent.llm_agent import AGENT_INSTRUCTION  # noqa: E402
from tau2.agent.llm_agent import SYSTEM_PROMPT as AGENT_SYSTEM_PROMPT  # noqa: E402
from tau2.data_model import message as t2m  # noqa: E402
from tau2.data_model.simulation import RewardInfo, SimulationRun, TerminationReason  # noqa: E402
from tau2.data_model.tasks import Task as Tau2Task  # noqa: E402
from tau2.environment.environment import Environment  # noqa: E402
from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation  # noqa: E402
from tau2.orchestrator.orchestrator import DEFAULT_FIRST_AGENT_MESSAGE  # noqa: E402
from tau2.registry import registry  # noqa: E402
from tau2.utils.utils import get_dict_hash  # noqa: E402

from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult  # noqa: E402
from tracekit.targets.tau2.users import ScriptedUser, UserScenario, UserSimulator, UserState, stop_token  # noqa: E402
from tracekit.types import Message, Task  # noqa: E402

log = logging.getLogger(__name__)

DOMAINS = ("airline", "retail")
BENCHMARKS = {"tau2_airline": ("airline",), "tau2_retail": ("retail",), "tau2": ("airline", "retail")}
SPLITS = ("train", "test", "base")
AGENT_STOP = "###STOP###"  # tau2's stop token (LLMSoloAgent.STOP_TOKEN); agents may end an episode with it
SCORED = {TerminationReason.USER_STOP.value, TerminationReason.AGENT_STOP.value}
GREETING = DEFAULT_FIRST_AGENT_MESSAGE.content


def is_successful(reward: float) -> bool:
    """tau^2's success criterion (``tau2.metrics.agent_metrics.is_successful``): reward == 1 up to 1e-6."""
    return (1 - 1e-6) <= reward <= (1 + 1e-6)


# ------------------------------------------------------------------ shared DBs, copy-on-write views


class CowDict(dict):
    """A dict over shared base values that deep-copies a value the first time it is looked up by key.

    Key lookups (``[]``, ``get``, ``pop``, ``setdefault``) return private copies, so a tool that
    fetches an entry and mutates it never touches the shared base. Iteration (``values()``,
    ``items()``, C-level reads such as pydantic's ``model_dump``) returns the stored objects without
    copying: tau^2's airline and retail tools only *read* what they iterate (searches, user
    look-ups by email/name), which the tests check by comparing the base DB hash after every gold
    replay. Values stored with ``[]=`` are the view's own.
    """

    __slots__ = ("_owned",)

    def __init__(self, base: Iterable[Any] | dict[Any, Any] = ()):
        super().__init__(base)
        self._owned: set[Any] = set()

    def _own(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        if key not in self._owned:
            value = copy.deepcopy(value)
            dict.__setitem__(self, key, value)
            self._owned.add(key)
        return value

    def __getitem__(self, key: Any) -> Any:
        return self._own(key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self._own(key) if key in self else default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self._own(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key not in self:
            return dict.pop(self, key, *default)
        value = self._own(key)
        dict.pop(self, key)
        self._owned.discard(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        dict.__setitem__(self, key, value)
        self._owned.add(key)

    def __delitem__(self, key: Any) -> None:
        dict.__delitem__(self, key)
        self._owned.discard(key)


@dataclass(frozen=True)
class _DomainSpec:
    db_class: type
    db_path: str
    tools_class: type
    policy_path: str


def _spec(domain: str) -> _DomainSpec:
    if domain == "airline":
        from tau2.domains.airline.data_model import FlightDB
        from tau2.domains.airline.tools import AirlineTools
        from tau2.domains.airline.utils import AIRLINE_DB_PATH, AIRLINE_POLICY_PATH

        return _DomainSpec(FlightDB, str(AIRLINE_DB_PATH), AirlineTools, str(AIRLINE_POLICY_PATH))
    if domain == "retail":
        from tau2.domains.retail.data_model import RetailDB
        from tau2.domains.retail.tools import RetailTools
        from tau2.domains.retail.utils import RETAIL_DB_PATH, RETAIL_POLICY_PATH

        return _DomainSpec(RetailDB, str(RETAIL_DB_PATH), RetailTools, str(RETAIL_POLICY_PATH))
    raise ValueError(f"tau2 domain must be one of {DOMAINS}, got {domain!r}")


@lru_cache(maxsize=None)
def base_db(domain: str) -> Any:
    """The domain's DB, parsed once per process (never mutated: environments get views of it)."""
    spec = _spec(domain)
    t0 = time.perf_counter()
    db = spec.db_class.load(spec.db_path)
    log.info("tau2 %s DB parsed once for this process (%.2fs)", domain, time.perf_counter() - t0)
    return db


def pristine_db_hash(domain: str) -> str:
    """tau^2's hash of a freshly parsed DB (``DB.get_hash``), to check that the shared base is untouched."""
    return _spec(domain).db_class.load(_spec(domain).db_path).get_hash()


def cow_db(domain: str) -> Any:
    """A copy-on-write view of the shared DB: every top-level dict field wrapped in a :class:`CowDict`."""
    base = base_db(domain)
    fields = {}
    for name in type(base).model_fields:
        value = getattr(base, name)
        fields[name] = CowDict(value) if isinstance(value, dict) else copy.deepcopy(value)
    return type(base).model_construct(**fields)


def _entry_json(value: Any) -> str:
    """One DB entry exactly as tau^2's hash serialises it inside the whole DB."""
    return json.dumps(value.model_dump() if isinstance(value, BaseModel) else value, sort_keys=True, default=str)


@lru_cache(maxsize=None)
def _base_entry_json(domain: str) -> dict[str, dict[Any, str]]:
    """Per top-level dict field, the JSON of every base entry (computed once per process)."""
    base = base_db(domain)
    return {
        name: {k: _entry_json(v) for k, v in getattr(base, name).items()}
        for name in type(base).model_fields
        if isinstance(getattr(base, name), dict)
    }


def db_hash(domain: str, db: Any) -> str:
    """tau^2's DB hash (``get_dict_hash(db.model_dump())``: sha256 of ``json.dumps(..., sort_keys=True,
    default=str)``), computed from cached JSON for entries a copy-on-write view has not copied.

    ``json.dumps`` with sorted keys is compositional: the whole document is ``{"field": {"key":
    <entry json>, ...}, ...}`` with keys in sorted order and ``", "`` / ``": "`` separators, so
    re-serialising only the owned (possibly mutated) entries gives the identical digest.
    A DB that is not a view (e.g. rebuilt by ``update_db``) is hashed the stock way.
    """
    fields = type(db).model_fields
    if not all(isinstance(getattr(db, f), CowDict) for f in fields):
        return get_dict_hash(db.model_dump())
    cached = _base_entry_json(domain)
    parts = []
    for name in sorted(fields):
        view: CowDict = getattr(db, name)
        base_json = cached[name]
        items = ", ".join(
            json.dumps(k) + ": " + (_entry_json(dict.__getitem__(view, k)) if k in view._owned else base_json[k])
            for k in sorted(dict.keys(view))
        )
        parts.append(json.dumps(name) + ": {" + items + "}")
    return hashlib.sha256(("{" + ", ".join(parts) + "}").encode()).hexdigest()


@lru_cache(maxsize=None)
def _cow_tools_class(domain: str) -> type:
    """The domain's toolkit with ``get_db_hash`` answered by :func:`db_hash` (same digest, ~20x faster)."""
    tools_class = _spec(domain).tools_class

    def get_db_hash(self: Any) -> str:
        return db_hash(domain, self.db)

    return type(f"Cow{tools_class.__name__}", (tools_class,), {"get_db_hash": get_db_hash})


def make_environment(domain: str, solo_mode: bool = False) -> Environment:
    """A tau^2 environment of ``domain`` on a copy-on-write view of the shared DB (what tau2's
    ``get_environment`` builds, minus the parse)."""
    if solo_mode:
        raise ValueError(f"{domain} domain does not support solo mode")  # as tau2's get_environment
    return Environment(domain_name=domain, policy=policy(domain), tools=_cow_tools_class(domain)(cow_db(domain)))


def stock_environment(domain: str) -> Environment:
    """A tau^2 environment built the stock way (parses db.json), for benchmarks and checks."""
    return registry.get_env_constructor(domain)()


@lru_cache(maxsize=None)
def cow_registry_name(domain: str) -> str:
    """Register :func:`make_environment` for ``domain`` in tau^2's registry (once) and return its name,
    so ``evaluate_simulation`` builds its predicted and gold environments on copy-on-write views."""
    name = f"tracekit_cow_{domain}"
    if name not in registry.get_domains():
        registry.register_domain(lambda solo_mode=False: make_environment(domain, solo_mode), name)
    return name


@lru_cache(maxsize=None)
def tool_schemas(domain: str) -> tuple[dict[str, Any], ...]:
    """The agent's tools as tau^2 passes them to the model: ``[t.openai_schema for t in env.get_tools()]``."""
    return tuple(t.openai_schema for t in make_environment(domain).get_tools())


@lru_cache(maxsize=None)
def policy(domain: str) -> str:
    with open(_spec(domain).policy_path, encoding="utf-8") as f:
        return f.read()


def system_prompt(domain: str) -> str:
    """tau^2's LLM-agent system prompt: its agent instruction + ``<policy>`` (tau2 ``LLMAgent.system_prompt``)."""
    return AGENT_SYSTEM_PROMPT.format(domain_policy=policy(domain), agent_instruction=AGENT_INSTRUCTION)


@lru_cache(maxsize=None)
def load_tasks(domain: str) -> tuple[Tau2Task, ...]:
    return tuple(registry.get_tasks_loader(domain)(None))


@lru_cache(maxsize=None)
def load_splits(domain: str) -> dict[str, tuple[str, ...]]:
    """``split_tasks.json`` of the domain: split name -> tau2 task ids."""
    return {k: tuple(v) for k, v in registry.get_task_splits_loader(domain)().items()}


def evaluate_messages(
    domain: str, task: Tau2Task, messages: list[Any], termination: str, stock: bool = False
) -> RewardInfo:
    """tau^2's reward for an episode: ``evaluate_simulation(..., EvaluationType.ALL)`` verbatim.

    ``messages`` are tau2 messages; ``stock=True`` uses tau^2's own domain constructor (parsing
    db.json twice), otherwise the copy-on-write constructor.
    """
    sim = SimulationRun(
        id="tracekit", task_id=task.id, start_time="", end_time="", duration=0.0,
        termination_reason=TerminationReason(termination), messages=messages,
    )
    name = domain if stock else cow_registry_name(domain)
    return evaluate_simulation(sim, task, EvaluationType.ALL, solo_mode=False, domain=name)


def gold_replay_messages(env: Environment, task: Tau2Task, drop_last: bool = False) -> list[Any]:
    """A tau2 message list replaying the task's gold actions on ``env`` (the last one dropped if
    asked): greeting, a user request, each call with its tool result, a report containing the
    communicate info, the user's ###STOP###. For evaluator checks and benchmarks."""
    actions = list(task.evaluation_criteria.actions or []) if task.evaluation_criteria else []
    if drop_last:
        actions = actions[:-1]
    msgs: list[Any] = [
        t2m.AssistantMessage(role="assistant", content=GREETING),
        t2m.UserMessage(role="user", content="I need help."),
    ]
    for a in actions:
        tool_call = t2m.ToolCall(id=a.action_id, name=a.name, arguments=a.arguments, requestor=a.requestor)
        msgs.append(t2m.AssistantMessage(role="assistant", tool_calls=[tool_call]))
        msgs.append(env.get_response(tool_call))
    info = " ".join(task.evaluation_criteria.communicate_info or []) if task.evaluation_criteria else ""
    msgs.append(t2m.AssistantMessage(role="assistant", content=f"Your request has been processed. {info}"))
    msgs.append(t2m.UserMessage(role="user", content="###STOP###"))
    return msgs


# ------------------------------------------------------------------ tasks


def task_uid(domain: str, tau2_id: str) -> str:
    """Our task id: tau2's id prefixed by the domain (``"airline/12"``), unique across domains."""
    return f"{domain}/{tau2_id}"


def scenario_of(task: Tau2Task) -> UserScenario:
    instr = task.user_scenario.instructions
    structured = not isinstance(instr, str)
    return UserScenario(
        instructions=str(task.user_scenario),
        reason_for_call=instr.reason_for_call if structured else instr,
        known_info=(instr.known_info or "") if structured else "",
        unknown_info=(instr.unknown_info or "") if structured else "",
        task_instructions=instr.task_instructions if structured else "",
    )


def to_task(domain: str, task: Tau2Task) -> Task:
    """Our :class:`Task` for a tau2 task. ``data`` carries the gold actions and communicate info
    (used by the gold agent and by analysis), never shown to a model agent."""
    crit = task.evaluation_criteria
    return Task(
        id=task_uid(domain, task.id),
        env=f"tau2_{domain}",
        instruction=str(task.user_scenario),
        data={
            "domain": domain,
            "tau2_id": task.id,
            "actions": [a.model_dump(mode="json") for a in (crit.actions or [])] if crit else [],
            "communicate_info": list(crit.communicate_info or []) if crit else [],
            "purpose": task.description.purpose if task.description else None,
        },
    )


def select_tasks(
    domains: Iterable[str], split: str = "base", task_ids: Iterable[str] | None = None, limit: int | None = None
) -> list[tuple[str, Tau2Task]]:
    """(domain, tau2 task) pairs: the split's tasks in ``tasks.json`` order, then the subset, then
    the first ``limit`` per domain. ``task_ids`` may be our ids (``airline/3``) or tau2's (``3``,
    matched in every selected domain); ids not in the split raise."""
    if split not in SPLITS:
        raise ValueError(f"benchmark.split must be one of {SPLITS}, got {split!r}")
    if limit is not None and limit < 1:
        raise ValueError(f"benchmark.limit must be >= 1 or null, got {limit}")
    wanted = None if task_ids is None else [str(t) for t in task_ids]
    out: list[tuple[str, Tau2Task]] = []
    matched: set[str] = set()
    for domain in domains:
        in_split = set(load_splits(domain)[split])
        chosen = []
        for t in load_tasks(domain):
            if t.id not in in_split:
                continue
            if wanted is not None:
                hits = {w for w in wanted if w in (t.id, task_uid(domain, t.id))}
                if not hits:
                    continue
                matched |= hits
            chosen.append((domain, t))
        out.extend(chosen[:limit] if limit else chosen)
    if wanted is not None and set(wanted) - matched:
        missing = sorted(set(wanted) - matched)
        raise ValueError(f"benchmark.task_ids not in split {split!r} of {list(domains)}: {missing[:10]}")
    return out


# ------------------------------------------------------------------ episodes


@dataclass
class _UserTurn:
    """An episode waiting for its user's reply to ``text``."""

    text: str


class Tau2Episode(Episode):
    """One tau^2 conversation, stepped one assistant message at a time.

    Keeps two parallel records: our :class:`Message` list (what the agent sees) and tau2's message
    list (what tau^2's evaluator replays). A parse-error message (tool call text that did not
    parse) gets an error tool result and never reaches the user or the tau2 record.
    """

    def __init__(self, suite: Tau2Suite, domain: str, task: Tau2Task, seed: int):
        self.suite = suite
        self.domain = domain
        self.task = task
        self.seed = seed
        self.env: Environment | None = None
        self.user_state: UserState | None = None
        self.tau2_messages: list[Any] = []
        self.done = False
        self.termination = ""
        self.num_errors = 0
        self.stop_token: str | None = None

    # two-phase protocol used by Tau2Suite.reset_batch / step_batch to batch user replies
    def _begin(self) -> _UserTurn:
        if self.env is not None:
            raise RuntimeError(f"episode {self.task.id} was already reset")
        self.env = make_environment(self.domain)
        self.user_state = self.suite.user.start(scenario_of(self.task), self.seed)
        self.tau2_messages = [t2m.AssistantMessage(role="assistant", content=GREETING)]
        return _UserTurn(GREETING)

    def _observation(self, first_user_text: str) -> Observation:
        step = self._receive_user(first_user_text)
        return Observation(
            messages=[
                Message(role="system", content=system_prompt(self.domain)),
                Message(role="assistant", content=GREETING),
                *step.messages,
            ],
            tools=[dict(t) for t in tool_schemas(self.domain)],
            done=step.done,
            termination=step.termination,
        )

    def _apply(self, action: Message) -> StepResult | _UserTurn:
        if self.env is None:
            raise RuntimeError(f"episode {self.task.id}: step() before reset()")
        if self.done:
            raise RuntimeError(f"episode {self.task.id} is done ({self.termination})")
        if action.role != "assistant":
            raise ValueError(f"an agent action must be an assistant message, got role {action.role!r}")
        if action.tool_calls:
            return self._run_tools(action)
        if action.parse_error:
            # tau^2 has no such case (litellm parses calls); the agent sees a tool error and the
            # unparsed text is neither sent to the user nor scored.
            self.num_errors += 1
            err = Message(role="tool", content=f"Error: could not parse the tool call: {action.parse_error}",
                          tool_call_id="parse_error", error=True)
            return self._after_tools([err])
        text = action.content or ""
        if not text.strip():
            return self._finish([], TerminationReason.AGENT_ERROR.value)
        self.tau2_messages.append(t2m.AssistantMessage(role="assistant", content=text))
        if self.suite.agent_can_stop and AGENT_STOP in text:
            return self._finish([], TerminationReason.AGENT_STOP.value)
        return _UserTurn(text)

    def _run_tools(self, action: Message) -> StepResult:
        calls = [t2m.ToolCall(id=c.id, name=c.name, arguments=c.arguments, requestor="assistant")
                 for c in action.tool_calls]
        content = action.content if action.content and action.content.strip() else None
        self.tau2_messages.append(t2m.AssistantMessage(role="assistant", content=content, tool_calls=calls))
        results = []
        for call in calls:
            tool_msg = self.env.get_response(call)  # tool exceptions become "Error: ..." here, as in tau^2
            self.tau2_messages.append(tool_msg)
            self.num_errors += tool_msg.error
            results.append(Message(role="tool", content=tool_msg.content, tool_call_id=call.id, name=call.name,
                                   error=tool_msg.error))
        self.env.sync_tools()
        return self._after_tools(results)

    def _after_tools(self, results: list[Message]) -> StepResult:
        if self.num_errors >= self.suite.max_errors:
            return self._finish(results, TerminationReason.TOO_MANY_ERRORS.value)
        return StepResult(messages=results)

    def _receive_user(self, text: str) -> StepResult:
        msg = Message(role="user", content=text)
        if not text.strip():
            return self._finish([msg], TerminationReason.USER_ERROR.value)
        self.tau2_messages.append(t2m.UserMessage(role="user", content=text))
        token = stop_token(text)
        if token:
            self.stop_token = token
            return self._finish([msg], TerminationReason.USER_STOP.value)
        return StepResult(messages=[msg])

    def _finish(self, messages: list[Message], termination: str) -> StepResult:
        self.done, self.termination = True, termination
        return StepResult(messages=messages, done=True, termination=termination)

    # the Episode protocol (unbatched path)
    def reset(self) -> Observation:
        turn = self._begin()
        return self._observation(self.suite.user.respond([self.user_state], [turn.text])[0])

    def step(self, action: Message) -> StepResult:
        r = self._apply(action)
        if isinstance(r, StepResult):
            return r
        return self._receive_user(self.suite.user.respond([self.user_state], [r.text])[0])

    def outcome(self) -> Outcome:
        """tau^2's reward for user/agent stops (and the 0 it gives every other ending)."""
        info: dict[str, Any] = {"domain": self.domain, "tau2_task_id": self.task.id, "num_errors": self.num_errors}
        if self.stop_token:
            info["user_stop_token"] = self.stop_token
        if not self.done or self.termination not in SCORED:
            note = f"terminated prematurely ({self.termination or 'cut off'}): reward 0 as in tau^2"
            return Outcome(reward=0.0, success=False, info={**info, "note": note})
        ri = evaluate_messages(self.domain, self.task, self.tau2_messages, self.termination)
        info.update(_reward_summary(ri))
        return Outcome(reward=float(ri.reward), success=is_successful(ri.reward), info=info)


def _reward_summary(ri: RewardInfo) -> dict[str, Any]:
    return {
        "db_match": ri.db_check.db_match if ri.db_check else None,
        "communicate": [{"info": c.info, "met": c.met} for c in (ri.communicate_checks or [])],
        "actions_matched": [a.action_match for a in (ri.action_checks or [])],
        "reward_breakdown": {getattr(k, "value", k): v for k, v in (ri.reward_breakdown or {}).items()},
    }


class Tau2Suite(EnvSuite):
    """tau^2 airline and/or retail as an :class:`EnvSuite`.

    ``reset_batch`` / ``step_batch`` answer the simulated users of many episodes with one
    ``user.respond`` call (one batched model call for an LLM user).
    """

    expensive_steps = True  # rollout.env_workers=auto steps its episodes in worker processes (tracekit.envs.pool)

    def __init__(
        self,
        name: str = "tau2",
        domains: Iterable[str] | None = None,
        split: str = "base",
        task_ids: Iterable[str] | None = None,
        limit: int | None = None,
        user: UserSimulator | None = None,
        max_errors: int = 10,
        agent_can_stop: bool = True,
    ):
        if domains is None:
            if name not in BENCHMARKS:
                raise ValueError(f"unknown tau2 benchmark {name!r}: expected one of {sorted(BENCHMARKS)} or domains=")
            domains = BENCHMARKS[name]
        self.domains = tuple(domains)
        for d in self.domains:
            _spec(d)
        if max_errors < 1:
            raise ValueError(f"max_errors must be >= 1, got {max_errors}")
        self.name = name
        self.split = split
        self.user = user if user is not None else ScriptedUser()
        self.max_errors = max_errors
        self.agent_can_stop = agent_can_stop
        self._selected = select_tasks(self.domains, split, task_ids, limit)
        self._by_uid = {task_uid(d, t.id): (d, t) for d, t in self._selected}

    def tasks(self) -> list[Task]:
        return [to_task(d, t) for d, t in self._selected]

    def tau2_task(self, task_id: str) -> tuple[str, Tau2Task]:
        try:
            return self._by_uid[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not in suite {self.name} (split {self.split})") from None

    def episode(self, task: Task, seed: int = 0) -> Tau2Episode:
        domain, t = self.tau2_task(task.id)
        return Tau2Episode(self, domain, t, seed)

    def interface(self) -> dict[str, Any]:
        return {
            d: {"system_prompt": system_prompt(d), "policy": policy(d), "tools": [dict(t) for t in tool_schemas(d)]}
            for d in self.domains
        }

    def reset_batch(self, episodes: list[Episode]) -> list[Observation | Exception]:
        out: list[Any] = [None] * len(episodes)
        pending: list[tuple[int, _UserTurn]] = []
        for i, ep in enumerate(episodes):
            try:
                pending.append((i, ep._begin()))
            except Exception as e:  # noqa: BLE001 - recorded per episode by the runner
                out[i] = e
        self._answer_users(episodes, pending, out, lambda ep, text: ep._observation(text))
        return out

    def step_batch(self, episodes: list[Episode], actions: list[Message]) -> list[StepResult | Exception]:
        out: list[Any] = [None] * len(episodes)
        pending: list[tuple[int, _UserTurn]] = []
        for i, (ep, action) in enumerate(zip(episodes, actions)):
            try:
                r = ep._apply(action)
            except Exception as e:  # noqa: BLE001
                out[i] = e
                continue
            if isinstance(r, _UserTurn):
                pending.append((i, r))
            else:
                out[i] = r
        self._answer_users(episodes, pending, out, lambda ep, text: ep._receive_user(text))
        return out

    def _answer_users(self, episodes, pending, out, deliver) -> None:
        if not pending:
            return
        try:
            replies = self.user.respond([episodes[i].user_state for i, _ in pending], [t.text for _, t in pending])
        except Exception as e:  # noqa: BLE001 - every waiting episode gets the error (an EndpointError is re-raised by the runner)
            for i, _ in pending:
                out[i] = e
            return
        for (i, _), reply in zip(pending, replies):
            try:
                out[i] = deliver(episodes[i], reply)
            except Exception as e:  # noqa: BLE001
                out[i] = e
