"""Shared parts of the coding capability environments (target family ``coding``: the coding target's tools).

An instance is a tiny seeded Python package ``calc/`` (functions drawn from :data:`BANK`, one of them with one of
its known bugs) with a pytest file per module whose tests are numbered (``test_case_<k>``), so that a failing
test's name does not give the faulty function away. Every bug in the bank is caught by its function's test and
fixed by reverting it (``tests/test_synthesis_library.py`` holds that for every entry).

The world is a real private copy of the package; ``bash`` runs each command in the sandbox of the coding target
(:mod:`tracekit.coding.sandbox`), ``submit`` freezes the tree. The snapshot records the files at submission and,
per command, whether it changed the tree and whether it was a test run and its exit status, so the verifiers are
computed from what the agent actually did.
"""

from __future__ import annotations

import random
import weakref
from dataclasses import dataclass
from typing import Any

from tracekit.targets.coding.repo import Workspace, read_tree, run_tests
from tracekit.coding.sandbox import CommandLimits
from tracekit.targets.coding.interface import TOOLS
from tracekit.synthesis.protocol import Call, Instance, SyntheticEnv, World
from tracekit.types import Message, stable_hash

PACKAGE = "calc"
TEST_RE_WORDS = ("pytest", "unittest")


@dataclass(frozen=True)
class Fn:
    name: str
    source: str
    tests: tuple[str, ...]  # assertion lines
    bugs: tuple[tuple[str, str], ...]  # (exact text, its buggy replacement) in source


BANK: tuple[Fn, ...] = (
    Fn("clamp", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
       ("clamp(5, 0, 3) == 3", "clamp(-1, 0, 3) == 0", "clamp(2, 0, 3) == 2"),
       (("max(lo, min(x, hi))", "min(lo, max(x, hi))"), ("min(x, hi)", "min(x, lo)"))),
    Fn("mean", "def mean(xs):\n    return sum(xs) / len(xs)\n",
       ("mean([1, 2, 3]) == 2", "mean([4]) == 4"),
       (("/ len(xs)", "/ (len(xs) + 1)"), ("sum(xs)", "sum(xs[1:])"))),
    Fn("count_vowels", 'def count_vowels(s):\n    return sum(1 for c in s.lower() if c in "aeiou")\n',
       ('count_vowels("Hello World") == 3', 'count_vowels("AEIOU") == 5'),
       (("s.lower()", "s"), ('"aeiou"', '"aeio"'))),
    Fn("running_sum", "def running_sum(xs):\n    out, total = [], 0\n    for x in xs:\n        total += x\n"
       "        out.append(total)\n    return out\n",
       ("running_sum([1, 2, 3]) == [1, 3, 6]", "running_sum([]) == []"),
       (("total += x", "total = x"), ("out.append(total)", "out.append(x)"))),
    Fn("dedupe", "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n"
       "            seen.add(x)\n            out.append(x)\n    return out\n",
       ("dedupe([1, 2, 1, 3, 2]) == [1, 2, 3]", "dedupe([3, 1, 3]) == [3, 1]"),
       (("seen.add(x)", "pass"), ("return out", "return sorted(out)"))),
    Fn("chunk", "def chunk(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n",
       ("chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]", "chunk([], 3) == []"),
       (("range(0, len(xs), n)", "range(0, len(xs) - n, n)"), ("xs[i:i + n]", "xs[i:i + n - 1]"))),
    Fn("is_palindrome", "def is_palindrome(s):\n    t = [c.lower() for c in s if c.isalnum()]\n    return t == t[::-1]\n",
       ('is_palindrome("A man, a plan, a canal: Panama")', 'not is_palindrome("abc")'),
       (("c.lower()", "c"), ("t[::-1]", "t[1:][::-1]"))),
    Fn("word_freq", "def word_freq(text):\n    counts = {}\n    for w in text.lower().split():\n"
       "        counts[w] = counts.get(w, 0) + 1\n    return counts\n",
       ('word_freq("a b A") == {"a": 2, "b": 1}', 'word_freq("") == {}'),
       (("counts.get(w, 0) + 1", "counts.get(w, 1)"), ("text.lower().split()", "text.split()"))),
    Fn("flatten", "def flatten(xss):\n    return [x for xs in xss for x in xs]\n",
       ("flatten([[1, 2], [3], []]) == [1, 2, 3]",),
       (("[x for xs in xss for x in xs]", "[xs[0] for xs in xss if xs]"), ("for xs in xss", "for xs in xss[1:]"))),
    Fn("safe_div", "def safe_div(a, b, default=0.0):\n    if b == 0:\n        return default\n    return a / b\n",
       ("safe_div(6, 3) == 2", "safe_div(1, 0) == 0.0", "safe_div(1, 0, default=-1) == -1"),
       (("if b == 0:", "if a == 0:"), ("return a / b", "return b / a"))),
    Fn("title_case", 'def title_case(s):\n    return " ".join(w[:1].upper() + w[1:].lower() for w in s.split())\n',
       ('title_case("hello WORLD") == "Hello World"',),
       (("w[1:].lower()", "w[1:]"), ("w[:1].upper()", "w[:1]"))),
    Fn("fizzbuzz", 'def fizzbuzz(n):\n    if n % 15 == 0:\n        return "FizzBuzz"\n    if n % 3 == 0:\n'
       '        return "Fizz"\n    if n % 5 == 0:\n        return "Buzz"\n    return str(n)\n',
       ('fizzbuzz(15) == "FizzBuzz"', 'fizzbuzz(9) == "Fizz"', 'fizzbuzz(10) == "Buzz"', 'fizzbuzz(7) == "7"'),
       (("n % 15 == 0", "n % 10 == 0"), ("n % 5 == 0", "n % 5 == 1"))),
)
MODULE_NAMES = ("ops", "text", "seqs", "util")


@dataclass
class Package:
    files: dict[str, str]
    buggy: str  # function name
    module_path: str  # calc/<module>.py holding it
    test_id: str  # its failing test's node id
    line_range: tuple[int, int]  # 1-based, inclusive: the buggy function's lines in its module
    fixed_module: str  # the module's correct text
    bug: tuple[str, str]
    lines: tuple[str, str] = ("", "")  # (the buggy line, the correct line)
    sources: tuple[str, str] = ("", "")  # (the buggy function's source, its correct source)


def build_package(rng: random.Random, n_functions: int, n_modules: int) -> Package:
    """A seeded package: ``n_functions`` bank functions over ``n_modules`` modules, one bug, numbered tests."""
    fns = rng.sample(BANK, n_functions)
    buggy = rng.choice(fns)
    bug = rng.choice(buggy.bugs)
    modules = rng.sample(MODULE_NAMES, n_modules)
    placement: dict[str, list[Fn]] = {m: [] for m in modules}
    for i, fn in enumerate(fns):
        placement[modules[i % n_modules]].append(fn)
    files = {f"{PACKAGE}/__init__.py": ""}
    case = 0
    out: dict[str, Any] = {}
    for mod, members in placement.items():
        correct = "\n\n".join(f.source for f in members)
        text = correct
        if buggy in members:
            start = correct.index(buggy.source)
            text = correct[:start] + buggy.source.replace(bug[0], bug[1], 1) + correct[start + len(buggy.source):]
            first = correct[:start].count("\n") + 1
            right = next(line for line in buggy.source.splitlines() if bug[0] in line)
            out = {"module_path": f"{PACKAGE}/{mod}.py", "fixed_module": correct,
                   "line_range": (first, first + buggy.source.count("\n") - 1),
                   "lines": (right.replace(bug[0], bug[1], 1), right),
                   "sources": (buggy.source.replace(bug[0], bug[1], 1), buggy.source)}
        files[f"{PACKAGE}/{mod}.py"] = text
        tests = [f"from {PACKAGE}.{mod} import {', '.join(f.name for f in members)}\n"]
        cases = [(f, rng.random()) for f in members]
        cases.sort(key=lambda x: x[1])  # test order shuffled against definition order
        for f, _ in cases:
            case += 1
            body = "".join(f"    assert {t}\n" for t in f.tests)
            tests.append(f"\n\ndef test_case_{case}():\n{body}")
            if f is buggy:
                out["test_id"] = f"tests/test_{mod}.py::test_case_{case}"
        files[f"tests/test_{mod}.py"] = "".join(tests)
    return Package(files=files, buggy=buggy.name, bug=bug, **out)


def failing_test_statement(pkg: Package) -> str:
    return (f"The test {pkg.test_id} fails (run it with `python -m pytest -q {pkg.test_id.split('::')[0]}`). "
            "The package's code is under calc/, its tests under tests/.")


def is_test_command(command: str) -> bool:
    return any(w in command for w in TEST_RE_WORDS)


def fix_command(pkg: Package) -> str:
    """A one-line edit: the buggy function's faulty line corrected (a Python script through bash; the function's
    source is the anchor, so an identical line elsewhere in the module is left alone)."""
    wrong, right = pkg.sources
    return (f"python - <<'EOF'\nimport pathlib\np = pathlib.Path({pkg.module_path!r})\n"
            f"p.write_text(p.read_text().replace({wrong!r}, {right!r}, 1))\nEOF")


class CodingWorld(World):
    """A private copy of the instance's package; ``bash`` in the sandbox, ``submit`` freezes the tree."""

    def __init__(self, files: dict[str, str]):
        self._read_tree = read_tree
        self._files = files
        self._ws: Any = None  # the copy is made on the first tool call (an episode that calls none needs none)
        self.commands: list[dict[str, Any]] = []
        self.submitted: dict[str, Any] | None = None
        self._hash = stable_hash(files, 32)

    @property
    def ws(self) -> Any:
        if self._ws is None:
            self._ws = Workspace(self._files, prefix="libenv-")
            weakref.finalize(self, self._ws.close)
        return self._ws

    def call(self, name: str, arguments: dict[str, Any]) -> Any:
        if self.submitted is not None:
            raise RuntimeError("already submitted")
        if name == "submit":
            files = self._read_tree(self._ws.repo) if self._ws is not None else dict(self._files)
            self.submitted = {"files": files, "answer": str(arguments.get("answer", ""))[:200]}
            if self._ws is not None:
                self._ws.close()
            return "Submitted."
        if name != "bash":
            raise ValueError(f"Tool '{name}' not found.")
        command = arguments.get("command")
        if not isinstance(command, str) or not command.strip():
            raise ValueError("bash needs a non-empty string argument 'command'")
        r = self.ws.run(command, CommandLimits(cpu_seconds=20, wall_seconds=20, output_chars=3000))
        now = stable_hash(self._read_tree(self.ws.repo), 32)
        self.commands.append({"command": command[:2000], "returncode": r.returncode, "changed": now != self._hash,
                              "test": is_test_command(command), "events": r.events})
        self._hash = now
        return r.for_agent()

    def snapshot(self) -> dict[str, Any]:
        return {"commands": self.commands, "submitted": self.submitted is not None,
                "answer": (self.submitted or {}).get("answer", ""),
                "files": (self.submitted or {}).get("files") if self.submitted else None}


def tests_pass(files: dict[str, str] | None) -> bool:
    """Every test of the package passes on ``files`` (run in the sandbox)."""
    if not files:
        return False

    originals = [p for p in files if p.startswith("tests/")]
    with Workspace(files, prefix="libverify-") as ws:
        run = run_tests(ws.repo, sorted(originals), CommandLimits(cpu_seconds=30, wall_seconds=30))
    return bool(run.tests) and not run.timed_out and all(o == "passed" for o in run.tests.values())


class CodingEnv(SyntheticEnv):
    """Base of the coding capability environments: the coding target's tools, a generated package per seed."""

    target = "coding"
    difficulty_levels = (0, 1)
    default_difficulty = 0
    max_turns = 8
    sizes = {0: (3, 1), 1: (6, 2)}  # difficulty -> (functions, modules)

    def tools(self) -> list[dict[str, Any]]:
        return [dict(t) for t in TOOLS]

    def new_world(self, instance: Instance) -> World:
        return CodingWorld(dict(instance.state["files"]))

    def package(self, seed: int) -> tuple[random.Random, Package]:
        rng = random.Random(f"{self.name}:{self.difficulty}:{seed}")
        n_fn, n_mod = self.sizes[self.difficulty]
        return rng, build_package(rng, n_fn, n_mod)

    def instance(self, seed: int, pkg: Package, goal: str, solution: list[dict[str, Any]],
                 expected: list[list[str]] | None = None) -> Instance:
        return Instance(seed=seed, system_prompt=self.policy, user_goal=goal, state={"files": pkg.files},
                        params={"buggy": pkg.buggy, "module_path": pkg.module_path, "test_id": pkg.test_id,
                                "line_range": list(pkg.line_range), "fixed_module": pkg.fixed_module,
                                "bug": list(pkg.bug), "lines": list(pkg.lines)},
                        solution=[Call(**c) for c in solution], expected_outputs=expected or [])

    def verify(self, instance: Instance, final_state: dict[str, Any], messages: list[Message]) -> tuple[float, bool]:
        ok = self.check(instance, final_state)
        return (1.0 if ok else 0.0), ok

    def check(self, instance: Instance, final_state: dict[str, Any]) -> bool:
        raise NotImplementedError
