"""scripts/import_graph.py: counts statements (module- vs function-level), finds a planted circle, and names an
import that runs up the layers of a contract."""

from __future__ import annotations

import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402

from tests import procs  # noqa: E402


def _tree(tmp_path: Path) -> Path:
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "top.py").write_text("import json\n")
    (pkg / "low" / "__init__.py").write_text("")
    # a -> b at module level, b -> a inside a function (two statements naming two names count once), b -> top: up
    (pkg / "low" / "a.py").write_text("from pkg.low import b\nimport os\n")
    (pkg / "low" / "b.py").write_text("def f():\n    from pkg.low.a import x, y\n    import pkg.top\n")
    (tmp_path / "contract.ini").write_text(
        "[importlinter]\nroot_package = pkg\n\n[importlinter:contract:l]\nname = l\ntype = layers\n"
        "containers = pkg\nlayers =\n    top\n    low\n")
    return pkg


def test_reports_planted_circle_and_upward_import(tmp_path):
    pkg = _tree(tmp_path)
    out = io.StringIO()
    r = import_graph.report(pkg, tmp_path / "contract.ini", out=out)
    text = out.getvalue()
    assert (r["statements"], r["function_level"]) == (3, 2), text  # a's (os is external), b's two
    assert r["circles"] == [["pkg.low.a", "pkg.low.b"]], text
    assert "pkg.low.b:2 -> pkg.low.a (function-level)" in text
    assert r["up"] == 1 and "pkg.low.b:3 -> pkg.top (layer 2 -> 1, function-level)" in text


def test_runs_on_the_package():
    r = procs.run([sys.executable, str(ROOT / "scripts" / "import_graph.py")], capture_output=True, text=True,
                  timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("internal import statements: ") and "imports up the layers (.importlinter" in r.stdout


def test_package_has_no_circles_no_upward_import_and_every_deferred_import_says_why():
    """The ratchet of issue 31's hub split: no import circle, no import up the layers (issue 51: none ignored either),
    and a function-level import only where it must wait (tau2's seconds of import time, the sandbox's limits), each
    saying so with a ``# deferred:`` comment."""
    pkg = ROOT / "tracekit"
    mods = import_graph.modules_of(pkg)
    stmts = import_graph.statements(mods)
    found = import_graph.report(pkg, ROOT / ".importlinter", out=io.StringIO())
    assert found["circles"] == [] and found["up"] == 0
    assert "ignore_imports" not in (ROOT / ".importlinter").read_text()
    for s in (s for s in stmts if s.function_level):
        line = mods[s.source].read_text().splitlines()[s.line - 1]
        assert "# deferred:" in line, f"{s.source}:{s.line} imports inside a function without '# deferred: <why>'"


def test_module_sizes_table_names_new_gone_and_resized_modules():
    import module_sizes

    t = module_sizes.table({"p.a": 10, "p.b": 5, "p.c": 7}, {"p.a": 12, "p.c": 7, "p.d": 3})
    assert t.startswith("modules 3 -> 3, lines 22 -> 22; 3 modules new, gone or resized, 1 unchanged")
    assert "| `p.a` | 10 | 12 | +2 |" in t and "| `p.b` | 5 | - | gone |" in t and "| `p.d` | - | 3 | new |" in t
    assert "`p.c`" not in t
    assert module_sizes.module_name("tracekit/envs/__init__.py") == "tracekit.envs"
