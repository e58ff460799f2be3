"""The ToolSandbox reference labeler: a documented heuristic over what a ToolSandbox trajectory shows, no LLM.

It labels ``data/toolsandbox_reference.yaml`` from the trajectory's tool calls and results and from what the
scenario declares (``Trajectory.info``: its categories, its allowed tools, the tools its milestones name):

- permission_error_recovery: NA unless a tool result was a setting-blocked error (``PermissionError`` or
  ``ConnectionError`` in the result) or the scenario is in ToolSandbox's ``STATE_DEPENDENCY`` category.
  LACKING if a blocked tool was never called again successfully afterwards, or (``STATE_DEPENDENCY``) the
  episode is not perfect and no setter (``set_*``) call went through. Else PRESENT.
- datetime_reasoning: NA unless the scenario allows a time tool (get_current_timestamp,
  timestamp_to_datetime_info, datetime_info_to_timestamp, shift_timestamp, timestamp_diff, search_holiday).
  LACKING if a time-tool call failed, a time tool the milestones name was never called successfully, or no
  time tool was called at all. Else PRESENT.

Noise (``noise`` > 0) flips applicable labels as :class:`tracekit.targets.tau2.labels.ReferenceLabeler` does.
"""

from __future__ import annotations

from pathlib import Path

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.rules import RuleLabeler
from tracekit.types import Capability, LabelValue, Trajectory

DICTIONARY_PATH = Path(__file__).with_name("dictionary.yaml")
PER, DTR = "permission_error_recovery", "datetime_reasoning"
TIME_TOOLS = frozenset({"get_current_timestamp", "timestamp_to_datetime_info", "datetime_info_to_timestamp",
                        "shift_timestamp", "timestamp_diff", "search_holiday"})
BLOCKED = ("PermissionError", "ConnectionError")


def reference_dictionary() -> list[Capability]:
    return load_dictionary(DICTIONARY_PATH)


def _calls(traj: Trajectory) -> list[tuple[str, bool, bool]]:
    """(tool name, result was an error, result was setting-blocked) per tool call, in order."""
    results = {m.tool_call_id: m for m in traj.messages if m.role == "tool"}
    out = []
    for m in traj.messages:
        for c in m.tool_calls if m.role == "assistant" else []:
            r = results.get(c.id)
            text = (r.content or "") if r is not None else ""
            error = r is None or r.error
            out.append((c.name, error, error and any(b in text for b in BLOCKED)))
    return out


def toolsandbox_labels(traj: Trajectory) -> dict[str, tuple[LabelValue, str]]:
    calls = _calls(traj)
    cats = set(traj.info.get("categories", []))
    allowed = set(traj.info.get("allowed_tools", []))
    named = set(traj.info.get("milestone_tools", []))
    out: dict[str, tuple[LabelValue, str]] = {}

    blocked = [(i, n) for i, (n, _, b) in enumerate(calls) if b]
    if not blocked and "STATE_DEPENDENCY" not in cats:
        out[PER] = (LabelValue.NA, "no setting blocked a call and the scenario has no state dependency")
    else:
        unrecovered = sorted({n for i, n in blocked if not any(m == n and not e for m, e, _ in calls[i + 1:])})
        changed = any(n.startswith("set_") and not e for n, e, _ in calls)
        if unrecovered:
            out[PER] = (LabelValue.LACKING, f"blocked call(s) never retried successfully: {unrecovered}")
        elif "STATE_DEPENDENCY" in cats and not traj.success and not changed:
            out[PER] = (LabelValue.LACKING, "the task depends on a setting and no setting was changed")
        else:
            out[PER] = (LabelValue.PRESENT, "every blocked call was retried after the blocker was resolved")

    if not allowed & TIME_TOOLS:
        out[DTR] = (LabelValue.NA, "the scenario offers no time tool")
    else:
        failed = sorted({n for n, e, _ in calls if n in TIME_TOOLS and e})
        used_ok = {n for n, e, _ in calls if n in TIME_TOOLS and not e}
        missing = sorted((named & TIME_TOOLS) - used_ok)
        if failed:
            out[DTR] = (LabelValue.LACKING, f"time tool call(s) failed: {failed}")
        elif missing:
            out[DTR] = (LabelValue.LACKING, f"time tool(s) the milestones need were never called successfully: {missing}")
        elif not used_ok:
            out[DTR] = (LabelValue.LACKING, "the task offers time tools and none was called")
        else:
            out[DTR] = (LabelValue.PRESENT, "the time computations the task needs were made")
    return out


class ToolSandboxReferenceLabeler(RuleLabeler):
    capabilities = (PER, DTR)
    dictionary_path = DICTIONARY_PATH

    def rules(self, traj: Trajectory) -> dict[str, tuple[LabelValue, str]]:
        return toolsandbox_labels(traj)
