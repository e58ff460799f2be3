"""Built-in reference environments, one per capability the paper names (Appendix J).

tau^2 (real airline/retail tools and data models over small generated databases): structured data reasoning,
tool calling precision, multi-step task completion, precondition verification. ToolSandbox-shaped: permission
error recovery, datetime reasoning. Micro (the micro world's find/read/write store, issue 42): lookup by name,
refuse locked, finish all writes, report value, write by id. Coding (the coding target's bash/submit tools over a
generated package): fault localization, minimal edit, test before submit. They are the offline default of the synthesize stage and the examples the
generation agent is shown.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from tracekit.synthesis.protocol import SyntheticEnv
from tracekit.synthesis.targets import target_family

# name -> (module, class, family): the family is the library family of the environment's target
# (:func:`tracekit.synthesis.targets.target_family` of its class's ``target``; a test holds the two equal), declared
# here so that a family's environments are known without importing them (the tau^2 ones import tau2)
_MODULES = {
    "tau2_structured_data_reasoning": ("structured_data_reasoning", "StructuredDataReasoning", "tau2"),
    "tau2_tool_calling_precision": ("tool_calling_precision", "ToolCallingPrecision", "tau2"),
    "tau2_multi_step_task_completion": ("multi_step_task_completion", "MultiStepTaskCompletion", "tau2"),
    "tau2_precondition_verification": ("precondition_verification", "PreconditionVerification", "tau2"),
    "toolsandbox_permission_error_recovery": ("permission_error_recovery", "PermissionErrorRecovery", "toolsandbox"),
    "toolsandbox_datetime_reasoning": ("datetime_reasoning", "DatetimeReasoning", "toolsandbox"),
    "coding_fault_localization": ("coding_fault_localization", "CodingFaultLocalization", "coding"),
    "coding_minimal_edit": ("coding_minimal_edit", "CodingMinimalEdit", "coding"),
    "coding_test_before_submit": ("coding_test_before_submit", "CodingTestBeforeSubmit", "coding"),
    "micro_lookup_by_name": ("micro", "MicroLookupByName", "micro"),
    "micro_refuse_locked": ("micro", "MicroRefuseLocked", "micro"),
    "micro_finish_all_writes": ("micro", "MicroFinishAllWrites", "micro"),
    "micro_report_value": ("micro", "MicroReportValue", "micro"),
    "micro_write_by_id": ("micro", "MicroWriteById", "micro"),
}
LIBRARY_NAMES = tuple(_MODULES)


def _known(name: str) -> tuple[str, str, str]:
    if name not in _MODULES:
        raise KeyError(f"no built-in synthetic environment {name!r}; known: {', '.join(LIBRARY_NAMES)}")
    return _MODULES[name]


def library_env(name: str) -> type[SyntheticEnv]:
    """The class of built-in environment ``name`` (imported on demand: the tau^2 ones import tau2)."""
    module, cls, _ = _known(name)
    return getattr(__import__(f"{__name__}.{module}", fromlist=[cls]), cls)


def library_family(name: str) -> str:
    """The library family of built-in environment ``name`` (``tau2``, ``toolsandbox``, ``coding``, ``micro``), without
    importing it."""
    return _known(name)[2]


def family_environments(family: str) -> tuple[str, ...]:
    """The built-in environments of library family ``family``, in library order (none for an unknown family)."""
    return tuple(n for n in LIBRARY_NAMES if _MODULES[n][2] == family)


_target_family = target_family  # the family of a target's interface: the table of tracekit.synthesis.targets


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
