"""One check per knob (issue 31): the recipes' settings classes declare their ranges once; the class and the
config validator both read them, with the same one-line message; the gate's knobs have one default."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tracekit.config import ConfigError, MoeConfig
from tracekit.moe.gate import GateTrainConfig
from tracekit.ranges import check_value, in_range
from tracekit.rl.distill import DistillSettings
from tracekit.rl.settings import GRPOSettings
from tracekit.rl.sft import SFTSettings
from tracekit.validate import RANGES, validate


@pytest.mark.parametrize("x,rule,ok", [
    (0, ">= 0", True), (-1e-9, ">= 0", False), (0, "> 0", False), (1, "<= 1", True), (1.5, "< 1", False),
    (0, "[0, 1)", True), (1, "[0, 1)", False), (0, "(0, 1]", False), (1, "(0, 1]", True), (0.5, "(0, 1)", True),
])  # fmt: skip
def test_rules(x, rule, ok):
    assert in_range(x, rule) is ok


def test_check_value_names_the_key_and_checks_each_element():
    check_value("k", None, ">= 1")  # an optional knob left unset passes
    with pytest.raises(ValueError, match=r"^grpo\.betas=\(0\.9, 1\.0\) is invalid: must be in \[0, 1\)$"):
        check_value("grpo.betas", (0.9, 1.0), "[0, 1)")


@pytest.mark.parametrize("group,settings", [
    ("grpo", GRPOSettings), ("moe", GateTrainConfig), ("consolidation.sft", SFTSettings),
    ("consolidation.distill", DistillSettings), ("baselines.adp_sft", SFTSettings),
])  # fmt: skip
def test_the_validator_reads_each_recipes_own_ranges(group, settings):
    assert {f"{group}.{k}": v for k, v in settings.RANGES.items()}.items() <= RANGES.items()


@pytest.mark.parametrize("settings,group,field,value", [
    (GRPOSettings, "grpo", "max_grad_norm", -1.0), (GRPOSettings, "grpo", "max_prompt_tokens", 100),
    (SFTSettings, "consolidation.sft", "warmup_ratio", 1.0), (DistillSettings, "consolidation.distill", "top_p", 0.0),
    (GateTrainConfig, "moe", "steps", 0),
])  # fmt: skip
def test_class_and_config_give_the_same_line(make_cfg, settings, group, field, value):
    with pytest.raises(ValueError) as by_class:
        settings(**{field: value})
    with pytest.raises(ConfigError) as by_config:
        validate(make_cfg(f"{group}.{field}={value}"))
    rule = settings.RANGES[field]
    assert str(by_config.value) == f"{group}.{field}={value!r} is invalid: must be " + (
        rule if rule[0] in "<>" else f"in {rule}")
    assert str(by_class.value).split("=")[0].endswith(field) and str(by_class.value).endswith(rule)


def test_one_name_for_the_gradient_clip(make_cfg):
    assert all("max_grad_norm" in {f.name for f in fields(s)} for s in (GRPOSettings, SFTSettings, DistillSettings,
                                                                        GateTrainConfig))
    with pytest.raises(ConfigError, match=r"unknown key grpo\.grad_clip"):
        validate(make_cfg("+grpo.grad_clip=1.0"))


def test_the_moe_group_is_the_gate_trainers_knobs_plus_routing():
    gate = {f.name: f.default for f in fields(GateTrainConfig)}
    moe = {f.name: f.default for f in fields(MoeConfig)}
    assert gate.items() <= moe.items()  # one name and one default per knob
    assert not {"pad_id", "seed"} & moe.keys()  # runtime values (the tokenizer's, the stage's seed), not knobs
