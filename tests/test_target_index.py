"""The targets' index (tracekit/target_index.py, issue 51) is the worlds': every kind's Target, every interface's
functions and every library environment's class resolve; the episode names it lists are the ones the suites give; the
analysis each family names reads that family's episodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tracekit.target_index import ENVIRONMENTS, FAMILIES, INTERFACES, KINDS, kind_of_env, resolve

CONF = Path(__file__).resolve().parent.parent / "conf" / "benchmark"


def test_every_kind_resolves_to_its_target_and_every_family_to_a_kind():
    for kind, entry in KINDS.items():
        assert resolve(entry.target).kind == kind
    assert all(f.analysis in KINDS for f in FAMILIES.values())
    assert {i.family for i in INTERFACES.values()} | {e.family for e in ENVIRONMENTS.values()} <= set(FAMILIES)


def test_every_library_environment_resolves_to_its_class_of_its_family():
    for name, entry in ENVIRONMENTS.items():
        cls = resolve(entry.cls)
        assert cls.name == name and INTERFACES[cls.target].family == entry.family, name


def test_the_episode_names_are_the_suites():
    from tracekit.targets.micro.library import KINDS as MICRO_KINDS
    from tracekit.targets.toolsandbox.suite import DOMAINS

    assert set(KINDS["micro"].envs) == set(MICRO_KINDS)
    assert set(KINDS["toolsandbox"].envs) == {"toolsandbox", *(f"toolsandbox_{d}" for d in DOMAINS)}
    for path in CONF.glob("*.yaml"):  # a coding suite names its episodes by its benchmark's name
        b = yaml.safe_load(path.read_text())
        if b["kind"] in ("coding", "swebench"):
            assert b["name"] in KINDS[b["kind"]].envs, path.name


def test_each_family_is_read_by_its_own_analysis_and_an_unknown_name_is_refused():
    assert {n: kind_of_env(n) for n in ("tau2_retail", "tau2_tool_calling_precision", "toolsandbox_datetime_reasoning",
                                          "coding_minimal_edit", "coding_toolz", "micro_report_value",
                                          "micro_combo_refuse_locked__report_value", "swebench_verified")} == {
        "tau2_retail": "tau2", "tau2_tool_calling_precision": "tau2", "toolsandbox_datetime_reasoning": "toolsandbox",
        "coding_minimal_edit": "coding", "coding_toolz": "coding", "micro_report_value": "micro",
        "micro_combo_refuse_locked__report_value": "micro", "swebench_verified": "swebench"}
    with pytest.raises(KeyError, match="no target names its episodes 'nope'"):
        kind_of_env("nope")
