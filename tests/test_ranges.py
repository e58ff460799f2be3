"""One check per knob (issue 31): the recipes' settings classes declare their ranges once; the class and the
config validator both read them, with the same one-line message; the gate's knobs have one default."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from tracekit.analysis.select import Thresholds
from tracekit.analysis.settings import AnalysisSettings
from tracekit.config import ConfigError, MoeConfig
from tracekit.moe.gate import GateTrainConfig
from tracekit.ranges import check_value, field_hints, in_range
from tracekit.rl.distill import DistillSettings
from tracekit.rl.settings import GRPOSettings, LauncherSettings
from tracekit.rl.sft import SFTSettings
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.validate import CHOICES, RANGES, validate


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


# owners declare, validate walks (issue 38): each settings class declares its choices beside its ranges


@pytest.mark.parametrize("settings,group,field,value", [
    (Thresholds, "thresholds", "undefined_er_pos", "never"), (AnalysisSettings, "analysis", "labeler", "oracle"),
    (SynthesisConfig, "synthesis", "source", "web"), (LauncherSettings, "launcher", "kind", "slurm"),
    (GRPOSettings, "grpo", "checkpoint_policy", "none"), (SFTSettings, "consolidation.sft", "dtype", "int8"),
])  # fmt: skip
def test_class_and_config_give_the_same_line_for_a_choice(make_cfg, settings, group, field, value):
    with pytest.raises(ValueError) as by_class:
        settings(**{field: value})
    with pytest.raises(ConfigError) as by_config:
        validate(make_cfg(f"{group}.{field}={value}"))
    options = ", ".join(settings.CHOICES[field])
    assert str(by_config.value) == f"{group}.{field}={value!r} is invalid: must be one of {options}"
    assert str(by_class.value).endswith(f".{field}={value!r} is invalid: must be one of {options}")


def test_validate_holds_no_table_and_names_no_target():
    """Its rules are the owners' (walked from the schema); it imports no target module's names."""
    source = (Path(__file__).parent.parent / "tracekit" / "validate.py").read_text()
    assert "RANGES, CHOICES = declared(config_schema())" in source
    assert not re.search(r'^\s+"[\w.*]+": ("|\(|\w+,)', source, re.M), "a literal rule table in validate.py"
    assert not re.search(r"^from tracekit\.targets\.(?!registry )[\w.]+ import", source, re.M)  # the registry only
    assert not re.search(r"^from tracekit\.coding", source, re.M)


def test_every_rule_is_declared_by_the_class_of_its_group():
    """Each collected rule is found on the class the schema gives its group (no rule without an owner)."""
    owners = {"thresholds": Thresholds, "analysis": AnalysisSettings, "synthesis": SynthesisConfig, "launcher": LauncherSettings}
    for key in [*RANGES, *CHOICES]:
        group, _, name = key.partition(".")
        if group in owners:
            cls = owners[group]
            assert name in {**cls.RANGES, **getattr(cls, "CHOICES", {})}, key


def test_thresholds_are_their_own_schema_in_one_hop():
    """thresholds.delta: YAML -> the Thresholds schema -> select() (no copy between them)."""
    from tracekit.schema import config_schema

    assert dict(field_hints(config_schema()))["thresholds"] is Thresholds
