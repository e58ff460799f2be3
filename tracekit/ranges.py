"""Value ranges written once: a settings class declares ``RANGES`` (field -> rule), its ``__post_init__`` checks
them, and ``tracekit.validate`` reads the same dict for the config group the class backs, so a knob has one check.

A rule is ``"<op> <bound>"`` (``>= 0``, ``> 0``, ``<= 1``) or an interval (``[0, 1)``, ``(0, 1]``). A field
holding a list (``betas``) is checked element by element; None (an optional knob left unset) passes.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

# the training recipes' dtype choices (auto: bf16 on GPU, fp32 on CPU): one list for grpo, sft, distill and adp_sft
DTYPES = ("auto", "float32", "bfloat16")


def one_of(options: tuple[str, ...]) -> str:
    """``a, b or c``: how a message names the choices."""
    return ", ".join(options[:-1]) + " or " + options[-1] if len(options) > 1 else options[0]


BOUND_OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


def in_range(x: float, rule: str) -> bool:
    if rule[0] in "[(":
        lo, hi = (float(v) for v in rule[1:-1].split(","))
        return (lo <= x if rule[0] == "[" else lo < x) and (x <= hi if rule[-1] == "]" else x < hi)
    op, bound = rule.split()
    return BOUND_OPS[op](x, float(bound))


def what_it_must_be(rule: str) -> str:
    return rule if rule[0] in "<>" else f"in {rule}"


def check_value(key: str, value: Any, rule: str) -> None:
    """Raise ``<key>=<value> is invalid: must be <rule>`` (one line) when ``value`` (or an element) breaks ``rule``."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and not in_range(item, rule):
            raise ValueError(f"{key}={value!r} is invalid: must be {what_it_must_be(rule)}")


def check_ranges(group: str, obj: Any, ranges: Mapping[str, str]) -> None:
    """:func:`check_value` on each field of ``obj`` named in ``ranges`` (first failure raised, as
    ``<group>.<field>=...``). Dotted fields (``lora.rank``) read nested attributes."""
    for name, rule in ranges.items():
        value = obj
        for part in name.split("."):
            value = getattr(value, part)
        check_value(f"{group}.{name}", value, rule)
