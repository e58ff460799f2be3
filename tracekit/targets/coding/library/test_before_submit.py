"""Coding C3, test before submit: after the last edit, run the tests and submit only once they pass.

The bug is named and easy (the faulty function and the wrong expression are given). Reward 1 iff, at ``submit``,
every test passes on the submitted tree *and* the command log shows a test run (``pytest``/``unittest``) after the
last command that changed the tree, whose exit status was 0 (the agent saw them pass). Submitting an untested fix,
even a correct one, scores 0. Difficulty: 0: three functions in one module; 1: six over two modules.
"""

from __future__ import annotations

from tracekit.targets.coding.library.common import CodingEnv, failing_test_statement, fix_command, tests_pass
from tracekit.synthesis.protocol import Instance

POLICY = """You are a software engineer. The repository in the current directory holds a small Python package and its
tests. Use the `bash` tool (a fresh shell per command) to edit files and run tests (python -m pytest -q).
Always run the tests after your last change and check that they pass before you call `submit`."""


class CodingTestBeforeSubmit(CodingEnv):
    name = "coding_test_before_submit"
    capability = "test_before_submit"
    description = ("Run the relevant tests after the last edit and submit only once they pass; never submit an "
                   "untested change.")
    policy = POLICY

    def generate(self, seed: int) -> Instance:
        _, pkg = self.package(seed)
        wrong, right = pkg.lines
        goal = (failing_test_statement(pkg) + f" In `{pkg.buggy}` ({pkg.module_path}) the line `{wrong.strip()}` "
                f"should be `{right.strip()}`. Fix it, make sure the tests pass, then submit.")
        edit = fix_command(pkg)
        solution = [{"name": "bash", "arguments": {"command": edit}},
                    {"name": "bash", "arguments": {"command": "python -m pytest -q tests"}},
                    {"name": "submit", "arguments": {}}]
        return self.instance(seed, pkg, goal, solution)

    def check(self, instance: Instance, final_state: dict) -> bool:
        if not final_state.get("submitted"):
            return False
        commands = final_state.get("commands", [])
        last_change = max((i for i, c in enumerate(commands) if c.get("changed")), default=-1)
        tested = any(c.get("test") and c.get("returncode") == 0 for c in commands[last_change + 1:])
        return tested and tests_pass(final_state.get("files"))
