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

_MODULES = {
    "tau2_structured_data_reasoning": ("structured_data_reasoning", "StructuredDataReasoning"),
    "tau2_tool_calling_precision": ("tool_calling_precision", "ToolCallingPrecision"),
    "tau2_multi_step_task_completion": ("multi_step_task_completion", "MultiStepTaskCompletion"),
    "tau2_precondition_verification": ("precondition_verification", "PreconditionVerification"),
    "toolsandbox_permission_error_recovery": ("permission_error_recovery", "PermissionErrorRecovery"),
    "toolsandbox_datetime_reasoning": ("datetime_reasoning", "DatetimeReasoning"),
    "coding_fault_localization": ("coding_fault_localization", "CodingFaultLocalization"),
    "coding_minimal_edit": ("coding_minimal_edit", "CodingMinimalEdit"),
    "coding_test_before_submit": ("coding_test_before_submit", "CodingTestBeforeSubmit"),
    "micro_lookup_by_name": ("micro", "MicroLookupByName"),
    "micro_refuse_locked": ("micro", "MicroRefuseLocked"),
    "micro_finish_all_writes": ("micro", "MicroFinishAllWrites"),
    "micro_report_value": ("micro", "MicroReportValue"),
    "micro_write_by_id": ("micro", "MicroWriteById"),
}
LIBRARY_NAMES = tuple(_MODULES)


def library_env(name: str) -> type[SyntheticEnv]:
    """The class of built-in environment ``name`` (imported on demand: the tau^2 ones import tau2)."""
    if name not in _MODULES:
        raise KeyError(f"no built-in synthetic environment {name!r}; known: {', '.join(LIBRARY_NAMES)}")
    module, cls = _MODULES[name]
    return getattr(__import__(f"{__name__}.{module}", fromlist=[cls]), cls)


def _target_family(target: str) -> str:
    return "tau2" if target.startswith("tau2") else target


def find_library_env(capability: str, target: str | None = None) -> type[SyntheticEnv] | None:
    """The built-in environment for ``capability`` (snake_case or spaced) on ``target``'s family, if any."""
    wanted = capability.strip().lower().replace(" ", "_").replace("-", "_")
    found = [library_env(n) for n in LIBRARY_NAMES if library_env(n).capability == wanted]
    if target is not None:
        found = [c for c in found if _target_family(c.target) == _target_family(target)]
    return found[0] if found else None


def library_source(name: str) -> str:
    """Source text of a built-in environment module (shown to the generation agent as an example)."""
    return Path(inspect.getfile(library_env(name))).read_text(encoding="utf-8")
