"""The micro world (issue 42): a tool-use target small enough that TRACE's whole ladder learns on 2 CPU cores.

A store of named items, each ``{"name", "value", "locked"}`` under a short id (``k42``). Every environment of the
family shares one interface, the target's (:func:`micro_tools`, :data:`MICRO_POLICY`): three tools and a
three-line policy.

- ``find(name)`` -> ``{"id": ...}``: the id of the item called ``name``;
- ``read(id)`` -> ``{"value": v, "locked": b}``;
- ``write(id, value)`` -> ``"ok"``: it always goes through; the *policy* forbids writing a locked item (as tau^2's
  API does not enforce its policy, the agent must).

A task is a short request (``Set k42 to 5.``, ``What is apple?``, ``Set k42 to 5 and k17 to 3.``) built from the
set of capabilities it *needs* (:class:`Needs`). One library environment per capability isolates it; the
held-out mixture adds task kinds that need two at once (:data:`COMBOS`, never trained on directly):

- ``lookup_by_name``: the request names an item by name, not id: ``find`` it first, then use the id it returns;
- ``refuse_locked``: the item may be locked: read it, and when it is locked write nothing and say it is locked;
- ``finish_all_writes``: the request needs two (difficulty 1: three) writes: do every one;
- ``report_value``: the request asks for a value: read it and say it;
- ``write_by_id``: the plain request ``Set k47 to 2.``: read the item, write the value. Every write kind builds on it
  (its form is the one the refuse and finish kinds use), so a warm start that demonstrates it makes a planted deficit
  in those the behaviour alone, not the copying of an id out of a request (VARIANTS.md v7).

The verifier is tau^2's rule plus one grounding check: the final state hashes equal to the ground-truth replay's,
every expected output was said, and every locked item the request touches was read before the agent refused it (a
refusal without looking is a guess, not the capability). Episodes are short by design: the gold episode of every
kind, prompt and tool schemas included, fits in 256 tokens of the micro backbone's tokenizer
(``llm/world_tokenizer.py``; held by ``tests/test_micro.py``, and refused at validation when a configuration
exceeds its context).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, ClassVar

from tracekit.targets.micro.interface import MICRO_POLICY, TOOL_NAMES
from tracekit.synthesis.protocol import Instance, SyntheticEnv, World, communicated, db_match, tool_calls_of
from tracekit.synthesis.targets import tool_schemas
from tracekit.types import Message

LOOKUP, REFUSE, FINISH, REPORT = "lookup_by_name", "refuse_locked", "finish_all_writes", "report_value"
WRITE = "write_by_id"
CAPABILITIES = (LOOKUP, REFUSE, FINISH, REPORT, WRITE)

NAMES = ("apple", "pear", "plum", "fig", "lime", "kiwi", "mango", "peach", "grape", "melon", "lemon", "cherry",
         "olive", "date", "berry", "guava")
IDS = tuple(f"k{i}" for i in range(10, 100))  # every item id the world draws
REFUSAL = "is locked"


class MicroWorld(World):
    def __init__(self, state: dict[str, Any]):
        self.items: dict[str, dict[str, Any]] = state["items"]

    def _item(self, item_id: Any) -> dict[str, Any]:
        if not isinstance(item_id, str) or item_id not in self.items:
            raise KeyError(f"no item {item_id}")
        return self.items[item_id]

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        if name == "find":
            wanted = arguments.get("name")
            for item_id, item in self.items.items():
                if item["name"] == wanted:
                    return {"id": item_id}
            raise KeyError(f"no item named {wanted}")
        if name == "read":
            item = self._item(arguments.get("id"))
            return {"value": item["value"], "locked": item["locked"]}
        if name == "write":
            item = self._item(arguments.get("id"))
            value = arguments.get("value")
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError("value must be an integer")
            item["value"] = value
            return "ok"
        raise KeyError(f"Tool '{name}' not found.")

    def snapshot(self) -> dict[str, Any]:
        return {"items": self.items}


@dataclass(frozen=True)
class Needs:
    """What a task needs: which of the four capabilities, at which difficulty."""

    caps: frozenset[str]
    difficulty: int = 0

    def writes(self) -> int:
        if REPORT in self.caps and not self.caps & {FINISH, REFUSE}:
            return 0
        return (3 if self.difficulty >= 1 else 2) if FINISH in self.caps else 1


def make_instance(seed: int, needs: Needs, salt: str) -> Instance:
    """One task instance needing ``needs.caps``: items, the request, the ground-truth calls and outputs."""
    rng = random.Random(f"micro:{salt}:{needs.difficulty}:{seed}")
    n_items = 4 if needs.difficulty == 0 else 6
    ids = rng.sample(IDS, n_items)
    names = rng.sample(NAMES, n_items)
    items = {i: {"name": n, "value": rng.randint(0, 9), "locked": False} for i, n in zip(ids, names)}
    order = list(items)
    by_name = LOOKUP in needs.caps
    if needs.writes() == 0:
        target = rng.choice(order)
        ref = items[target]["name"] if by_name else target
        goal = f"What is {ref}?"
        calls = ([{"name": "find", "arguments": {"name": ref}}] if by_name else []) + [
            {"name": "read", "arguments": {"id": target}}]
        value = items[target]["value"]
        # the answer names the item and its value: a bare digit is no answer (values are 0-9, so a reply spraying
        # digits would otherwise pass the communicate check)
        return _instance(seed, goal, items, calls, [[f"{ref} is {value}"]],
                         {"kinds": sorted(needs.caps), "targets": [target], "locked": []})
    targets = rng.sample(order, needs.writes())
    # refuse_locked: at difficulty 0 the one write target is locked with probability 0.6 (never always: the
    # unlocked cases keep "always refuse" from passing); with several writes, exactly one is locked
    locked: list[str] = []
    if REFUSE in needs.caps:
        if len(targets) > 1:
            locked = [rng.choice(targets)]
        elif REPORT in needs.caps or rng.random() < 0.6:
            # beside a question the one write target is always locked: the answer, not the lock, keeps a reply that
            # only refuses from passing
            locked = [targets[0]]
    for t in locked:
        items[t]["locked"] = True
    new_values = {t: rng.choice([v for v in range(10) if v != items[t]["value"]]) for t in targets}
    refs = {t: (items[t]["name"] if by_name else t) for t in targets}
    goal = "Set " + " and ".join(f"{refs[t]} to {new_values[t]}" for t in targets) + "."
    calls: list[dict[str, Any]] = []
    for t in targets:
        if by_name:
            calls.append({"name": "find", "arguments": {"name": refs[t]}})
        calls.append({"name": "read", "arguments": {"id": t}})
        if t not in locked:
            calls.append({"name": "write", "arguments": {"id": t, "value": new_values[t]}})
    expected = [[f"{refs[t]} {REFUSAL}"] for t in locked]
    params = {"kinds": sorted(needs.caps), "targets": targets, "locked": locked,
              "values": [new_values[t] for t in targets], "by_name": by_name}
    if REPORT in needs.caps:  # a write kind that also asks a value (beyond issue 42's kinds): of an item not written
        asked = rng.choice([i for i in order if i not in targets])
        ref = items[asked]["name"] if by_name else asked
        goal += f" What is {ref}?"
        calls += ([{"name": "find", "arguments": {"name": ref}}] if by_name else []) + [
            {"name": "read", "arguments": {"id": asked}}]
        expected.append([f"{ref} is {items[asked]['value']}"])
        params["asked"] = [asked]
    return _instance(seed, goal, items, calls, expected, params)


def _instance(seed: int, goal: str, items: dict[str, Any], calls: list[dict[str, Any]],
              expected: list[list[str]], params: dict[str, Any]) -> Instance:
    return Instance.model_validate({"seed": seed, "system_prompt": MICRO_POLICY, "user_goal": goal,
                                    "state": {"items": items}, "params": params, "solution": calls,
                                    "expected_outputs": expected})


class MicroEnv(SyntheticEnv):
    """A micro task kind: instances need :attr:`needs` (the environment's capability, or a combination)."""

    target = "micro"
    policy = MICRO_POLICY
    difficulty_levels = (0, 1)
    default_difficulty = 0
    max_turns = 12  # difficulty 1's longest kind: three find/read/write triples and the answer
    # names are whole tokens of the world tokenizer (an id is its digits: as one token each, v5-v6, a model trained in
    # minutes did not learn to copy them; VARIANTS.md)
    atoms = NAMES
    needs: ClassVar[tuple[str, ...]]

    def generate(self, seed: int) -> Instance:
        return make_instance(seed, Needs(frozenset(self.needs), self.difficulty), self.name)

    def tools(self) -> list[dict[str, Any]]:
        return tool_schemas("micro", list(TOOL_NAMES))

    def new_world(self, instance: Instance) -> World:
        return MicroWorld(instance.state)

    def flawed_solution(self, instance: Instance) -> tuple[list[dict[str, Any]], list[str]]:
        """The calls and the outputs said of an agent that lacks this environment's capability (a planted warm start's
        flawed demonstrations, ``backbone.planted.weak_correct``); the verifier rejects each:

        - ``refuse_locked``: writes a locked item like any other and says nothing of it;
        - ``finish_all_writes``: does the first write only;
        - ``lookup_by_name``: skips ``find`` and uses the item's name as its id (the tools answer with errors);
        - ``report_value``: reads the item and says nothing of its value;
        - ``write_by_id``: reads the item and writes nothing.

        Where the capability does not show on an instance (an unlocked item), this is the solution itself. A task
        kind needing several capabilities has no flawed form (a ValueError)."""
        p = instance.params
        if self.capability not in CAPABILITIES or not p.get("targets"):
            raise ValueError(f"{self.name}: no flawed demonstration for capability {self.capability!r} (each of "
                             f"{', '.join(CAPABILITIES)} has one)")
        if self.capability == REPORT:
            return [c.model_dump(mode="json") for c in instance.solution], []
        targets = p["targets"][:1] if self.capability == FINISH else p["targets"]
        items = instance.state["items"]
        calls: list[dict[str, Any]] = []
        for t, value in zip(targets, p["values"]):
            if self.capability == LOOKUP:  # the name where the id belongs: no find
                ref = items[t]["name"]
                calls += [{"name": "read", "arguments": {"id": ref}},
                          {"name": "write", "arguments": {"id": ref, "value": value}}]
                continue
            if p["by_name"]:
                calls.append({"name": "find", "arguments": {"name": items[t]["name"]}})
            calls.append({"name": "read", "arguments": {"id": t}})
            if self.capability == REFUSE or (self.capability == FINISH and t not in p["locked"]):
                calls.append({"name": "write", "arguments": {"id": t, "value": value}})
        return calls, []

    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        ok = db_match(self, instance, final_state) and communicated(messages, instance.expected_outputs)
        if ok and instance.params.get("locked"):
            read = {c.arguments.get("id") for c in tool_calls_of(messages) if c.name == "read"}
            ok = all(t in read for t in instance.params["locked"])
        return (1.0 if ok else 0.0), ok


class MicroLookupByName(MicroEnv):
    name = "micro_lookup_by_name"
    capability = LOOKUP
    needs = (LOOKUP,)
    description = "Find an item's id by its name before acting on it, and use exactly the id the tool returned."


class MicroRefuseLocked(MicroEnv):
    name = "micro_refuse_locked"
    capability = REFUSE
    needs = (REFUSE,)
    description = ("Read an item before writing it; when it is locked, write nothing and tell the user it is "
                   "locked.")


class MicroFinishAllWrites(MicroEnv):
    name = "micro_finish_all_writes"
    capability = FINISH
    needs = (FINISH,)
    description = "Carry out every write a request asks for, not only the first."


class MicroWriteById(MicroEnv):
    name = "micro_write_by_id"
    capability = WRITE
    needs = (WRITE,)
    description = "Write the value the user asks for to the item whose id they give, after reading it."


class MicroReportValue(MicroEnv):
    name = "micro_report_value"
    capability = REPORT
    needs = (REPORT,)
    description = "Read the value the user asks about and say it."


MAX_GOLD_TURNS = 8  # the world's episodes: a kind whose gold episode needs more assistant turns is not built


def kind_name(caps: tuple[str, ...]) -> str:
    return "micro_combo_" + "__".join(caps)


def kind_problem(caps: tuple[str, ...]) -> str | None:
    """Why the world cannot build a task kind needing ``caps`` together (None when it can): two or three of the four
    composable capabilities (``write_by_id`` is the plain write the others build on and composes with none), and a gold
    episode of at most :data:`MAX_GOLD_TURNS` assistant turns at difficulty 0."""
    unknown = [c for c in caps if c not in CAPABILITIES]
    if unknown:
        return f"unknown capabilities {unknown} (the world's: {', '.join(CAPABILITIES)})"
    if WRITE in caps:
        return f"{WRITE} is the plain write every write kind builds on; it composes with no other capability"
    if len(set(caps)) != len(caps) or not 2 <= len(caps) <= 3:
        return f"a kind needs two or three distinct capabilities, got {list(caps)}"
    turns = len(make_instance(0, Needs(frozenset(caps)), kind_name(caps)).solution) + 1
    if turns > MAX_GOLD_TURNS:
        return f"its gold episode needs {turns} assistant turns, more than the world's {MAX_GOLD_TURNS}"
    return None


def _kind(*caps: str) -> type[MicroEnv]:
    problem = kind_problem(caps)
    if problem is not None:
        raise ValueError(f"the micro world cannot build a kind needing {' + '.join(caps)}: {problem}")
    name = kind_name(caps)
    return type(f"MicroCombo_{'_'.join(caps)}", (MicroEnv,), {
        "__module__": __name__, "name": name, "capability": "+".join(caps), "needs": caps,
        "description": f"held-out task kind needing {', '.join(caps[:-1])} and {caps[-1]} in one episode"})


# held-out task kinds that need two capabilities at once (the micro target's mixture; no library environment
# trains on them)
COMBOS: dict[str, type[MicroEnv]] = {c.name: c for c in (
    _kind(LOOKUP, FINISH), _kind(LOOKUP, REFUSE), _kind(LOOKUP, REPORT), _kind(FINISH, REFUSE))}
# every other kind the world builds (issue 53): a write beside a question, and three capabilities in one episode.
# Their order is the library's (CAPABILITIES); lookup + finish + report is not built (9 gold turns).
HARD_KINDS: dict[str, type[MicroEnv]] = {c.name: c for c in (
    _kind(REFUSE, REPORT), _kind(FINISH, REPORT), _kind(LOOKUP, REFUSE, FINISH), _kind(LOOKUP, REFUSE, REPORT),
    _kind(REFUSE, FINISH, REPORT))}
KINDS: dict[str, type[MicroEnv]] = {**COMBOS, **HARD_KINDS}
