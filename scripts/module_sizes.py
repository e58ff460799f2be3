"""Lines per module of the package at a git revision against the working tree: a markdown table of the modules
that changed (new, gone or resized), for a redesign's before/after report.

    python scripts/module_sizes.py 0b1d707            # the tree issue 31 reviewed -> now
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def sizes_at(rev: str, package: str = "tracekit") -> dict[str, int]:
    files = subprocess.run(["git", "ls-tree", "-r", "--name-only", rev, package], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    out = {}
    for f in (f for f in files if f.endswith(".py")):
        text = subprocess.run(["git", "show", f"{rev}:{f}"], cwd=ROOT, check=True, capture_output=True).stdout
        out[module_name(f)] = text.count(b"\n")
    return out


def sizes_now(package: str = "tracekit") -> dict[str, int]:
    return {module_name(str(p.relative_to(ROOT))): p.read_bytes().count(b"\n")
            for p in sorted((ROOT / package).rglob("*.py")) if "__pycache__" not in p.parts}


def table(before: dict[str, int], after: dict[str, int]) -> str:
    rows = []
    for m in sorted(before.keys() | after.keys()):
        a, b = before.get(m), after.get(m)
        if a != b:
            note = "new" if a is None else "gone" if b is None else f"{b - a:+d}"
            rows.append(f"| `{m}` | {'-' if a is None else a} | {'-' if b is None else b} | {note} |")
    same = sum(1 for m in before.keys() & after.keys() if before[m] == after[m])
    head = (f"modules {len(before)} -> {len(after)}, lines {sum(before.values()):,} -> {sum(after.values()):,}; "
            f"{len(rows)} modules new, gone or resized, {same} unchanged\n\n"
            "| module | lines before | lines after | change |\n|---|---:|---:|---|\n")
    return head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the revision to compare the working tree against")
    args = ap.parse_args(argv)
    print(table(sizes_at(args.rev), sizes_now()), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
