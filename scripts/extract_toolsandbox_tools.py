"""Write tracekit/targets/toolsandbox/data/toolsandbox_tools.json: every agent-visible ToolSandbox tool in the OpenAI format
ToolSandbox's own converter (``convert_to_openai_tools``) produces, from the real ToolSandbox through its
environment server. The library environments' schemas are checked against this extract
(tests/test_synthesis_library.py) and the extract against the real ToolSandbox (tests/test_toolsandbox.py).

    python scripts/extract_toolsandbox_tools.py      # needs ToolSandbox's environment (scripts/install.sh)
"""

from __future__ import annotations

import json
from pathlib import Path

from tracekit.artifacts import atomic_write_text
from tracekit.targets.toolsandbox.suite import ToolSandboxServer
from tracekit.targets.toolsandbox.interface import TOOLSANDBOX_EXTRACT


def main() -> None:
    server = ToolSandboxServer()
    try:
        tools = server.request("tools")
    finally:
        server.stop()
    text = json.dumps({"source": "apple/ToolSandbox 165848b, tool_sandbox.common.tool_conversion.convert_to_openai_tools",
                       "tools": tools}, indent=1, ensure_ascii=False) + "\n"
    atomic_write_text(Path(TOOLSANDBOX_EXTRACT), text)
    print(f"{len(tools)} tools -> {TOOLSANDBOX_EXTRACT}")


if __name__ == "__main__":
    main()
