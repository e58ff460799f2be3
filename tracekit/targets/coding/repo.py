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
- :func:`run_tests`: pytest inside the sandbox under tracekit's reporter; the outcome of every test by node id,
  through a signed channel the tested code cannot find, with every sign of tampering.
"""

from __future__ import annotations

import importlib.metadata
import hmac
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
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
MAX_REPORT_BYTES = 16 << 20  # a test run's report channel carrying more than this is tampering


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
    tampering: list[str] = field(default_factory=list)  # why the outcome cannot be trusted (see run_tests)
    ended: bool = False  # the reporter's signed end record arrived
    returncode: int | None = None

    def passed(self) -> set[str]:
        return {t for t, o in self.tests.items() if o == "passed"}


REPORTER = PLUGIN_DIR / "tracekit_report.py"
DECOY = "TRACEKIT_REPORT"  # named in the test run's environment: a path no reporter uses (a write there is tampering)
NOT_PACKAGES = ("conftest.py", "setup.py", "noxfile.py", "sitecustomize.py", "usercustomize.py")


def top_level_packages(repo: Path) -> tuple[str, ...]:
    """The importable top-level names of the tree at ``repo`` (packages with ``__init__.py``, modules)."""
    out = []
    for p in sorted(repo.iterdir()):
        if p.is_dir() and (p / "__init__.py").is_file() and p.name.isidentifier():
            out.append(p.name)
        elif p.is_file() and p.suffix == ".py" and p.name not in NOT_PACKAGES and p.stem.isidentifier():
            out.append(p.stem)
    return tuple(out)


def run_tests(repo: Path, selection: list[str], limits: CommandLimits, hide: tuple[str, ...] = (),
              protected: tuple[Path, ...] = ()) -> TestRun:
    """pytest on ``selection`` (node ids or paths, relative to ``repo``) in the sandbox (``hide``: as
    :func:`tracekit.coding.sandbox.run`'s: the package the tree is a copy of, which only the tree may provide;
    ``protected``: paths of the tree the run sees read-only, the test directories). A run killed at a limit (a
    hanging test) reports what finished before (nothing, usually) and ``timed_out``.

    **The outcome's channel** (the tree's code runs in the same process as the reporter, so nothing it can reach
    is trusted as such): pytest runs under :data:`REPORTER` (``tracekit_report.py``), our own configuration
    (``-c /dev/null``, ``--rootdir``/``--confcutdir`` the tree, no cache provider, no plugin autoload), which
    writes HMAC-signed, numbered records to an inherited pipe; the key comes through a second pipe the reporter
    reads and closes before any code of the tree is imported. No path of the report exists anywhere; the
    environment names a decoy (:data:`DECOY`) that nothing reads. What makes the run ``tampering`` (listed in
    ``TestRun.tampering``): a record the key did not sign, out of order, or anything after the end record; no end
    record from a process that was not killed at a limit; an exit status other than the end record's, or one that
    contradicts the outcomes; more than :data:`MAX_REPORT_BYTES` on the channel; a write to the decoy; and every
    ``tamper`` record of the reporter's in-process checks (see its module)."""
    holder = sandbox.new_workdir("res-")
    key = os.urandom(32)
    chan_r, chan_w = os.pipe()
    key_r, key_w = os.pipe()
    got = bytearray()
    over = [False]

    def drain() -> None:
        while True:
            data = os.read(chan_r, 1 << 16)
            if not data:
                return
            if len(got) + len(data) > MAX_REPORT_BYTES:
                over[0] = True
            else:
                got.extend(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        os.write(key_w, key)
        os.close(key_w)
        key_w = -1
        sandbox.bounded_dir(holder, 1 << 20, inodes=64)
        sandbox.give_to_sandbox(holder)
        argv = [sys.executable, "-B", str(REPORTER), "--channel", str(chan_w), "--key-fd", str(key_r),
                "--repo", str(repo), "--package", ",".join(top_level_packages(repo)),
                "--protected", ",".join(os.path.relpath(p, repo) for p in protected), "--",
                "-q", "-p", "no:cacheprovider", "--rootdir", str(repo), "--confcutdir", str(repo), "-c", "/dev/null",
                "-o", "addopts=", "--tb=short", "--no-header", "-W", "ignore::DeprecationWarning", *selection]
        env = {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", DECOY: str(holder / "report.json")}
        r = sandbox.run(argv, repo, limits, env=env, read_only=(PLUGIN_DIR,), writable=(holder,), hide=hide,
                        protected=tuple(protected), pass_fds=(chan_w, key_r))
        decoy = sorted(p.name for p in holder.iterdir())
    finally:
        for fd in (chan_w, key_r, key_w):
            if fd >= 0:
                os.close(fd)
        reader.join(timeout=30)
        os.close(chan_r)
        sandbox.release_dir(holder)
        shutil.rmtree(holder, ignore_errors=True)
    timed_out = "wall_time" in r.events or "cpu_time" in r.events
    run = TestRun(wall_s=r.wall_s, timed_out=timed_out, events=r.events, output=r.output, returncode=r.returncode)
    _read_channel(bytes(got), key, r.returncode, run)
    if over[0]:
        run.tampering.append(f"more than {MAX_REPORT_BYTES} bytes on the report channel")
    if decoy:
        run.tampering.append(f"the test run wrote {', '.join(decoy)} where ${DECOY} points (no reporter does)")
    return run


def _read_channel(data: bytes, key: bytes, returncode: int | None, run: TestRun) -> None:
    """Fill ``run`` from the channel's records (see :func:`run_tests`): outcomes, and every reason not to trust
    them in ``run.tampering``."""
    expected, end = 0, None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
            body = rec["body"]
            ok = hmac.compare_digest(hmac.new(key, body.encode(), "sha256").hexdigest(), str(rec["mac"]))
            msg = json.loads(body) if ok else None
        except (ValueError, KeyError, TypeError, AttributeError):
            ok, msg = False, None
        if not ok or not isinstance(msg, dict) or msg.get("seq") != expected:
            run.tampering.append(f"record {i} on the report channel is not the reporter's (unsigned, forged or "
                                 f"out of order): {line[:120]!r}")
            return
        if end is not None:
            run.tampering.append(f"record {i} on the report channel follows the end record")
            return
        expected += 1
        kind = msg.get("kind")
        if expected == 1 and kind != "start":
            run.tampering.append("the report channel does not begin with the reporter's start record")
        if kind == "test":
            run.tests[msg["nodeid"]] = msg["outcome"]
            if msg.get("text"):
                run.failures[msg["nodeid"]] = msg["text"]
        elif kind == "collect_error":
            run.collect_errors.append(msg["nodeid"])
            run.failures[msg["nodeid"]] = msg.get("text", "")
        elif kind == "tamper":
            run.tampering.append(f"{msg.get('where')}: {msg.get('what')}")
        elif kind == "end":
            end = msg
    if end is None:  # the caller decides: killed at a limit, or ended by the tested code (tampering)
        return
    run.ended = True
    status = end.get("exitstatus")
    if returncode != status:
        run.tampering.append(f"the test process exited {returncode}, its reporter's end record says {status}")
    failed = any(o == "failed" for o in run.tests.values()) or bool(run.collect_errors)
    if (status == 0 and failed) or (status == 1 and not failed):
        run.tampering.append(f"pytest's exit status {status} contradicts the reported outcomes")
