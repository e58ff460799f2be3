"""The ToolSandbox environment server: apple/ToolSandbox's own machinery behind a JSON-lines protocol.

Runs inside ToolSandbox's own virtual environment (its pinned dependencies conflict with tracekit's), as
``<venv>/bin/python toolsandbox_server.py``; it imports only the standard library and ``tool_sandbox``, never
tracekit. :mod:`tracekit.targets.toolsandbox.suite` starts, health-checks, restarts and stops it.

Protocol: one JSON object per line. Request ``{"id": n, "op": ..., ...}``; reply ``{"id": n, "ok": true,
"result": ...}`` or ``{"id": n, "ok": false, "error": "<Type>: <message>", "scenario_error": bool}``
(``scenario_error``: the exception came out of ToolSandbox while it played the scenario). The first line the
server writes is ``{"ready": true, ...}`` once the scenarios are loaded. Everything else ToolSandbox prints
(tqdm, logging, stray prints) goes to stderr: stdout carries the protocol only.

Ops:
- ``ping``: liveness and what the server holds.
- ``scenarios {variants}``: the 129 base scenarios (category ``NO_DISTRACTION_TOOLS``) and the named variants
  asked for; per scenario its categories, allowed tools, whether a tool needs RapidAPI, ``max_messages`` and
  the oracle script (the calls and agent messages its milestones define, in DAG order).
- ``reset {episode, scenario, user}``: a fresh copy of the scenario's starting execution context, the system's
  execution-environment messages run exactly as ``Scenario.play`` runs them; returns what the agent sees (its
  messages, the allowed tools in OpenAI format from ToolSandbox's own converter).
- ``step {episode, action, forced_user}``: the agent's message enters the sandbox database as
  ``OpenAIAPIAgent`` writes it (tool calls -> Python code via ``openai_tool_call_to_python_code``, to the
  execution environment; text -> to the user), then the roles respond as in ``Scenario.play``'s loop (the
  execution environment, the user) until a message is addressed to the agent again, the conversation ends
  (the user's ``end_conversation`` tool) or ``max_messages`` is reached.
- ``evaluate {episode}``: ``scenario.evaluation.evaluate(context, max_turn_count=scenario.max_messages)``.
- ``restore {episode, scenario, user, steps}``: rebuild an episode by replaying its actions with the user's
  recorded turns (after a restart).
- ``play {scenario, actions, user_turns}``: ToolSandbox's own ``Scenario.play`` with roles that replay a
  recorded trajectory, then its evaluation: the independent check of what tracekit recorded.
- ``close {episode}``, ``shutdown``.

Users: ``{"kind": "scripted"}`` (offline; from the scenario's own messages: the first time the agent asks a
question it answers with the task the scenario's system message gives the user, otherwise it ends the
conversation with ToolSandbox's ``end_conversation`` tool), or ``{"kind": "llm", "base_url", "model",
"api_key_env", "temperature", "max_tokens", "seed"}`` (ToolSandbox's ``OpenAIAPIUser``, its OpenAI client
pointed at the configured endpoint instead of api.openai.com).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys
import traceback
from typing import Any

PROTOCOL = 1


def _protocol_stdout() -> Any:
    """The real stdout for protocol lines; ``sys.stdout`` (and fd 1) go to stderr from here on."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8")


OUT = _protocol_stdout()

import tool_sandbox.tools.rapid_api_search_tools as _rapid
from openai.types.chat.chat_completion_message_tool_call import (
    ChatCompletionMessageToolCall,
    Function,
)
from tool_sandbox.common.execution_context import (
    DatabaseNamespace,
    RoleType,
    ScenarioCategories,
    get_current_context,
    set_current_context,
)
from tool_sandbox.common.message_conversion import (
    Message,
    openai_tool_call_to_python_code,
)
from tool_sandbox.common.tool_conversion import convert_to_openai_tools
from tool_sandbox.roles.base_role import BaseRole
from tool_sandbox.roles.execution_environment import ExecutionEnvironment
from tool_sandbox.roles.openai_api_user import OpenAIAPIUser
from tool_sandbox.scenarios import named_scenarios
from tool_sandbox.scenarios.user_simulator_few_shot_examples import USER_INSTRUCTION

BASE = ScenarioCategories.NO_DISTRACTION_TOOLS
# the named variants ToolSandbox builds over every base scenario (name suffix -> category)
VARIANTS = ("3_distraction_tools", "10_distraction_tools", "all_tools",
            "3_distraction_tools_tool_description_scrambled", "3_distraction_tools_arg_type_scrambled",
            "3_distraction_tools_arg_description_scrambled", "3_distraction_tools_tool_name_scrambled")


class ScenarioError(Exception):
    """An exception ToolSandbox raised while playing a scenario."""


class ReplayExhausted(Exception):
    """A replay role was asked for more turns than were recorded."""


def _sandbox(ctx: Any) -> Any:
    return ctx.get_database(DatabaseNamespace.SANDBOX, drop_sandbox_message_index=False,
                            get_all_history_snapshots=True)


def _end_conversation_code(call_id: str) -> str:
    call = ChatCompletionMessageToolCall(id=call_id, type="function",
                                         function=Function(name="end_conversation", arguments="{}"))
    return openai_tool_call_to_python_code(call, {"end_conversation"}, execution_facing_tool_name=None)


def _task_text(scenario: Any) -> str:
    """The task the scenario's system message gives the simulated user (after ToolSandbox's instruction)."""
    for row in scenario.starting_context.get_database(DatabaseNamespace.SANDBOX).to_dicts():
        if row["sender"] == RoleType.SYSTEM and row["recipient"] == RoleType.USER and row["visible_to"] != [RoleType.USER]:
            text = row["content"] or ""
            return text[len(USER_INSTRUCTION):].strip() if text.startswith(USER_INSTRUCTION) else text.strip()
    return ""


class ScriptedUser(BaseRole):
    """Offline user from the scenario's own messages (see the module docstring)."""

    role_type = RoleType.USER

    def __init__(self, task_text: str) -> None:
        self.task_text = task_text
        self.answered = False
        self.turns: list[dict[str, Any]] = []  # what it did, for restores and replays

    def respond(self, ending_index: int | None = None) -> None:
        messages = self.filter_messages(self.get_messages(ending_index=ending_index))
        last = messages[-1]
        if last.sender == RoleType.SYSTEM:
            return
        if last.sender == RoleType.AGENT and "?" in (last.content or "") and not self.answered and self.task_text:
            self.answered = True
            self.turns.append({"say": self.task_text})
            self.add_messages([Message(sender=RoleType.USER, recipient=RoleType.AGENT, content=self.task_text)])
            return
        if last.sender == RoleType.EXECUTION_ENVIRONMENT:
            return  # its end_conversation call came back: nothing more to say
        self.turns.append({"end": True})
        self.add_messages([Message(sender=RoleType.USER, recipient=RoleType.EXECUTION_ENVIRONMENT,
                                   content=_end_conversation_code(f"user_end_{len(self.turns)}"))])


class EndpointUser(OpenAIAPIUser):
    """ToolSandbox's OpenAI user simulator, its client pointed at the configured endpoint."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import httpx
        from openai import OpenAI

        key = os.environ.get(spec.get("api_key_env") or "", "") or "EMPTY"
        # an explicit http client: ToolSandbox pins openai 1.17, whose default client passes httpx's `proxies`,
        # which httpx 0.28 (what pip resolves beside it) no longer takes
        timeout = spec.get("timeout_s", 60.0)
        self.openai_client = OpenAI(base_url=spec["base_url"], api_key=key, timeout=timeout,
                                    max_retries=spec.get("max_retries", 3), http_client=httpx.Client(timeout=timeout))
        self.model_name = spec["model"]
        self.temperature = spec.get("temperature", 0.0)
        self.max_tokens = spec.get("max_tokens", 512)
        self.seed = spec.get("seed")
        self.turns: list[dict[str, Any]] = []

    def model_inference(self, openai_messages: Any, openai_tools: Any) -> Any:
        resp = self.openai_client.chat.completions.create(
            model=self.model_name, messages=openai_messages, tools=openai_tools, temperature=self.temperature,
            max_tokens=self.max_tokens, **({"seed": self.seed + len(self.turns)} if self.seed is not None else {}))
        msg = resp.choices[0].message
        self.turns.append({"end": True} if msg.tool_calls else {"say": msg.content})
        if msg.tool_calls is None and msg.content is None:
            msg.content = ""
        return resp


class ReplayUser(BaseRole):
    """Replays recorded user turns (``{"say": text}`` or ``{"end": true}``) in order."""

    role_type = RoleType.USER

    def __init__(self, turns: list[dict[str, Any]]) -> None:
        self.pending = list(turns)
        self.turns: list[dict[str, Any]] = []

    def respond(self, ending_index: int | None = None) -> None:
        messages = self.filter_messages(self.get_messages(ending_index=ending_index))
        if messages[-1].sender in (RoleType.SYSTEM, RoleType.EXECUTION_ENVIRONMENT):
            return
        if not self.pending:
            raise ReplayExhausted("the user was asked for more turns than were recorded")
        turn = self.pending.pop(0)
        self.turns.append(turn)
        if turn.get("end"):
            self.add_messages([Message(sender=RoleType.USER, recipient=RoleType.EXECUTION_ENVIRONMENT,
                                       content=_end_conversation_code(f"user_end_{len(self.turns)}"))])
        else:
            self.add_messages([Message(sender=RoleType.USER, recipient=RoleType.AGENT, content=turn["say"])])


def sandbox_call_id(call_id: Any, k: int) -> str:
    """The call id as ToolSandbox's generated code can use it (a Python identifier: ``<id>_parameters = ...``)."""
    text = str(call_id or "")
    if text.isidentifier() and not text.startswith("__"):
        return text
    return f"call_{k}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def agent_messages(action: dict[str, Any], ctx: Any) -> list[Message]:
    """The sandbox messages ToolSandbox's ``OpenAIAPIAgent`` writes for one assistant message: its tool calls
    as Python code to the execution environment (a call naming no allowed tool becomes code raising the
    ``KeyError`` ToolSandbox's conversion raises, executed by the execution environment like any call), or,
    without tool calls, its text to the user."""
    calls = action.get("tool_calls") or []
    if not calls:
        return [Message(sender=RoleType.AGENT, recipient=RoleType.USER, content=action.get("content") or "")]
    available = AgentView.get_available_tools()
    out = []
    for k, c in enumerate(calls):
        call_id = sandbox_call_id(c.get("id"), k)
        call = ChatCompletionMessageToolCall(id=call_id, type="function", function=Function(
            name=c["name"], arguments=json.dumps(c.get("arguments") or {})))
        try:
            code = openai_tool_call_to_python_code(call, set(available), execution_facing_tool_name=(
                ctx.get_execution_facing_tool_name(c["name"]) if c["name"] in available else None))
        except KeyError as e:
            code = f"raise KeyError({str(e)!r})"
        out.append(Message(sender=RoleType.AGENT, recipient=RoleType.EXECUTION_ENVIRONMENT, content=code,
                           openai_tool_call_id=call_id, openai_function_name=c["name"]))
    return out


class AgentView(BaseRole):
    """The agent's view of the sandbox (its tools, its messages); tracekit's agent acts through the server."""

    role_type = RoleType.AGENT


class ReplayAgent(BaseRole):
    """Replays recorded assistant messages (for ``play``)."""

    role_type = RoleType.AGENT

    def __init__(self, actions: list[dict[str, Any]]) -> None:
        self.pending = list(actions)

    def respond(self, ending_index: int | None = None) -> None:
        messages = self.filter_messages(self.get_messages(ending_index=ending_index))
        if messages[-1].sender == RoleType.SYSTEM:
            return
        if not self.pending:
            raise ReplayExhausted("the agent was asked for more turns than were recorded")
        self.add_messages(agent_messages(self.pending.pop(0), get_current_context()))


def to_chat(m: Message, names: dict[str, str]) -> dict[str, Any] | None:
    """A sandbox message as the agent's chat message (ToolSandbox's ``to_openai_messages`` pairs)."""
    if m.sender == RoleType.SYSTEM and m.recipient == RoleType.AGENT:
        return {"role": "system", "content": m.content}
    if m.sender == RoleType.USER and m.recipient == RoleType.AGENT:
        return {"role": "user", "content": m.content}
    if m.sender == RoleType.EXECUTION_ENVIRONMENT and m.recipient == RoleType.AGENT:
        return {"role": "tool", "content": m.content, "tool_call_id": names.get(m.openai_tool_call_id or "", m.openai_tool_call_id),
                "name": m.openai_function_name, "error": m.tool_call_exception is not None}
    return None  # the agent's own messages are already on its side


class Episode:
    def __init__(self, name: str, scenario: Any, user: dict[str, Any]) -> None:
        self.name, self.scenario = name, scenario
        self.user_spec = user
        if user.get("kind") == "llm":
            self.user: Any = EndpointUser(user)
        elif user.get("kind") == "replay":
            self.user = ReplayUser(user.get("turns", []))
        else:
            self.user = ScriptedUser(_task_text(scenario))
        self.env = ExecutionEnvironment()
        self.ctx = copy.deepcopy(scenario.starting_context)
        self.done, self.termination = False, ""
        self.ids: dict[str, str] = {}  # sandbox call id -> the agent's call id

    def roles(self) -> dict[Any, Any]:
        return {RoleType.USER: self.user, RoleType.EXECUTION_ENVIRONMENT: self.env}

    @property
    def limit(self) -> int:
        return self._first + self.scenario.max_messages

    def reset(self) -> dict[str, Any]:
        set_current_context(self.ctx)
        db = _sandbox(self.ctx)
        first = self.ctx.max_sandbox_message_index
        for i in range(first + 1):  # the system's messages to the execution environment (imports), as play() does
            if db["recipient"][i] == RoleType.EXECUTION_ENVIRONMENT and db["sender"][i] == RoleType.SYSTEM:
                self.env.respond(ending_index=i)
        self._first = first
        self.ctx = get_current_context()
        self._run_roles()
        self.ctx = get_current_context()
        tools = convert_to_openai_tools(AgentView.get_available_tools())
        msgs = [c for m in AgentView.filter_messages(AgentView.get_messages()) if (c := to_chat(m, self.ids))]
        return {"messages": msgs, "tools": tools, "done": self.done, "termination": self.termination}

    def _run_roles(self) -> None:
        """``Scenario.play``'s loop, handing back when the next message is addressed to the agent."""
        while True:
            db = _sandbox(get_current_context())
            if not db["conversation_active"][-1]:
                self.done, self.termination = True, "user_stop"
                return
            if db["sandbox_message_index"][-1] >= self.limit:
                self.done, self.termination = True, "max_messages"
                return
            recipient = db["recipient"][-1]
            if recipient == RoleType.AGENT:
                return
            try:
                self.roles()[recipient].respond()
            except ReplayExhausted:
                raise
            except Exception as e:
                raise ScenarioError(f"{type(e).__name__}: {e}") from e

    def step(self, action: dict[str, Any], forced_user: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if self.done:
            raise RuntimeError(f"episode of {self.name} already ended ({self.termination})")
        set_current_context(self.ctx)
        if forced_user is not None:
            self.user = ReplayUser(forced_user)
        before = get_current_context().max_sandbox_message_index
        new = agent_messages(action, get_current_context())
        for m, c in zip(new, action.get("tool_calls") or []):  # tool calls: one sandbox message each, in order
            self.ids[m.openai_tool_call_id] = c["id"]
        turns_before = len(self.user.turns)
        BaseRole.add_messages(new)
        self._run_roles()
        self.ctx = get_current_context()
        msgs = AgentView.get_messages()
        fresh = [m for i, m in enumerate(msgs) if i > before]
        out = [c for m in fresh if AgentView.role_type in (m.visible_to or []) and (c := to_chat(m, self.ids))]
        return {"messages": out, "done": self.done, "termination": self.termination,
                "user_turns": self.user.turns[turns_before:]}

    def evaluate(self) -> dict[str, Any]:
        set_current_context(self.ctx)
        return evaluation_dict(self.scenario.evaluation.evaluate(execution_context=self.ctx,
                                                                  max_turn_count=self.scenario.max_messages))


def evaluation_dict(r: Any) -> dict[str, Any]:
    return {"similarity": float(r.similarity), "milestone_similarity": float(r.milestone_similarity),
            "minefield_similarity": float(r.minefield_similarity), "turn_count": int(r.turn_count),
            "milestone_mapping": {str(k): [int(v[0]), float(v[1])] for k, v in r.milestone_mapping.items()},
            "minefield_mapping": {str(k): [int(v[0]), float(v[1])] for k, v in r.minefield_mapping.items()}}


# ------------------------------------------------------------------ scenario listing, the oracle script


def _topological(matcher: Any) -> list[int]:
    import networkx

    return list(networkx.lexicographical_topological_sort(matcher.milestone_dag))


def oracle_script(scenario: Any) -> dict[str, Any]:
    """What the milestones define, in DAG order: each tool call a milestone names (a ``tool_trace`` row addressed
    from the execution environment to the agent) and each message the agent must send the user. Milestones that
    only constrain a database's state define no replayable step, a call whose arguments depend on earlier results
    (``tool_trace_dependant_similarity``) or that names no arguments (``{}``: any arguments match) is replayed as
    written; all three are counted so a report can say why the oracle cannot score 1.0 there."""
    steps: list[dict[str, Any]] = []
    state_only = dependent = open_arguments = 0
    for i in _topological(scenario.evaluation.milestone_matcher):
        m = scenario.evaluation.milestone_matcher.milestones[i]
        defined = False
        for c in m.snapshot_constraints:
            if c.database_namespace != DatabaseNamespace.SANDBOX or c.target_dataframe is None:
                continue
            fn = getattr(c.snapshot_constraint, "func", c.snapshot_constraint)
            if getattr(fn, "__name__", "") == "tool_trace_dependant_similarity":
                dependent += 1
            for row in c.target_dataframe.to_dicts():
                if row.get("sender") == RoleType.EXECUTION_ENVIRONMENT and row.get("tool_trace"):
                    trace = json.loads(row["tool_trace"])
                    if isinstance(trace, list):  # alternatives (any one matches): replay the first
                        trace = trace[0]
                    steps.append({"call": {"name": trace["tool_name"], "arguments": trace["arguments"]}})
                    open_arguments += not trace["arguments"]  # {}: any arguments match, the milestone names none
                    defined = True
                elif row.get("sender") == RoleType.AGENT and row.get("recipient") == RoleType.USER and row.get("content"):
                    steps.append({"say": row["content"]})
                    defined = True
        if not defined:
            state_only += 1
    return {"steps": steps, "state_only_milestones": state_only, "dependent_constraints": dependent,
            "open_argument_calls": open_arguments}


def describe(name: str, sc: Any, rapid: set[str]) -> dict[str, Any]:
    allow = list(sc.starting_context.tool_allow_list or [])
    return {"name": name, "categories": [str(c) for c in sc.categories], "base": BASE in sc.categories,
            "tools": allow, "rapidapi": sorted(set(allow) & rapid), "max_messages": sc.max_messages,
            "oracle": oracle_script(sc),
            "minefields": len(sc.evaluation.minefield_matcher.milestones)}


class Server:
    def __init__(self) -> None:
        self.scenarios = named_scenarios(preferred_tool_backend="DEFAULT")
        tools = next(iter(self.scenarios.values())).starting_context.name_to_tool
        self.rapid = {n for n, f in tools.items() if getattr(f, "__module__", "") == _rapid.__name__}
        self.episodes: dict[str, Episode] = {}

    def scenario(self, name: str) -> Any:
        if name not in self.scenarios:
            raise KeyError(f"ToolSandbox has no scenario {name!r}")
        return self.scenarios[name]

    def op_ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "protocol": PROTOCOL, "scenarios": len(self.scenarios), "episodes": len(self.episodes)}

    def op_scenarios(self, variants: list[str] = ()) -> list[dict[str, Any]]:
        bad = [v for v in variants if v not in VARIANTS]
        if bad:
            raise ValueError(f"unknown ToolSandbox variants {bad} (known: {', '.join(VARIANTS)})")
        base = [n for n, s in self.scenarios.items() if BASE in s.categories]
        names = [*base, *(f"{n}_{v}" for v in variants for n in base)]
        return [describe(n, self.scenarios[n], self.rapid) for n in names]

    def op_tools(self) -> list[dict[str, Any]]:
        """Every agent-visible tool in ToolSandbox's OpenAI format (no scrambling)."""
        ctx = copy.deepcopy(next(iter(self.scenarios.values())).starting_context)
        ctx.tool_allow_list = None
        ctx.tool_deny_list = None
        set_current_context(ctx)
        return convert_to_openai_tools(AgentView.get_available_tools())

    def op_reset(self, episode: str, scenario: str, user: dict[str, Any]) -> dict[str, Any]:
        ep = Episode(scenario, self.scenario(scenario), user)
        self.episodes[episode] = ep
        return ep.reset()

    def op_step(self, episode: str, action: dict[str, Any], forced_user: list | None = None) -> dict[str, Any]:
        return self._episode(episode).step(action, forced_user)

    def op_evaluate(self, episode: str) -> dict[str, Any]:
        return self._episode(episode).evaluate()

    def op_restore(self, episode: str, scenario: str, user: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
        ep = Episode(scenario, self.scenario(scenario), user)
        self.episodes[episode] = ep
        ep.reset()
        real_user = ep.user
        for s in steps:
            ep.step(s["action"], forced_user=s["user_turns"])
        if user.get("kind") != "replay":  # the live user takes over where the record ends
            if isinstance(real_user, ScriptedUser):
                real_user.answered = any("say" in t for s in steps for t in s["user_turns"])
            real_user.turns = [t for s in steps for t in s["user_turns"]]
            ep.user = real_user
        return {"restored": len(steps), "done": ep.done}

    def op_play(self, scenario: str, actions: list[dict[str, Any]], user_turns: list[dict[str, Any]]) -> dict[str, Any]:
        """ToolSandbox's own ``Scenario.play`` + evaluation on a recorded trajectory."""
        sc = self.scenario(scenario)
        roles = {RoleType.AGENT: ReplayAgent(actions), RoleType.USER: ReplayUser(user_turns),
                 RoleType.EXECUTION_ENVIRONMENT: ExecutionEnvironment()}
        exhausted = None
        try:
            ctx = sc.play(roles=roles, scenario_name=scenario)
        except ReplayExhausted as e:  # the recorded run was cut (max steps): evaluate what was played
            exhausted, ctx = str(e), get_current_context()
        result = evaluation_dict(sc.evaluation.evaluate(execution_context=ctx, max_turn_count=sc.max_messages))
        return {**result, "cut": exhausted}

    def op_close(self, episode: str) -> dict[str, Any]:
        self.episodes.pop(episode, None)
        return {"closed": episode}

    def _episode(self, episode: str) -> Episode:
        if episode not in self.episodes:
            raise KeyError(f"no live episode {episode!r} on this server (pid {os.getpid()})")
        return self.episodes[episode]


def main() -> None:
    import logging

    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    try:
        server = Server()
    except Exception as e:  # noqa: BLE001
        OUT.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        return
    OUT.write(json.dumps({"ready": True, "pid": os.getpid(), "protocol": PROTOCOL,
                          "scenarios": len(server.scenarios)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req_id = None
        try:
            req = json.loads(line)
            req_id = req.pop("id", None)
            op = req.pop("op")
            if op == "shutdown":
                OUT.write(json.dumps({"id": req_id, "ok": True, "result": "bye"}) + "\n")
                return
            result = getattr(server, f"op_{op}")(**req)
            reply = {"id": req_id, "ok": True, "result": result}
        except Exception as e:  # noqa: BLE001 - every failure goes back to the client as one reply
            traceback.print_exc(file=sys.stderr)
            reply = {"id": req_id, "ok": False, "error": f"{type(e).__name__}: {e}",
                     "scenario_error": isinstance(e, ScenarioError)}
        OUT.write(json.dumps(reply, default=str) + "\n")


if __name__ == "__main__":
    main()
