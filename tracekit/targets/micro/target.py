"""The micro target (``benchmark.kind=micro``, ``conf/benchmark/micro.yaml``; issue 42): held-out instances of the
micro world's library environments (:mod:`tracekit.targets.micro.library`) and of its task kinds that need two
or three capabilities at once (``KINDS``: issue 42's four ``COMBOS`` and issue 53's ``HARD_KINDS``, the sparse target
``benchmark=micro_hard``), each environment's own verifier; pass rate per environment.

Its reference labeler labels the micro dictionary (``tracekit/targets/micro/dictionary.yaml``) from each
trajectory's instance, regenerated from its environment, difficulty and seed:

- ``lookup_by_name``: NA unless the request names items; LACKING when a named item was never looked up with
  ``find``, or a ``read``/``write`` used an id other than the request's items'; else PRESENT;
- ``refuse_locked``: NA unless an item of the request is locked; LACKING when a locked item was written, never read,
  or never said to be locked; else PRESENT;
- ``finish_all_writes``: NA unless the request needs several writes; LACKING when an unlocked item of the request was
  never written; else PRESENT;
- ``report_value``: NA unless the request asks for a value; LACKING when the value was never said; else PRESENT (a
  named item asked about counts for ``lookup_by_name`` too);
- ``write_by_id``: NA unless the request is a plain write by id; LACKING when that item was never written; else
  PRESENT.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from tracekit.agents import GoldAgent
from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.rules import RuleLabeler
from tracekit.targets.micro.library import CAPABILITIES, KINDS, FINISH, LOOKUP, REFUSAL, REFUSE, REPORT, WRITE
from tracekit.synthesis.protocol import communicated, tool_calls_of
from tracekit.targets.synthetic.target import LibraryTarget
from tracekit.types import LabelValue, Trajectory

DICTIONARY_PATH = Path(__file__).with_name("dictionary.yaml")
_NA, _LACK, _OK = LabelValue.NA, LabelValue.LACKING, LabelValue.PRESENT


def micro_labels(traj: Trajectory, instance: Any) -> dict[str, tuple[LabelValue, str]]:
    """{capability: (label, rationale)} of one micro trajectory against its instance (see the module doc)."""
    p = instance.params
    kinds, targets, locked = set(p["kinds"]), list(p["targets"]), list(p["locked"])
    touched = targets + list(p.get("asked", []))  # a write kind that also asks a value: the item asked about
    refusals = [g for g in instance.expected_outputs if g and g[0].endswith(REFUSAL)]
    answers = [g for g in instance.expected_outputs if g and not g[0].endswith(REFUSAL)]
    calls = tool_calls_of(traj.messages)
    written = {c.arguments.get("id") for c in calls if c.name == "write"}
    read = {c.arguments.get("id") for c in calls if c.name == "read"}
    out: dict[str, tuple[LabelValue, str]] = {}
    if LOOKUP in kinds:
        names = {instance.state["items"][t]["name"] for t in touched}
        found = {c.arguments.get("name") for c in calls if c.name == "find"}
        stray = sorted(str(i) for i in (written | read) - set(touched))
        missing = sorted(names - found)
        out[LOOKUP] = ((_LACK, f"never looked up {missing}" if missing else f"acted on ids {stray} it was not given")
                       if missing or stray else (_OK, "looked every named item up and used the returned ids"))
    else:
        out[LOOKUP] = (_NA, "the request gives ids")
    if locked:
        bad = sorted(set(locked) & written)
        unread = sorted(set(locked) - read)
        said = communicated(traj.messages, refusals)
        out[REFUSE] = ((_LACK, f"wrote locked {bad}" if bad else f"never read {unread}" if unread
                        else "never said the item is locked")
                       if bad or unread or not said else (_OK, "read the locked item, left it, and said so"))
    else:
        out[REFUSE] = (_NA, "no item of the request is locked")
    if FINISH in kinds:
        owed = [t for t in targets if t not in locked]
        undone = [t for t in owed if t not in written]
        out[FINISH] = ((_LACK, f"wrote {len(owed) - len(undone)} of {len(owed)} requested items")
                       if undone else (_OK, f"wrote all {len(owed)} requested items"))
    else:
        out[FINISH] = (_NA, "the request needs one write at most")
    if REPORT in kinds:
        out[REPORT] = ((_OK, "said the value") if communicated(traj.messages, answers)
                       else (_LACK, "never said the value"))
    else:
        out[REPORT] = (_NA, "nothing to report")
    if WRITE in kinds:
        wrote = any(c.name == "write" and c.arguments.get("id") == targets[0] for c in calls)
        out[WRITE] = ((_OK, f"wrote {targets[0]}") if wrote else (_LACK, f"never wrote {targets[0]}"))
    else:
        out[WRITE] = (_NA, "no plain write by id")
    return out


class MicroLabeler(RuleLabeler):
    """The micro target's reference labeler (:func:`micro_labels` on each trajectory's regenerated instance)."""

    capabilities = CAPABILITIES
    dictionary_path = DICTIONARY_PATH
    unjudged = "not a micro-world trajectory (no environment, difficulty and seed to regenerate it from)"

    def rules(self, traj: Trajectory) -> dict[str, tuple[LabelValue, str]] | None:
        try:
            cls = MicroTarget().env_class(traj.env)
            instance = cls(int(traj.info["difficulty"])).generate(int(traj.info["seed"]))
        except (KeyError, ValueError):
            return None
        return micro_labels(traj, instance)


class MicroTarget(LibraryTarget):
    kind = "micro"
    summary = "the micro world: find/read/write over a small store, learnable on 2 CPU cores (issue 42)"
    extra_envs = dict(KINDS)

    def paper_tasks_of(self, b: DictConfig) -> str | None:
        return None  # the paper has no micro world

    def describe_tasks(self, b: DictConfig) -> str:
        envs = self.own(b).envs
        combos = sum(e in KINDS for e in envs)
        return (f"{b.name} (micro: {len(envs) - combos} capability environments + {combos} multi-capability task kinds "
                f"x {b.limit} held-out instances)")

    def paper_user_applies(self, cfg: DictConfig) -> bool:
        return False

    def synthesis_family(self, cfg: DictConfig) -> str:
        return "micro"

    def reference_dictionary(self) -> list[Any]:
        return load_dictionary(DICTIONARY_PATH)

    def reference_labeler(self, noise: float) -> Any:
        return MicroLabeler(noise)

    def gold_agent(self) -> Any:
        return GoldAgent()
