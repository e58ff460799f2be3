"""The coding target's reward: 1 when every FAIL_TO_PASS and PASS_TO_PASS test passes with the patch's fix, else 0;
a reward only a fix earns.

:func:`evaluate_patch` is SWE-bench's procedure (a fresh container, the test files reset, only the model patch
applied), run locally and hardened against reward hacking (SWE-bench's harness trusts what runs in the container;
RL on SWE tasks finds every hole in that trust: editing tests, conftest hooks, rewriting the report, exiting early):

1. **What is taken from a patch.** The patch is applied with ``git apply`` in the sandbox to a scratch copy of the
   buggy tree, only to learn the files it changes. Then a *fresh* copy of the buggy tree is made and, of those
   changes, only the new text of the package's own existing source files is written into it
   (:func:`takes`: a ``.py`` file of the buggy tree that is not a test file, under no ``tests``/``test``
   directory, and not ``conftest.py``, ``setup.py``, ``noxfile.py``, ``sitecustomize.py`` or
   ``usercustomize.py``). Everything else the patch changes is dropped and recorded in the verdict (``dropped``):
   new files of any kind (a new ``conftest.py``, a ``sitecustomize.py``, a ``.pth``), test files and conftests,
   and test or packaging configuration (``pytest.ini``, ``pyproject.toml``, ``setup.cfg``, ``tox.ini``, ...).
   A patch whose every change is dropped scores 0 as ``only_dropped`` (no test runs).
2. **How the tests run** (:func:`tracekit.targets.coding.repo.run_tests`): pytest under tracekit's reporter with tracekit's
   own configuration (``-c /dev/null``, ``--rootdir``/``--confcutdir`` the tree, ``-p no:cacheprovider``, no
   plugin autoload), the test directories bound read-only over the copy (they can be neither written nor renamed)
   and hashed again afterwards.
3. **How the outcome comes back**: signed, numbered records on an inherited pipe whose key the reporter reads
   before any code of the tree is imported; the environment names only a decoy path. The reporter checks, after
   each test, that pytest's internals are those it snapshotted before the tree was imported (functions, classes,
   code objects, hook implementations, the import system), that no trace or profile function is set, that the
   package's ``sys.modules`` entries are files of the tree and each test ran, as collected, from its own file; an
   audit hook (PEP 578: it cannot be removed) reports at once a write, rename or removal of a test file, a look at
   ``/proc/self/fd``, ``gc.get_objects`` and the like, a replaced code object, a tracer in place.

A run that shows any sign of tampering (a failed check, a forged, missing or trailing record, an exit status other
than the reporter's, a write to the decoy, a test file changed) scores 0 with status ``tampering`` and the reasons
in ``tampering``; it is never a ``tests_failed``.

**What this does not defend against**: code of the tree that reaches into the reporter (it is a registered
pytest plugin; the signing function is a closure over the key's pads, the snapshot and the audit hook's state are
its attributes; ``ctypes`` reads any memory) and then forges a complete signed record stream, silencing every
check and restoring every patched object before each one: the in-process attacker, which only a test run in a
process the tree's code cannot touch would stop; code that is a fix only on the test
inputs (special-casing the tests' values: that is a fix as far as any test can tell); and a patch that changes
the package's source files in ways the tests do not exercise. The sandbox (:mod:`tracekit.coding.sandbox`) bounds
what such code can reach: its own copy, no network, no host files but the allow-listed view.

Never raises for a bad patch: an empty patch, one that does not apply, or tests that hang all score 0 with the
reason in ``status`` (:data:`STATUSES`).

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
from pathlib import Path
from typing import Any, Protocol

from tracekit.coding import sandbox
from tracekit.targets.coding import repo as R
from tracekit.coding.runtime import task_hide
from tracekit.coding.sandbox import CommandLimits


class PatchTask(Protocol):
    """What :func:`evaluate_patch` reads of a task (:class:`tracekit.targets.coding.tasks.CodingTask` has it)."""

    test_files: Sequence[str]
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]

STATUSES = ("resolved", "tests_failed", "empty_patch", "malformed_patch", "only_dropped", "tests_timeout",
            "tampering")
NOT_SOURCE = ("conftest.py", "setup.py", "noxfile.py", "sitecustomize.py", "usercustomize.py")
TEST_DIRS = ("tests", "test", "testing")
LIMIT_EVENTS = ("memory", "processes", "cpu_time", "wall_time", "killed", "file_size", "disk")


@dataclass
class PatchVerdict:
    reward: float
    status: str
    fail_to_pass: dict[str, str] = field(default_factory=dict)  # test -> outcome on the patched tree
    pass_to_pass_failed: list[str] = field(default_factory=list)
    detail: str = ""
    wall_s: float = 0.0
    dropped: list[str] = field(default_factory=list)  # files the patch changed that were not taken ("<path>: why")
    tampering: list[str] = field(default_factory=list)  # why the run's outcome was not trusted

    @property
    def resolved(self) -> bool:
        return self.status == "resolved"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def prediction(instance_id: str, model: str, patch: str) -> dict[str, str]:
    return {"instance_id": instance_id, "model_name_or_path": model, "model_patch": patch}


def takes(path: str, buggy_tree: Mapping[str, str], test_files: Sequence[str]) -> str | None:
    """None if the patch's change to ``path`` is taken (a source file of the package), else why it is dropped."""
    parts = path.split("/")
    name = parts[-1]
    if path not in buggy_tree:
        return "a new file"
    if path in test_files or name.startswith("test_") or name.endswith("_test.py") or \
            any(p in TEST_DIRS for p in parts[:-1]):
        return "a test file"
    if name in NOT_SOURCE:
        return "test or packaging configuration"
    if not name.endswith(".py"):
        return "not a Python source file (configuration or data)"
    return None


def _taken(task: PatchTask, buggy_tree: dict[str, str], patched: Mapping[str, str]) -> tuple[dict[str, str | None],
                                                                                             list[str]]:
    """({source path: new text, None when deleted}, ["<path>: why dropped"]) of the patch's changes."""
    taken: dict[str, str | None] = {}
    dropped: list[str] = []
    for path in sorted(set(buggy_tree) | set(patched)):
        new = patched.get(path)
        if new == buggy_tree.get(path):
            continue
        why = takes(path, buggy_tree, task.test_files)
        if why is None:
            taken[path] = new
        else:
            dropped.append(f"{path}: {why}")
    return taken, dropped


def evaluate_patch(task: PatchTask, buggy_tree: dict[str, str], patch: str, limits: CommandLimits) -> PatchVerdict:
    """Score ``patch`` on ``task`` (see the module docstring). Nothing but the patched tree provides the task's
    package: every other copy of it is hidden from the test run (``task.repo``: ``<distribution>==<version>``)."""
    if not patch or not patch.strip():
        return PatchVerdict(0.0, "empty_patch", detail="nothing changed")
    hide = task_hide(getattr(task, "repo", None))
    with R.Workspace(buggy_tree, prefix="apply-", hide=hide) as scratch:
        ok, message = R.apply_patch(scratch.repo, patch, limits, hide=hide)
        if not ok:
            return PatchVerdict(0.0, "malformed_patch", detail=message)
        patched = R.read_tree(scratch.repo)
    taken, dropped = _taken(task, buggy_tree, patched)
    if not taken:
        return PatchVerdict(0.0, "only_dropped", detail="the patch changes no source file of the package",
                            dropped=dropped)
    tree = {p: t for p, t in {**buggy_tree, **taken}.items() if t is not None}
    tests = [t for t in task.test_files if t in tree]
    with R.Workspace(tree, prefix="eval-", hide=hide) as ws:
        # read-only for the run: each test file's directory (a mount point: not renamed either), or the file itself
        # at the top of the tree
        test_dirs = sorted({str(Path(t).parent) for t in tests} - {"."})
        protected = tuple(ws.repo / d for d in test_dirs) + tuple(ws.repo / t for t in tests if "/" not in t)
        run = R.run_tests(ws.repo, task.FAIL_TO_PASS + task.PASS_TO_PASS, limits, hide=hide, protected=protected)
        after = R.read_tree(ws.repo)
    tampering = list(run.tampering)
    tampering += [f"{t}: the test file changed during the run" for t in tests if after.get(t) != buggy_tree[t]]
    if run.timed_out and not tampering:
        return PatchVerdict(0.0, "tests_timeout", detail=f"killed at the limit ({', '.join(run.events)})",
                            wall_s=run.wall_s, dropped=dropped)
    if not run.ended and not tampering:
        limit = [e for e in run.events if e in LIMIT_EVENTS]
        if limit:
            return PatchVerdict(0.0, "tests_failed", detail=f"killed at a limit ({', '.join(limit)}): "
                                f"{run.output.strip()[-300:]}", wall_s=run.wall_s, dropped=dropped)
        tampering.append(f"the test process ended (exit status {run.returncode}) without its reporter's end "
                         "record (os._exit, or the reporter stopped)")
    if tampering:
        return PatchVerdict(0.0, "tampering", detail="; ".join(tampering)[:400], wall_s=run.wall_s,
                            dropped=dropped, tampering=tampering[:50])
    f2p = {t: run.tests.get(t, "not_run") for t in task.FAIL_TO_PASS}
    p2p_failed = [t for t in task.PASS_TO_PASS if run.tests.get(t) != "passed"]
    resolved = all(o == "passed" for o in f2p.values()) and not p2p_failed
    detail = "" if resolved else (run.output.strip()[-400:] if not run.tests else "")
    return PatchVerdict(1.0 if resolved else 0.0, "resolved" if resolved else "tests_failed", f2p, p2p_failed,
                        detail, run.wall_s, dropped)


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
