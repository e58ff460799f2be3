"""The jail shows an allow-list, not the host minus what a scan recognises: copies of a task's package that no
scan recognises (issue 49's seven) are invisible wherever in the interpreter's prefix they lie and however late
they are saved there.

The prefix is a temporary venv under ``$HOME/.cache`` (a home and cache tree), its interpreter the one the jail
starts, so the jail binds it exactly as it binds a host's interpreter prefix; the copies are planted in it, and in
the real interpreter's standard-library directory, after the jail has run its first command.
"""

from __future__ import annotations

import json
import os
import py_compile
import shutil
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path

from tests import procs
from tests.test_coding_sandbox import _python, plant_task_cache
from tracekit.coding import runtime, sandbox

PROBE = r"""
import json, sys
from tracekit.targets.coding.repo import Workspace
from tracekit.coding.sandbox import CommandLimits
L = CommandLimits(wall_seconds=60, output_chars=200_000)
planted = json.loads(sys.argv[1])
with Workspace({"pkg/mod.py": "X = 1\n"}) as ws:
    first = ws.run("python -c 'import sys; print(sys.prefix)'", L)  # the view is built before the copies exist
    open(sys.argv[2], "w").write("planted?")
    import time
    while not open(sys.argv[2]).read().startswith("done"):
        time.sleep(0.05)
    probe = ws.run("for p in " + " ".join(planted) + "; do test -e \"$p\" && echo VISIBLE \"$p\"; done; "
                   "find " + sys.argv[3] + " -print 2>/dev/null; ls -A " + sys.argv[4] + "; echo END", L)
print(json.dumps({"prefix": first.output.strip(), "rc": first.returncode, "probe": probe.output}))
"""


def _toolz_zip(dest: Path, site: Path) -> None:
    with zipfile.ZipFile(dest, "w") as z:
        for f in sorted((site / "toolz").rglob("*.py")):
            z.write(f, str(f.relative_to(site)))


def _plant(prefix: Path, stdlib: Path, marker: str) -> list[Path]:
    """The issue's seven copies (and two in the real standard library), each readable by anyone on the host."""
    import importlib.metadata

    site = Path(importlib.metadata.distribution("toolz").locate_file(""))
    pristine = site / "toolz" / "itertoolz.py"
    lib = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    tag = sys.implementation.cache_tag
    out = []
    pyc = lib / "__pycache__" / f"itertoolz.{tag}.pyc"  # 1: a __pycache__ holding only the pristine module's .pyc
    py_compile.compile(str(pristine), cfile=str(pyc), doraise=True)
    out.append(pyc)
    tree = prefix / ".pycache" / str(site).lstrip("/") / "toolz" / "__pycache__" / f"itertoolz.{tag}.pyc"
    py_compile.compile(str(pristine), cfile=str(tree), doraise=True)  # 2: a PYTHONPYCACHEPREFIX tree
    out.append(tree)
    funcs = lib / "funcs"  # 3: the package unpacked under another name
    shutil.copytree(site / "toolz", funcs, ignore=shutil.ignore_patterns("__pycache__"))
    out.append(funcs / "itertoolz.py")
    for dest in (prefix / "toolz-master.zip", prefix / "share" / "toolz.zip", prefix / "bin" / "blob"):  # 4-6
        dest.parent.mkdir(parents=True, exist_ok=True)
        _toolz_zip(dest, site)
        out.append(dest)
    cache = prefix / "backup"  # 7: a renamed backup of the task cache (every gold patch in tasks.jsonl)
    plant_task_cache(cache, marker)
    (cache / "coding_tasks").rename(cache / "ct-backup")
    out += sorted((cache / "ct-backup").rglob("tasks.jsonl"))
    shutil.copytree(site / "toolz", stdlib / f"funcs_{marker}", ignore=shutil.ignore_patterns("__pycache__"))
    _toolz_zip(stdlib / f"toolz-{marker}.zip", site)
    out += [stdlib / f"funcs_{marker}" / "itertoolz.py", stdlib / f"toolz-{marker}.zip"]
    for dirpath, dirnames, filenames in os.walk(prefix):
        os.chmod(dirpath, 0o755)
        for n in filenames:
            os.chmod(os.path.join(dirpath, n), os.stat(os.path.join(dirpath, n)).st_mode | 0o444)
    return out


def test_copies_planted_late_in_the_interpreters_prefix_are_invisible():
    home = Path(os.environ.get("HOME", "/root")) / ".cache"
    home.mkdir(parents=True, exist_ok=True)
    venv = Path(tempfile.mkdtemp(prefix="tracekit-prefix-", dir=home))
    os.chmod(venv, 0o755)
    stdlib = Path(runtime.stdlib_dir())
    marker = uuid.uuid4().hex[:12]
    signal = venv.with_suffix(".signal")
    planted: list[Path] = []
    try:
        procs.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                  check=True, timeout=60)
        lib = venv / "lib" / stdlib.name
        expected = [str(venv / p) for p in ("toolz-master.zip", "share/toolz.zip", "bin/blob", ".pycache", "backup")]
        expected += [str(lib / "funcs"), str(lib / "__pycache__" / f"itertoolz.{sys.implementation.cache_tag}.pyc")]
        import threading

        result = {}

        def probe() -> None:
            result["p"] = _python(str(venv / "bin" / "python"), PROBE, json.dumps(expected + [
                str(stdlib / f"funcs_{marker}"), str(stdlib / f"toolz-{marker}.zip")]), str(signal),
                str(venv), str(stdlib))

        signal.write_text("")
        t = threading.Thread(target=probe)
        t.start()
        while signal.read_text() != "planted?" and t.is_alive():
            t.join(0.05)
        planted = _plant(venv, stdlib, marker)  # after the jail's first command
        for p in planted:  # the threat is real: each copy is there, readable by anyone
            assert p.is_file() and p.stat().st_mode & 0o004, p
        signal.write_text("done")
        t.join(180)
        p = result["p"]
        assert p.returncode == 0, p.stderr[-2000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["rc"] == 0 and out["prefix"] == str(venv), out  # the jail's python is the prefix's
        seen = out["probe"]
        assert seen.rstrip().endswith("END") and "VISIBLE" not in seen, seen[-3000:]
        shown = {venv, venv / "pyvenv.cfg", venv / "bin", venv / "lib", lib,
                 *(venv / "bin" / n for n in os.listdir(venv / "bin") if n.startswith("python"))}
        for line in seen.splitlines():  # of the prefix: what starts python, and the task runtime
            if line.startswith(str(venv)):
                assert Path(line) in shown or sandbox._inside(line, str(lib / "site-packages")), line
        assert not any(k in seen for k in (marker, "funcs", "toolz", "ct-backup", "blob", ".pycache")), seen[-3000:]
        assert {"os.py", "json", "lib-dynload"} <= set(seen.split())  # the listing saw the standard library
    finally:
        shutil.rmtree(venv, ignore_errors=True)
        signal.unlink(missing_ok=True)
        shutil.rmtree(stdlib / f"funcs_{marker}", ignore_errors=True)
        (stdlib / f"toolz-{marker}.zip").unlink(missing_ok=True)


def test_only_the_standard_librarys_own_entries_are_shown():
    for name in ("os.py", "json", "lib-dynload", "collections", "_sysconfigdata__linux_x86_64-linux-gnu.py",
                 "LICENSE.txt"):
        assert runtime.stdlib_entry(name), name
    for name in ("site-packages", "test", "funcs", "toolz", "toolz.zip", "toolz-master.zip", "blob", "json.zip",
                 "config-3.11-x86_64-linux-gnu", "os.py.bak", "coding_tasks"):
        assert not runtime.stdlib_entry(name), name


def test_the_view_binds_no_host_tree_beyond_the_allow_list(tmp_path):
    """Every bind of an agent's command: a system directory of programs and libraries, a named file, the
    interpreter's image, the task runtime, the copy; nothing of /usr/local, /usr/share (but named files), /usr/src,
    $HOME or a prefix bound as a directory."""
    mounts, _ = sandbox.view(tmp_path, sandbox.CommandLimits())
    home = sandbox._real(os.environ.get("HOME", "/root"))
    rt = sandbox._real(sandbox.work_root() / "runtime")
    for m in mounts:
        if m["kind"] != "bind" or m.get("dev"):
            continue
        src = m["src"]
        if sandbox._inside(src, rt) or src == sandbox._real(tmp_path):
            continue
        if os.path.isdir(src):
            assert src in sandbox.system_binds() or src == "/nix/store", m
            assert not any(sandbox._inside(src, d) for d in ("/usr/local", "/usr/share", "/usr/src", home)), m
        else:
            assert not sandbox._inside(src, "/usr/local") and not sandbox._inside(src, "/usr/src"), m
