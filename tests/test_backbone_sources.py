"""Contract edges are real edges (issue 38, item 4).

- A backbone source is registered by the module that owns it (``llm.backbones.register_backbone_source``), never
  named in a string under ``tracekit/llm``: the planted warm start registers ``planted`` when imported, the app's
  import path registers it, a source asked for but not registered fails in one line, and a training subprocess
  imports again the owners its parent had registered.
- The env pool's worker entry point is the factory function its caller passes (pickled by reference), not a
  ``"module:name"`` string the pool imports.

Each registry check runs in a fresh interpreter (a registration, once imported, stays for the test process)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_an_unregistered_source_fails_in_one_line_and_the_planted_one_registers_on_import():
    out = _run(
        "import tracekit.llm.backbones as B\n"
        "assert B.BACKBONE_SOURCES == {} and B.backbone_source_modules() == []\n"
        "try:\n"
        "    B.backbone_source('planted', 'qwen3_micro')\n"
        "except LookupError as e:\n"
        "    print(e)\n"
        "import sys\n"
        "assert not any(m.startswith('tracekit.planted') for m in sys.modules)  # llm imports no planted module\n"
        "import tracekit.warmstart.planted as W\n"
        "assert B.backbone_source('planted') is W.planted_dir\n"
        "print(B.backbone_source_modules())\n")
    message, modules = out.splitlines()
    assert message.startswith("backbone qwen3_micro: backbone.planted is set but no 'planted' backbone source is "
                              "registered in this process: import the module that owns backbone.planted first")
    assert message.endswith("registered: none")
    assert modules == "['tracekit.warmstart.planted']"


def test_the_app_import_path_registers_the_planted_source():
    """``python -m tracekit`` imports tracekit.cli, which imports tracekit.validate (the one declared upward edge
    to the warm start), so the app's process can build a planted backbone."""
    assert _run("import tracekit.cli, tracekit.llm.backbones as B; print(sorted(B.BACKBONE_SOURCES))") == "['planted']"


def test_a_training_subprocess_imports_the_registered_owners_again(tmp_path):
    """rl.launch.TrainSpec carries the parent's registered owners (through its JSON file) and its subprocess entry
    imports them before it builds the model."""
    out = _run(
        "import tracekit.warmstart.planted\n"
        "from tracekit.rl.launch import Factory, TrainSpec\n"
        "s = TrainSpec(model=Factory('tracekit.rl.toy:tiny_policy'), env=Factory('tracekit.rl.toy:keyword_suite'),"
        " out_dir='x')\n"
        "assert TrainSpec.from_json(s.to_json()) == s\n"
        "print(s.backbone_sources)\n")
    assert out == "['tracekit.warmstart.planted']"
    assert _run(
        "import tracekit.llm.backbones as B\n"
        "from tracekit.rl.launch import Factory, TrainSpec\n"
        "assert TrainSpec(model=Factory('m:f'), env=Factory('m:g'), out_dir='x').backbone_sources == []\n"
        "B.import_backbone_sources(TrainSpec.from_json({'model': {'target': 'm:f'}, 'env': {'target': 'm:g'},"
        " 'out_dir': 'x', 'grpo': {}, 'backbone_sources': ['tracekit.warmstart.planted']}).backbone_sources)\n"
        "print(B.backbone_source('planted').__module__)\n") == "tracekit.warmstart.planted"


def test_register_refuses_a_name_instead_of_a_function():
    from tracekit.llm.backbones import register_backbone_source

    with pytest.raises(TypeError, match="must be a function"):
        register_backbone_source("elsewhere", "tracekit.warmstart.planted:planted_dir")  # type: ignore[arg-type]


def _code_strings(path: Path) -> list[str]:
    """The string constants of a module that are not docstrings."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_llm_names_no_planted_module_and_the_pool_imports_nothing_by_name():
    named = {str(p.relative_to(ROOT)): s for p in sorted((ROOT / "tracekit" / "llm").rglob("*.py"))
             for s in _code_strings(p) if "tracekit.planted" in s}
    assert named == {}
    pool = (ROOT / "tracekit" / "envs" / "pool.py").read_text(encoding="utf-8")
    assert "importlib" not in pool and "import_module" not in pool


def test_the_pool_worker_runs_the_factory_function_it_was_given():
    from tracekit.envs.pool import SuiteSpec
    from tracekit.wiring import suite_from_config, suite_spec

    spec = SuiteSpec(suite_from_config, ({},))
    assert spec.factory is suite_from_config and spec.factory_name == "tracekit.wiring:suite_from_config"
    import pickle

    assert pickle.loads(pickle.dumps(spec)).factory is suite_from_config  # crosses to a worker by reference
    assert suite_spec.__module__ == "tracekit.wiring"
