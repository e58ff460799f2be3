"""The library of reference environments, one per capability the paper names (Appendix J), found through the targets'
index (:data:`tracekit.target_index.ENVIRONMENTS`): each lives in its world's folder
(``tracekit/targets/<kind>/library/``). tau^2 (real airline/retail tools and data models over small generated
databases): structured data reasoning, tool calling precision, multi-step task completion, precondition verification.
ToolSandbox-shaped: permission error recovery, datetime reasoning. Micro (the micro world's find/read/write store, issue
42): lookup by name, refuse locked, finish all writes, report value, write by id. Coding (the coding target's
bash/submit tools over a generated package): fault localization, minimal edit, test before submit. They are the offline
default of the synthesize stage and the examples the generation agent is shown.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from tracekit.synthesis.protocol import SyntheticEnv
from tracekit.synthesis.targets import target_family
from tracekit.target_index import ENVIRONMENTS, Environment, resolve

LIBRARY_NAMES = tuple(ENVIRONMENTS)


def _known(name: str) -> Environment:
    if name not in ENVIRONMENTS:
        raise KeyError(f"no built-in synthetic environment {name!r}; known: {', '.join(LIBRARY_NAMES)}")
    return ENVIRONMENTS[name]


def library_env(name: str) -> type[SyntheticEnv]:
    """The class of built-in environment ``name`` (imported on demand: the tau^2 ones import tau2)."""
    return resolve(_known(name).cls)


def library_family(name: str) -> str:
    """The library family of built-in environment ``name`` (``tau2``, ``toolsandbox``, ``coding``, ``micro``), without
    importing it."""
    return _known(name).family


def family_environments(family: str) -> tuple[str, ...]:
    """The built-in environments of library family ``family``, in library order (none for an unknown family)."""
    return tuple(n for n in LIBRARY_NAMES if ENVIRONMENTS[n].family == family)


def find_library_env(capability: str, target: str | None = None) -> type[SyntheticEnv] | None:
    """The built-in environment for ``capability`` (snake_case or spaced) on ``target``'s family, if any."""
    wanted = capability.strip().lower().replace(" ", "_").replace("-", "_")
    found = [library_env(n) for n in LIBRARY_NAMES if library_env(n).capability == wanted]
    if target is not None:
        found = [c for c in found if target_family(c.target) == target_family(target)]
    return found[0] if found else None


def library_source(name: str) -> str:
    """Source text of a built-in environment module (shown to the generation agent as an example)."""
    return Path(inspect.getfile(library_env(name))).read_text(encoding="utf-8")
