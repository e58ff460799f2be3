"""The README's and docs/ARCHITECTURE.md's lists of methods, consolidation strategies and targets are the
registries' keys, ARCHITECTURE's layer list is `.importlinter`'s layers contract, and its package layout names every
package and module of tracekit/.

A list is a marked block: ``<!-- registry: NAME -->`` ... ``<!-- /registry -->``; each bullet (``- `name` ...:``)
or table row (first cell) names its entries in backticks. A registry entry that no list names fails here."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from tracekit.methods import METHODS
from tracekit.methods.consolidate import STRATEGIES
from tracekit.methods.consolidate.merge import MERGES
from tracekit.targets.registry import kinds

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
_TICKED = re.compile(r"`([a-z0-9_]+)`")


def documented(text: str, block: str) -> set[str]:
    """The names a marked block lists: per bullet, the backticked names before its first ':'; per table row (not
    the header or the rule), the backticked names of its first cell."""
    m = re.search(rf"<!-- registry: {block} -->\n(.*?)<!-- /registry -->", text, re.S)
    assert m, f"no <!-- registry: {block} --> block"
    names, rows = set(), [line for line in m.group(1).splitlines() if line.strip()]
    table = [line for line in rows if line.startswith("|")]
    for line in rows:
        if line.startswith("- "):
            names.update(_TICKED.findall(line.split(":", 1)[0]))
    for line in table[2:]:  # after the header and the |---| rule
        names.update(_TICKED.findall(line.split("|")[1]))
    return names


def mismatch(registry: set[str], listed: set[str]) -> str | None:
    """None when the list is the registry; else what is undocumented and what is listed but not registered."""
    missing, extra = sorted(registry - listed), sorted(listed - registry)
    if not missing and not extra:
        return None
    return f"undocumented: {missing}; documented but not registered: {extra}"


REGISTRIES = {"methods": set(METHODS), "strategies": set(STRATEGIES), "targets": set(kinds())}
CASES = [(README, "methods"), (README, "strategies"),
         (ARCHITECTURE, "methods"), (ARCHITECTURE, "strategies"), (ARCHITECTURE, "targets")]


@pytest.mark.parametrize(("doc", "block"), CASES, ids=[f"{d.name}:{b}" for d, b in CASES])
def test_doc_lists_the_registry(doc, block):
    problem = mismatch(REGISTRIES[block], documented(doc.read_text(), block))
    assert problem is None, f"{doc.relative_to(ROOT)} <!-- registry: {block} -->: {problem}"


def test_the_merges_are_strategies():
    assert {m.name for m in MERGES} <= set(STRATEGIES)


def test_a_new_registry_entry_fails_the_check():
    listed = documented(README.read_text(), "methods")
    assert mismatch(set(METHODS), listed) is None
    problem = mismatch(set(METHODS) | {"planted_new_method"}, listed)
    assert problem is not None and "undocumented: ['planted_new_method']" in problem
    # and a list naming what is no longer registered
    assert "not registered: ['moe']" in mismatch(set(STRATEGIES) - {"moe"}, documented(ARCHITECTURE.read_text(),
                                                                                          "strategies"))


def test_parser_reads_bullets_and_table_rows():
    text = ("<!-- registry: x -->\n- `a` (`a.py`): uses `not_me`\n| k | m |\n|---|---|\n| `b`, `c` | `d.py` |\n"
            "<!-- /registry -->\n")
    assert documented(text, "x") == {"a", "b", "c"}  # not `a.py` (no name), `not_me` (after the ':'), `d.py`


def test_readme_names_every_preset_and_target_config():
    text = README.read_text()
    for group in ("experiment", "benchmark", "consolidation", "sweep"):
        for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
            assert f"`{path.stem}`" in text or f"{group}={path.stem}" in text, f"README does not name {group}={path.stem}"


def _layers_of_contract() -> list[str]:
    cp = configparser.ConfigParser(interpolation=None)
    cp.read(ROOT / ".importlinter")
    layers = cp["importlinter:contract:layers"]["layers"]
    return [" ".join(line.split()) for line in layers.strip().splitlines() if line.strip()]


def test_architecture_layer_list_is_the_contract():
    text = ARCHITECTURE.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"(?m)^\d+\. `([^`]+)`", section)
    assert listed == _layers_of_contract()


def _layout_entries() -> tuple[str, dict[str, str]]:
    """ARCHITECTURE's package layout block, and each package's entry in it (``  name/`` at two spaces, plus its
    deeper-indented continuation lines)."""
    section = ARCHITECTURE.read_text().split("## Package layout", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if m := re.match(r"  (\w+)/\s", line + " "):
            current = m.group(1)
            entries[current] = line
        elif current and line.startswith("   "):
            entries[current] += "\n" + line
        else:
            current = None
    return block, entries


def test_architecture_layout_names_every_package_and_module():
    """Every top-level module of tracekit/ (``name.py``), every package (``name/``) and, in its package's entry, every
    module below it (by name), so the layout stays the tree."""
    package = ROOT / "tracekit"
    block, entries = _layout_entries()
    missing = [f"{p.name}" for p in sorted(package.glob("*.py"))
               if p.name != "__init__.py" and not re.search(rf"(?<![\w.]){re.escape(p.name)}", block)]
    for folder in sorted(d for d in package.iterdir() if (d / "__init__.py").is_file()):
        if folder.name not in entries:
            missing.append(f"{folder.name}/")
            continue
        for module in sorted(folder.rglob("*.py")):
            if "__pycache__" in module.parts or module.stem in ("__init__", "__main__"):
                continue
            if not re.search(rf"(?<![\w.]){re.escape(module.stem)}\b", entries[folder.name]):
                missing.append(str(module.relative_to(package)))
    assert not missing, f"docs/ARCHITECTURE.md's package layout does not name: {missing}"
