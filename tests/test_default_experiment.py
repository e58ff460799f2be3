"""The default experiment (issue 50): `python -m tracekit` is the micro world's ladder (experiment=micro_ladder),
built on experiment=micro with its cuts named, from the shipped warm start, and it learns.

Which test holds learning, and why this way: the default's full fresh run takes ~6-10 minutes on 2 cores, far over
the fast suite's budget, so it is `test_the_default_run_learns` (slow). The fast suite holds it in two steps that fail
as soon as either stops being true:
- `test_the_measured_default_run_is_todays_default_and_learned`: the committed measurement of a fresh default run
  (benchmarks/results/default_run/: its jobs' artifacts.json and the side-by-side results.json) computed what
  today's default computes, stage key for stage key (every value a stage reads), and its table shows TRACE above
  Base with the paired 95% CI above 0; a change to what the default computes fails it until it is measured again;
- `test_the_shipped_warm_start_is_the_defaults`: the shipped warm start the measurement started from is the one the
  default installs (its key and every file's sha256).
The default's stage keys up to compose are experiment=micro's (`test_the_default_computes_what_micro_computes`), but
not its warm start's bits (a 1-thread build; micro's committed tables came from a 2-thread one): the default's learning
is its own measurement's, not micro's tables'.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tracekit.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
MEASURED = ROOT / "benchmarks" / "results" / "default_run"
KEY_FREE = {"name", "warm_start", "built_on"}  # what the default adds over micro: no stage reads them


def _leaves(node, prefix=""):
    out = {}
    for k, v in node.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_the_default_is_micro_with_only_its_named_cuts(make_cfg):
    default, micro = make_cfg(), make_cfg("experiment=micro")
    assert default.name == "micro_ladder" and default.warm_start == "micro" and default.built_on.preset == "micro"
    a, b = _leaves(OmegaConf.to_container(default, resolve=True)), _leaves(OmegaConf.to_container(micro, resolve=True))
    differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and k.split(".")[0] not in KEY_FREE | {"paths"}}
    assert differ == set(default.built_on.cuts), f"differs from micro without being a named cut: {differ}"
    assert list(default.eval.methods) == ["base", "single_capability", "trace"]
    assert "grpo_target" in micro.eval.methods


def test_the_default_computes_what_micro_computes():
    recorded = json.loads((ROOT / "tests" / "data" / "stage_keys.json").read_text())
    for stage in ("rollout", "discover", "label", "select", "synthesize", "train", "compose"):
        assert recorded["default"][stage] == recorded["micro"][stage], stage
    assert recorded["default"]["evaluate"] != recorded["micro"]["evaluate"]  # fewer rows


def test_the_first_log_line_and_summary_name_the_cuts(make_cfg, tmp_path):
    from tracekit.cli import write_summary
    from tracekit.pipeline import RunRecord
    from tracekit.report.preset import built_on_line

    cfg = make_cfg()
    line = built_on_line(cfg)
    assert "built on experiment=micro, CUT relative to it (1): eval.methods=[base, single_capability, trace]" in line
    assert "grpo_target" in line and "warm start: the shipped copy micro" in line
    write_summary(tmp_path, cfg, RunRecord(tmp_path))
    summary = (tmp_path / "summary.md").read_text()
    assert "**Built on `experiment=micro`, cut (1):**" in summary and "| `eval.methods` |" in summary


def test_a_bad_built_on_is_refused_in_one_line(make_cfg):
    from tracekit.validate import validate

    from omegaconf import open_dict

    from tracekit.report.preset import check_built_on

    cfg = make_cfg()
    with open_dict(cfg):
        cfg.built_on.cuts["eval.nope"] = "why"
    with pytest.raises(ConfigError, match=r"^built_on\.cuts\.eval\.nope: eval\.nope is no key of this config$"):
        check_built_on(cfg)
    with pytest.raises(ConfigError, match=r"^built_on\.cuts\.eval: a reason \(text\) for the cut"):
        validate(make_cfg("+built_on.cuts.eval.nope=why"))  # a nested mapping is no reason
    with pytest.raises(ConfigError, match=r"built_on\.preset=nothere: no conf/experiment/nothere\.yaml"):
        validate(make_cfg("built_on.preset=nothere"))


def test_the_default_adds_a_table4_strategy_over_one_upstream(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tracekit.cli import CONF_DIR

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", return_hydra_config=True)
    GlobalHydra.instance().clear()
    assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    assert cfg.hydra.sweeper.params.consolidation == "moe,merge_cat"
    assert cfg.hydra.callbacks.side_by_side._target_ == "tracekit.report.sweep.SideBySideTable"


def _measured_jobs() -> list[Path]:
    return sorted(p for p in (MEASURED / "jobs").iterdir() if (p / "config.yaml").is_file())


def test_the_measured_default_run_is_todays_default_and_learned(make_cfg):
    from tracekit.artifacts import Artifact
    from tracekit.stages import build_pipeline

    jobs = _measured_jobs()
    assert [p.name for p in jobs] == ["0", "1"], "benchmarks/results/default_run/jobs/: run benchmarks/default_run.py"
    pipe = build_pipeline()
    for job, strategy in zip(jobs, ("moe", "merge_cat"), strict=True):
        # every stage today's default computes has the key the measured run's stage had, given the measured inputs'
        # contents: the same computation (settings added since with key-neutral defaults do not move it)
        done = {a["stage"]: a for a in json.loads((job / "artifacts.json").read_text()).values()}
        cfg = make_cfg(f"consolidation={strategy}")
        for name in pipe.order(cfg, list(cfg.stages)):
            inputs = {n: Artifact(n, done[n]["key"], Path(done[n]["path"]), done[n]["content_key"], hit=True)
                      for n in pipe.inputs(cfg, name)}
            assert pipe.key(cfg, pipe.stages[name], inputs) == done[name]["key"], (
                f"the default's {name} stage is not the measured one (job {job.name}): measure the default again")
    rows = json.loads((MEASURED / "results.json").read_text())
    by_method = {r["method"]: (label, r) for label, r in rows.items() if label == "TRACE" or r["method"] != "trace"}
    base, trace = by_method["base"][1], by_method["trace"][1]
    assert by_method["trace"][0] == "TRACE"
    assert trace["overall"]["pass_rate"] > base["overall"]["pass_rate"]
    assert trace["paired_vs_base"]["ci"][0] > 0, trace["paired_vs_base"]
    assert any(r["method"] == "trace" and label != "TRACE" for label, r in rows.items())  # the Table 4 strategy row


@pytest.mark.slow
def test_the_default_run_learns(tmp_path):
    """`python -m tracekit`, fresh (empty cache), from the shipped warm start: TRACE above Base, paired CI above 0."""
    env = {**os.environ, "TRACEKIT_ROOT": str(tmp_path), "TRACEKIT_CACHE": str(tmp_path / "cache"),
           "WANDB_MODE": "offline", "PYTHONHASHSEED": "0"}
    proc = subprocess.run([sys.executable, "-m", "tracekit"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (sweep,) = (tmp_path / "outputs" / "multirun").iterdir()
    rows = json.loads((sweep / "results.json").read_text())
    base = next(r for r in rows.values() if r["method"] == "base")
    trace = rows["TRACE"]
    assert trace["overall"]["pass_rate"] > base["overall"]["pass_rate"] and trace["paired_vs_base"]["ci"][0] > 0
    assert (sweep / "ladder.png").is_file()
    last = [line for out in (proc.stdout, proc.stderr) for line in out.splitlines()[-3:]]
    assert any(f"table: {sweep / 'results.md'} | chart: {sweep / 'ladder.png'}" in line for line in last), last


# ------------------------------------------------------------------------------------------ the shipped warm start


def test_the_shipped_warm_start_is_the_defaults(make_cfg):
    from tracekit.warmstart.shipped import verify_shipped

    ident = verify_shipped("micro", make_cfg().backbone)
    assert ident["backbone"] == "micro" and "model/model.safetensors" in ident["files"]


def test_a_warm_start_of_another_key_is_refused_in_one_line(make_cfg):
    from tracekit.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("backbone.planted.sft.lr=1.0e-3"))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("warm_start=micro: the shipped warm start is micro-2cd0dbadb55ea23b, this config's")
    assert "warm_start=null" in str(e.value)
    validate(make_cfg("backbone.planted.sft.lr=1.0e-3", "warm_start=null"))  # trained instead: accepted


def test_a_shipped_warm_start_whose_files_differ_is_refused_in_one_line(make_cfg, tmp_path, monkeypatch):
    from tracekit.warmstart import shipped

    copy = tmp_path / "warmstarts"
    shutil.copytree(shipped.WARMSTARTS / "micro", copy / "micro")
    monkeypatch.setattr(shipped, "WARMSTARTS", copy)
    weights = copy / "micro" / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    with pytest.raises(shipped.ShippedWarmStartError, match=r"^warm_start=micro: model/model\.safetensors under .* "
                                                            r"differ from the sha256 in its identity\.json"):
        shipped.verify_shipped("micro", make_cfg().backbone)
    with pytest.raises(shipped.ShippedWarmStartError, match=r"warm_start=nosuch: no shipped warm start"):
        shipped.verify_shipped("nosuch", make_cfg().backbone)


def test_installing_puts_the_shipped_files_where_the_warm_start_is_loaded_from(make_cfg, tmp_path):
    from tracekit.llm.backbones import get_spec
    from tracekit.warmstart.shipped import install_shipped, shipped_dir
    from tracekit.warmstart.planted import planted_dir
    from tracekit.wiring import backbone_dict

    cfg = make_cfg()
    path, copied = install_shipped("micro", cfg.backbone, tmp_path / "cache")
    assert copied and path == planted_dir(get_spec(backbone_dict(cfg)), "cpu", tmp_path / "cache")  # no training
    assert (path / "model" / "model.safetensors").read_bytes() == (shipped_dir("micro") / "model" /
                                                                   "model.safetensors").read_bytes()
    assert install_shipped("micro", cfg.backbone, tmp_path / "cache") == (path, False)  # there already: kept


def test_the_rebuild_check_compares_the_record_but_for_its_build_time(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from build_warmstart import same_record

    shipped = json.loads((ROOT / "tracekit" / "warmstart" / "warmstarts" / "micro" / "planted.json").read_text())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(shipped))
    b.write_text(json.dumps({**shipped, "seconds": shipped["seconds"] + 100}))
    assert same_record(a, b)
    b.write_text(json.dumps({**shipped, "sft": {**shipped["sft"], "loss_last": 0.5}}))
    assert not same_record(a, b)
