"""The TRACE stages wired into the pipeline (glue between config, cache and the library modules)."""

from __future__ import annotations

from tracekit.pipeline import Pipeline


def build_pipeline() -> Pipeline:
    return Pipeline([])
