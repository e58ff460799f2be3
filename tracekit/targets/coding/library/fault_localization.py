"""Coding C1, fault localization: find the function a failing test points to, before touching anything.

A seeded package ``calc/`` (``coding_common.BANK``), one function carrying one known bug; the tests are numbered,
so the failing test's name does not say which function it exercises. The agent must read the test (or run it and
read the traceback) and the source, then ``submit`` naming the faulty function (``answer``). Reward 1 iff the
submitted answer names exactly the buggy function (its name as a whole word, and no other function of the
package). Difficulty: 0: three functions in one module; 1: six functions over two modules.
"""

from __future__ import annotations

import re

from tracekit.targets.coding.library.common import BANK, CodingEnv, failing_test_statement
from tracekit.synthesis.protocol import Instance

POLICY = """You are a software engineer. The repository in the current directory holds a small Python package and its
tests. Use the `bash` tool (a fresh shell per command: cat, grep -n, sed -n, python -m pytest) to investigate.
Your task here is only to find the faulty function: do not fix it. When you know it, call `submit` with
`answer` set to the function's name."""


class CodingFaultLocalization(CodingEnv):
    name = "coding_fault_localization"
    capability = "fault_localization"
    description = ("Find the function responsible for a failing test: read the test and the traceback, open the "
                   "source it points to, and name the faulty function.")
    policy = POLICY

    def generate(self, seed: int) -> Instance:
        _, pkg = self.package(seed)
        test_file = pkg.test_id.split("::")[0]
        goal = failing_test_statement(pkg) + " Which function is faulty? Submit its name as `answer`."
        solution = [{"name": "bash", "arguments": {"command": f"python -m pytest -q {pkg.test_id}"}},
                    {"name": "bash", "arguments": {"command": f"cat {test_file}"}},
                    {"name": "submit", "arguments": {"answer": pkg.buggy}}]
        return self.instance(seed, pkg, goal, solution)

    def check(self, instance: Instance, final_state: dict) -> bool:
        if not final_state.get("submitted"):
            return False
        answer = final_state.get("answer", "")
        named = {f.name for f in BANK if re.search(rf"(?<![\w.]){re.escape(f.name)}(?!\w)", answer)}
        return named == {instance.params["buggy"]}
