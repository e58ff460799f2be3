"""ToolSandbox (apple/ToolSandbox at 165848b, paper App. B) as a steppable :class:`EnvSuite`.

ToolSandbox pins dependencies that conflict with tracekit's, so it runs in its own virtual environment as an
environment server (:mod:`tracekit.targets.toolsandbox.server`, a JSON-lines protocol over the server's stdin and
stdout). :class:`ToolSandboxServer` starts it, health-checks it (``ping``), restarts it when it dies and stops
it; :class:`ToolSandboxSuite` turns its scenarios into tasks and episodes.

What comes from ToolSandbox unchanged: the scenarios (the 129 base ones, category ``NO_DISTRACTION_TOOLS``, and
the named variants), each scenario's starting execution context, its tools and their OpenAI schemas (its own
converter, scrambling included), the execution environment that runs every tool call as Python in the
context's console, its simulated user (``OpenAIAPIUser``, pointed at the configured endpoint) and its
evaluator (milestones matched in DAG order against the database snapshots, minefields): an episode's reward is
ToolSandbox's similarity in [0, 1], its success similarity 1.0. What is ours: the agent (any tracekit agent),
stepping one assistant message at a time, the offline scripted user (see the server's docstring: numbers with
it are not ToolSandbox results), and the server's restart: when it dies, the episode whose request was in
flight ends with an :class:`EnvironmentServerError` (an infrastructure failure: the episode core runs it again,
never scores it), the server is started again and every other live episode is rebuilt on it by replaying its
actions with its user's recorded turns.

Scenarios whose tools call RapidAPI (search_lat_lon, search_weather_around_lat_lon, search_stock, ...) need a
``RAPID_API_KEY`` and the network: without the key they are skipped and counted (:attr:`ToolSandboxSuite.skipped`).

The virtual environment: ``$TOOLSANDBOX_VENV`` or ``~/.cache/tracekit/toolsandbox-venv``, built by
``TOOLSANDBOX_SRC=<ToolSandbox checkout> bash scripts/install.sh``.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import subprocess
import threading
from collections import Counter
from pathlib import Path
from typing import Any

from tracekit.agents import Agent
from tracekit.envs.base import EnvSuite, Episode, InfraError, Observation, Outcome, StepResult
from tracekit.targets.toolsandbox.interface import TOOLSANDBOX_SYSTEM_PROMPT, toolsandbox_tools
from tracekit.llm.base import ChatResponse
from tracekit.types import Message, Task, ToolCall

log = logging.getLogger(__name__)

SERVER = Path(__file__).with_name("server.py")
DEFAULT_VENV = Path("~/.cache/tracekit/toolsandbox-venv")
INSTALL_STEP = "TOOLSANDBOX_SRC=<path to apple/ToolSandbox at 165848b> bash scripts/install.sh"
VARIANTS = ("3_distraction_tools", "10_distraction_tools", "all_tools",
            "3_distraction_tools_tool_description_scrambled", "3_distraction_tools_arg_type_scrambled",
            "3_distraction_tools_arg_description_scrambled", "3_distraction_tools_tool_name_scrambled")
DOMAINS = ("base", *VARIANTS)  # benchmark.domains of the toolsandbox target: the base scenarios and named variants
PERFECT = 1.0 - 1e-9
UNHELPFUL = "I am sorry, but I cannot assist with that."  # ToolSandbox's UnhelpfulAgent, word for word


class EnvironmentServerError(InfraError):
    """The ToolSandbox server died, timed out or could not start (one line, naming its log). An infrastructure
    failure: the episode whose request was in flight is run again from scratch (``rollout.infra_retries``), never
    scored."""


class ScenarioError(RuntimeError):
    """ToolSandbox raised while playing a scenario (the episode is recorded with it; the run goes on)."""


def venv_dir() -> Path:
    return Path(os.environ.get("TOOLSANDBOX_VENV") or DEFAULT_VENV).expanduser()


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def missing_environment() -> str | None:
    """Why the ToolSandbox environment cannot run here (one line naming the install step), or None."""
    py = venv_python()
    if not py.exists():
        return f"ToolSandbox's environment is not built (no {py}): run {INSTALL_STEP}"
    return None


def require_environment() -> Path:
    why = missing_environment()
    if why:
        raise EnvironmentServerError(why)
    return venv_python()


class ToolSandboxServer:
    """One ToolSandbox server process: started on first use, health-checked, restarted when it dies."""

    def __init__(self, python: Path | None = None, startup_timeout_s: float = 180.0, request_timeout_s: float = 120.0,
                 log_path: Path | None = None):
        self.python = Path(python) if python else require_environment()
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.log_path = Path(log_path) if log_path else Path(os.environ.get("TMPDIR", "/tmp")) / f"toolsandbox-server-{os.getpid()}.log"
        self.proc: subprocess.Popen[str] | None = None
        self.generation = 0  # bumped at every (re)start: episodes built on an older one must be restored
        self.restarts = 0
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        if self.alive:
            return
        if self.proc is not None:
            self.restarts += 1
            log.warning("ToolSandbox server (pid %s) is gone; restarting it (restart %d)", self.proc.pid, self.restarts)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        self._lines = queue.Queue()
        logf = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen([str(self.python), "-u", str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=logf, text=True, bufsize=1, env=env, cwd=str(self.log_path.parent))
        logf.close()
        threading.Thread(target=self._read, args=(self.proc, self._lines), daemon=True).start()
        ready = self._next_line(self.startup_timeout_s, "start")
        if not ready.get("ready"):
            self.stop()
            raise EnvironmentServerError(f"ToolSandbox server did not start: {ready.get('error')} (log: {self.log_path})")
        self.generation += 1

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)  # EOF: the process is gone

    def _next_line(self, timeout: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise EnvironmentServerError(f"ToolSandbox server gave no answer to {what} within {timeout:.0f} s "
                                         f"(killed; log: {self.log_path})") from None
        if line is None:
            code = self.proc.wait() if self.proc is not None else None
            raise EnvironmentServerError(f"ToolSandbox server died during {what} (exit code {code}; log: {self.log_path})")
        return json.loads(line)

    def request(self, op: str, **kwargs: Any) -> Any:
        """One request; a dead server is started first. Raises EnvironmentServerError (the server died or timed
        out: it is killed and will be restarted by the next request), ScenarioError (ToolSandbox raised while
        playing) or RuntimeError (any other error the server reported)."""
        with self._lock:
            self.start()
            assert self.proc is not None and self.proc.stdin is not None
            req_id = next(self._ids)
            try:
                self.proc.stdin.write(json.dumps({"id": req_id, "op": op, **kwargs}) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as e:
                self.kill()
                raise EnvironmentServerError(f"ToolSandbox server died before {op} ({e}; log: {self.log_path})") from None
            reply = self._next_line(self.request_timeout_s, op)
        if reply.get("id") != req_id:
            self.kill()
            raise EnvironmentServerError(f"ToolSandbox server answered request {reply.get('id')} to {req_id} ({op})")
        if not reply["ok"]:
            raise (ScenarioError if reply.get("scenario_error") else RuntimeError)(f"ToolSandbox {op}: {reply['error']}")
        return reply["result"]

    def ping(self) -> dict[str, Any]:
        return self.request("ping")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """Ask the server to exit, then make sure it has."""
        if self.alive:
            try:
                assert self.proc is not None and self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"id": 0, "op": "shutdown"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001, S110 - it is being stopped either way
                pass
        self.kill()

    def __del__(self) -> None:  # a suite dropped without close() must not leave its server behind
        try:
            self.kill()
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown: nothing left to report to
            pass


def action_dict(m: Message) -> dict[str, Any]:
    return {"content": m.content, "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                                for c in m.tool_calls]}


def _message(d: dict[str, Any]) -> Message:
    if d["role"] == "tool":
        return Message(role="tool", content=d.get("content") or "", tool_call_id=d.get("tool_call_id"),
                       name=d.get("name"), error=bool(d.get("error")))
    return Message(role=d["role"], content=d.get("content") or "")


class ToolSandboxEpisode(Episode):
    """One scenario played on the server; its actions and user turns are logged so a restart can rebuild it."""

    _ids = itertools.count()

    def __init__(self, suite: ToolSandboxSuite, task: Task, seed: int):
        self.suite, self.task, self.seed = suite, task, seed
        self.id = f"{task.id}#{seed}#{next(self._ids)}"
        self.steps: list[dict[str, Any]] = []  # {"action", "user_turns"} per step, for restores
        self.generation = 0
        self.done = False

    def _user(self) -> dict[str, Any]:
        return self.suite.user_spec(self.seed)

    def _ensure(self) -> None:
        server = self.suite.server
        server.start()
        if self.generation != server.generation:  # built on a server that is gone: replay it onto this one
            server.request("restore", episode=self.id, scenario=self.task.id, user=self._user(), steps=self.steps)
            self.generation = server.generation
            self.suite.restored += 1

    def reset(self) -> Observation:
        server = self.suite.server
        r = server.request("reset", episode=self.id, scenario=self.task.id, user=self._user())
        self.generation = server.generation
        self.done = r["done"]
        return Observation(messages=[_message(m) for m in r["messages"]], tools=r["tools"], done=r["done"],
                           termination=r["termination"])

    def step(self, action: Message) -> StepResult:
        self._ensure()
        act = action_dict(action)
        r = self.suite.server.request("step", episode=self.id, action=act)
        self.steps.append({"action": act, "user_turns": r["user_turns"]})
        self.done = r["done"]
        return StepResult(messages=[_message(m) for m in r["messages"]], done=r["done"], termination=r["termination"])

    def outcome(self) -> Outcome:
        self._ensure()
        r = self.suite.server.request("evaluate", episode=self.id)
        self.suite.server.request("close", episode=self.id)
        sim = float(r["similarity"])
        return Outcome(reward=sim, success=sim >= PERFECT, info={
            "similarity": sim, "milestone_similarity": r["milestone_similarity"],
            "minefield_similarity": r["minefield_similarity"], "turn_count": r["turn_count"],
            "milestone_mapping": r["milestone_mapping"], "minefield_mapping": r["minefield_mapping"],
            "categories": self.task.data.get("categories", []), "allowed_tools": self.task.data.get("tools", []),
            "milestone_tools": sorted({s["call"]["name"] for s in self.task.data.get("oracle", {}).get("steps", [])
                                       if "call" in s}),
            "user_turns": [t for s in self.steps for t in s["user_turns"]]})


class ToolSandboxSuite(EnvSuite):
    """ToolSandbox's scenarios as tasks: the base ones (``domains`` has ``base``) and any named variants.

    ``user``: ``{"kind": "scripted"}`` or ``{"kind": "llm", "base_url", "model", "api_key_env", "temperature",
    "max_tokens", "timeout_s", "max_retries"}`` (an OpenAI-compatible endpoint ToolSandbox's own user calls).
    ``scenarios`` / ``exclude``: base scenario names to keep / to drop, in every domain (a variant by the base
    scenario it is made from), before ``task_ids`` and ``limit`` (the target's training split,
    :mod:`tracekit.targets.toolsandbox.target`).
    """

    expensive_steps = True  # rollout.env_workers=auto steps its episodes in worker processes (tracekit.envs.pool)

    def __init__(self, name: str = "toolsandbox", domains: list[str] | tuple[str, ...] = ("base",),
                 task_ids: list[str] | None = None, limit: int | None = None, user: dict[str, Any] | None = None,
                 server: ToolSandboxServer | None = None, scenarios: list[str] | None = None,
                 exclude: list[str] | None = None):
        bad = [d for d in domains if d not in DOMAINS]
        if bad or not domains:
            raise ValueError(f"ToolSandbox domains {list(domains)}: each must be one of {', '.join(DOMAINS)}")
        self.name, self.domains = name, tuple(domains)
        self.task_ids, self.limit = (list(task_ids) if task_ids else None), limit
        self.keep = None if scenarios is None else frozenset(scenarios)
        self.exclude = frozenset(exclude or ())
        self.user = dict(user or {"kind": "scripted"})
        self.server = server or ToolSandboxServer()
        self.restored = 0
        self.skipped: dict[str, list[str]] = {}
        self._tasks: list[Task] | None = None

    def user_spec(self, seed: int) -> dict[str, Any]:
        return {**self.user, "seed": seed} if self.user.get("kind") == "llm" else dict(self.user)

    def scenarios(self) -> list[dict[str, Any]]:
        """Every scenario of the configured domains as the server describes it (RapidAPI ones included)."""
        variants = [d for d in self.domains if d != "base"]
        rows = self.server.request("scenarios", variants=variants)
        if "base" not in self.domains:
            rows = [r for r in rows if not r["base"]]
        return rows

    def tasks(self) -> list[Task]:
        if self._tasks is not None:
            return list(self._tasks)
        rows = [r for r in self.scenarios() if (self.keep is None or base_name(r) in self.keep)
                and base_name(r) not in self.exclude]
        if self.task_ids is not None:
            known = {r["name"] for r in rows}
            unknown = [t for t in self.task_ids if t not in known]
            if unknown:
                raise KeyError(f"ToolSandbox has no scenario(s) {unknown} in domains {list(self.domains)}")
            rows = [r for r in rows if r["name"] in set(self.task_ids)]
        keyed = bool(os.environ.get("RAPID_API_KEY"))
        skipped_rapid = [r["name"] for r in rows if r["rapidapi"] and not keyed]
        rows = [r for r in rows if keyed or not r["rapidapi"]]
        if skipped_rapid:
            self.skipped["rapidapi_key"] = skipped_rapid
            log.warning("ToolSandbox: %d scenarios skipped: their tools call RapidAPI and RAPID_API_KEY is not set",
                        len(skipped_rapid))
        if self.limit is not None:
            per: Counter[str] = Counter()
            kept = []
            for r in rows:
                d = domain_of(r)
                if per[d] < self.limit:
                    kept.append(r)
                    per[d] += 1
            rows = kept
        self._tasks = [Task(id=r["name"], env=f"toolsandbox_{domain_of(r)}" if self.domains != ("base",) else "toolsandbox",
                            instruction=r["name"], data={k: r[k] for k in ("categories", "tools", "max_messages", "oracle",
                                                                            "minefields", "base")})
                       for r in rows]
        return list(self._tasks)

    def episode(self, task: Task, seed: int = 0) -> ToolSandboxEpisode:
        return ToolSandboxEpisode(self, task, seed)

    def interface(self) -> dict[str, Any]:
        return {"toolsandbox": {"system_prompt": TOOLSANDBOX_SYSTEM_PROMPT, "policy": TOOLSANDBOX_SYSTEM_PROMPT,
                                "tools": list(toolsandbox_tools().values())}}

    def all_tools(self) -> list[dict[str, Any]]:
        """Every agent-visible ToolSandbox tool, as its converter gives it (no allow list, no scrambling)."""
        return self.server.request("tools")

    def play(self, scenario: str, actions: list[dict[str, Any]], user_turns: list[dict[str, Any]]) -> dict[str, Any]:
        """ToolSandbox's own ``Scenario.play`` and evaluation on a recorded trajectory (a fresh server context)."""
        return self.server.request("play", scenario=scenario, actions=actions, user_turns=user_turns)

    def close(self) -> None:
        self.server.stop()


def domain_of(row: dict[str, Any]) -> str:
    if row["base"]:
        return "base"
    return next((v for v in sorted(VARIANTS, key=len, reverse=True) if row["name"].endswith("_" + v)), "base")


def base_name(row: dict[str, Any] | str) -> str:
    """The base scenario a scenario is made from (itself for a base one): its name less the variant suffix."""
    name = row if isinstance(row, str) else row["name"]
    if not isinstance(row, str) and row["base"]:
        return name
    v = next((v for v in sorted(VARIANTS, key=len, reverse=True) if name.endswith("_" + v)), None)
    return name[: -len(v) - 1] if v else name


def replay_inputs(traj: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A recorded trajectory as ``play``'s inputs: its assistant messages and its user's turns."""
    actions = [action_dict(m) for m in traj.messages if m.role == "assistant"]
    return actions, list(traj.info.get("user_turns", []))


# ------------------------------------------------------------------ the oracle and the do-nothing agent


class ToolSandboxOracle(Agent):
    """Replays what each scenario's milestones define (``task.data['oracle']['steps']``, in DAG order): each
    named tool call (one call per turn), each message the agent must send; after the script, it says
    ToolSandbox's UnhelpfulAgent line (the scripted user then ends the conversation)."""

    name = "gold"
    max_new_tokens = 0

    def act(self, states: list[Any]) -> list[Any]:
        out = []
        for s in states:
            steps = s.task.data.get("oracle", {}).get("steps")
            if steps is None:
                raise ValueError(f"task {s.task.id} has no oracle script (task.data['oracle']): not a ToolSandbox task")
            if s.turn < len(steps):
                step = steps[s.turn]
                if "call" in step:
                    msg = Message(role="assistant", tool_calls=[ToolCall(id=f"oracle_{s.turn}", name=step["call"]["name"],
                                                                         arguments=dict(step["call"]["arguments"]))])
                else:
                    msg = Message(role="assistant", content=step["say"])
            else:
                msg = Message(role="assistant", content=UNHELPFUL)
            out.append(ChatResponse(message=msg, text=msg.content or ""))
        return out



class UnhelpfulAgent(ToolSandboxOracle):
    """ToolSandbox's ``UnhelpfulAgent``: every turn the same refusal (the do-nothing baseline)."""

    name = "unhelpful"

    def act(self, states: list[Any]) -> list[Any]:
        return [ChatResponse(message=Message(role="assistant", content=UNHELPFUL), text=UNHELPFUL) for _ in states]
