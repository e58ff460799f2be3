"""The coding target's bash sandbox: every escape attempt contained and reported, and the next command still runs.

Each containment claim of :mod:`tracekit.coding.sandbox` is a test here that fails when the claim does not hold:
what a command sees (no stage cache, gold patches or hidden tests; no checkout, $HOME, host /proc, sibling copies or
host unix sockets), the per-episode limits (memory, processes, disk) under each accounting this machine can run,
the bounded read-back of the copy, the interpreters it works with (a venv under /tmp or $HOME, the system Python,
not root), and the one-line refusal where the jail cannot be set up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import tracemalloc
import uuid
from pathlib import Path

import pytest

from tests import procs
from tracekit.coding import sandbox
from tracekit.targets.coding.repo import MAX_TREE_BYTES, Workspace, read_tree

ROOT = Path(__file__).resolve().parents[1]
# wall_seconds: generous, so that a command that should finish (or hit another limit) never meets the wall clock on
# a loaded machine; the two tests of the wall limit itself use SHORT_WALL
LIMITS = sandbox.CommandLimits(cpu_seconds=1, wall_seconds=30, memory_bytes=512 << 20, processes=48,
                               output_chars=500)
SHORT_WALL = dataclasses.replace(LIMITS, wall_seconds=2.5)
KILL_SLACK_S = 20  # killed at the wall limit means within this, not after the commands' 1000 s
WIDE = sandbox.CommandLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=512 << 20, processes=48,
                             output_chars=4000)
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="runs a subprocess as another user / without a capability")
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.fixture()
def ws():
    w = Workspace({"pkg/mod.py": "X = 1\n"})
    yield w
    w.close()


def _clear_caches() -> None:
    sandbox._accounting.cache_clear()
    sandbox._problem.cache_clear()


@pytest.fixture(params=["default", "watchdog"])
def accounting(request, monkeypatch):
    """Each per-episode limit under this machine's accounting and under the watchdog (the fallback)."""
    if request.param == "watchdog":
        monkeypatch.setenv("TRACEKIT_SANDBOX_ACCOUNTING", "watchdog")
    _clear_caches()
    yield sandbox.accounting().name
    monkeypatch.delenv("TRACEKIT_SANDBOX_ACCOUNTING", raising=False)
    _clear_caches()


def _python(exe: str, code: str, *args: str, user: int | None = None, drop_cap: str | None = None,
            env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``exe -c code args`` with tracekit importable from this checkout, optionally as ``user`` (setpriv) or
    without a capability."""
    argv = [exe, "-c", code, *args]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    if drop_cap:
        argv = ["setpriv", "--inh-caps=-all", f"--bounding-set=-{drop_cap}", *argv]
    full_env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "HOME": os.environ.get("HOME", "/root"),
                "LC_ALL": "C.UTF-8", **(env or {})}
    return procs.run(argv, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


# ---------------------------------------------------------------- what a command sees


def plant_task_cache(cache: Path, marker: str) -> list[Path]:
    """A coding-task set written the way ``tracekit.targets.coding.tasks.load_or_generate`` writes it:
    ``<cache>/coding_tasks/<key>/{pristine.json,tasks.jsonl,report.json}`` (gold patch and hidden tests inside)."""
    from tracekit.artifacts import atomic_write_json, write_jsonl
    from tracekit.targets.coding.tasks import CodingTask

    test = f"tests/test_{marker}.py"
    task = CodingTask(
        instance_id=f"toolz.0.planted__{marker}", repo="toolz==0.0", base_commit="0" * 40,
        patch=f"diff --git a/toolz/x.py b/toolz/x.py\n--- a/toolz/x.py\n+++ b/toolz/x.py\n@@ -1 +1 @@\n"
              f"-X = 1\n+X = 2  # GOLD-{marker}\n",
        bug_patch="", FAIL_TO_PASS=[f"{test}::test_hidden_{marker}"], PASS_TO_PASS=[f"{test}::test_other"],
        problem_statement="planted", buggy_files={"toolz/x.py": "X = 1\n"}, modifier="planted",
        entity="toolz/x.py::X", split="test", test_files=[test])
    final = cache / "coding_tasks" / f"planted{marker}"
    final.mkdir(parents=True)
    atomic_write_json(final / "pristine.json", {test: f"def test_hidden_{marker}():\n    assert X == 2\n"})
    write_jsonl(final / "tasks.jsonl", [task.to_dict()])
    atomic_write_json(final / "report.json", {"key": f"planted{marker}", "valid": 1})
    return [final / "tasks.jsonl", final / "pristine.json"]


@pytest.fixture()
def planted(monkeypatch):
    """Task caches in the default place (``outputs/cache`` under the working directory: the checkout), at
    ``$TRACEKIT_CACHE`` under $HOME, and in a world-readable /var/tmp."""
    marker = uuid.uuid4().hex[:12]
    home = Path(os.environ.get("HOME", "/root"))
    caches = [Path.cwd() / "outputs" / "cache", home / f".cache/tracekit-test-{marker}",
              Path(f"/var/tmp/tracekit-test-{marker}")]
    monkeypatch.setenv("TRACEKIT_CACHE", str(caches[1]))
    files = []
    try:
        for c in caches:
            files += plant_task_cache(c, marker)
        yield marker, files
    finally:
        shutil.rmtree(caches[0] / "coding_tasks" / f"planted{marker}", ignore_errors=True)
        for c in caches[1:]:
            shutil.rmtree(c, ignore_errors=True)


def test_the_agent_cannot_read_gold_patches_or_hidden_tests(ws, planted):
    marker, files = planted
    secrets = (f"GOLD-{marker}", f"test_hidden_{marker}")  # the gold patch, the hidden test
    for f in files:  # the threat is real: the files are there and world-readable
        assert f.is_file() and f.stat().st_mode & 0o004 and any(s in f.read_text() for s in secrets)
    r = ws.run("find / -xdev -path '*coding_tasks*' -name '*.jsonl' | xargs cat", WIDE)  # the command
    assert not any(s in r.output for s in secrets)
    r = ws.run(" ".join(f"cat {f};" for f in files) + " ls " + " ".join(str(f.parent) for f in files), WIDE)
    assert not any(s in r.output for s in secrets) and r.output.count("No such file or directory") == 2 * len(files)
    # everything but /usr (the host's, read-only) and /proc, walked: no task cache anywhere
    r = ws.run("find / \\( -path /proc -o -path /usr \\) -prune -o -print 2>/dev/null | grep -c . ; "
               "find / \\( -path /proc -o -path /usr \\) -prune -o \\( -path '*coding_tasks*' -o -name '*.jsonl' "
               f"-o -name 'planted*' -o -name '*{marker}*' \\) -print 2>/dev/null", WIDE)
    lines = r.output.split()
    assert int(lines[0]) > 100 and lines[1:] == [], r.output  # it walked the view, and found nothing


@pytest.mark.slow
def test_no_task_cache_anywhere_in_the_whole_view(ws, planted):
    marker, _ = planted
    r = ws.run(f"find / -path /proc -prune -o \\( -path '*coding_tasks*' -o -name '*{marker}*' \\) -print "
               "2>/dev/null; echo walked", sandbox.CommandLimits(wall_seconds=120, cpu_seconds=120))
    assert r.output.split() == ["walked"], r.output


def test_a_secret_inside_a_bound_directory_is_covered(ws, tmp_path, monkeypatch):
    shown = tmp_path / "shown"
    (shown / "cache" / "coding_tasks").mkdir(parents=True)
    (shown / "cache" / "coding_tasks" / "tasks.jsonl").write_text("GOLD\n")
    (shown / "lib.py").write_text("L = 1\n")
    monkeypatch.setenv("TRACEKIT_CACHE", str(shown / "cache"))
    r = sandbox.run(f"cat {shown}/lib.py; ls -A {shown}/cache; cat {shown}/cache/coding_tasks/tasks.jsonl", ws.repo,
                    LIMITS, read_only=(shown,))
    assert "L = 1" in r.output and "GOLD" not in r.output and "No such file" in r.output


# ---------------------------------------------------------------- nothing a task was made from

TASKS = dict(modifiers=("func_pm_remove_cond",), max_per_modifier=1, max_candidates_per_modifier=4)  # as the
# coding-task tests make them (tests/test_coding_tasks.py: GEN)
HUGE = sandbox.CommandLimits(cpu_seconds=120, wall_seconds=120, memory_bytes=1 << 30, output_chars=1 << 20)


@pytest.fixture(scope="module")
def taskset(tmp_path_factory):
    from tracekit.targets.coding.tasks import TaskGenConfig, load_or_generate

    return load_or_generate(TaskGenConfig(**TASKS), tmp_path_factory.mktemp("cache"))


def _episode(taskset, task):
    from tracekit.targets.coding.suite import CodingSuite

    suite = CodingSuite("coding_toolz", taskset, split=task.split, limits=HUGE, task_ids=[task.instance_id])
    ep = suite.episode(suite.tasks()[0])
    ep.reset()
    return ep


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_no_file_in_the_jail_equals_what_a_task_was_made_from(taskset):
    """For every task: the pre-bug version of each file its bug touched exists nowhere in the jail (the whole tree
    walked from inside, with and without -xdev, every file of the same size hashed), nor does any copy of the
    package by name (source directories, .dist-info, wheels) but the task's own tree."""
    import importlib.metadata

    installed = importlib.metadata.distribution("toolz")
    assert taskset.tasks
    for task in taskset.tasks:
        touched = {rel: taskset.pristine[rel] for rel in task.buggy_files}
        for rel, text in touched.items():  # the threat is real: the installed package holds the pre-bug file
            assert _sha256(Path(installed.locate_file(rel)).read_text(encoding="utf-8")) == _sha256(text)
        control = max((r for r in taskset.pristine if r not in touched), key=lambda r: len(taskset.pristine[r]))
        sizes = " -o ".join(f"-size {len(t.encode('utf-8'))}c" for t in [*touched.values(), taskset.pristine[control]])
        ep = _episode(taskset, task)
        try:
            r = ep.ws.run(
                "for x in '' -xdev; do echo \"== walk$x\"; find / $x -path /proc -prune -o -type f "
                f"\\( {sizes} \\) -print0 2>/dev/null | xargs -0 -r sha256sum; done; echo '== names'; "
                "find / -path /proc -prune -o \\( -iname '*toolz*' -o -name tlz -o -name tlz.py \\) "
                "-print 2>/dev/null; echo '== count'; find / -path /proc -prune -o -print 2>/dev/null | wc -l; "
                "echo '== import'; cd / && python -c 'import toolz' 2>&1 | tail -1", HUGE)
        finally:
            ep.ws.close()
        out = dict(part.split("\n", 1) for part in r.output.split("== ")[1:])
        hashed = {line.split(None, 1)[0]: line.split(None, 1)[1] for k in ("walk", "walk-xdev")
                  for line in out[k].splitlines() if line.strip()}
        assert not {_sha256(t) for t in touched.values()} & set(hashed), r.output[-2000:]
        # the walk hashes what it should: an untouched file of the copy, found at its place in the copy
        assert hashed.get(_sha256(taskset.pristine[control])) == f"{ep.ws.repo}/{control}", r.output[-2000:]
        assert all(p.startswith(str(ep.ws.repo) + "/") for p in out["names"].split()), out["names"]
        assert int(out["count"]) > 10_000, out["count"]  # the walk covered the view (/usr, the interpreter)
        assert "No module named 'toolz'" in out["import"]  # outside its copy, no toolz to import


def test_copying_the_package_from_anywhere_does_not_solve_a_task(taskset):
    """The attack: find the package anywhere in the jail, copy it over the task's tree, submit. On a jail that
    binds the interpreter's site-packages it resolves every task; here there is nothing to copy."""
    task = taskset.tasks[0]
    ep = _episode(taskset, task)
    from tracekit.types import Message, ToolCall

    attack = ("for d in $(find / -path /proc -prune -o -type d \\( -name toolz -o -name tlz \\) -print 2>/dev/null "
              "| grep -v \"^$PWD/\"); do echo FOUND $d; cp -r \"$d/.\" \"$(basename \"$d\")/\"; done; "
              "for w in $(find / -path /proc -prune -o -name 'toolz*.whl' -print 2>/dev/null); do echo FOUND $w; "
              "python -m zipfile -e \"$w\" .; done; git status --short; echo attacked")
    step = ep.step(Message(role="assistant", tool_calls=[ToolCall(id="a", name="bash", arguments={"command": attack})]))
    said = step.messages[0].content
    assert "attacked" in said and "FOUND" not in said, said
    ep.step(Message(role="assistant", tool_calls=[ToolCall(id="s", name="submit", arguments={})]))
    o = ep.outcome()
    assert (o.reward, o.success) == (0.0, False) and o.info["status"] in ("empty_patch", "tests_failed"), o.info


def test_every_copy_of_a_hidden_package_in_a_bound_directory_is_covered(ws, tmp_path):
    """Copies of the task's package outside the interpreter's site directories (another version's source tree,
    its .dist-info, a wheel, a renamed file of it) are covered where a bound directory holds them; the rest of
    that directory stays; without ``hide`` all of it shows."""
    import importlib.metadata

    d = importlib.metadata.distribution("toolz")
    site_dir = Path(d.locate_file(""))
    shown = tmp_path / "shown"
    shutil.copytree(site_dir / "toolz", shown / "lib" / "toolz", ignore=shutil.ignore_patterns("__pycache__"))
    (shown / "lib" / "toolz" / "recipes.py").write_text("# another version\n")  # not the same files: by name
    shutil.copytree(site_dir / f"toolz-{d.version}.dist-info", shown / "lib" / f"toolz-{d.version}.dist-info")
    (shown / "dist").mkdir()
    (shown / "dist" / "toolz-0.9.0-py3-none-any.whl").write_bytes(b"PK wheel")
    (shown / "dist" / "renamed.txt").write_text((site_dir / "toolz" / "itertoolz.py").read_text())
    (shown / "dist" / "mine.py").write_text("M = 1\n" * 100)
    os.chmod(tmp_path, 0o755)
    probe = (f"cd {shown} && find lib -type f | wc -l; "
             "wc -c < dist/toolz-0.9.0-py3-none-any.whl; wc -c < dist/renamed.txt; wc -c < dist/mine.py")
    hidden = sandbox.run(probe, ws.repo, WIDE, read_only=(shown,), hide=("toolz",))
    assert hidden.output.split()[:4] == ["0", "0", "0", "600"], hidden.output
    shown_all = sandbox.run(probe, ws.repo, WIDE, read_only=(shown,))
    assert int(shown_all.output.split()[0]) > 10 and shown_all.output.split()[1:3] != ["0", "0"], shown_all.output


def test_a_cache_under_a_bound_directory_is_refused(make_cfg, monkeypatch, ws):
    """``paths.cache_dir=`` inside a directory the jail binds into every command (the smallest of /usr's bound
    ones): the coding target refuses before generating anything, in one line naming the cache and the directory; so
    does every command while ``$TRACEKIT_CACHE`` names one there, or while a task cache left there by another run
    exists. The interpreter's prefix is not such a directory any more (the jail shows an image of what it needs):
    a cache there is neither refused nor visible."""
    from tracekit.artifacts import StageCache
    from tracekit.coding import runtime
    from tracekit.targets.registry import target

    bound = next((d for d in ("/usr/sbin", "/usr/libexec", "/usr/bin") if d in sandbox.system_binds()
                  and os.access(d, os.W_OK)), None)
    if bound is None:
        pytest.skip("no directory bound into every command is writable here")
    monkeypatch.setattr(sandbox, "_CACHES", {})
    cache = Path(bound) / f"tracekit-test-cache-{uuid.uuid4().hex[:12]}"
    in_prefix = Path(sandbox._real(sys.prefix)) / f"tracekit-test-cache-{uuid.uuid4().hex[:12]}"
    try:
        cfg = make_cfg("benchmark=coding_toolz", "benchmark.split=test")
        cfg.paths.cache_dir = str(cache)
        with pytest.raises(sandbox.CacheExposed) as e:
            target("coding").build_suite(cfg, None, None)
        said = str(e.value)
        assert _one_line(said) and f"{cache} (paths.cache_dir)" in said and f"inside {bound}," in said, said
        assert not cache.exists()  # refused before anything was generated
        monkeypatch.setattr(sandbox, "_CACHES", {})
        cache.mkdir()
        monkeypatch.setenv("TRACEKIT_CACHE", str(cache))
        with pytest.raises(sandbox.CacheExposed, match=f"{cache} \\(TRACEKIT_CACHE\\) lies inside {bound},"):
            ws.run("true", LIMITS)
        monkeypatch.delenv("TRACEKIT_CACHE")
        plant_task_cache(cache, "left")  # left by another run, named by nothing this process knows
        runtime._SCANS.clear()  # (a bound tree is walked again after SCAN_TTL_S)
        with pytest.raises(sandbox.CacheExposed) as e:
            ws.run("true", LIMITS)
        assert _one_line(str(e.value)) and f"{cache}/coding_tasks lies inside {bound}," in str(e.value)
        shutil.rmtree(cache / "coding_tasks")
        StageCache(cache).get_or_compute("rollouts", "k1", lambda d: (d / "trajectories.jsonl").write_text("{}\n"))
        runtime._SCANS.clear()  # a stage artifact (trajectories hold gold patches) left there by another run
        with pytest.raises(sandbox.CacheExposed, match=f"{cache}/rollouts/k1 lies inside {bound},"):
            ws.run("true", LIMITS)
        shutil.rmtree(cache)
        runtime._SCANS.clear()
        if os.access(in_prefix.parent, os.W_OK):
            sandbox.register_cache(in_prefix)  # not refused: nothing of the prefix is bound as a directory
            plant_task_cache(in_prefix, "prefix")
            r = ws.run(f"ls {in_prefix} {in_prefix}/coding_tasks; echo end", LIMITS)
            assert r.output.count("No such file or directory") == 2 and "plantedprefix" not in r.output, r.output
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(in_prefix, ignore_errors=True)
        runtime._SCANS.clear()
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"


def test_the_checkout_home_host_proc_and_passwd_are_not_visible(ws):
    top = sandbox.checkout_root()
    home = os.environ.get("HOME", "/root")
    r = ws.run(f"ls -A {home}; echo ---; ls /proc | grep -c '^[0-9]'; cat /proc/*/cmdline | tr '\\0' ' '; echo; "
               f"echo ---; cat /etc/passwd; echo ---; ls -A /; echo ---; cat {top or '/nonexistent'}/pyproject.toml",
               WIDE)
    shown_home, procs, passwd, top_level, checkout = r.output.split("---\n")
    allowed = {Path(p).relative_to(home).parts[0] for p in sandbox.interpreter_paths() if sandbox._inside(p, home)}
    assert set(shown_home.split()) <= allowed  # only the way to the interpreter, nothing of $HOME
    n, cmdlines = procs.split("\n", 1)
    assert int(n) <= 4 and "pytest" not in cmdlines  # its own PID namespace's procfs: the jail, bash, ls/cat
    assert passwd.strip().splitlines() == sandbox.ETC_MADE["passwd"].strip().splitlines()
    assert set(top_level.split()) <= {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp",
                                      "usr", "var", *(Path(p).parts[1] for p in sandbox.interpreter_paths()),
                                      Path(sandbox.work_root()).parts[1]}, top_level
    assert "No such file or directory" in checkout and "[project]" not in checkout


def test_sibling_copies_are_invisible_and_untouchable(ws):
    with Workspace({"pkg/mod.py": "Y = 1\n"}) as other:
        r = ws.run(f"ls -A {sandbox.work_root()}; cat {other.repo}/pkg/mod.py; echo x > {other.repo}/pkg/mod.py; "
                   f"ls {other.root}", LIMITS)
        assert set(r.output.split("\n")[0].split()) == {ws.root.name}
        assert "Y = 1" not in r.output and (other.repo / "pkg" / "mod.py").read_text() == "Y = 1\n"


def test_host_unix_sockets_cannot_be_reached(ws):
    paths = [Path(tempfile.gettempdir()) / f"tk-sock-{uuid.uuid4().hex[:8]}",
             sandbox.work_root() / f"tk-sock-{uuid.uuid4().hex[:8]}"]
    servers = []
    try:
        for p in paths:
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(p))
            os.chmod(p, 0o777)
            s.listen(4)
            servers.append(s)
        abstract = socket.socket(socket.AF_UNIX)
        abstract.bind(f"\0tk-abstract-{os.getpid()}")
        abstract.listen(4)
        servers.append(abstract)
        names = [str(p) for p in paths] + [f"\0tk-abstract-{os.getpid()}"]
        for n in names:  # reachable from the host
            c = socket.socket(socket.AF_UNIX)
            c.connect(n)
            c.close()
        (ws.repo / "probe.py").write_text(
            "import socket, sys\nfor n in sys.argv[1:]:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n"
            "        s.connect(n.replace('@', '\\0')); print('CONNECTED', n)\n"
            "    except OSError as e: print('refused', e.strerror)\n")
        sandbox.give_to_sandbox(ws.repo)
        r = ws.run("python probe.py " + " ".join(repr(n.replace("\0", "@")) for n in names), LIMITS)
        said = r.output.splitlines()
        assert "CONNECTED" not in r.output and len(said) == len(names) and all(x.startswith("refused ") for x in said)
    finally:
        for s in servers:
            s.close()
        for p in paths:
            p.unlink(missing_ok=True)


# ---------------------------------------------------------------- what a command may do


def test_isolation_is_reported():
    iso = sandbox.isolation()
    assert set(iso) >= {"mode", "accounting", "view", "cpu", "wall", "memory", "processes", "disk", "files",
                        "network"}
    assert iso["mode"] in ("root", "userns") and iso["accounting"] in sandbox.ACCOUNTINGS
    assert iso["mode"] == ("root" if IS_ROOT else "userns")


def test_command_runs_in_the_copy_and_output_is_truncated(ws):
    r = ws.run("cat pkg/mod.py; echo made > new.txt", LIMITS)
    assert r.returncode == 0 and "X = 1" in r.output and (ws.repo / "new.txt").read_text() == "made\n"
    r = ws.run("yes abcdefgh | head -c 20000", LIMITS)
    assert "output_truncated" in r.events and len(r.output) < 700 and "characters cut" in r.output
    r = ws.run("exit 3", LIMITS)
    assert r.returncode == 3 and "[exit code 3]" in r.for_agent()


def test_sleep_forever_is_killed_at_the_wall_limit_with_its_background_children(ws):
    nap = f"sleep 1000.{uuid.uuid4().int % 10**9}"  # this run's own: pgrep must not see another run's sleeps
    r = ws.run(f"{nap} & setsid {nap} & {nap}", SHORT_WALL)
    assert r.returncode is None and "wall_time" in r.events and r.wall_s < SHORT_WALL.wall_seconds + KILL_SLACK_S
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"
    left = procs.run(["pgrep", "-f", nap], capture_output=True, text=True).stdout.split()
    assert not left


def test_cpu_loop_is_killed_at_the_cpu_limit(ws):
    r = ws.run("python -c 'while True: pass'", LIMITS)
    assert "cpu_time" in r.events or "wall_time" in r.events


def test_memory_blowup_fails_inside_the_command(ws):
    r = ws.run("python -c 'x = bytearray(3 << 30)'", LIMITS)
    assert r.returncode != 0 and "memory" in r.events


def test_one_file_is_capped(ws):
    r = ws.run("head -c $((70 << 20)) /dev/zero > big", LIMITS)
    assert "file_size" in r.events and (ws.repo / "big").stat().st_size <= sandbox.CommandLimits().file_bytes


def test_write_outside_the_copy_is_refused(ws):
    target = Path(tempfile.gettempdir()) / f"tracekit-escape-{os.getpid()}.txt"
    r = ws.run(f"echo pwned > /usr/escape.txt; echo pwned > /root/escape.txt; touch /etc/escape; touch /escape; "
               f"echo pwned > {target}", LIMITS)
    assert "write_denied" in r.events and not Path("/usr/escape.txt").exists() and not Path("/etc/escape").exists()
    assert not target.exists() and not Path("/escape").exists()
    r = ws.run(f"echo y > /tmp/escape-{os.getpid()}; cat /tmp/escape-{os.getpid()}", LIMITS)  # a private tmpfs
    assert r.output.strip() == "y" and not Path(f"/tmp/escape-{os.getpid()}").exists()


def test_mount_unshare_sudo_su_do_not_lift_the_jail(ws):
    r = ws.run("unshare -r sh -c 'umount -l /usr; mount -o remount,rw /usr; mount -o remount,rw /; "
               "touch /usr/escape-u /escape-u'; mount -t tmpfs none /tmp; mount -o remount,rw /usr; "
               "sudo true; su -c true; touch /usr/escape-m", LIMITS)
    assert r.returncode != 0 and not Path("/usr/escape-u").exists() and not Path("/usr/escape-m").exists()
    assert not Path("/escape-u").exists()


HIT_INIT = ("kill -9 1; python -c 'import ctypes; print(\"attach\", ctypes.CDLL(None).ptrace(16, 1, 0, 0))'; "
            "ls /proc/1/root/ /proc/1/cwd/; cat /proc/1/environ; echo survived")


def test_the_jail_init_cannot_be_killed_traced_or_entered(ws):
    r = ws.run(HIT_INIT, LIMITS)
    assert "survived" in r.output and "attach -1" in r.output and r.output.count("Permission denied") >= 3, r.output
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"


def test_read_only_directory_stays_visible_and_read_only(ws):
    shown = Path(f"/tmp/tracekit-shown-{os.getpid()}")
    hidden = Path(f"/tmp/tracekit-hidden-{os.getpid()}.txt")
    try:
        (shown / "pkg").mkdir(parents=True)
        (shown / "pkg" / "plugin.py").write_text("P = 1\n")
        hidden.write_text("secret\n")
        r = sandbox.run(f"cat {shown}/pkg/plugin.py; cat {hidden}; echo x > {shown}/pkg/plugin.py", ws.repo, LIMITS,
                        read_only=(shown / "pkg",))
        assert "P = 1" in r.output and "secret" not in r.output and "write_denied" in r.events
        assert (shown / "pkg" / "plugin.py").read_text() == "P = 1\n"
    finally:
        hidden.unlink(missing_ok=True)
        shutil.rmtree(shown, ignore_errors=True)


def test_network_is_unreachable(ws):
    r = ws.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"", LIMITS)
    assert r.returncode != 0 and "network_blocked" in r.events
    r = ws.run("python -c \"import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)\"", LIMITS)
    assert r.returncode != 0


def test_fork_bomb_stops_at_the_process_limit(ws):
    r = ws.run(":(){ :|:& };:; sleep 1", SHORT_WALL)
    assert r.wall_s < SHORT_WALL.wall_seconds + KILL_SLACK_S and ("processes" in r.events or "wall_time" in r.events)
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"


def test_patch_ignores_what_the_agent_leaves_around(ws):
    r = ws.run("mkdir sub && cd sub && git init -q && echo hi > f; ln -s /etc/passwd ../pw; mkdir .pytest_cache; "
               "echo c > .pytest_cache/x; sed -i 's/X = 1/X = 2/' ../pkg/mod.py; mkfifo ../fifo; "
               "ln ../pkg/mod.py ../hard", LIMITS)
    assert r.returncode == 0, r.output
    assert set(read_tree(ws.repo)) == {"pkg/mod.py", "sub/f", "hard"}
    patch = ws.diff()
    assert "+X = 2" in patch and "diff --git a/sub/f b/sub/f" in patch and "passwd" not in patch


# ---------------------------------------------------------------- per-episode limits

THREE_ALLOCATIONS = ("for i in 1 2 3; do python -c 'import time; x = b\"x\" * (300 << 20); time.sleep(1.5); "
                     "print(\"held\")' & done; wait")


def test_memory_is_limited_per_episode_not_per_process(ws, accounting):
    one = ws.run("python -c 'x = b\"x\" * (300 << 20); print(\"held\")'", WIDE)
    assert _held(one.output) == 1 and "memory" not in one.events  # one process of 300 MB fits
    r = ws.run(THREE_ALLOCATIONS, WIDE)  # three together (900 MB) do not fit in 512 MiB
    assert "memory" in r.events and _held(r.output) < 3, (accounting, r.events, r.output)


def _held(output: str) -> int:
    return sum(line.strip() == "held" for line in output.splitlines())


def test_processes_are_limited_per_episode_not_per_uid(accounting):
    many = "for i in $(seq 40); do sleep 2 & done; wait; echo all-started"
    with Workspace({"a": ""}) as a, Workspace({"b": ""}) as b:
        results = {}
        threads = [threading.Thread(target=lambda w=w: results.update({w.root.name: w.run(many, WIDE)}))
                   for w in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results.values():  # 40 each at once, 80 together as one uid: each episode has its own 48
            assert "all-started" in r.output and "processes" not in r.events, (accounting, r.output[-300:])
        r = a.run("for i in $(seq 60); do sleep 2 & done; wait; echo done", WIDE)
        assert "processes" in r.events, (accounting, r.output[-300:])


def test_disk_is_limited_per_episode(ws):
    limit = 100 << 20
    with Workspace({"pkg/mod.py": "X = 1\n"}, disk_bytes=limit) as w:
        write = "for i in 1 2 3; do head -c $((30 << 20)) /dev/zero > big$1$i || echo FULL; done"
        first = w.run(write.replace("$1", "a"), WIDE)
        assert "FULL" not in first.output and "disk" not in first.events, first.output  # 90 MB fit
        second = w.run(write.replace("$1", "b"), WIDE)  # 180 MB over two commands do not
        assert "disk" in second.events and "FULL" in second.output
        used = sum(p.stat().st_size for p in w.repo.iterdir())
        assert used <= limit + (1 << 20)
        one = w.run("rm -f big*; for i in 1 2 3 4 5; do head -c $((60 << 20)) /dev/zero > f$i; done; du -sm .",
                    WIDE)  # the five 60 MB files in one command
        assert "disk" in one.events and sum(p.stat().st_size for p in w.repo.iterdir()) <= limit + (1 << 20)
        assert "alive" in w.run("rm -f f*; echo alive", WIDE).output


def test_reading_the_copy_back_is_bounded(ws):
    n, size = 300, 2 << 20
    r = ws.run(f"for i in $(seq {n}); do truncate -s {size} sparse$i; done; du -sk . ", WIDE)
    assert r.returncode == 0 and int(r.output.split()[0]) < 10_000  # 600 MB apparent, a few KB on disk
    tracemalloc.start()
    try:
        tree = read_tree(ws.repo)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    read = sum(len(v) for v in tree.values())
    assert read <= MAX_TREE_BYTES and peak < MAX_TREE_BYTES + (size * 3) + (8 << 20)
    assert len(tree) <= MAX_TREE_BYTES // size + 1 and tree.n_cut == n + 1 - len(tree)  # + pkg/mod.py
    assert all("read budget" in c for c in tree.cut) and len(tree.cut) == 50
    small = read_tree(ws.repo, max_bytes=10 * size)
    assert sum(len(v) for v in small.values()) <= 10 * size and small.n_cut == n + 1 - len(small)
    ws.diff()
    assert ws.cut  # the episode records what its patch left out
    r = ws.run("rm -f sparse*; mkdir many && cd many && seq 3000 | xargs touch", WIDE)
    assert r.returncode == 0
    assert read_tree(ws.repo, max_entries=1000).cut == ["many/: more than 1000 entries: the rest of the tree"]


# ---------------------------------------------------------------- interpreters and users


VENV_CHECK = r"""
import json, sys
from tracekit.coding import sandbox
from tracekit.targets.coding.repo import Workspace, run_tests
from tracekit.coding.sandbox import CommandLimits
files = {"pkg/__init__.py": "def f():\n    return 1\n",
         "tests/test_f.py": "from pkg import f\ndef test_f():\n    assert f() == 1\n"}
with Workspace(files) as ws:
    r = ws.run("python -c 'import sys, json, sqlite3, ctypes; print(sys.prefix)'", CommandLimits(wall_seconds=30))
    t = run_tests(ws.repo, ["tests/test_f.py"], CommandLimits(wall_seconds=60)) if sys.argv[1] == "pytest" else None
print(json.dumps({"prefix": r.output.strip(), "rc": r.returncode, "tests": t.tests if t else None,
                  "out": t.output[-500:] if t else r.output, "mode": sandbox.mode()}))
"""


def _venv_check(python: str, pytest_too: bool = True) -> dict:
    p = _python(python, VENV_CHECK, "pytest" if pytest_too else "none")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("where", ["tmp", "home"])
def test_the_jail_runs_with_a_venv_under_tmp_or_home(where):
    base = Path(tempfile.gettempdir()) if where == "tmp" else Path(os.environ.get("HOME", "/root")) / ".cache"
    base.mkdir(parents=True, exist_ok=True)
    venv = Path(tempfile.mkdtemp(prefix="tracekit-venv-", dir=base))
    os.chmod(venv, 0o755)  # as `python -m venv` makes it
    try:
        procs.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                  check=True, timeout=60)
        out = _venv_check(str(venv / "bin" / "python"))
        assert out["rc"] == 0 and out["prefix"] == str(venv), out  # the command's python is the venv's
        assert out["tests"] == {"tests/test_f.py::test_f": "passed"}, out["out"]
    finally:
        shutil.rmtree(venv, ignore_errors=True)


@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_the_jail_runs_with_the_system_python():
    out = _venv_check(SYSTEM_PYTHON, pytest_too=procs.run([SYSTEM_PYTHON, "-c", "import pytest"],
                                                           capture_output=True).returncode == 0)
    assert out["rc"] == 0 and out["prefix"] == procs.run(
        [SYSTEM_PYTHON, "-c", "import sys; print(sys.prefix)"], capture_output=True, text=True).stdout.strip()
    assert out["tests"] in (None, {"tests/test_f.py::test_f": "passed"}), out["out"]


USERNS_CHECK = r"""
import json, sys
from tracekit.coding import sandbox
from tracekit.targets.coding.repo import Workspace
L = sandbox.CommandLimits(cpu_seconds=5, wall_seconds=10, memory_bytes=512 << 20, processes=48, output_chars=3000,
                          disk_bytes=64 << 20)
out = {"mode": sandbox.mode(), "accounting": sandbox.accounting().name}
with Workspace({"pkg/mod.py": "X = 1\n"}, disk_bytes=L.disk_bytes) as ws:
    def run(c):
        r = ws.run(c, L)
        return {"rc": r.returncode, "events": r.events, "out": r.output}
    out["id"] = run("id -u; cat /proc/self/uid_map")
    out["write"] = run("echo x > /usr/x; echo x > /etc/x; echo x > /x; echo ok > mine.txt; cat mine.txt")
    out["remount"] = run("unshare -r sh -c 'mount -o remount,rw /usr; umount -l /usr; touch /usr/x'; "
                         "mount -o remount,rw /; touch /usr/y")
    out["gold"] = run("find / -xdev -path '*coding_tasks*' -name '*.jsonl' | xargs cat; cat " + sys.argv[1])
    out["init"] = run(sys.argv[3])
    out["memory"] = run(sys.argv[2])
    out["processes"] = run("for i in $(seq 60); do sleep 2 & done; wait; echo done")
    out["disk"] = run("for i in $(seq 30); do head -c $((10 << 20)) /dev/zero > d$i; sleep 0.1; done; echo wrote-all")
    out["disk_used"] = sandbox._tree_bytes(ws.repo)
    out["after"] = run("rm -f d*; echo alive")
print(json.dumps(out))
"""


@needs_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_the_jail_without_root_in_user_namespaces(planted):
    """As an unprivileged user (nobody, the system Python): the jail is built in a user namespace, the command
    runs in a nested one, limits by the watchdog."""
    marker, files = planted
    p = _python(SYSTEM_PYTHON, USERNS_CHECK, str(files[-2]), THREE_ALLOCATIONS, HIT_INIT, user=sandbox.NOBODY,
                env={"HOME": "/nonexistent"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["mode"] == "userns" and out["id"]["rc"] == 0 and out["id"]["out"].split()[0] == str(sandbox.NOBODY)
    assert out["write"]["out"].strip().endswith("ok") and out["write"]["out"].count("Read-only file system") == 3
    assert not Path("/usr/x").exists() and not Path("/usr/y").exists() and out["remount"]["rc"] != 0
    assert f"GOLD-{marker}" not in out["gold"]["out"] and "No such file" in out["gold"]["out"]
    init = out["init"]["out"]  # PID 1 holds the namespace's capabilities: same uid, but not traceable
    assert "survived" in init and "attach -1" in init and init.count("Permission denied") >= 3, init
    assert "memory" in out["memory"]["events"] and out["memory"]["out"].count("held") < 3, out["memory"]
    assert "processes" in out["processes"]["events"], out["processes"]
    assert "disk" in out["disk"]["events"] and "wrote-all" not in out["disk"]["out"], out["disk"]
    assert out["disk_used"] < (64 << 20) + (60 << 20)  # polled: over by at most a few writes
    assert out["after"]["out"].strip() == "alive"


# ---------------------------------------------------------------- a jail that cannot be set up

PROBE = r"""
import json, os
from pathlib import Path
from tracekit.coding import sandbox
out = {"problem": sandbox.jail_problem(), "isolation": sandbox.isolation()}
try:
    sandbox.run("echo ran", Path(os.getcwd()))
    out["run"] = "ran"
except sandbox.JailUnavailable as e:
    out["run"] = f"{type(e).__name__}: {e}"
if os.environ.get("TK_TARGET"):
    from omegaconf import OmegaConf
    from tracekit.targets.coding.config import build_suite, check
    bench = OmegaConf.create({"kind": "coding", "split": "test", "name": "coding_toolz"})
    out["check"] = check(bench)
    cache = Path(os.environ["TK_TARGET"])
    try:
        build_suite(bench, cache)
        out["build"] = "built"
    except sandbox.JailUnavailable as e:
        out["build"] = str(e)
    out["generated"] = (cache / "coding_tasks").exists()
print(json.dumps(out))
"""


def _one_line(text: str) -> bool:
    return bool(text) and "\n" not in text and "Traceback" not in text


@needs_root
def test_no_mount_permission_refuses_in_one_line_and_the_target_does_not_run(tmp_path):
    p = _python(sys.executable, PROBE, drop_cap="sys_admin", env={"TK_TARGET": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert _one_line(out["problem"]) and "no mount permission" in out["problem"] and "CAP_SYS_ADMIN" in out["problem"]
    assert out["run"] == f"JailUnavailable: {out['problem']}" and out["isolation"]["mode"] == "unavailable"
    (key, value, valid), = out["check"]
    assert key == "benchmark.kind" and out["problem"] in valid
    assert out["build"] == out["problem"] and not out["generated"]  # refused before any task was generated


NO_USERNS = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
r, w = os.pipe()
go_r, go_w = os.pipe()
pid = os.fork()
if pid == 0:  # a user namespace mapping root and nobody, where no further user namespace may be made
    assert libc.unshare(0x10000000) == 0
    os.write(w, b"x"); os.read(go_r, 1)
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    os.execv(sys.argv[1], [sys.argv[1], "-c", sys.argv[2]])
os.read(r, 1)
for name in ("uid_map", "gid_map"):
    with open(f"/proc/{pid}/{name}", "w") as f:
        f.write("0 0 1\n65534 65534 1\n")
os.write(go_w, b"x")
_, st = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(st))
"""


@needs_root
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="no system python3 in /usr/bin")
def test_no_user_namespaces_refuses_in_one_line():
    p = _python(sys.executable, NO_USERNS, SYSTEM_PYTHON, PROBE, env={"HOME": "/nonexistent"})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert _one_line(out["problem"]) and "no user namespaces for uid 65534" in out["problem"], out["problem"]
    assert out["run"] == f"JailUnavailable: {out['problem']}"


def test_a_forced_accounting_runs_or_is_refused_in_one_line(monkeypatch):
    try:
        for name in sandbox.ACCOUNTINGS:  # each one the machine has works; the others are refused naming why
            monkeypatch.setenv("TRACEKIT_SANDBOX_ACCOUNTING", name)
            _clear_caches()
            problem = sandbox.jail_problem()
            assert problem is None or (_one_line(problem) and f"TRACEKIT_SANDBOX_ACCOUNTING={name}: " in problem)
            if problem is None:
                assert sandbox.isolation()["accounting"] == name
        assert sandbox.jail_problem() is None  # the watchdog needs no more than the jail itself
        monkeypatch.setenv("TRACEKIT_SANDBOX_ACCOUNTING", "quota")
        _clear_caches()
        problem = sandbox.jail_problem()
        assert _one_line(problem) and "TRACEKIT_SANDBOX_ACCOUNTING='quota' is not one of" in problem
        with pytest.raises(sandbox.JailUnavailable, match="quota"):
            sandbox.run("true", Path.cwd())
    finally:
        monkeypatch.delenv("TRACEKIT_SANDBOX_ACCOUNTING")
        _clear_caches()


@needs_root
def test_a_copy_left_mounted_by_a_dead_process_is_swept():
    dead = procs.popen(["true"])
    dead.wait()
    stale = sandbox.work_root() / f"ep-{dead.pid}-stale"
    (stale / "repo").mkdir(parents=True)
    sandbox.bounded_dir(stale / "repo", 1 << 20, 16)
    sandbox._BOUNDED.pop(sandbox._real(stale / "repo"))  # as if the process that made it had died
    mine = Workspace({"a": "1"})
    try:
        sandbox._sweep_stale(sandbox.work_root())
        points = [p for _, p, _, _ in sandbox._mounts()]
        assert str(stale / "repo") not in points and not stale.exists()
        assert str(mine.repo) in points and (mine.repo / "a").read_text() == "1"  # a live process's copy stays
    finally:
        mine.close()
        if stale.exists():
            sandbox._libc.umount2(str(stale / "repo").encode(), 2)
            shutil.rmtree(stale, ignore_errors=True)
