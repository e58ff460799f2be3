"""Config composition, paper defaults and value checks (before any work)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import is_dataclass
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

import pytest

from tests import procs
from tracekit.config import ConfigError
from tracekit.schema import config_schema
from tracekit.validate import CHOICES, RANGES, validate

GROUPS = ["benchmark", "backbone", "agent", "thresholds", "analysis", "synthesis", "grpo", "moe",
          "consolidation", "llm", "eval", "launcher", "logger", "experiment"]
ROOT = Path(__file__).resolve().parent.parent


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRACEKIT_ROOT": str(cwd)}
    return procs.run([sys.executable, "-m", "tracekit", *args], capture_output=True, text=True,
                     timeout=60, cwd=cwd, env=env)


def test_paper_defaults(make_cfg):
    cfg = make_cfg("~experiment")  # the groups' own values (the default experiment cuts CPU budgets)
    validate(cfg)
    assert (cfg.thresholds.delta, cfg.thresholds.rho, cfg.thresholds.k, cfg.thresholds.n) == (0.20, 0.10, 8, 10)
    assert cfg.grpo.lr == 1e-5 and cfg.grpo.iterations == 40 and cfg.grpo.temperature == 1.0
    assert cfg.moe.lambda_lb == 0.05 and cfg.moe.top_k == 1
    assert cfg.eval.temperature == 0.0 and list(cfg.eval.seeds) == [42]
    assert cfg.eval.max_steps == 50 and cfg.eval.context_budget == 32000
    assert cfg.grpo.groups * cfg.grpo.group_size == 32  # 5,120 rollouts / (4 capabilities x 40 iterations)
    assert make_cfg().name == "micro_ladder"  # `python -m tracekit` runs the micro world's ladder (issue 50)


@pytest.mark.parametrize("override,key", [
    ("thresholds.delta=1.5", "thresholds.delta"),
    ("thresholds.rho=-0.1", "thresholds.rho"),
    ("thresholds.k=11", "thresholds.k"),
    ("grpo.group_size=1", "grpo.group_size"),
    ("grpo.groups=0", "grpo.groups"),
    ("eval.context_budget=10", "eval.context_budget"),
    ("stages=[rollout,nope]", "stages"),
    ("analysis.discovery=pinned", "analysis.dictionary_path"),
    ("moe.impl=sparse", "moe.impl"),
    ("consolidation.method=merge_nope", "consolidation.method"),
    # passed validation, then failed after seconds of work
    ("moe.steps=0", "moe.steps"),
    ("agent.max_new_tokens=0", "agent.max_new_tokens"),
    ("benchmark.limit=0", "benchmark.limit"),
    ("grpo.lr=-1", "grpo.lr"),
    ("grpo.lr=0", "grpo.lr"),
    ("grpo.keep_checkpoints=0", "grpo.keep_checkpoints"),
    ("launcher.master_port=70000", "launcher.master_port"),
    ("backbone.device=gpu", "backbone.device"),
    ("benchmark.domains=[airline,telecom]", "benchmark.domains"),
    ("user.max_turns=null", "user.max_turns"),
    ("analysis.min_capabilities=11", "analysis.min_capabilities"),
    ("synthesis.target_low=0.9", "synthesis.target_low"),
    ("experiment=embedded user=llm user.endpoint=nope", "user.endpoint"),
    ("llm=openai llm.endpoints.user.base_url=127.0.0.1:8000", "llm.endpoints.user.base_url"),
])
def test_out_of_range_values_fail_validation(make_cfg, override, key):
    cfg = make_cfg(*override.split())
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_cli_rejects_bad_threshold_with_one_line_and_no_artifacts(tmp_path):
    out = _cli("thresholds.delta=1.5", cwd=tmp_path)
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "thresholds.delta" in lines[0] and "[0, 1]" in lines[0]
    assert not (tmp_path / "outputs" / "cache").exists()


def test_cli_rejects_typo_key(tmp_path):
    out = _cli("thresholds.dleta=0.3", cwd=tmp_path)
    assert out.returncode != 0 and "dleta" in out.stderr


def test_cli_help_and_cfg_job(tmp_path):
    help_out = _cli("--help", cwd=tmp_path)
    assert help_out.returncode == 0 and "tracekit" in help_out.stdout
    job = _cli("--cfg", "job", cwd=tmp_path)
    assert job.returncode == 0
    top = {line.split(":")[0] for line in job.stdout.splitlines() if line and not line.startswith(" ")}
    assert set(GROUPS) <= top


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_and_validates(make_cfg, preset):
    validate(make_cfg(f"experiment={preset}"))


@pytest.mark.parametrize("path", sorted((ROOT / "conf" / "backbone").glob("*.yaml")), ids=lambda p: p.stem)
def test_backbone_configs_agree_with_the_registry(path):
    """The yaml files carry the architecture numbers for readers; the registry must say the same."""
    import yaml

    from tracekit.llm.backbones import BACKBONES

    y = yaml.safe_load(path.read_text())
    reg = BACKBONES[y["name"]]
    assert (y["source"], y["chat_format"]) == (reg.source, reg.chat_format)
    assert y.get("hf_id") in (None, reg.hf_id)
    assert {k: reg.arch.get(k) for k in y.get("arch") or {}} == (y.get("arch") or {})


def _schema_leaves(schema: type, prefix: str = ""):
    """(pattern, type) of every leaf field of the schema (``*``: any entry of a dict of dataclasses)."""
    for name, hint in get_type_hints(schema).items():
        if is_dataclass(hint):
            yield from _schema_leaves(hint, f"{prefix}{name}.")
        elif get_origin(hint) is dict and is_dataclass(get_args(hint)[1]):
            yield from _schema_leaves(get_args(hint)[1], f"{prefix}{name}.*.")
        else:
            yield f"{prefix}{name}", hint


def _scalar_types(hint) -> set:
    """int | None -> {int}; list[str] -> {str}; tuple[float, float] -> {float}."""
    args = [a for a in get_args(hint) if a not in (type(None), Ellipsis)]
    if get_origin(hint) in (list, tuple) or len(args) < len(get_args(hint)):
        return set().union(*(_scalar_types(a) for a in args))
    return {hint}


# strings with no fixed set of values: names, ids, paths, URLs, module names
FREE_TEXT = {"benchmark.name", "benchmark.task_ids", "backbone.name", "backbone.hf_id", "user.endpoint",
             "analysis.dictionary_path", "analysis.labels_from", "analysis.endpoint", "synthesis.endpoint",
             "synthesis.chains",  # "<capability>+<capability>": capabilities are the selection's (generated ones too)
             "grpo.lora.target_modules",
             "grpo.lora.target_parameters", "llm.endpoints.*.base_url", "llm.endpoints.*.model",
             "llm.endpoints.*.api_key_env", "logger.project", "logger.entity", "paths.root_dir", "paths.cache_dir",
             "paths.run_dir", "name", "benchmark.coding.package", "benchmark.coding.model_name",
             "benchmark.coding.dataset", "benchmark.coding.repos_dir",
             *(f"consolidation.{g}.lora.{k}" for g in ("sft", "distill")
                                        for k in ("target_modules", "target_parameters"))}


def test_every_numeric_field_has_a_range_and_every_string_a_choice_list():
    leaves = dict(_schema_leaves(config_schema()))
    numeric = {p for p, hint in leaves.items() if _scalar_types(hint) & {int, float}}
    strings = {p for p, hint in leaves.items() if str in _scalar_types(hint)}
    assert numeric == set(RANGES)
    assert strings == set(CHOICES) | FREE_TEXT and not set(CHOICES) & FREE_TEXT


@pytest.mark.parametrize("override", ["+thresholds.deltaa=0.5", "+thresholds.deltaa=", "++grpo.lora.scale=2",
                                      "+foo=1", "++llm.endpoints.analysis.retries=1"])
def test_added_keys_outside_the_schema_fail_validation(make_cfg, override):
    key = override.lstrip("+").split("=")[0]
    with pytest.raises(ConfigError, match=rf"unknown key {key} \(valid: "):
        validate(make_cfg(override))


def test_unknown_key_names_the_valid_keys(make_cfg):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("+thresholds.deltaa=0.5"))
    assert str(e.value) == "unknown key thresholds.deltaa (valid: delta, rho, k, n, undefined_er_pos)"


def test_open_groups_take_new_keys(make_cfg):
    from omegaconf import open_dict

    from tracekit.config import EndpointConfig

    cfg = make_cfg("experiment=embedded", "+backbone.arch.rope_theta=1e6", "grpo.engine=vllm", "+grpo.vllm.port=8001",
                   "+grpo.vllm.model_path=/models/base")
    # a new endpoint name (from a yaml file: OmegaConf 2.3 cannot `+`-add an entry to a dict of dataclasses)
    with open_dict(cfg):
        cfg.llm.endpoints.judge = EndpointConfig(kind="openai", base_url="http://127.0.0.1:1/v1", model="m")
    validate(cfg)
    cfg.llm.endpoints.judge.concurrency = 0
    with pytest.raises(ConfigError, match=r"llm\.endpoints\.judge\.concurrency=0"):
        validate(cfg)


@pytest.mark.parametrize("content,reason", [
    (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text"),
    (b"capabilities: [", "cannot parse"),
    (b"capabilities:\n  - name: Not Snake\n    description: x\n", "wrong schema"),
    (b"capabilities:\n  - {name: a, description: x}\n  - {name: a, description: y}\n", "duplicate"),
])
def test_malformed_pinned_dictionary_fails_validation_naming_the_file(make_cfg, tmp_path, content, reason):
    path = tmp_path / "dictionary.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as e:
        validate(make_cfg("analysis.discovery=pinned", f"analysis.dictionary_path={path}"))
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_wellformed_pinned_dictionary_passes(make_cfg, tmp_path):
    path = tmp_path / "dictionary.json"
    path.write_text('{"capabilities": [{"name": "tool_use", "description": "calls tools"}]}')
    validate(make_cfg("analysis.discovery=pinned", f"analysis.dictionary_path={path}"))


# --------------------------------------------------------------------------------------------
# no dead or silently overridden knob (issue 38)


def test_grpo_save_rollouts_is_no_knob(make_cfg):
    # every run keeps its rollouts full (the gate's and SFT's data): a knob that could not change that is gone
    with pytest.raises(ConfigError, match=r"^unknown key grpo\.save_rollouts "):
        validate(make_cfg("+grpo.save_rollouts=none"))


@pytest.mark.parametrize("overrides,line", [
    (["grpo.engine=vllm"], r"^grpo\.vllm\.model_path is not set: "),
    (["grpo.engine=vllm", "+grpo.vllm.model_path=/m", "+grpo.vllm.prot=1"],
     r"^unknown key grpo\.vllm\.prot \(valid: model_path, host, port, "),
    (["grpo.engine=vllm", "+grpo.vllm.model_path=/m", "+grpo.vllm.max_lora_rank=8", "grpo.lora.rank=16"],
     r"^grpo\.vllm\.max_lora_rank=8 is invalid: must be >= grpo\.lora\.rank=16 "),
    (["grpo.engine=vllm", "+grpo.vllm.model_path=/m", "grpo.temperature=0.7", "grpo.old_logprobs=rollout"],
     r"^grpo\.old_logprobs='rollout' is invalid: must be recompute with grpo\.engine=vllm and grpo\.temperature=0\.7"),
    (["+grpo.vllm.port=8001"], r"^grpo\.vllm=\{'port': 8001\} is invalid: must be empty with grpo\.engine="),
])  # fmt: skip
def test_the_vllm_engines_keys_and_rules_are_checked_at_validation(make_cfg, overrides, line):
    with pytest.raises(ConfigError, match=line) as e:
        validate(make_cfg(*overrides))
    assert "\n" not in str(e.value)


def test_a_valid_vllm_engine_passes(make_cfg):
    validate(make_cfg("grpo.engine=vllm", "+grpo.vllm.model_path=/m", "grpo.temperature=0.7",
                      "grpo.old_logprobs=recompute"))


def test_grpo_target_keeps_checkpoints_by_its_own_setting(make_cfg):
    from tracekit.stages import build_pipeline

    pipe = build_pipeline()
    for name in ("grpo_target", "swe_rl"):
        reads = pipe.reads(make_cfg(), name)
        assert "grpo.checkpoint_every" not in reads and "grpo.keep_checkpoints" not in reads and "grpo" not in reads
        assert "grpo.lr" in reads and f"baselines.{name}" in reads
    assert "grpo" in pipe.reads(make_cfg(), "train")  # the capability runs keep grpo.checkpoint_every's checkpoints


# the groups whose every knob a settings class declares (benchmark and backbone files are specs of a target and a
# model: they name their values whole); a file may name its option (kind, mode, ...) even where that is the default
OWNED_GROUPS = ("agent", "user", "eval", "thresholds", "analysis", "synthesis", "grpo", "moe", "consolidation",
                "baselines", "launcher", "logger")
OPTION_KEYS = ("kind", "mode", "source", "discovery", "labeler", "method")


def _leaves(node, prefix):
    from omegaconf import OmegaConf

    if OmegaConf.is_dict(node) and len(node) > 0:
        for k in node:
            yield from _leaves(node._get_node(k), f"{prefix}.{k}")
    else:
        yield prefix, node


@pytest.mark.parametrize("group", OWNED_GROUPS)
def test_a_group_file_sets_only_what_differs_from_its_class_defaults(group):
    """One place for each knob's default (issue 51): the settings class; a conf/<group>/*.yaml file names its option
    and sets what differs (an interpolation such as ${seed} is a value of its own)."""
    from omegaconf import OmegaConf

    schema = OmegaConf.structured(config_schema())
    restated = []
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        data = OmegaConf.load(path)
        for key, node in _leaves(data, group) if data else ():  # a file of comments alone sets nothing
            if key.rsplit(".", 1)[1] in OPTION_KEYS or "${" in str(node._value()):
                continue
            default = OmegaConf.select(schema, key, throw_on_missing=False)
            have = OmegaConf.to_container(node) if OmegaConf.is_config(node) else node._value()
            default = OmegaConf.to_container(default) if OmegaConf.is_config(default) else default
            if have == default and type(have) is type(default):
                restated.append(f"{path.relative_to(ROOT)}: {key}")
    assert not restated, f"restated class defaults (set them in the class, or drop them): {restated}"
