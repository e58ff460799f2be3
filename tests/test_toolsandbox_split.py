"""ToolSandbox's training split (``benchmark.toolsandbox.train_split``, :mod:`tracekit.targets.toolsandbox.target`): ``heldout`` (a seeded
category-stratified half of the base scenarios, never evaluated) and ``eval`` (the evaluated scenarios, the rows
marked so); its checks before any work, its place in the cache keys, the planning of the paper's ToolSandbox rows
(fast, from the committed scenario catalog); and GRPO on target end to end under both, on the real ToolSandbox
(skipped, naming the install step, where its virtual environment is not built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests import procs
from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.targets.toolsandbox.suite import missing_environment
from tracekit.targets.registry import target
from tracekit.targets.toolsandbox.target import (
    EVAL_NOTE,
    TRAIN_SPLITS,
    catalog,
    excluded_from_evaluation,
    heldout_train_scenarios,
    stratum,
)

ROOT = Path(__file__).resolve().parent.parent
NO_VENV = missing_environment()
needs_venv = pytest.mark.skipif(NO_VENV is not None, reason=str(NO_VENV))


@pytest.fixture
def venv_present(monkeypatch, tmp_path):
    """A stand-in ToolSandbox environment (only its interpreter's presence is checked by validate())."""
    if NO_VENV is None:
        return
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    monkeypatch.setenv("TOOLSANDBOX_VENV", str(tmp_path / "venv"))


def _ts(make_cfg, *overrides):
    return make_cfg("experiment=embedded", "benchmark=toolsandbox", "eval.methods=[base,grpo_target]", *overrides)


# ---------------------------------------------------------------------------------------------- the split


def test_the_catalog_holds_the_129_base_scenarios_with_their_categories():
    rows = catalog()
    assert len(rows) == 129 and len({r["name"] for r in rows}) == 129
    assert all("NO_DISTRACTION_TOOLS" in r["categories"] and stratum(r) for r in rows)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_heldout_is_a_seeded_half_stratified_by_category(seed):
    rows = catalog()
    train = set(heldout_train_scenarios(seed))
    assert len(train) == round(len(rows) / 2) and train <= {r["name"] for r in rows}
    assert heldout_train_scenarios(seed) == heldout_train_scenarios(seed)  # deterministic in the seed
    by = Counter(stratum(r) for r in rows)
    got = Counter(stratum(r) for r in rows if r["name"] in train)
    for k, n in by.items():  # every stratum (category set) split in half, an odd one rounded either way
        assert got[k] in (n // 2, (n + 1) // 2), (k, n, got[k])
    for c in {c for r in rows for c in stratum(r)}:  # so every category is, within its strata's roundings
        n = sum(c in r["categories"] for r in rows)
        t = sum(c in r["categories"] for r in rows if r["name"] in train)
        odd = sum(1 for k, m in by.items() if c in k and m % 2)
        assert abs(t - n / 2) <= odd / 2 + 1e-9, (c, n, t)


def test_heldout_depends_on_the_seed():
    assert heldout_train_scenarios(0) != heldout_train_scenarios(1)


def test_heldout_never_trains_on_an_evaluated_scenario(make_cfg, venv_present):
    cfg = _ts(make_cfg)
    validate(cfg)
    t = target("toolsandbox")
    train, evaluated = set(t.training_scenarios(cfg)), set(t.evaluated_scenarios(cfg))
    assert train and evaluated and not train & evaluated
    assert train | evaluated == {r["name"] for r in catalog()}
    assert set(excluded_from_evaluation(cfg.benchmark)) == train  # what the evaluation suite drops
    from tracekit.methods.target_train import train_suite_spec

    spec = train_suite_spec(cfg, limit=2)
    assert set(spec["scenarios"]) == train and spec["limit"] == 2 and "evaluated" not in spec
    own = spec["benchmark"]["toolsandbox"]
    assert (own["train_split"], own["train_seed"]) == ("heldout", 0)
    assert t.train_split_notes(spec) == () and "never evaluated" in t.train_split_label(spec)


def test_eval_trains_on_exactly_the_evaluated_scenarios_and_marks_the_rows(make_cfg, venv_present):
    from tracekit.methods.target_train import train_suite_spec

    t = target("toolsandbox")
    cfg = _ts(make_cfg, "benchmark.toolsandbox.train_split=eval")
    validate(cfg)
    assert t.training_scenarios(cfg) == t.evaluated_scenarios(cfg) == [r["name"] for r in catalog()]
    assert excluded_from_evaluation(cfg.benchmark) == []
    picked = ["get_cellular", "cellular_off"]
    sub = _ts(make_cfg, "benchmark.toolsandbox.train_split=eval", f"benchmark.task_ids=[{','.join(picked)}]")
    validate(sub)
    spec = train_suite_spec(sub, limit=None)
    assert sorted(spec["scenarios"]) == sorted(picked) and spec["evaluated"]["task_ids"] == picked
    assert t.train_split_notes(spec) == (EVAL_NOTE,) and "train_split=eval" in t.train_split_label(spec)


def test_the_split_name_and_seed_are_in_the_training_and_evaluation_keys(make_cfg, venv_present):
    from tracekit.methods.target_train import train_suite_spec
    from tracekit.stages import build_pipeline
    from tracekit.types import stable_hash

    pipe = build_pipeline()
    cfgs = [_ts(make_cfg), _ts(make_cfg, "benchmark.toolsandbox.train_seed=1"), _ts(make_cfg, "benchmark.toolsandbox.train_split=eval")]
    specs = [stable_hash(train_suite_spec(c, limit=2)) for c in cfgs]
    assert len(set(specs)) == 3  # what trains on the split (grpo_target's target_train spec, GEPA's reads)
    keys = [pipe.key(c, pipe.stages["rollout"], {}) for c in cfgs]
    assert len(set(keys)) == 3  # the evaluated scenarios depend on it too (heldout drops the training half)
    for stage in ("grpo_target", "gepa"):
        assert "benchmark.toolsandbox" in pipe.reads(cfgs[0], stage)
    # the other targets' keys and training identities do not carry ToolSandbox's settings (benchmark.<kind>)
    smoke = make_cfg("experiment=smoke")
    assert "toolsandbox" not in train_suite_spec(smoke)["benchmark"]
    assert not any(r.startswith("benchmark.toolsandbox") for r in pipe.reads(smoke, "rollout"))


@pytest.mark.parametrize("bad, says", [
    ("benchmark.toolsandbox.train_split=nope", "benchmark.toolsandbox.train_split='nope' is invalid: must be one of heldout, eval"),
    ("benchmark.limit=0", "benchmark.limit"),
    ("benchmark.task_ids=[add_reminder_content_and_date_and_time_alt]", "training scenarios of benchmark.toolsandbox.train_split=heldout"),
    ("benchmark.toolsandbox.train_domains=[base]", "benchmark.toolsandbox.train_domains"),
])
def test_bad_split_settings_are_one_config_error_line(make_cfg, venv_present, bad, says):
    assert "add_reminder_content_and_date_and_time_alt" in heldout_train_scenarios(0)
    with pytest.raises(ConfigError) as e:
        validate(_ts(make_cfg, bad))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_split_that_leaves_no_training_scenario_is_refused(make_cfg, venv_present, monkeypatch):
    import tracekit.targets.toolsandbox.target as ts

    monkeypatch.setattr(ts, "heldout_train_scenarios", lambda seed, *a, **k: [])
    with pytest.raises(ConfigError, match="leaves no training scenario") as e:
        validate(_ts(make_cfg))
    assert "\n" not in str(e.value)
    assert TRAIN_SPLITS.keys() == {"heldout", "eval"}


def test_the_paper_target_is_the_full_129_only_under_eval(make_cfg):
    from tracekit.report.paper import describe_target, target_cut

    full = ("benchmark=toolsandbox", "benchmark.limit=null")  # the embedded default cuts the scenarios
    assert target_cut(make_cfg(*full, "benchmark.toolsandbox.train_split=eval")) is None
    cfg = make_cfg(*full)
    assert target_cut(cfg) is not None
    assert "64 base scenarios held out for training (train_split=heldout, seed 0)" in describe_target(cfg.benchmark)


def test_every_toolsandbox_row_of_the_paper_plans(venv_present):
    """Tables 3, 7, 8 and Figure 5: every row composes and validates (GRPO on target and GEPA included); only the
    ADP rows (no ADP data configured) may be refused."""
    from tracekit.reproduce.runner import check_all

    lines = check_all(["table3", "table7", "table8", "figure5"])
    for line in lines:
        assert ": ok (" in line or ("cannot run" in line and "adp_sft" in line and "'ADP'" in line), line


# ---------------------------------------------------------------------------------------------- end to end


@needs_venv
def test_the_catalog_is_what_the_real_toolsandbox_lists():
    from tracekit.targets.toolsandbox.suite import ToolSandboxServer

    server = ToolSandboxServer()
    try:
        rows = server.request("scenarios", variants=[])
    finally:
        server.stop()
    real = [{"name": r["name"], "categories": sorted(r["categories"]), "rapidapi": sorted(r["rapidapi"])} for r in rows]
    assert real == list(catalog())  # else: python scripts/extract_toolsandbox_scenarios.py


@needs_venv
def test_the_training_suites_hold_the_split_scenarios(make_cfg):
    from tracekit.methods.target_train import open_target_train, train_suite_spec

    t = target("toolsandbox")
    cfg = make_cfg("benchmark=toolsandbox")
    evaluated = t.build_suite(cfg, None, None)
    train = open_target_train(train_suite_spec(cfg, limit=2))
    try:
        ids = [x.id for x in train.tasks()]
        assert len(ids) == 2 and set(ids) <= set(heldout_train_scenarios(0))
        assert not set(ids) & {x.id for x in evaluated.tasks()} and not set(ids) & set(t.evaluated_scenarios(cfg))
    finally:
        train.close()
        evaluated.close()


def _cli(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "offline"}
    out = procs.run([sys.executable, "-m", "tracekit", "experiment=smoke", "benchmark=toolsandbox",
                     "eval.methods=[base,grpo_target]", "baselines.grpo_target.episodes=4",
                     "baselines.grpo_target.train_limit=2", *overrides],
                     cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@needs_venv
@pytest.mark.slow
@pytest.mark.parametrize("split", ["heldout", "eval"])
def test_grpo_on_target_runs_end_to_end_on_two_training_scenarios(tmp_path, split):
    out = _cli(tmp_path, f"benchmark.toolsandbox.train_split={split}")
    (art,) = (tmp_path / "cache" / "grpo_target").glob("*/grpo_target.json")
    r = json.loads(art.read_text())
    spec = r["train_suite"]
    assert spec["benchmark"]["train_split"] == split and spec["limit"] == 2 and r["budget"]["episodes"] == 4
    (run,) = sorted((tmp_path / "outputs" / "runs").glob("*"))[-1:]
    results = json.loads((run / "results.json").read_text())
    notes = results["GRPO on Target"]["notes"]
    if split == "eval":
        assert EVAL_NOTE in notes and "| GRPO on Target |" in out.stdout
        assert set(spec["scenarios"]) == {r["name"] for r in catalog()}
    else:
        assert EVAL_NOTE not in notes and any("never evaluated" in n for n in notes)
        assert set(spec["scenarios"]) == set(heldout_train_scenarios(0))
