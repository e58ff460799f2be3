"""Coding C2, minimal edit: fix a located bug with a small edit confined to the faulty function.

The faulty function and its module are named in the task, with the failing test. Reward 1 iff, at ``submit``, every
test passes and the change against the original tree touches only the faulty function's lines, in that module
only, with at most ``2 x the gold fix + 2`` changed lines (a rewrite of the module, reformatting or an edit of the
tests scores 0). Difficulty: 0: three functions in one module; 1: six over two modules.
"""

from __future__ import annotations

import difflib

from tracekit.targets.coding.library.common import CodingEnv, failing_test_statement, fix_command, tests_pass
from tracekit.synthesis.protocol import Instance

POLICY = """You are a software engineer. The repository in the current directory holds a small Python package and its
tests. Use the `bash` tool (a fresh shell per command) to read and edit files, e.g. sed -n '1,20p' FILE to read
lines and sed -i 's/OLD/NEW/' FILE to change one. Fix the bug with the smallest possible edit: change only the
faulty lines, do not rewrite or reformat other code, do not touch the tests. Then call `submit`."""


def changed_lines(old: str, new: str) -> tuple[int, list[int]]:
    """(number of changed lines, the old-file line numbers (1-based) the change touches)."""
    sm = difflib.SequenceMatcher(None, old.splitlines(), new.splitlines(), autojunk=False)
    n, where = 0, []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag != "equal":
            n += (i2 - i1) + (j2 - j1)
            where += list(range(i1 + 1, i2 + 1)) or [i1 + 1 if i1 < len(old.splitlines()) else i1]
    return n, where


class CodingMinimalEdit(CodingEnv):
    name = "coding_minimal_edit"
    capability = "minimal_edit"
    description = ("Fix a bug with a small, well-formed edit of the faulty lines only: no rewrites of other code, "
                   "no edits of the tests or of other files.")
    policy = POLICY

    def generate(self, seed: int) -> Instance:
        _, pkg = self.package(seed)
        goal = (failing_test_statement(pkg) + f" The bug is in the function `{pkg.buggy}` in {pkg.module_path}. "
                "Fix it with a minimal edit and submit.")
        edit = fix_command(pkg)
        solution = [{"name": "bash", "arguments": {"command": f"grep -n 'def {pkg.buggy}' {pkg.module_path}"}},
                    {"name": "bash", "arguments": {"command": edit}},
                    {"name": "bash", "arguments": {"command": f"python -m pytest -q {pkg.test_id.split('::')[0]}"}},
                    {"name": "submit", "arguments": {}}]
        return self.instance(seed, pkg, goal, solution)

    def check(self, instance: Instance, final_state: dict) -> bool:
        files = final_state.get("files")
        if not final_state.get("submitted") or not files:
            return False
        original = instance.state["files"]
        path = instance.params["module_path"]
        if set(files) != set(original) or any(files[p] != original[p] for p in original if p != path):
            return False
        gold_n, _ = changed_lines(original[path], instance.params["fixed_module"])
        n, where = changed_lines(original[path], files[path])
        lo, hi = instance.params["line_range"]
        if n == 0 or n > 2 * gold_n + 2 or any(not lo <= w <= hi for w in where):
            return False
        return tests_pass(files)
