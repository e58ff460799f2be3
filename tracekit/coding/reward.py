"""The coding target's reward: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes on the patched tree, else 0.

:func:`evaluate_patch` is SWE-bench's procedure run locally: a fresh copy of the task's buggy tree, the model
patch applied with ``git apply`` (inside the sandbox), the task's test files restored to their original text (a
patch cannot pass by editing the tests), then only the FAIL_TO_PASS + PASS_TO_PASS tests run, in the sandbox.
Never raises for a bad patch: an empty patch, one that does not apply, or tests that hang all score 0 with the
reason in ``status`` (``empty_patch``, ``malformed_patch``, ``tests_timeout``, ``tests_failed``, ``resolved``).

:func:`prediction` is SWE-bench's prediction record (``instance_id``, ``model_name_or_path``, ``model_patch``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from tracekit.coding import repo as R
from tracekit.coding import sandbox
from tracekit.coding.sandbox import CommandLimits

if TYPE_CHECKING:
    from tracekit.coding.tasks import CodingTask

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


def evaluate_patch(task: CodingTask, buggy_tree: dict[str, str], patch: str, limits: CommandLimits) -> PatchVerdict:
    """Score ``patch`` on ``task`` (see the module docstring)."""
    if not patch or not patch.strip():
        return PatchVerdict(0.0, "empty_patch", detail="nothing changed")
    with R.Workspace(buggy_tree, prefix="eval-") as ws:
        ok, message = R.apply_patch(ws.repo, patch, limits)
        if not ok:
            return PatchVerdict(0.0, "malformed_patch", detail=message)
        for rel in task.test_files:  # the tests as the task defines them
            path = ws.repo / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(buggy_tree[rel], encoding="utf-8")
        sandbox.give_to_sandbox(ws.repo)
        run = R.run_tests(ws.repo, task.FAIL_TO_PASS + task.PASS_TO_PASS, limits)
    if run.timed_out:
        return PatchVerdict(0.0, "tests_timeout", detail=f"killed at the limit ({', '.join(run.events)})",
                            wall_s=run.wall_s)
    f2p = {t: run.tests.get(t, "not_run") for t in task.FAIL_TO_PASS}
    p2p_failed = [t for t in task.PASS_TO_PASS if run.tests.get(t) != "passed"]
    resolved = all(o == "passed" for o in f2p.values()) and not p2p_failed
    detail = "" if resolved else (run.output.strip()[-400:] if not run.tests else "")
    return PatchVerdict(1.0 if resolved else 0.0, "resolved" if resolved else "tests_failed", f2p, p2p_failed,
                        detail, run.wall_s)
