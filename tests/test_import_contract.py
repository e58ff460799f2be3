"""The import contract (`.importlinter`, the layer list of docs/ARCHITECTURE.md) holds, and can fail: the same
contract over a copy of the package with one planted upward import is broken."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import procs

pytest.importorskip("importlinter", reason="import-linter is a dev dependency (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / ".importlinter"


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    """`lint-imports` on ``cwd``'s `.importlinter`, the package found on ``pythonpath`` (grimp parses, never imports)."""
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return procs.run([sys.executable, "-c", code, "--no-cache"], cwd=cwd, env=env, capture_output=True,
                     text=True, timeout=60)


def test_contract_holds_today():
    r = _lint(ROOT, ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def test_planted_upward_import_breaks_the_contract(tmp_path):
    # the package's Python files, the real contract, one new module-level import: an environment importing training
    shutil.copytree(ROOT / "tracekit", tmp_path / "tracekit", ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(CONFIG, tmp_path / ".importlinter")
    base = tmp_path / "tracekit" / "envs" / "base.py"
    base.write_text(base.read_text() + "\nimport tracekit.rl.grpo  # planted\n")
    r = _lint(tmp_path, tmp_path)
    assert r.returncode != 0, r.stdout[-4000:]
    assert "tracekit.envs does not import tracekit.rl, even indirectly BROKEN" in " ".join(r.stdout.split())
    assert "tracekit.envs.base -> tracekit.rl.grpo" in r.stdout
