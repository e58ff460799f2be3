"""Repository snapshots, private working copies, patches and test runs (all untrusted execution in the sandbox).

- :func:`package_snapshot`: the source files of an installed distribution (e.g. ``toolz`` from the registry), its
  tests included, as ``{relative path: text}``.
- :class:`Workspace`: one private copy of a tree (``<workdir>/repo``, owned by the sandbox user) with its git
  directory kept *outside* the copy (``<workdir>/git``, root-only), so nothing an agent writes into the copy can
  configure the git that computes its patch (no hooks, no fsmonitor, no filters).
- :func:`apply_patch`: ``git apply`` of an untrusted patch, run inside the sandbox on a fresh copy.
- :func:`run_tests`: pytest inside the sandbox with a small reporting plugin; the outcome of every test by node id.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.coding import sandbox
from tracekit.coding.sandbox import CommandLimits

PLUGIN_DIR = Path(__file__).with_name("pytest_plugin")
_GIT = ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-c", "safe.directory=*",
        "-c", "user.name=tracekit", "-c", "user.email=tracekit@localhost", "-c", "commit.gpgsign=false",
        "-c", "core.autocrlf=false", "-c", "diff.noprefix=false"]


def package_snapshot(dist: str) -> tuple[str, dict[str, str]]:
    """(version, {path: text}) of the ``.py`` files of installed distribution ``dist`` (its packages and tests)."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"coding target: distribution {dist!r} is not installed (pip install {dist})") from None
    files = {}
    for f in d.files or []:
        rel = str(f)
        if not rel.endswith(".py") or ".dist-info" in rel or rel.startswith(("..", "/")) or "__pycache__" in rel:
            continue
        files[rel] = Path(d.locate_file(f)).read_text(encoding="utf-8")
    if not files:
        raise RuntimeError(f"coding target: distribution {dist!r} lists no Python files")
    return d.version, dict(sorted(files.items()))


def write_tree(files: dict[str, str], dest: Path) -> Path:
    for rel, text in files.items():
        p = dest / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return dest


MAX_FILE_BYTES = 2 << 20  # a larger file in a copy is left out of its patch
CACHE_DIRS = (".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis")


def read_tree(root: Path) -> dict[str, str]:
    """Regular files under ``root`` as text: symlinks, ``.git`` and tool caches (``CACHE_DIRS``), ``.pyc`` files
    and files over ``MAX_FILE_BYTES`` are left out (nothing is followed out of the tree)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in CACHE_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            st = p.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_size <= MAX_FILE_BYTES and not name.endswith(".pyc"):
                out[str(p.relative_to(root))] = p.read_bytes().decode("utf-8", errors="replace")
    return out


def _git(git_dir: Path, work: Path, *args: str, stdin: str | None = None) -> str:
    r = subprocess.run([*_GIT, f"--git-dir={git_dir}", f"--work-tree={work}", *args], input=stdin,
                       capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(git_dir),
                                                                          "GIT_CONFIG_NOSYSTEM": "1", "LC_ALL": "C"})
    if r.returncode != 0:
        raise RuntimeError(f"git {' '.join(args[:2])} failed: {r.stderr.strip()[:300]}")
    return r.stdout


class Workspace:
    """A private copy of ``files`` at ``self.repo`` with a base commit; :meth:`diff` is the patch against it."""

    def __init__(self, files: dict[str, str], prefix: str = "ws-", agent_git: bool = False):
        self.root = sandbox.new_workdir(prefix)
        self.repo = write_tree(files, self.root / "repo")
        self.repo.mkdir(exist_ok=True)
        self.git_dir = self.root / "git"
        _git(self.git_dir, self.repo, "init", "-q")
        _git(self.git_dir, self.repo, "add", "-A")
        _git(self.git_dir, self.repo, "commit", "-q", "-m", "base", "--allow-empty")
        sandbox.give_to_sandbox(self.repo)
        if agent_git:  # the agent's own repository in the copy (git status/diff/stash work); git never tracks .git,
            # and the patch is computed with the outside git dir, so nothing in it is ever read by this process
            r = sandbox.run("git init -q && git add -A && git -c user.name=agent -c user.email=agent@localhost "
                            "commit -qm base", self.repo, CommandLimits(wall_seconds=60))
            if r.returncode != 0:
                raise RuntimeError(f"cannot initialize the agent's git repository: {r.output.strip()[-200:]}")

    def diff(self) -> str:
        """The copy's changes against the base commit, new and deleted files included (git's unified format).
        Computed on a root-owned staging copy of the copy's regular files (:func:`read_tree`), so nothing the
        agent left in the copy (nested repositories, symlinks, special files) reaches git."""
        stage = self.root / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        write_tree(read_tree(self.repo), stage).mkdir(exist_ok=True)
        try:
            _git(self.git_dir, stage, "add", "-A")
            return _git(self.git_dir, stage, "diff", "--cached", "--no-color", "--no-ext-diff", "--no-textconv",
                        "--binary", "HEAD")
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def run(self, command: str, limits: CommandLimits) -> sandbox.CommandResult:
        return sandbox.run(command, self.repo, limits)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_patch(repo: Path, patch: str, limits: CommandLimits) -> tuple[bool, str]:
    """``git apply`` ``patch`` to the tree at ``repo`` inside the sandbox; (applied, git's message)."""
    if not patch.strip():
        return False, "empty patch"
    holder = sandbox.new_workdir("patch-")
    try:
        (holder / "model.patch").write_text(patch if patch.endswith("\n") else patch + "\n", encoding="utf-8")
        sandbox.give_to_sandbox(holder)
        r = sandbox.run(["git", "apply", "--whitespace=nowarn",
                         str(holder / "model.patch")], repo, limits)
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    ok = r.returncode == 0
    return ok, r.output.strip()[-500:] if not ok else "applied"


@dataclass
class TestRun:
    tests: dict[str, str] = field(default_factory=dict)  # node id -> passed | failed | skipped
    failures: dict[str, str] = field(default_factory=dict)
    collect_errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    timed_out: bool = False
    events: list[str] = field(default_factory=list)
    output: str = ""

    def passed(self) -> set[str]:
        return {t for t, o in self.tests.items() if o == "passed"}


def run_tests(repo: Path, selection: list[str], limits: CommandLimits) -> TestRun:
    """pytest on ``selection`` (node ids or paths, relative to ``repo``) in the sandbox. A run killed at a limit
    (a hanging test) reports what finished before (nothing, usually) and ``timed_out``."""
    holder = sandbox.new_workdir("res-")
    try:
        sandbox.give_to_sandbox(holder)
        report = holder / "report.json"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tracekit_report",
                "--rootdir", str(repo), "--confcutdir", str(repo), "-c", "/dev/null", "-o", "addopts=", "--tb=short", "--no-header",
                "-W", "ignore::DeprecationWarning", *selection]
        env = {"PYTHONPATH": f"{repo}:{PLUGIN_DIR}", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               "TRACEKIT_REPORT": str(report)}
        r = sandbox.run(argv, repo, limits, env=env, read_only=(PLUGIN_DIR,))
        data = json.loads(report.read_text()) if report.exists() else {}
    finally:
        shutil.rmtree(holder, ignore_errors=True)
    return TestRun(data.get("tests", {}), data.get("failures", {}), data.get("collect_errors", []), r.wall_s,
                   "wall_time" in r.events or "cpu_time" in r.events, r.events, r.output)
