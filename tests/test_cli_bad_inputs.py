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
    (("backbone.planted.demos_weak=abc",), "backbone.planted.demos_weak='abc' is invalid: must be an integer >= 0"),
    (("backbone.planted.difficulty=5",), "backbone.planted.difficulty=5 is invalid: must be a level every planted "
                                         "environment has ([0, 1])"),
    (("backbone.arch.vocab_size=abc",), "backbone.arch.vocab_size='abc' is invalid: must be an integer >= 259 "),
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


# -- a cache or root the coding jail would show every command -----------------------------------------------------


def _bound_dir() -> str:
    from tracekit.coding.sandbox import system_binds

    bound = next(b for b in system_binds() if (b == "/usr" or b.startswith("/usr/")) and Path(b).is_dir())
    return f"{bound}/tracekit-test-refused-{__import__('os').getpid()}"


@pytest.mark.parametrize("key", ["paths.cache_dir", "paths.root_dir"])
def test_a_coding_run_with_its_cache_or_root_under_a_bound_dir_is_refused_naming_the_key(make_cfg, key):
    refused = _bound_dir()
    cfg = make_cfg("benchmark=coding_toolz", f"{key}={refused}")
    shown = refused if key == "paths.cache_dir" else f"{refused}/outputs"  # a root: the outputs its runs write
    with pytest.raises(ConfigError, match=rf"^coding sandbox: refused: the tracekit cache or root {shown} \({key}\) "
                                          "lies inside /usr"):
        validate(cfg)
    assert not Path(refused).exists()


def test_a_root_under_a_bound_dir_is_refused_before_hydra_makes_the_run_dir(monkeypatch, tmp_path):
    """exposed_root_problem composes and validates the run's config before Hydra writes its run dir under the root;
    a target without the jail keeps such a root."""
    from tracekit.cli import exposed_root_problem

    refused = _bound_dir()
    monkeypatch.setenv("TRACEKIT_ROOT", refused)
    monkeypatch.setenv("TRACEKIT_CACHE", str(tmp_path / "cache"))  # validating micro caches its world tokenizer
    why = exposed_root_problem(["benchmark=coding_toolz", "stages=[rollout]", "logger=none"])
    assert why is not None and f"{refused}/outputs (paths.root_dir) lies inside /usr" in why
    assert exposed_root_problem(["experiment=micro", "stages=[rollout]"]) is None
    why = exposed_root_problem(["-m", "benchmark=coding_toolz", "stages=[rollout]", "seed=0,1"])  # the first point
    assert why is not None and f"{refused}/outputs (paths.root_dir) lies inside /usr" in why
    assert not Path(refused).exists()


def test_a_coding_config_whose_paths_resolve_only_in_the_app_passes_the_sweep_callbacks_validation(make_cfg):
    """The sweep callback validates each job before Hydra's runtime exists (paths.root_dir holds ${hydra:...}): the
    coding target checks its paths when the job starts instead of refusing every job."""
    from tracekit.coding.sandbox import jail_problem
    from tracekit.targets.registry import target_of

    if jail_problem():
        pytest.skip(f"the coding target refuses this machine first: {jail_problem()}")
    cfg = make_cfg("benchmark=coding_toolz")
    cfg.paths.root_dir = "${hydra:runtime.cwd}"
    cfg.paths.cache_dir = "${paths.root_dir}/outputs/cache"
    target_of(cfg).validate(cfg)


# -- a disk that fills while train writes a checkpoint or an adapter -----------------------------------------------

_FILL = """
import sys, torch
from pathlib import Path
import tracekit.cli as cli
from tracekit.rl.components import atomic_dir
cli._model_cache = lambda: None
try:
    atomic_dir(Path(sys.argv[1]) / "adapter", lambda tmp: (tmp.mkdir(), torch.save(torch.zeros(1 << 20), tmp / "w.pt")))
except Exception as e:
    sys.exit(cli.report_failure(e, (sys.argv[1],)))
"""


def test_a_full_disk_under_a_checkpoint_write_is_one_line_naming_the_path_and_the_free_space(tmp_path):
    """A real full disk (a 1 MiB tmpfs in a private mount namespace): torch's zip writer fails with "unexpected
    pos ...", which the train stage's writes turn into one line naming the path and the space left."""
    from tests.test_cli_errors import _mount_ns

    disk = tmp_path / "disk"
    disk.mkdir()
    out = subprocess.run([*_mount_ns(), "sh", "-c", f'mount -t tmpfs -o size=1m tmpfs {disk} && exec "$@"', "sh",
                          sys.executable, "-c", _FILL, str(disk)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "WANDB_MODE": "offline"})
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("tracekit:")]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"tracekit: error: No space left on device (0.0 MiB free on its disk; RuntimeError: ")
    assert "unexpected pos" in lines[0] and f": {disk}/adapter: free space there" in lines[0]


def test_a_failed_checkpoint_write_with_space_left_keeps_its_own_error_and_leaves_no_partial(tmp_path, monkeypatch):
    import shutil

    import torch

    from tracekit.rl import components

    def failing_save(obj, path):
        raise RuntimeError("unexpected pos 8512 vs 8406")

    model = torch.nn.Linear(2, 2)
    monkeypatch.setattr(components, "save_peft_adapter", lambda *a, **k: None)
    monkeypatch.setattr(components.torch, "save", failing_save)
    backend = SimpleNamespace(save=lambda d, rank: None)
    with pytest.raises(RuntimeError, match="^unexpected pos"):  # plenty of space: not a full disk
        components.save_checkpoint(tmp_path / "ckpt", 1, model, backend, {}, keep=2)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=3 << 20))
    with pytest.raises(OSError) as e:
        components.save_checkpoint(tmp_path / "ckpt", 1, model, backend, {}, keep=2)
    assert e.value.errno == 28 and e.value.filename == str(tmp_path / "ckpt" / "iter_00001")
    assert "3.0 MiB free on its disk; RuntimeError: unexpected pos 8512 vs 8406" in e.value.strerror
    assert list((tmp_path / "ckpt").iterdir()) == []  # the unfinished checkpoint's space given back
