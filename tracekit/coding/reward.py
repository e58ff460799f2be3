"""The coding target's reward: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes on the patched tree, else 0.

:func:`evaluate_patch` is SWE-bench's procedure run locally: a fresh copy of the task's buggy tree, the model
patch applied with ``git apply`` (inside the sandbox), the task's test files restored to their original text (a
patch cannot pass by editing the tests), then only the FAIL_TO_PASS + PASS_TO_PASS tests run, in the sandbox.
Never raises for a bad patch: an empty patch, one that does not apply, or tests that hang all score 0 with the
reason in ``status`` (``empty_patch``, ``malformed_patch``, ``tests_timeout``, ``tests_failed``, ``resolved``).

:func:`prediction` is SWE-bench's prediction record (``instance_id``, ``model_name_or_path``, ``model_patch``).

:func:`swe_rl_reward` is the SWE-RL baseline's rule-based reward (Wei et al., 2025; arXiv:2502.18449, section 2.1),
written from its definition:

- a format error scores -1 (SWE-RL: the output cannot be parsed, a search block is not found, or an edit changes
  nothing; here, where the agent edits a real tree through bash and the patch is ``git diff``, a *format error* is
  a submission that changes nothing, or a patch that does not apply);
- otherwise the reward is the mean, over every file that the predicted patch or the oracle patch changes, of
  ``difflib.SequenceMatcher(None, predicted_file_diff, oracle_file_diff, autojunk=False).ratio()``, where a file
  diff is the unified diff (3 lines of context, the two ``---``/``+++`` header lines dropped) between the file's
  original text and its new text; a file changed by only one side scores 0.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from tracekit.coding import sandbox
from tracekit.coding import repo as R
from tracekit.coding.runtime import task_hide
from tracekit.coding.sandbox import CommandLimits


class PatchTask(Protocol):
    """What :func:`evaluate_patch` reads of a task (:class:`tracekit.coding.tasks.CodingTask` has it)."""

    test_files: Sequence[str]
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]

STATUSES = ("resolved", "tests_failed", "empty_patch", "malformed_patch", "tests_timeout")


@dataclass
class PatchVerdict:
    reward: float
    status: str
    fail_to_pass: dict[str, str] = field(default_factory=dict)  # test -> outcome on the patched tree
    pass_to_pass_failed: list[str] = field(default_factory=list)
    detail: str = ""
    wall_s: float = 0.0

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prediction(instance_id: str, model: str, patch: str) -> dict[str, str]:
    return {"instance_id": instance_id, "model_name_or_path": model, "model_patch": patch}


def evaluate_patch(task: PatchTask, buggy_tree: dict[str, str], patch: str, limits: CommandLimits) -> PatchVerdict:
    """Score ``patch`` on ``task`` (see the module docstring). Nothing but the patched tree provides the task's
    package: every other copy of it is hidden from the test run (``task.repo``: ``<distribution>==<version>``)."""
    if not patch or not patch.strip():
        return PatchVerdict(0.0, "empty_patch", detail="nothing changed")
    hide = task_hide(getattr(task, "repo", None))
    with R.Workspace(buggy_tree, prefix="eval-", hide=hide) as ws:
        ok, message = R.apply_patch(ws.repo, patch, limits, hide=hide)
        if not ok:
            return PatchVerdict(0.0, "malformed_patch", detail=message)
        for rel in task.test_files:  # the tests as the task defines them
            path = ws.repo / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(buggy_tree[rel], encoding="utf-8")
        sandbox.give_to_sandbox(ws.repo)
        run = R.run_tests(ws.repo, task.FAIL_TO_PASS + task.PASS_TO_PASS, limits, hide=hide)
    if run.timed_out:
        return PatchVerdict(0.0, "tests_timeout", detail=f"killed at the limit ({', '.join(run.events)})",
                            wall_s=run.wall_s)
    f2p = {t: run.tests.get(t, "not_run") for t in task.FAIL_TO_PASS}
    p2p_failed = [t for t in task.PASS_TO_PASS if run.tests.get(t) != "passed"]
    resolved = all(o == "passed" for o in f2p.values()) and not p2p_failed
    detail = "" if resolved else (run.output.strip()[-400:] if not run.tests else "")
    return PatchVerdict(1.0 if resolved else 0.0, "resolved" if resolved else "tests_failed", f2p, p2p_failed,
                        detail, run.wall_s)


# --------------------------------------------------------------------------------------------
# SWE-RL's reward (the swe_rl baseline, tracekit/methods/swe_rl.py)

FORMAT_ERROR = -1.0


class FormatError(ValueError):
    """The prediction is not a usable edit (nothing changed, or a patch that does not apply)."""


def file_diff(old: str, new: str, context: int = 3) -> str:
    """SWE-RL's normalized per-file change: the unified diff of ``old`` -> ``new`` without its two header lines."""
    lines = list(difflib.unified_diff(old.splitlines(), new.splitlines(), fromfile="old", tofile="new",
                                      lineterm="", n=context))
    return "\n".join(lines[2:])


def changed_file_diffs(context: Mapping[str, str], new_content: Mapping[str, str]) -> dict[str, str]:
    """path -> normalized diff, for each path of ``new_content`` whose text differs from ``context`` (missing: "")."""
    out = {}
    for path, new in new_content.items():
        d = file_diff(context.get(path, ""), new)
        if d:
            out[path] = d
    return out


def change_similarities(pred: Mapping[str, str], oracle: Mapping[str, str]) -> dict[str, float]:
    """Per changed file (union of both sides): sequence similarity of the two diffs (0 if one side is empty)."""
    out = {}
    for path in sorted(set(pred) | set(oracle)):
        p, o = pred.get(path, ""), oracle.get(path, "")
        out[path] = 0.0 if not p or not o else difflib.SequenceMatcher(None, p, o, autojunk=False).ratio()
    return out


def swe_rl_score(context: Mapping[str, str], oracle_new: Mapping[str, str],
                 pred_new: Mapping[str, str]) -> tuple[float, dict[str, float]]:
    """(reward, per-file similarities): -1 when the prediction changes nothing, else the mean similarity."""
    pred = changed_file_diffs(context, pred_new)
    if not pred:
        return FORMAT_ERROR, {}
    oracle = changed_file_diffs(context, oracle_new)
    sims = change_similarities(pred, oracle)
    return sum(sims.values()) / len(sims), sims


def swe_rl_reward(context: Mapping[str, str], oracle_new: Mapping[str, str], pred_new: Mapping[str, str] | None,
                  malformed: bool = False) -> float:
    """SWE-RL's reward; ``pred_new=None`` or ``malformed``: the prediction could not be read (a format error)."""
    if malformed or pred_new is None:
        return FORMAT_ERROR
    return swe_rl_score(context, oracle_new, pred_new)[0]
