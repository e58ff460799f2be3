"""Simulated users for conversational target environments (tau^2-bench).

Two simulators share one batched interface, so a rollout runner can answer the users of many
episodes with one model call:

- :class:`LLMUser` (``user=llm``): tau^2's own user simulator prompt (its global simulation
  guidelines + the task's ``<scenario>``), driven through any :class:`~tracekit.llm.base.ChatClient`
  (an OpenAI-compatible endpoint or a local model). As in tau^2, the user sees only the agent's text
  messages (never tool calls or results), with roles flipped (agent -> ``user``, itself ->
  ``assistant``), and ends the conversation with ``###STOP###`` / ``###TRANSFER###`` /
  ``###OUT-OF-SCOPE###``.
- :class:`ScriptedUser` (``user=scripted``): deterministic rules over the task's scenario, for
  tests and offline smoke runs. **Numbers obtained with it are not valid tau^2 results**: it does
  not follow the scenario's task instructions, only opens with the reason for the call, answers
  identity questions from the known info, says "Yes." to confirmation requests and stops once the
  agent makes a statement that asks nothing (typically: reports the outcome).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from tau2.user.base import OUT_OF_SCOPE, STOP, TRANSFER

from tracekit.llm.base import ChatClient, ChatRequest
from tracekit.types import Message, stable_hash

STOP_TOKENS = (STOP, TRANSFER, OUT_OF_SCOPE)


@dataclass(frozen=True)
class UserScenario:
    """What a simulated user knows. ``instructions`` is the full scenario text given to an LLM user
    (tau^2: ``str(task.user_scenario)``); the structured fields feed the scripted user."""

    instructions: str
    reason_for_call: str = ""
    known_info: str = ""
    unknown_info: str = ""
    task_instructions: str = ""


@dataclass
class UserState:
    """One episode's user: its scenario, seed and the visible conversation in its own frame
    (``assistant`` = the user's own messages, ``user`` = the agent's text messages)."""

    scenario: UserScenario
    seed: int
    history: list[Message] = field(default_factory=list)

    @property
    def turns(self) -> int:
        """Number of replies the user has produced so far."""
        return sum(1 for m in self.history if m.role == "assistant")


def stop_token(text: str) -> str | None:
    """The tau^2 stop token contained in a user message (tau2 ``UserSimulator.is_stop``), else None."""
    return next((t for t in STOP_TOKENS if t in text), None)


class UserSimulator(ABC):
    """A batched simulated user."""

    name: str = "user"

    def start(self, scenario: UserScenario, seed: int) -> UserState:
        return UserState(scenario=scenario, seed=seed)

    def respond(self, states: list[UserState], agent_texts: list[str]) -> list[str]:
        """Reply to one agent text message per state (updates each state's history in place)."""
        if len(states) != len(agent_texts):
            raise ValueError(f"respond: {len(states)} states but {len(agent_texts)} agent messages")
        for s, text in zip(states, agent_texts):
            s.history.append(Message(role="user", content=text))
        replies = self._replies(states)
        for s, reply in zip(states, replies):
            s.history.append(Message(role="assistant", content=reply))
        return replies

    @abstractmethod
    def _replies(self, states: list[UserState]) -> list[str]:
        """The next user message of each state (whose last history entry is the agent's text)."""


class LLMUser(UserSimulator):
    """tau^2's user simulator through a :class:`ChatClient`.

    System prompt = tau2 ``user_simulator.SYSTEM_PROMPT`` filled with tau2's global guidelines
    (``simulation_guidelines.md``; airline/retail give the user no tools) and the scenario text.
    Each call's seed is derived from (episode seed, user turn) so sampled users are reproducible.
    ``max_turns`` (None = unlimited, as in tau^2) makes the user send ``###STOP###`` after that
    many replies.
    """

    name = "llm"

    def __init__(
        self,
        client: ChatClient,
        temperature: float = 0.0,
        max_new_tokens: int = 512,
        max_turns: int | None = None,
    ):
        # tau2.user.user_simulator imports litellm (~6 s): only when an LLM user is built.
        from tau2.user.user_simulator import SYSTEM_PROMPT, get_global_user_sim_guidelines

        self.client = client
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.max_turns = max_turns
        self._template = SYSTEM_PROMPT
        self._guidelines = get_global_user_sim_guidelines(use_tools=False)

    def system_prompt(self, scenario: UserScenario) -> str:
        return self._template.format(global_user_sim_guidelines=self._guidelines, instructions=scenario.instructions)

    def _replies(self, states: list[UserState]) -> list[str]:
        out: list[str | None] = [None] * len(states)
        todo = []
        for i, s in enumerate(states):
            if self.max_turns is not None and s.turns >= self.max_turns:
                out[i] = STOP
            else:
                todo.append(i)
        requests = [
            ChatRequest(
                messages=[Message(role="system", content=self.system_prompt(states[i].scenario)), *states[i].history],
                tools=None,
                temperature=self.temperature,
                max_new_tokens=self.max_new_tokens,
                seed=int(stable_hash([states[i].seed, "user", states[i].turns]), 16) % 2**31,
            )
            for i in todo
        ]
        for i, resp in zip(todo, self.client.chat(requests) if requests else []):
            # A user turn is text only; an empty reply ends the episode as tau^2's user_error.
            out[i] = (resp.message.content or "").strip()
        return [o if o is not None else "" for o in out]


# ---------------------------------------------------------------- scripted user

_USER_ID = re.compile(r"\b([a-z]+(?:_[a-z]+)+_\d+)\b")
_EMAIL = re.compile(r"\b([\w.+-]+@[\w-]+(?:\.[\w-]+)+)\b")
_ZIP = re.compile(r"\b(\d{5})\b")
_NAME = re.compile(r"\b([A-Z][a-z]+ [A-Z][a-z]+)\b")
_ORDER_ID = re.compile(r"#W\d{7}")
# tau2 airline reservation ids: 6 upper-case letters/digits (flight numbers HAT123 excluded).
_RESERVATION_ID = re.compile(r"\b(?!HAT\d{3}\b)(?=[A-Z0-9]*[A-Z])(?=[A-Z0-9]*\d|[A-Z]{6}\b)[A-Z0-9]{6}\b")
_ASKS_ORDER = re.compile(r"\border(?:s)?\s*(?:id|number|#)|\bwhich order", re.I)
_ASKS_RESERVATION = re.compile(r"\b(?:reservation|booking|confirmation)\s*(?:id|number|code)|\bwhich (?:reservation|booking)", re.I)
_ASKS_NAME = re.compile(r"\b(?:your|full|first|last) name\b|\bzip", re.I)
_NOT_NAMES = {"You", "Your", "I", "The", "If", "Big", "New"}
# "you" as an object (told you, to you...) becomes "me"; elsewhere the second person becomes first.
_PERSON = [
    (re.compile(r"\byou are\b", re.I), "I am"),
    (re.compile(r"\byou're\b", re.I), "I'm"),
    (re.compile(r"\byou've\b", re.I), "I've"),
    (re.compile(r"\byou'd\b", re.I), "I'd"),
    (re.compile(r"\byourself\b", re.I), "myself"),
    (re.compile(r"\byour\b"), "my"),
    (re.compile(r"\bYour\b"), "My"),
    (re.compile(r"\b(to|for|with|told|tell|help|asked|give|gave|that|let) you\b", re.I), r"\1 me"),
    (re.compile(r"\byou\b", re.I), "I"),
]
_REQUEST = re.compile(r"\b(please|provide|could you|can you|may i|tell me|let me know)\b", re.I)
_CONFIRM = re.compile(r"\b(confirm|proceed|go ahead|would you like|do you want|shall i|should i|yes/no|is that correct|is this correct)\b", re.I)


@dataclass(frozen=True)
class KnownFacts:
    """Identity facts a scripted user can disclose, parsed from its scenario."""

    name: str | None
    user_id: str | None
    email: str | None
    zip: str | None
    order_ids: tuple[str, ...]
    reservation_ids: tuple[str, ...]


def known_facts(scenario: UserScenario) -> KnownFacts:
    """Parse name / user id / email / zip from ``known_info`` and order / reservation ids from the
    whole scenario (reason for call, known info, task instructions)."""
    known = scenario.known_info or ""
    everything = " ".join([scenario.reason_for_call, known, scenario.task_instructions])
    names = [n for n in _NAME.findall(known) if not set(n.split()) & _NOT_NAMES]

    def first(rx: re.Pattern[str], text: str) -> str | None:
        m = rx.search(text)
        return m.group(1) if m else None

    return KnownFacts(
        name=names[0] if names else None,
        user_id=first(_USER_ID, known),
        email=first(_EMAIL, known),
        zip=first(_ZIP, known),
        order_ids=tuple(dict.fromkeys(_ORDER_ID.findall(everything))),
        reservation_ids=tuple(dict.fromkeys(_RESERVATION_ID.findall(everything))),
    )


def first_person(text: str) -> str:
    """Rewrite second-person scenario text into the user's first person ("You want" -> "I want")."""
    for rx, repl in _PERSON:
        text = rx.sub(repl, text)
    return text


def opening_message(scenario: UserScenario, max_chars: int = 400) -> str:
    """The reason for the call, condensed: its first paragraph in the first person, cut at a
    sentence boundary within ``max_chars``."""
    para = next((p.strip() for p in scenario.reason_for_call.split("\n\n") if p.strip()), "")
    text = " ".join(first_person(para or scenario.instructions).split())
    if len(text) <= max_chars:
        return text
    cut = text[:max_chars]
    end = max(cut.rfind(". "), cut.rfind("? "), cut.rfind("! "))
    return cut[: end + 1] if end > 0 else cut


def scripted_reply(scenario: UserScenario, agent_text: str, turns: int, max_turns: int) -> str:
    """The scripted user's reply to ``agent_text`` after ``turns`` replies of its own.

    Rules, in order: the turn limit -> ``###STOP###``; a statement (neither a question nor a
    request such as "please provide") -> ``###STOP###``; identity questions (user id, email, name,
    zip, order / reservation ids) -> the known facts; a confirmation request -> "Yes."; any other
    question -> restate the request.
    """
    if turns >= max_turns:
        return STOP
    if "?" not in agent_text and not _REQUEST.search(agent_text):
        return STOP
    t = agent_text.lower()
    facts = known_facts(scenario)
    parts: list[str] = []
    if "user id" in t or "user_id" in t:
        parts.append(f"My user id is {facts.user_id}." if facts.user_id else "I don't know my user id.")
    if "email" in t:
        parts.append(f"My email is {facts.email}." if facts.email else "I don't remember my email address.")
    if _ASKS_NAME.search(agent_text):
        if facts.name:
            parts.append(f"My name is {facts.name}.")
        if facts.zip:
            parts.append(f"My zip code is {facts.zip}.")
    if _ASKS_ORDER.search(agent_text) and facts.order_ids:
        parts.append("The order id is " + ", ".join(facts.order_ids) + ".")
    if _ASKS_RESERVATION.search(agent_text) and facts.reservation_ids:
        parts.append("The reservation id is " + ", ".join(facts.reservation_ids) + ".")
    if parts:
        return " ".join(parts)
    if _CONFIRM.search(agent_text):
        return "Yes."
    return opening_message(scenario)


class ScriptedUser(UserSimulator):
    """Deterministic scenario-driven user (see module docstring; NOT valid for reporting numbers)."""

    name = "scripted"

    def __init__(self, max_turns: int = 10):
        if max_turns < 1:
            raise ValueError(f"user.max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns

    def _replies(self, states: list[UserState]) -> list[str]:
        out = []
        for s in states:
            agent_text = s.history[-1].content or ""
            if s.turns == 0:  # the agent's greeting: open with the reason for the call
                out.append(opening_message(s.scenario))
            else:
                out.append(scripted_reply(s.scenario, agent_text, s.turns, self.max_turns))
        return out
