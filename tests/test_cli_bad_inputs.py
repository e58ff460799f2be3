"""Issue 49 item 5: each bad input of the reliability probes refused in one line naming the key, before any work:
the validator in process for config values, the CLI's own checks of the command line (flags, overrides) in process,
and a few through ``python -m tracekit`` (exit 2, one line, no run dir left)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tracekit.config import ConfigError
from tracekit.validate import validate

ROOT = Path(__file__).resolve().parent.parent
MICRO = ("experiment=micro",)


@pytest.mark.parametrize("overrides,message", [
    (("benchmark.micro.difficulty=3",), "benchmark.micro.difficulty=3 is invalid: must be a difficulty level of "),
    (("benchmark.micro.difficulty=2",), "benchmark.micro.difficulty=2 is invalid: must be a difficulty level of "),
    (("backbone.planted.seed=-1",), "backbone.planted.seed=-1 is invalid: must be >= 0"),
    (("backbone.planted.seed=abc",), "backbone.planted.seed='abc' is invalid: must be an integer >= 0"),
    (("+backbone.planted.init_seed=-5",), "backbone.planted.init_seed=-5 is invalid: must be >= 0"),
    (("backbone.planted.weak_correct=abc",), "backbone.planted.weak_correct='abc' is invalid: must be a fraction"),
    (("backbone.planted.demos_strong=many",), "backbone.planted.demos_strong='many' is invalid: must be an integer"),
    (("backbone.arch.vocab_size=100",), "backbone.arch.vocab_size=100 is invalid: must be an integer >= 259 "),
    (("synthesis.acceptance=official", "synthesis.target_low=0.97", "synthesis.target_high=1.0"),
     "synthesis.target_low=0.97 is invalid: must be <= 0.950 with synthesis.acceptance=official"),
    (("synthesis.acceptance=official", "synthesis.min_reward_std=0.6"),
     "synthesis.min_reward_std=0.6 is invalid: must be <= 0.500 with synthesis.acceptance=official"),
    (("synthesis.acceptance=official", "synthesis.target_low=0", "synthesis.target_high=0"),
     "synthesis.min_reward_std=0.05 is invalid: must be <= 0.000"),
])
def test_a_bad_micro_value_is_one_line_naming_its_key(make_cfg, overrides, message):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg(*MICRO, *overrides))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_reachable_official_band_and_the_planted_defaults_pass(make_cfg):
    validate(make_cfg(*MICRO, "synthesis.acceptance=official", "+backbone.planted.init_seed=3", "backbone.planted.seed=2"))


def test_episodes_over_the_token_budget_are_refused_with_the_configs_vocabulary(make_cfg):
    """The refusal is reachable: a small vocabulary (few merges) makes the micro world's episodes long; validate
    tokenizes with the configured backbone.arch.vocab_size (before: the registry's 2048, whatever the config said)."""
    with pytest.raises(ConfigError, match=r"^eval\.context_budget=512 is invalid: must be >= \d+: the gold episode of "):
        validate(make_cfg(*MICRO, "backbone.arch.vocab_size=300"))


def test_train_with_every_capability_skipped_names_each_with_the_rates_measured(make_cfg, tmp_path):
    from tracekit.stages import train_stage
    from tracekit.synthesis.stage import MANIFEST

    refusal = ("refused by the official acceptance rule: mean_reward=0.950 above maximum 0.600 [mean reward 0.950, "
               "success 0.950, reward std 0.218 (4 groups, G=16)]")
    (tmp_path / MANIFEST).write_text(json.dumps({"environments": [
        {"capability": "refuse_locked", "status": "skipped", "reason": refusal},
        {"capability": "finish_all_writes", "status": "skipped", "reason": "validation failed: no tools"}]}))
    ctx = SimpleNamespace(cfg=make_cfg(*MICRO), inputs={"synthesize": SimpleNamespace(path=tmp_path)})
    with pytest.raises(RuntimeError) as e:
        train_stage(ctx)
    assert f"refuse_locked: {refusal}; finish_all_writes: validation failed: no tools" in str(e.value)


# -- the command line, before Hydra ----------------------------------------------------------------------------


def test_a_flag_after_the_overrides_is_one_line_with_the_command_in_order():
    from tracekit.cli import argument_problem

    assert argument_problem(["-m", "experiment=micro", "seed=0,1"]) is None
    assert argument_problem(["experiment=micro", "-m"]) is None  # argparse takes a flag last
    why = argument_problem(["experiment=micro", "-m", "stages=[rollout]", "seed=0,1"])
    assert why == ("unrecognized arguments: stages=[rollout] seed=0,1: Hydra's flags go before the overrides: "
                   "python -m tracekit -m experiment=micro stages=[rollout] seed=0,1")


@pytest.mark.parametrize("arg,message", [
    ("name=héllo", "the override 'name=héllo' cannot be parsed (token recognition error at: 'é'): the grammar takes "
                   "such characters only in a quoted value: 'name=\"héllo\"' (quoted for the shell too)"),
    ("name=${oc.env:HOME", "the override 'name=${oc.env:HOME' cannot be parsed (mismatched input '{' expecting "
                           "<EOF>): an interpolation ${...} opened and never closed"),
])
def test_an_override_the_grammar_refuses_is_named_with_how_to_fix_it(arg, message):
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from tracekit.cli import override_problem

    with pytest.raises(HydraException) as e:
        OverridesParser.create().parse_overrides(["experiment=micro", arg])
    assert override_problem(e.value, ["experiment=micro", arg, "seed=1"]) == message
    quoted = message.split("value: ")[1].split(" (")[0].strip("'") if "quoted" in message else None
    if quoted:  # and the quoting it suggests parses
        assert OverridesParser.create().parse_override(quoted).value() == "héllo"


def _cli(*args: str, root: Path) -> subprocess.CompletedProcess:
    env = {"TRACEKIT_ROOT": str(root), "TRACEKIT_CACHE": str(root / "cache"), "WANDB_MODE": "offline",
           "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "tracekit", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("args,starts", [
    (("experiment=micro", "-m", "stages=[rollout]", "seed=0,1"), "tracekit: error: unrecognized arguments: "),
    (("experiment=micro", "stages=[rollout]", "name=héllo"), "tracekit: config error: the override 'name=héllo' "),
    (("experiment=micro", "stages=[rollout]", "benchmark.micro.difficulty=3"),
     "tracekit: config error: benchmark.micro.difficulty=3 is invalid"),
])
def test_the_cli_refuses_in_one_line_with_exit_2_and_leaves_no_run_dir(tmp_path, args, starts):
    out = _cli(*args, root=tmp_path)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(starts), out.stderr[-2000:]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "cache").exists()
