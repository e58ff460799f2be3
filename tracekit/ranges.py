"""Settings rules written once, by their owner: a settings class declares ``RANGES`` (field -> numeric rule) and
``CHOICES`` (field -> the values a string may take) as class variables, its ``__post_init__`` checks them
(:func:`check_declared`), and :func:`tracekit.validate.validate` walks the config schema collecting the same dicts
(:func:`declared`) for the config group each class backs, so a knob has one rule and one message.

A range is ``"<op> <bound>"`` (``>= 0``, ``> 0``, ``<= 1``) or an interval (``[0, 1)``, ``(0, 1]``). A choice is a
tuple of values, a function giving one (computed when used: a registry's names), or a regular expression (a str)
the whole value must match. A field holding a list (``betas``, ``domains``) is checked element by element; None (an
optional knob left unset) passes. A dotted field (``lora.rank``) names a nested attribute.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

Choice = Union[tuple[str, ...], Callable[[], tuple[str, ...]], str]

# the training recipes' dtype choices (auto: bf16 on GPU, fp32 on CPU): one list for grpo, sft, distill and adp_sft
DTYPES = ("auto", "float32", "bfloat16")


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


def choice_options(rule: Choice) -> tuple[str, ...] | None:
    """The values a choice allows (None for a regular expression)."""
    if isinstance(rule, str):
        return None
    return tuple(rule()) if callable(rule) else tuple(rule)


def choice_ok(value: Any, rule: Choice) -> bool:
    if isinstance(rule, str):
        return isinstance(value, str) and re.fullmatch(rule, value) is not None
    return value in choice_options(rule)


def what_it_must_be_one_of(rule: Choice) -> str:
    return f"of the form {rule}" if isinstance(rule, str) else "one of " + ", ".join(map(str, choice_options(rule)))


def check_choice(key: str, value: Any, rule: Choice) -> None:
    """Raise ``<key>=<value> is invalid: must be one of ...`` (one line) when ``value`` (or an element) is not
    allowed by ``rule``."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if item is not None and not choice_ok(item, rule):
            raise ValueError(f"{key}={value!r} is invalid: must be {what_it_must_be_one_of(rule)}")


def _attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def check_declared(group: str, obj: Any) -> None:
    """The owner's own check: every ``RANGES`` and ``CHOICES`` rule its class declares, on ``obj``'s values (the
    first failure raised as ``<group>.<field>=... is invalid: must be ...``)."""
    check_ranges(group, obj, getattr(type(obj), "RANGES", {}))
    for name, rule in getattr(type(obj), "CHOICES", {}).items():
        check_choice(f"{group}.{name}", _attr(obj, name), rule)


def field_hints(schema: type) -> dict[str, Any]:
    """A settings dataclass's fields and their types (``X | None`` as ``X``; class variables are no fields)."""
    hints = get_type_hints(schema)
    out = {}
    for f in fields(schema):
        hint = hints[f.name]
        if get_origin(hint) is Union or type(hint).__name__ == "UnionType":  # X | None
            hint = next((a for a in get_args(hint) if a is not type(None)), hint)
        out[f.name] = hint
    return out


def declared(schema: type, prefix: str = "") -> tuple[dict[str, str], dict[str, Choice]]:
    """Every rule the settings classes of ``schema`` declare, keyed by the dotted config path of its field (a
    ``dict[str, <dataclass>]`` field's entries as ``*``): what :func:`tracekit.validate.validate` checks. Walks the
    nested dataclasses, so a group's rules are wherever its class is, never in a table of the validator's."""
    ranges = {f"{prefix}{k}": v for k, v in getattr(schema, "RANGES", {}).items()}
    choices = {f"{prefix}{k}": v for k, v in getattr(schema, "CHOICES", {}).items()}
    for name, hint in field_hints(schema).items():
        if is_dataclass(hint):
            sub = declared(hint, f"{prefix}{name}.")
        elif get_origin(hint) is dict and is_dataclass(entry := get_args(hint)[1]):
            sub = declared(entry, f"{prefix}{name}.*.")
        else:
            continue
        ranges.update(sub[0])
        choices.update(sub[1])
    return ranges, choices
