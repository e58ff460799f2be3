"""The targets' index (issue 51): plain data naming where each world's parts live, so the generic layers find a world
by name without importing it. Each target is one folder, ``tracekit/targets/<kind>/``; this module names its
``Target`` (by ``benchmark.kind``), the ``env`` its suites give their episodes, the interfaces synthesized environments
keep (by the name a library environment's ``target`` holds), each library family's analysis, and every library
environment's class. It imports nothing of tracekit (it is a bottom layer of ``.importlinter``): a reference is a
``"module:attribute"`` string under ``tracekit.targets``, imported when it is first looked up (tau^2's modules load
the benchmark, seconds), never at import time.

Adding a target: its folder and one line in :data:`KINDS` (with a synthesis interface or library environments, their
lines in :data:`INTERFACES`, :data:`FAMILIES` and :data:`ENVIRONMENTS`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

PACKAGE = "tracekit.targets"


@dataclass(frozen=True)
class Kind:
    """One ``benchmark.kind``: its ``Target`` class, and the ``env`` names its suites give their episodes (reference
    analysis finds the target of a rollout by them; a library target's episodes are named by their environment)."""

    target: str  # "module:Class" under tracekit.targets
    envs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Family:
    """A family of library environments (the environments that keep one target's tools): the kind whose reference
    dictionary and labeler read its episodes, and the modules a synthesis sandbox imports before a generated
    environment of the family (a module its environments import: loaded before the sandbox's limits apply)."""

    analysis: str  # a KINDS key
    preload: tuple[str, ...] = ()  # full module names


@dataclass(frozen=True)
class Interface:
    """An interface synthesized environments keep: its family, and functions giving its tool schemas (name -> OpenAI
    function schema) and its policy text. Plain data and the standard library only (the sandbox reads them)."""

    family: str  # a FAMILIES key
    tools: str  # "module:function" under tracekit.targets
    policy: str  # "module:function" under tracekit.targets


@dataclass(frozen=True)
class Environment:
    """A library environment (a ``SyntheticEnv`` for one capability): its family and its class."""

    family: str  # a FAMILIES key
    cls: str  # "module:Class" under tracekit.targets


_TOOLSANDBOX_DOMAINS = ("base", "3_distraction_tools", "10_distraction_tools", "all_tools",
                        "3_distraction_tools_tool_description_scrambled", "3_distraction_tools_arg_type_scrambled",
                        "3_distraction_tools_arg_description_scrambled", "3_distraction_tools_tool_name_scrambled")
_MICRO_KINDS = ("lookup_by_name__finish_all_writes", "lookup_by_name__refuse_locked", "lookup_by_name__report_value",
                "finish_all_writes__refuse_locked", "refuse_locked__report_value", "finish_all_writes__report_value",
                "lookup_by_name__refuse_locked__finish_all_writes", "lookup_by_name__refuse_locked__report_value",
                "refuse_locked__finish_all_writes__report_value")

# benchmark.kind -> its Target (docs/ARCHITECTURE.md's targets registry; tests/test_docs_registries.py holds the two)
KINDS: dict[str, Kind] = {
    "tau2": Kind("tau2.target:Tau2Target", ("tau2_airline", "tau2_retail")),
    "synthetic": Kind("synthetic.target:LibraryTarget"),
    "toolsandbox": Kind("toolsandbox.target:ToolSandboxTarget",
                        ("toolsandbox", *(f"toolsandbox_{d}" for d in _TOOLSANDBOX_DOMAINS))),
    "coding": Kind("coding.target:CodingTarget", ("coding", "coding_toolz")),  # issue 20: local SWE-smith-style tasks
    "swebench": Kind("swebench.target:SweBenchTarget", ("swebench", "swebench_verified")),  # issue 20: the harness
    "micro": Kind("micro.target:MicroTarget", tuple(f"micro_combo_{k}" for k in _MICRO_KINDS)),  # issue 42, 53
}

# library family -> its analysis and sandbox preloads (the family strings are part of stage keys: never rename one)
FAMILIES: dict[str, Family] = {
    "tau2": Family("tau2", ("tracekit.targets.tau2.library.common", "tracekit.synthesis.targets",
                            "tau2.domains.airline.tools", "tau2.domains.retail.tools")),
    "toolsandbox": Family("toolsandbox"),
    "coding": Family("coding"),
    "micro": Family("micro"),
}

# interface name (a library environment's ``target``, synthesis's target) -> its family and functions
INTERFACES: dict[str, Interface] = {
    "tau2_airline": Interface("tau2", "tau2.interface:airline_tools", "tau2.interface:airline_policy"),
    "tau2_retail": Interface("tau2", "tau2.interface:retail_tools", "tau2.interface:retail_policy"),
    "toolsandbox": Interface("toolsandbox", "toolsandbox.interface:toolsandbox_tools",
                             "toolsandbox.interface:toolsandbox_policy"),
    "coding": Interface("coding", "coding.interface:coding_tools", "coding.interface:coding_policy"),  # issue 20
    "micro": Interface("micro", "micro.interface:micro_tools", "micro.interface:micro_policy"),  # issue 42
}

# library environment name (part of stage keys: never rename one) -> its family and class, in library order
ENVIRONMENTS: dict[str, Environment] = {
    "tau2_structured_data_reasoning": Environment("tau2", "tau2.library.structured_data_reasoning:StructuredDataReasoning"),
    "tau2_tool_calling_precision": Environment("tau2", "tau2.library.tool_calling_precision:ToolCallingPrecision"),
    "tau2_multi_step_task_completion": Environment("tau2", "tau2.library.multi_step_task_completion:MultiStepTaskCompletion"),
    "tau2_precondition_verification": Environment("tau2", "tau2.library.precondition_verification:PreconditionVerification"),
    "toolsandbox_permission_error_recovery": Environment(
        "toolsandbox", "toolsandbox.library.permission_error_recovery:PermissionErrorRecovery"),
    "toolsandbox_datetime_reasoning": Environment("toolsandbox", "toolsandbox.library.datetime_reasoning:DatetimeReasoning"),
    "coding_fault_localization": Environment("coding", "coding.library.fault_localization:CodingFaultLocalization"),
    "coding_minimal_edit": Environment("coding", "coding.library.minimal_edit:CodingMinimalEdit"),
    "coding_test_before_submit": Environment("coding", "coding.library.test_before_submit:CodingTestBeforeSubmit"),
    "micro_lookup_by_name": Environment("micro", "micro.library:MicroLookupByName"),
    "micro_refuse_locked": Environment("micro", "micro.library:MicroRefuseLocked"),
    "micro_finish_all_writes": Environment("micro", "micro.library:MicroFinishAllWrites"),
    "micro_report_value": Environment("micro", "micro.library:MicroReportValue"),
    "micro_write_by_id": Environment("micro", "micro.library:MicroWriteById"),
}

# module paths environment packages cached before issue 51 import (a generated environment imports its family's
# library module as the example it was shown does): the synthesis sandbox serves them under their old names
MOVED_MODULES: dict[str, str] = {
    "tracekit.synthesis.library.tau2_common": "tracekit.targets.tau2.library.common",
    "tracekit.synthesis.library.toolsandbox_common": "tracekit.targets.toolsandbox.library.common",
    "tracekit.synthesis.library.coding_common": "tracekit.targets.coding.library.common",
    "tracekit.synthesis.library.micro": "tracekit.targets.micro.library",
    "tracekit.synthesis.micro_interface": "tracekit.targets.micro.interface",
    "tracekit.envs.toolsandbox_interface": "tracekit.targets.toolsandbox.interface",
    "tracekit.coding.interface": "tracekit.targets.coding.interface",
}


def resolve(ref: str) -> Any:
    """The attribute a ``"module:attribute"`` reference under ``tracekit.targets`` names (importing its module)."""
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(f"{PACKAGE}.{module}"), attr)


def kind_of_env(env: str) -> str:
    """The kind whose reference analysis reads episodes of ``env``: a library environment's family's analysis, else the
    kind whose suites name their episodes ``env`` (an unknown name: KeyError naming the known ones)."""
    if env in ENVIRONMENTS:
        return FAMILIES[ENVIRONMENTS[env].family].analysis
    for kind, entry in KINDS.items():
        if env in entry.envs:
            return kind
    known = [*ENVIRONMENTS, *(e for k in KINDS.values() for e in k.envs)]
    raise KeyError(f"no target names its episodes {env!r} (tracekit/target_index.py knows: {', '.join(known)})")
