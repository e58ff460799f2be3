"""The coding target's bash sandbox: every escape attempt contained and reported, and the next command still runs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tracekit.coding import sandbox
from tracekit.coding.repo import Workspace, read_tree

LIMITS = sandbox.CommandLimits(cpu_seconds=1, wall_seconds=2.5, memory_bytes=512 << 20, processes=48,
                               output_chars=500)
ns = pytest.mark.skipif(not sandbox.namespaces_available(),
                        reason="namespaces need root + unshare: only rlimits are enforced here (sandbox.isolation())")


@pytest.fixture()
def ws():
    w = Workspace({"pkg/mod.py": "X = 1\n"})
    yield w
    w.close()


def test_isolation_is_reported():
    iso = sandbox.isolation()
    assert set(iso) >= {"mode", "cpu", "wall", "memory", "processes", "files", "network"}
    assert iso["mode"] in ("namespaces", "rlimits")


def test_command_runs_in_the_copy_and_output_is_truncated(ws):
    r = ws.run("cat pkg/mod.py; echo made > new.txt", LIMITS)
    assert r.returncode == 0 and "X = 1" in r.output and (ws.repo / "new.txt").read_text() == "made\n"
    r = ws.run("yes abcdefgh | head -c 20000", LIMITS)
    assert "output_truncated" in r.events and len(r.output) < 700 and "characters cut" in r.output
    r = ws.run("exit 3", LIMITS)
    assert r.returncode == 3 and "[exit code 3]" in r.for_agent()


def test_sleep_forever_is_killed_at_the_wall_limit_with_its_background_children(ws):
    r = ws.run("sleep 1000 & sleep 1000", LIMITS)
    assert r.returncode is None and "wall_time" in r.events and r.wall_s < LIMITS.wall_seconds + 2
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"


def test_cpu_loop_is_killed_at_the_cpu_limit(ws):
    r = ws.run("python -c 'while True: pass'", LIMITS)
    assert "cpu_time" in r.events or "wall_time" in r.events


def test_memory_blowup_fails_inside_the_command(ws):
    r = ws.run("python -c 'x = bytearray(3 << 30)'", LIMITS)
    assert r.returncode != 0 and "memory" in r.events


@ns
def test_write_outside_the_copy_is_refused(ws, tmp_path):
    target = Path("/work") / f"tracekit-escape-{os.getpid()}.txt"
    r = ws.run(f"echo pwned > {target}; echo pwned > /root/escape.txt; touch /etc/escape", LIMITS)
    assert "write_denied" in r.events and not target.exists() and not Path("/etc/escape").exists()
    r = ws.run(f"echo y > /tmp/escape-{os.getpid()}; cat /tmp/escape-{os.getpid()}", LIMITS)  # a private tmpfs
    assert r.output.strip() == "y" and not Path(f"/tmp/escape-{os.getpid()}").exists()


@ns
def test_read_only_directory_under_tmp_stays_visible_and_read_only(ws):
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


@ns
def test_network_is_unreachable(ws):
    r = ws.run("python -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=2)\"", LIMITS)
    assert r.returncode != 0 and "network_blocked" in r.events


@ns
def test_fork_bomb_stops_at_the_process_limit(ws):
    r = ws.run(":(){ :|:& };:; sleep 1", LIMITS)
    assert r.wall_s < LIMITS.wall_seconds + 2 and ("processes" in r.events or "wall_time" in r.events)
    assert ws.run("echo alive", LIMITS).output.strip() == "alive"


def test_patch_ignores_what_the_agent_leaves_around(ws):
    r = ws.run("mkdir sub && cd sub && git init -q && echo hi > f; ln -s /etc/passwd ../pw; mkdir .pytest_cache; "
               "echo c > .pytest_cache/x; sed -i 's/X = 1/X = 2/' ../pkg/mod.py", LIMITS)
    assert r.returncode == 0, r.output
    assert set(read_tree(ws.repo)) == {"pkg/mod.py", "sub/f"}
    patch = ws.diff()
    assert "+X = 2" in patch and "diff --git a/sub/f b/sub/f" in patch and "passwd" not in patch
