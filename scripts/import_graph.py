#!/usr/bin/env python
"""The package's internal import graph, by import statement (issue 31).

    python scripts/import_graph.py                      # tracekit/, the layers of .importlinter
    python scripts/import_graph.py PKG_DIR --config FILE [--list-function-level]

Prints:
  - internal import statements: how many, module-level vs function-level (an import inside a function body runs
    when the function is called: a deferred import, often one that dodges a circle). One statement counts once,
    whatever number of names or modules it imports;
  - import circles: the strongly connected components of the module graph (module-level and function-level
    edges both; a circle of module-level edges alone is marked, it is the one that can fail at import time);
  - imports that run up the layers: statements in a module of a lower layer importing a module of a higher one,
    from the first `type = layers` contract of the import-linter config (its `containers` and `layers`).
Exit status 0 (a report, not a check: `lint-imports` is the check).
"""

from __future__ import annotations

import argparse
import ast
import collections
import configparser
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Stmt:
    source: str  # importing module
    targets: tuple[str, ...]  # internal modules the statement imports (resolved to existing modules)
    line: int
    function_level: bool


def modules_of(pkg_dir: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``pkg_dir`` (a package directory)."""
    out = {}
    for p in sorted(pkg_dir.rglob("*.py")):
        parts = p.relative_to(pkg_dir.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _existing(name: str, mods: dict[str, Path]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.Import | ast.ImportFrom, module: str, mods: dict[str, Path]) -> set[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: from the module's package
            pkg = module.split(".") if mods[module].name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
    return {t for t in (_existing(n, mods) for n in names) if t and t != module}


def statements(mods: dict[str, Path]) -> list[Stmt]:
    out = []
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_function = set()
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                in_function.update(id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom)))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = _targets(node, module, mods)
                if targets:
                    out.append(Stmt(module, tuple(sorted(targets)), node.lineno, id(node) in in_function))
    return sorted(out, key=lambda s: (s.source, s.line))


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan), largest first."""
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop(); on.discard(w); comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        comps.append(sorted(comp))
    return sorted(comps, key=lambda c: (-len(c), c))


def layers_of(config: Path) -> list[list[str]]:
    """The first layers contract's layers, top first, each a list of full module names (optional ones included)."""
    cp = configparser.ConfigParser(inline_comment_prefixes=None, interpolation=None)
    cp.read(config)
    for section in cp.sections():
        if section.startswith("importlinter:contract:") and cp[section].get("type", "").strip() == "layers":
            container = cp[section].get("containers", "").strip()
            out = []
            for line in cp[section]["layers"].strip().splitlines():
                line = line.split("#")[0].strip()
                if not line:
                    continue
                names = [n.strip().strip("()") for n in line.replace("|", ":").split(":") if n.strip()]
                out.append([f"{container}.{n}" if container else n for n in names])
            return out
    return []


def layer_index(module: str, layers: list[list[str]]) -> int | None:
    for i, layer in enumerate(layers):
        if any(module == m or module.startswith(m + ".") for m in layer):
            return i
    return None


def report(pkg_dir: Path, config: Path | None, list_function_level: bool = False, out=sys.stdout) -> dict:
    mods = modules_of(pkg_dir)
    stmts = statements(mods)
    func = [s for s in stmts if s.function_level]
    print(f"internal import statements: {len(stmts)} ({len(stmts) - len(func)} module-level, {len(func)} "
          f"function-level) in {len(mods)} modules", file=out)
    if list_function_level:
        for s in func:
            print(f"  function-level  {s.source}:{s.line} -> {', '.join(s.targets)}", file=out)

    edges, module_edges = collections.defaultdict(set), collections.defaultdict(set)
    for s in stmts:
        for t in s.targets:
            edges[s.source].add(t)
            if not s.function_level:
                module_edges[s.source].add(t)
    comps = circles(edges)
    strict = {tuple(c) for c in circles(module_edges)}
    print(f"import circles (strongly connected components): {len(comps)}", file=out)
    for c in comps:
        inner = [s for s in stmts if s.source in c and any(t in c for t in s.targets)]
        tag = " [module-level edges alone make a circle]" if any(set(m) <= set(c) for m in strict) else ""
        print(f"  {len(c)} modules{tag}: {', '.join(c)}", file=out)
        for s in inner:
            kind = "function" if s.function_level else "module"
            print(f"    {s.source}:{s.line} -> {', '.join(t for t in s.targets if t in c)} ({kind}-level)", file=out)

    up = []
    layers = layers_of(config) if config and config.exists() else []
    if layers:
        for s in stmts:
            i = layer_index(s.source, layers)
            for t in s.targets:
                j = layer_index(t, layers)
                if i is not None and j is not None and j < i:
                    up.append((s, t, i, j))
        print(f"imports up the layers ({config.name}, {len(layers)} layers): {len(up)} statements", file=out)
        for s, t, i, j in up:
            kind = "function" if s.function_level else "module"
            print(f"  {s.source}:{s.line} -> {t} (layer {i + 1} -> {j + 1}, {kind}-level)", file=out)
    else:
        print("imports up the layers: no layers contract found", file=out)
    return {"statements": len(stmts), "function_level": len(func), "circles": comps, "up": len(up)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("package", nargs="?", type=Path, default=ROOT / "tracekit", help="package directory")
    ap.add_argument("--config", type=Path, default=ROOT / ".importlinter", help="import-linter config (layers)")
    ap.add_argument("--list-function-level", action="store_true", help="list every function-level import")
    a = ap.parse_args(argv)
    report(a.package.resolve(), a.config, a.list_function_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
