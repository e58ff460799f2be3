"""Write tracekit/targets/toolsandbox/data/toolsandbox_scenarios.json: ToolSandbox's 129 base scenarios (name, categories,
the tools of it that call RapidAPI), from the real ToolSandbox through its environment server. The ToolSandbox
target's training split (``benchmark.toolsandbox.train_split``, :mod:`tracekit.targets.toolsandbox.target`) is computed from this
catalog, so it is known at config time (validation, planning) without ToolSandbox's environment; the catalog is
checked against the real ToolSandbox in tests/test_toolsandbox_split.py.

    python scripts/extract_toolsandbox_scenarios.py      # needs ToolSandbox's environment (scripts/install.sh)
"""

from __future__ import annotations

import json
from pathlib import Path

from tracekit.artifacts import atomic_write_text
from tracekit.targets.toolsandbox.suite import ToolSandboxServer
from tracekit.targets.toolsandbox.target import CATALOG


def main() -> None:
    server = ToolSandboxServer()
    try:
        rows = server.request("scenarios", variants=[])
    finally:
        server.stop()
    scenarios = [{"name": r["name"], "categories": sorted(r["categories"]), "rapidapi": sorted(r["rapidapi"])}
                 for r in rows if r["base"]]
    text = json.dumps({"source": "apple/ToolSandbox 165848b, tool_sandbox.scenarios.named_scenarios (base scenarios)",
                       "scenarios": scenarios}, indent=1, ensure_ascii=False) + "\n"
    atomic_write_text(Path(CATALOG), text)
    print(f"{len(scenarios)} scenarios -> {CATALOG}")


if __name__ == "__main__":
    main()
