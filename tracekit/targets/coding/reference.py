"""Reference labeler of the coding target: a documented heuristic over a trajectory's bash commands and its patch.

Per trajectory (its outcome ``info``: the commands run, the model patch, the task's entity ``file::function``):

- ``fault_localization``: PRESENT if some command names the faulty file (path or file name) or the faulty
  function, or the patch changes the faulty file; else LACKING (needed by every task, never NA).
- ``minimal_edit``: NA if the patch is empty (no edit was made). LACKING if it changes a test file, a file other
  than the faulty one, or more than ``max(10, 3 x the gold patch's)`` changed lines, or the patched tree does not
  apply / the changed file does not parse (``malformed_patch``, a collection error); else PRESENT.
- ``test_before_submit``: NA if the patch is empty. LACKING if no test command (``pytest``, ``unittest``, a
  ``test_*.py`` run) comes after the last editing command (``sed -i``, a redirection into a file, ``tee``,
  ``patch``, ``git apply``, ``python`` writing files: any command after which the tree changed is not observable
  per command, so a command is an edit when it matches those forms), or the episode ended without ``submit``;
  else PRESENT.

Same optional label noise as the tau^2 reference labeler (``noise``: flip PRESENT/LACKING with that probability,
seeded per (seed, run, trajectory, capability)).
"""

from __future__ import annotations

import re
from pathlib import Path

from tracekit.analysis.discovery import load_dictionary
from tracekit.analysis.rules import RuleLabeler
from tracekit.types import Capability, LabelValue, Trajectory

DICTIONARY_PATH = Path(__file__).with_name("dictionary.yaml")
FL, ME, TBS = "fault_localization", "minimal_edit", "test_before_submit"
_EDIT = re.compile(r"sed\s+-i|(?<![0-9&])>{1,2}\s*(?!/dev/null)[\w./-]+\.py|\btee\b|\bpatch\b|git\s+apply|"
                   r"\bpython[\d.]*\s+(-c\s+)?.*(write|open\(.+['\"]w)")
_TEST = re.compile(r"pytest|unittest|test_\w+\.py")


def reference_dictionary() -> list[Capability]:
    return load_dictionary(DICTIONARY_PATH)


def _patch_files(patch: str) -> list[str]:
    return re.findall(r"^diff --git a/(\S+) b/", patch, flags=re.MULTILINE)


def _changed_lines(patch: str) -> int:
    return sum(1 for line in patch.splitlines()
               if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))


def coding_labels(traj: Trajectory, gold_patch_lines: int | None = None) -> dict[str, tuple[LabelValue, str]]:
    info = traj.info
    entity = str(info.get("entity", "::"))
    path, _, func = entity.partition("::")
    commands = [c.get("command", "") for c in info.get("commands", [])]
    patch = (info.get("prediction") or {}).get("model_patch", "")
    files = _patch_files(patch)
    out: dict[str, tuple[LabelValue, str]] = {}
    looked = [c for c in commands if path and (path in c or Path(path).name in c or (func and func in c))]
    if looked or path in files:
        out[FL] = (LabelValue.PRESENT, f"looked at {path}::{func}" if looked else f"patched {path}")
    else:
        out[FL] = (LabelValue.LACKING, f"no command names {Path(path).name} or {func}, and the patch does not touch it")
    if not patch.strip():
        out[ME] = (LabelValue.NA, "no edit")
        out[TBS] = (LabelValue.NA, "no edit")
        return out
    status = info.get("status", "")
    limit = max(10, 3 * (gold_patch_lines or 1))
    n = _changed_lines(patch)
    tests = [f for f in files if "/tests/" in f"/{f}" or Path(f).name.startswith("test_")]
    others = [f for f in files if f != path and f not in tests]
    if status == "malformed_patch":
        out[ME] = (LabelValue.LACKING, "the patch does not apply")
    elif tests:
        out[ME] = (LabelValue.LACKING, f"the patch edits test file(s) {tests[:2]}")
    elif others:
        out[ME] = (LabelValue.LACKING, f"the patch edits unrelated file(s) {others[:2]}")
    elif n > limit:
        out[ME] = (LabelValue.LACKING, f"{n} changed lines (limit {limit})")
    elif any("SyntaxError" in str(v) or "IndentationError" in str(v)
             for v in [info.get("tests", {}).get("detail", "")]):
        out[ME] = (LabelValue.LACKING, "the edited file does not parse")
    else:
        out[ME] = (LabelValue.PRESENT, f"{n} changed lines in {path}")
    last_edit = max((i for i, c in enumerate(commands) if _EDIT.search(c)), default=-1)
    tested_after = any(_TEST.search(c) for c in commands[last_edit + 1:])
    if not info.get("submitted"):
        out[TBS] = (LabelValue.LACKING, "never submitted")
    elif not tested_after:
        out[TBS] = (LabelValue.LACKING, "no test run after the last edit")
    else:
        out[TBS] = (LabelValue.PRESENT, "tests run after the last edit, then submitted")
    return out


class CodingReferenceLabeler(RuleLabeler):
    capabilities = (FL, ME, TBS)
    dictionary_path = DICTIONARY_PATH
    unjudged = "no coding episode info (the episode failed before its outcome)"

    def rules(self, traj: Trajectory) -> dict[str, tuple[LabelValue, str]] | None:
        return coding_labels(traj, traj.info.get("gold_patch_lines")) if "commands" in traj.info else None
