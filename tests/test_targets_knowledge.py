"""What only a target knows, asked of the target (:mod:`tracekit.targets`), not branched on ``benchmark.kind``
elsewhere: the paper's task set a run is compared with, what a benchmark config runs, whether tau^2's LLM user is
the paper's, which targets carry gold patches (``swe_rl``), how many environments the training seeds are spread
over (GEPA), and the training split's label on a GRPO-on-target row."""

from __future__ import annotations

import pytest

from tracekit.config import ConfigError
from tracekit.targets.registry import kinds, target


def test_the_paper_task_sets_are_the_targets():
    assert target("tau2").paper_tasks.startswith("tau^2-Bench airline + retail")
    assert target("toolsandbox").paper_tasks == "ToolSandbox: 129 base scenarios"
    assert target("swebench").paper_tasks == "SWE-bench Verified: 500 instances"
    assert target("coding").paper_tasks is None  # the paper uses no local coding tasks: nothing to compare


def test_cuts_and_descriptions_come_from_the_target(make_cfg):
    from tracekit.report.paper import _is_tau2, describe_target, target_cut

    full = make_cfg("benchmark=tau2", "benchmark.limit=null", "benchmark.split=base")
    assert target_cut(full) is None and _is_tau2(full)
    one = make_cfg("benchmark=tau2_airline", "benchmark.limit=null", "benchmark.split=base")
    assert target_cut(one).paper == target("tau2").paper_tasks
    mini = make_cfg("benchmark=tau2_mini")
    assert target_cut(mini).paper == target("tau2").paper_tasks and _is_tau2(mini)  # tau^2's stand-in
    assert describe_target(mini.benchmark).startswith("tau2_mini (synthetic: ")
    ts = make_cfg("benchmark=toolsandbox")
    assert not _is_tau2(ts) and target_cut(make_cfg("benchmark=coding_toolz")) is None


def test_swe_rl_refuses_a_target_without_gold_patches_naming_those_with(make_cfg):
    from tracekit.methods import METHODS

    assert [k for k in kinds() if target(k).patch_reward] == ["coding", "swebench"]
    with pytest.raises(ConfigError, match=r"benchmark.kind=coding or swebench \(got synthetic, tau2_mini\)"):
        METHODS["swe_rl"].validate(make_cfg("benchmark=tau2_mini"))


def test_gepa_spreads_its_training_seeds_over_the_targets_environments(make_cfg):
    from tracekit.methods.gepa import OFFICIAL_TRAIN_SEEDS, training_spec

    mini = make_cfg("benchmark=tau2_mini")
    n = len(mini.benchmark.synthetic.envs)
    assert target("synthetic").train_envs(mini) == n and target("tau2").train_envs(mini) == 1
    assert training_spec(mini)["n_per_env"] == -(-OFFICIAL_TRAIN_SEEDS // n)


@pytest.mark.parametrize("kind, says", [("synthetic", "library environments' training seeds"),
                                        ("coding", "local coding train split (toolz)"),
                                        ("tau2", "tau^2 train split")])
def test_a_grpo_on_target_row_names_its_targets_training_split(kind, says):
    spec = {"benchmark": {"kind": kind, "coding": {"package": "toolz"}}}
    assert target(kind).train_split_label(spec) == says
    assert target("swebench").train_spec(None, {"benchmark": {"kind": "swebench"}}, None, 3)["benchmark"]["kind"] == "coding"
