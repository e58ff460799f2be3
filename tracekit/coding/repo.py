"""Repository snapshots, private working copies, patches and test runs (all untrusted execution in the sandbox).

- :func:`package_snapshot`: the source files of an installed distribution (e.g. ``toolz`` from the registry), its
  tests included, as ``{relative path: text}``.
- :class:`Workspace`: one private copy of a tree (``<workdir>/repo``, owned by the sandbox user; as root a tmpfs of
  the tree's size plus ``disk_bytes``, so an episode's disk use is bounded across its commands) with its git
  directory kept *outside* the copy (``<workdir>/git``, root-only), so nothing an agent writes into the copy can
  configure the git that computes its patch (no hooks, no fsmonitor, no filters).
- :func:`read_tree`: the copy read back with bounded memory (a total byte budget and an entry budget; what is left
  out is listed in the returned tree's ``cut``).
- :func:`apply_patch`: ``git apply`` of an untrusted patch, run inside the sandbox on a fresh copy.
- :func:`run_tests`: pytest inside the sandbox with a small reporting plugin; the outcome of every test by node id.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tracekit.coding import sandbox
from tracekit.coding.sandbox import CommandLimits

log = logging.getLogger(__name__)

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
MAX_TREE_BYTES = 128 << 20  # what read_tree reads in all (a copy of sparse or huge files cannot exhaust the host)
MAX_TREE_ENTRIES = 100_000  # files and directories read_tree visits
CACHE_DIRS = (".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis")
MAX_REPORT_BYTES = 16 << 20  # a test run's JSON report larger than this is not read


class Tree(dict):
    """``{relative path: text}`` as read back; ``cut``: what was left out because a budget ran out or a file was
    too large (``"<path>: <why>"``, at most 50 kept, ``n_cut`` counts all)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cut: list[str] = []
        self.n_cut = 0

    def _cut(self, what: str) -> None:
        self.n_cut += 1
        if len(self.cut) < 50:
            self.cut.append(what)


def read_tree(root: Path, max_bytes: int = MAX_TREE_BYTES, max_entries: int = MAX_TREE_ENTRIES) -> Tree:
    """Regular files under ``root`` as text: symlinks, ``.git`` and tool caches (``CACHE_DIRS``), ``.pyc`` files
    and files over ``MAX_FILE_BYTES`` are left out (nothing is followed out of the tree). Memory is bounded: at most
    ``max_bytes`` are read in all (a file is charged its size, so 300 sparse 2 MB files cost 600 MB of budget,
    not of memory) and ``max_entries`` entries visited; past either, the rest is left out and listed in ``cut``."""
    out = Tree()
    budget, entries = max_bytes, 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        entries += len(dirnames) + len(filenames)
        if entries > max_entries:
            out._cut(f"{os.path.relpath(dirpath, root)}/: more than {max_entries} entries: the rest of the tree")
            break
        dirnames[:] = sorted(d for d in dirnames if d not in CACHE_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            try:
                st = p.lstat()
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or name.endswith(".pyc"):
                continue
            if st.st_size > MAX_FILE_BYTES:
                out._cut(f"{rel}: {st.st_size} bytes > {MAX_FILE_BYTES}")
                continue
            if st.st_size > budget:
                out._cut(f"{rel}: the tree's read budget of {max_bytes} bytes is spent")
                continue
            try:
                fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            with os.fdopen(fd, "rb") as f:
                data = f.read(min(st.st_size, budget) + 1)
            if len(data) > min(st.st_size, budget):  # it grew since lstat
                out._cut(f"{rel}: changed while read")
                continue
            budget -= len(data)
            out[rel] = data.decode("utf-8", errors="replace")
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

    def __init__(self, files: dict[str, str], prefix: str = "ws-", agent_git: bool = False,
                 disk_bytes: int = CommandLimits().disk_bytes, hide: tuple[str, ...] = ()):
        self.hide = tuple(hide)  # distributions no command in the copy may see (the task's package)
        self.root = sandbox.new_workdir(prefix)
        self.repo = self.root / "repo"
        self.repo.mkdir()
        self.cut: list[str] = []  # what the last read-back of the copy left out (Tree.cut)
        size = sum((len(t.encode("utf-8")) // 4096 + 1) * 4096 for t in files.values()) + disk_bytes
        try:
            self._make(files, size, agent_git)
        except BaseException:
            self.close()
            raise

    def _make(self, files: dict[str, str], size: int, agent_git: bool) -> None:
        sandbox.bounded_dir(self.repo, size, inodes=2 * len(files) + sandbox.COPY_INODES)
        write_tree(files, self.repo)
        self.git_dir = self.root / "git"
        _git(self.git_dir, self.repo, "init", "-q")
        _git(self.git_dir, self.repo, "add", "-A")
        _git(self.git_dir, self.repo, "commit", "-q", "-m", "base", "--allow-empty")
        sandbox.give_to_sandbox(self.repo)
        if agent_git:  # the agent's own repository in the copy (git status/diff/stash work); git never tracks .git,
            # and the patch is computed with the outside git dir, so nothing in it is ever read by this process
            r = sandbox.run("git init -q && git add -A && git -c user.name=agent -c user.email=agent@localhost "
                            "commit -qm base", self.repo, CommandLimits(wall_seconds=60), hide=self.hide)
            if r.returncode != 0:
                raise RuntimeError(f"cannot initialize the agent's git repository: {r.output.strip()[-200:]}")

    def diff(self) -> str:
        """The copy's changes against the base commit, new and deleted files included (git's unified format).
        Computed on a root-owned staging copy of the copy's regular files (:func:`read_tree`), so nothing the
        agent left in the copy (nested repositories, symlinks, special files) reaches git."""
        stage = self.root / "stage"
        shutil.rmtree(stage, ignore_errors=True)
        tree = read_tree(self.repo)
        self.cut = tree.cut
        if tree.n_cut:
            log.warning("task copy %s: %d path(s) left out of the patch (%s)", self.repo, tree.n_cut,
                        "; ".join(tree.cut[:3]))
        write_tree(tree, stage).mkdir(exist_ok=True)
        try:
            _git(self.git_dir, stage, "add", "-A")
            return _git(self.git_dir, stage, "diff", "--cached", "--no-color", "--no-ext-diff", "--no-textconv",
                        "--binary", "HEAD")
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def run(self, command: str, limits: CommandLimits) -> sandbox.CommandResult:
        return sandbox.run(command, self.repo, limits, hide=self.hide)

    def close(self) -> None:
        sandbox.release_dir(self.repo)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Workspace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def apply_patch(repo: Path, patch: str, limits: CommandLimits, hide: tuple[str, ...] = ()) -> tuple[bool, str]:
    """``git apply`` ``patch`` to the tree at ``repo`` inside the sandbox; (applied, git's message). ``hide``: as
    :func:`tracekit.coding.sandbox.run`'s."""
    if not patch.strip():
        return False, "empty patch"
    holder = sandbox.new_workdir("patch-")
    try:
        (holder / "model.patch").write_text(patch if patch.endswith("\n") else patch + "\n", encoding="utf-8")
        r = sandbox.run(["git", "apply", "--whitespace=nowarn", str(holder / "model.patch")], repo, limits,
                        read_only=(holder / "model.patch",), hide=hide)
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


def run_tests(repo: Path, selection: list[str], limits: CommandLimits, hide: tuple[str, ...] = ()) -> TestRun:
    """pytest on ``selection`` (node ids or paths, relative to ``repo``) in the sandbox (``hide``: as
    :func:`tracekit.coding.sandbox.run`'s: the package the tree is a copy of, which only the tree may provide). A
    run killed at a limit (a hanging test) reports what finished before (nothing, usually) and ``timed_out``."""
    holder = sandbox.new_workdir("res-")
    try:
        sandbox.bounded_dir(holder, MAX_REPORT_BYTES + (1 << 20), inodes=64)
        sandbox.give_to_sandbox(holder)
        report = holder / "report.json"
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tracekit_report",
                "--rootdir", str(repo), "--confcutdir", str(repo), "-c", "/dev/null", "-o", "addopts=", "--tb=short", "--no-header",
                "-W", "ignore::DeprecationWarning", *selection]
        env = {"PYTHONPATH": f"{repo}:{PLUGIN_DIR}", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
               "TRACEKIT_REPORT": str(report)}
        r = sandbox.run(argv, repo, limits, env=env, read_only=(PLUGIN_DIR,), writable=(holder,), hide=hide)
        data = _report(report)
    finally:
        sandbox.release_dir(holder)
        shutil.rmtree(holder, ignore_errors=True)
    return TestRun(data.get("tests", {}), data.get("failures", {}), data.get("collect_errors", []), r.wall_s,
                   "wall_time" in r.events or "cpu_time" in r.events, r.events, r.output)


def _report(path: Path) -> dict:
    """The plugin's report (written by untrusted code: a regular file of bounded size holding a JSON object, else
    nothing)."""
    try:
        st = path.lstat()
    except OSError:
        return {}
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_REPORT_BYTES:
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
