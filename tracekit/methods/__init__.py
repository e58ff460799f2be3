"""The methods registry: every row family of the paper's tables, by name.

``eval.methods``, the ``method:`` of ``experiments/*.yaml`` rows, the evaluate stage's inputs and
``validate()`` all read :data:`METHODS`. Adding a method: one module defining a :class:`Method`
subclass (its settings class, if any, as its ``settings``: mounted at ``baselines.<name>``, :func:`baselines_schema`),
one entry below, and its defaults in ``conf/baselines/paper.yaml`` if it has settings.

The external baselines (paper Tables 1-3, Figure 4): ``grpo_target``, ``prompt_only``, ``gepa``,
``untargeted_synthetic`` (the runnable AWM control), ``adp_sft``, ``swe_rl`` (the coding target); their settings are ``baselines.*``
(``conf/baselines/paper.yaml``).
"""

from __future__ import annotations

from dataclasses import field, make_dataclass
from functools import cache

from tracekit.methods.adp_sft import AdpSft
from tracekit.methods.base import Method, PolicyRow
from tracekit.methods.base_agent import BaseAgent
from tracekit.methods.gepa import Gepa
from tracekit.methods.grpo_target import GrpoTarget
from tracekit.methods.prompt_only import PromptOnly
from tracekit.methods.single import SingleCapability
from tracekit.methods.swe_rl import SweRl
from tracekit.methods.trace import Trace
from tracekit.methods.untargeted import UntargetedSynthetic

METHODS: dict[str, Method] = {m.name: m for m in (
    BaseAgent(), SingleCapability(), Trace(), GrpoTarget(), PromptOnly(), Gepa(), UntargetedSynthetic(), AdpSft(),
    SweRl(),
)}


@cache
def baselines_schema() -> type:
    """The ``baselines`` group's schema: one field per method with settings, at its name, typed by its class."""
    return make_dataclass("BaselinesConfig", [(name, m.settings, field(default_factory=m.settings))
                                              for name, m in METHODS.items() if m.settings is not None])


def validate_methods(cfg) -> None:
    """Each method's own refusals (one line, ``ConfigError``) for the methods a run evaluates, and for the
    baselines the Figure 4 stage runs when it is a target."""
    names = list(dict.fromkeys(cfg.eval.methods))
    if "figure4" in cfg.stages:
        names += [n for n in ("gepa", "grpo_target") if n not in names]
    for name in names:
        if name in METHODS:  # unknown names are refused by the choices check, with the valid list
            METHODS[name].validate(cfg)


__all__ = ["METHODS", "Method", "PolicyRow", "baselines_schema", "validate_methods"]
