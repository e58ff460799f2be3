"""A synthetic environment (:mod:`tracekit.synthesis.protocol`) as an :class:`EnvSuite`.

Tasks are seeds (``seed-<z>``); an episode is instance ``G(z)``: the system message is the instance's policy
excerpt, the first user message its goal, the tools the environment's schemas. Tool calls run through the
backend (in-process for the built-in library, a sandboxed subprocess for generated code). A text-only assistant
message goes to the simulated user:

- ``scripted``: built from the instance: answers identity/detail questions from ``user_facts``, confirms
  ("yes") when asked to confirm, and stops (episode done) when the agent reports or closes;
- ``llm``: a :class:`ChatClient` role-playing the user from the goal and facts, stopping with ``###STOP###``;
- ``none``: the first text-only assistant message ends the episode.

The outcome is the environment's verifier: reward in [0, 1] and success.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.llm.base import ChatClient, ChatRequest
from tracekit.synthesis.protocol import EnvBackend, InProcessBackend, Instance, SyntheticEnv
from tracekit.types import Message, Task, stable_hash

UserKind = Literal["scripted", "llm", "none"]
STOP = "###STOP###"
CONFIRM_REPLY = "Yes, please go ahead."
CLOSING_REPLY = "Thanks, that's all."

# which words in the agent's question ask for which fact
FACT_TRIGGERS = {
    "user_id": ["user id", "user_id", "userid", "account id"],
    "email": ["email", "e-mail"],
    "order_id": ["order id", "order number", "which order", "order"],
    "reservation_id": ["reservation id", "reservation number", "confirmation number", "reservation", "booking"],
    "reason": ["reason", "why"],
    "payment_method": ["payment", "pay with", "refund to", "card"],
    "name": ["your name", "full name", "name"],
    "address": ["address", "ship"],
}
CLOSINGS = ["anything else", "is there something else", "have a great day", "have a nice day", "goodbye"]
CONFIRMS = ["confirm", "proceed", "shall i", "should i", "do you want me", "would you like me", "go ahead",
            "is that correct", "is this correct", "yes/no", "(yes", "ok to", "okay to", "can i go"]


class ScriptedUser:
    """A deterministic user simulator driven by the instance."""

    def __init__(self, instance: Instance, max_answers: int = 6):
        self.instance = instance
        self.max_answers = max_answers
        self.answers = 0

    def first_message(self) -> str:
        return self.instance.user_goal

    def reply(self, agent_text: str) -> tuple[str, bool]:
        """(user message, stop). The user stops when the agent closes, reports, or keeps asking."""
        text = agent_text.lower()
        if self.answers >= self.max_answers or any(c in text for c in CLOSINGS):
            return CLOSING_REPLY, True
        if any(c in text for c in CONFIRMS):
            self.answers += 1
            return CONFIRM_REPLY, False
        if "?" in text:
            for key, value in self.instance.user_facts.items():
                triggers = FACT_TRIGGERS.get(key, [key.replace("_", " ")])
                if any(re.search(r"\b" + re.escape(t), text) for t in triggers):
                    self.answers += 1
                    # an identifier is named ("My email is x"), a description is said as is
                    said = f"My {key.replace('_', ' ')} is {value}." if " " not in value else f"It's {value}."
                    return said, False
        return CLOSING_REPLY, True


USER_SYSTEM = """You are a customer talking to a customer-service agent. Stay in character and write only the
customer's next message, briefly. Your request (say it in your own words, one step at a time):
{goal}
Details you know and share only when asked:
{facts}
When the agent has done everything you asked, or says it cannot help, reply with exactly {stop}."""


class LLMUser:
    """A user simulator backed by a chat model (its calls are batched across episodes by the suite)."""

    def __init__(self, instance: Instance, client: ChatClient, temperature: float = 0.0, seed: int = 0,
                 max_new_tokens: int = 128):
        self.instance = instance
        self.client = client
        self.temperature = temperature
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        facts = "\n".join(f"- {k.replace('_', ' ')}: {v}" for k, v in instance.user_facts.items()) or "- (none)"
        self.system = USER_SYSTEM.format(goal=instance.user_goal, facts=facts, stop=STOP)
        self.history: list[Message] = []

    def first_message(self) -> str:
        return self.instance.user_goal

    def request(self, agent_text: str) -> ChatRequest:
        """The model call for the user's next message (roles swap: the agent speaks as "user")."""
        self.history.append(Message(role="user", content=agent_text))
        turn_seed = int(stable_hash([self.seed, "synthetic-user", len(self.history)]), 16) % 2**31
        return ChatRequest(messages=[Message(role="system", content=self.system),
                                     Message(role="assistant", content=self.instance.user_goal), *self.history],
                           temperature=self.temperature, seed=turn_seed, max_new_tokens=self.max_new_tokens)

    def accept(self, text: str) -> tuple[str, bool]:
        """(user message, stop) from the model's reply."""
        text = (text or "").strip()
        self.history.append(Message(role="assistant", content=text))
        if STOP in text or not text:
            return text.replace(STOP, "").strip() or CLOSING_REPLY, True
        return text, False

    def reply(self, agent_text: str) -> tuple[str, bool]:
        return self.accept(self.client.chat([self.request(agent_text)])[0].message.content or "")


class SyntheticEpisode(Episode):
    def __init__(self, suite: SyntheticSuite, instance: Instance, seed: int):
        self.suite = suite
        self.instance = instance
        self.seed = seed
        self.handle: str | None = None
        self.messages: list[Message] = []
        self.turns = 0
        self.done = False
        self.termination = ""
        self._new: list[Message] = []
        self._outcome: Outcome | None = None
        if suite.user == "llm":
            if suite.user_client is None:
                raise ValueError("user='llm' needs a user_client (a ChatClient)")
            self.user: ScriptedUser | LLMUser | None = LLMUser(instance, suite.user_client, suite.user_temperature, seed)
        else:
            self.user = ScriptedUser(instance) if suite.user == "scripted" else None

    def reset(self) -> Observation:
        self.handle = self.suite.backend.open(self.instance)
        opening = [Message(role="system", content=self.instance.system_prompt),
                   Message(role="user", content=self.instance.user_goal)]
        self.messages = list(opening)
        return Observation(messages=opening, tools=self.suite.info.tools)

    def step(self, action: Message) -> StepResult:
        needs_user = self.act(action)
        if needs_user:
            self.hear(*self.user.reply(action.content or ""))
        return self.result()

    def act(self, action: Message) -> bool:
        """Apply the agent's message; True when the simulated user must now reply to it."""
        if self.handle is None:
            raise RuntimeError("step() before reset()")
        if self.done:
            raise RuntimeError("step() after the episode ended")
        action = action.model_copy(update={"role": "assistant"})
        self.messages.append(action)
        self.turns += 1
        self._new = []
        if action.tool_calls:
            self._new = [self.suite.backend.call(self.handle, c) for c in action.tool_calls]
            self.messages.extend(self._new)
            return False
        if self.user is None:
            self._end("agent_stop")
            return False
        return True

    def hear(self, text: str, stop: bool) -> None:
        """Record the simulated user's reply."""
        message = Message(role="user", content=text)
        self._new.append(message)
        self.messages.append(message)
        if stop:
            self._end("user_stop")

    def result(self) -> StepResult:
        if not self.done and self.turns >= self.suite.max_turns:
            self._end("max_steps")
        return StepResult(messages=list(self._new), done=self.done, termination=self.termination)

    def _end(self, why: str) -> None:
        self.done, self.termination = True, why

    def outcome(self) -> Outcome:
        if self._outcome is None:
            if self.handle is None:
                raise RuntimeError("outcome() before reset()")
            verdict = self.suite.backend.finish(self.handle, self.messages)
            self._outcome = Outcome(reward=verdict.reward, success=verdict.success, info={
                "seed": self.instance.seed, "difficulty": self.suite.info.difficulty,
                "capability": self.suite.info.capability, "state_hash": verdict.state_hash,
                "termination": self.termination or "cut_off", "agent_turns": self.turns})
        return self._outcome


class SyntheticSuite(EnvSuite):
    """Seeds of a synthetic environment as tasks ``seed-<z>``."""

    def __init__(self, backend: EnvBackend, seeds: list[int] | range, user: UserKind = "scripted",
                 user_client: ChatClient | None = None, user_temperature: float = 0.0, max_turns: int | None = None):
        if user not in ("scripted", "llm", "none"):
            raise ValueError(f"user must be scripted, llm or none, not {user!r}")
        self.backend = backend
        self.info = backend.describe()
        self.name = self.info.name
        self.seeds = [int(z) for z in seeds]
        self.user = user
        self.user_client = user_client
        self.user_temperature = user_temperature
        self.max_turns = max_turns or self.info.max_turns
        self._instances: dict[int, Instance] = {}

    @classmethod
    def from_env(cls, env: SyntheticEnv, seeds: list[int] | range, **kwargs: Any) -> SyntheticSuite:
        """A suite over a trusted (built-in) environment object, run in this process."""
        return cls(InProcessBackend(env), seeds, **kwargs)

    def instances(self, seeds: list[int]) -> list[Instance]:
        missing = [z for z in seeds if z not in self._instances]
        if missing:
            self._instances.update(zip(missing, self.backend.generate(missing)))
        return [self._instances[z] for z in seeds]

    def tasks(self) -> list[Task]:
        return [Task(id=f"seed-{inst.seed}", env=self.name, instruction=inst.user_goal, data={"seed": inst.seed})
                for inst in self.instances(self.seeds)]

    def episode(self, task: Task, seed: int = 0) -> SyntheticEpisode:
        z = task.data.get("seed")
        if z is None:
            match = re.fullmatch(r"seed-(-?\d+)", task.id)
            if not match:
                raise ValueError(f"task id {task.id!r} is not seed-<int>")
            z = int(match.group(1))
        return SyntheticEpisode(self, self.instances([int(z)])[0], seed)

    def step_batch(self, episodes: list[Episode], actions: list[Message]) -> list[StepResult | Exception]:
        """Step many episodes; the LLM users' replies are one batched chat call."""
        out: list[StepResult | Exception | None] = [None] * len(episodes)
        asking: list[tuple[int, SyntheticEpisode, ChatRequest]] = []
        for i, (ep, action) in enumerate(zip(episodes, actions, strict=True)):
            try:
                if ep.act(action):
                    if isinstance(ep.user, LLMUser):
                        asking.append((i, ep, ep.user.request(action.content or "")))
                        continue
                    ep.hear(*ep.user.reply(action.content or ""))
                out[i] = ep.result()
            except Exception as e:  # noqa: BLE001 - handed back to the runner, recorded on the episode
                out[i] = e
        if asking:
            try:
                replies = self.user_client.chat([r for _, _, r in asking])
            except Exception as e:  # noqa: BLE001 - every waiting episode gets the error
                replies = [e] * len(asking)
            for (i, ep, _), reply in zip(asking, replies):
                if isinstance(reply, Exception):
                    out[i] = reply
                    continue
                ep.hear(*ep.user.accept(reply.message.content or ""))
                out[i] = ep.result()
        return out

    def interface(self) -> dict[str, Any]:
        return {"tools": self.info.tools, "policy": self.info.policy, "target": self.info.target,
                "capability": self.info.capability}

    def close(self) -> None:
        self.backend.close()
