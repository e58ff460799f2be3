"""The methods registry: every row family of the paper's tables, by name.

``eval.methods``, the ``method:`` of ``experiments/*.yaml`` rows, the evaluate stage's inputs and
``validate()`` all read :data:`METHODS`. Adding a method: one module defining a :class:`Method`
subclass, one entry below (and a config file under ``conf/`` if it has settings).
"""

from __future__ import annotations

from tracekit.methods.base import Budget, Method, Policy, PolicyRow
from tracekit.methods.base_agent import BaseAgent
from tracekit.methods.single import SingleCapability
from tracekit.methods.trace import Trace

METHODS: dict[str, Method] = {m.name: m for m in (BaseAgent(), SingleCapability(), Trace())}

__all__ = ["METHODS", "Budget", "Method", "Policy", "PolicyRow"]
