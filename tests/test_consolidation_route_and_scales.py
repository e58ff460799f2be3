"""Issue 53 items 2 and 3: TRACE's task-level router (``consolidation=route``) and merge scales chosen on validation
seeds (``consolidation.lam_search``): the router's rules and its merged adapter on a two-adapter toy, the scale
search's choice, label, notes and budget, keys unchanged without a search, and the one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tracekit.config import ConfigError
from tracekit.llm.tools import encode_prompt
from tracekit.methods.consolidate import STRATEGIES, compose_inputs, compose_reads
from tracekit.methods.consolidate import merge as merge_module
from tracekit.methods.consolidate.route import write_merged_adapter
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.moe.task_router import TaskRouter, label_ids, top_p_weights
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.types import Message
from tracekit.validate import validate

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tok):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("route")
    out = {}
    for i in range(2):
        torch.manual_seed(30 + i)
        get_peft_model(tiny_model(len(tok), seed=1), LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                                                 init_lora_weights=False)).save_pretrained(root / f"a{i}")
        out[f"cap{i}"] = root / f"a{i}"
    return out


def _route_model(dirs, tok):
    return build_lora_moe(tiny_model(len(tok), seed=1), dirs, MoEConfig(include_base_slot=True, granularity="trajectory",
                                                                      decider="task"),
                          backbone_spec={"x": 1}).eval()


# --------------------------------------------------------------------------------------------- the task router


def test_top_p_keeps_the_smallest_most_probable_set_and_renormalizes():
    p = torch.tensor([0.1, 0.6, 0.3])
    assert torch.allclose(top_p_weights(p, 0.5), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.allclose(top_p_weights(p, 0.8), torch.tensor([0.0, 2 / 3, 1 / 3]))
    assert torch.allclose(top_p_weights(p, 1.0), p)
    assert torch.allclose(top_p_weights(torch.tensor([2.0, 2.0]), 0.4).sum(), torch.tensor(1.0))


def test_the_router_decides_among_the_retrieved_capabilities_and_no_adapter(dirs, tok):
    model = _route_model(dirs, tok)
    encode = lambda m, t: encode_prompt(tok, m, t)  # noqa: E731
    spec = {"descriptions": {"cap0": "refuses locked items", "cap1": "finishes every write"}, "top_p": 0.9,
            "retrieve_k": 1, "corpus": [{"capability": "cap0", "task": "refuse the locked item", "example": "x"}]}
    router = TaskRouter(model, encode, tok, 0, spec, torch.zeros(0, model.config.hidden_size))
    router.embeddings = router.embed(["refuse the locked item"])
    w = router.decide([([Message(role="system", content="agent"), Message(role="user", content="do it")], None)])
    assert w.shape == (1, 3) and torch.allclose(w.sum(-1), torch.ones(1))
    assert float(w[0, 2]) == 0.0  # cap1 was never retrieved: never a candidate
    prompt = router.prompt("do it", [("cap0", "x")])
    assert "A. cap0: refuses locked items" in prompt[0].content and "B. none of these" in prompt[0].content
    assert label_ids(tok, 3) == [tok("A", add_special_tokens=False)["input_ids"][0],
                                 tok("B", add_special_tokens=False)["input_ids"][0],
                                 tok("C", add_special_tokens=False)["input_ids"][0]]
    with pytest.raises(ValueError, match="description of every capability: none for cap1"):
        TaskRouter(model, encode, tok, 0, {**spec, "descriptions": {"cap0": "x", "cap1": " "}}, torch.zeros(0, 4))


def test_one_merged_adapter_per_episode_is_the_pinned_bank(dirs, tok, tmp_path):
    """What a vLLM user serves (one merged peft adapter for the episode's weights) equals the pinned bank."""
    from peft import PeftModel

    model = _route_model(dirs, tok)
    model.save(tmp_path / "moe")
    weights = {"base": 0.0, "cap0": 0.25, "cap1": 0.75}
    merged = write_merged_adapter(tmp_path / "moe", weights, tmp_path / "merged")
    ids = torch.tensor([[5, 9, 1, 33, 60, 2, 7]])
    with torch.no_grad(), model.pinned(torch.tensor([0.0, 0.25, 0.75])):
        pinned = model(input_ids=ids).logits
    with torch.no_grad():
        served = PeftModel.from_pretrained(tiny_model(len(tok), seed=1), str(merged)).eval()(input_ids=ids).logits
        alone = tiny_model(len(tok), seed=1)(input_ids=ids).logits
    assert torch.allclose(pinned, served, atol=1e-4) and not torch.allclose(pinned, alone, atol=1e-3)
    assert write_merged_adapter(tmp_path / "moe", {"base": 1.0}, tmp_path / "none") is None  # the base model serves


def test_route_refuses_capabilities_without_descriptions_before_any_work(make_cfg, tmp_path):
    pinned = tmp_path / "dict.json"
    pinned.write_text(json.dumps({"capabilities": [{"name": "refuse_locked", "description": "refuses"},
                                                   {"name": "finish_all_writes", "description": "  "}]}))
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", "consolidation=route", "analysis.discovery=pinned",
                          f"analysis.dictionary_path={pinned}"))
    assert "every capability needs a non-empty description" in str(e.value) and "\n" not in str(e.value)
    validate(make_cfg("experiment=smoke", "consolidation=route"))  # the reference dictionary describes each one
    # at compose, the selection itself: refused before any model is loaded
    select = tmp_path / "select"
    select.mkdir()
    (select / "selected_names.json").write_text(json.dumps([{"name": "cap0", "description": ""}]))
    ctx = SimpleNamespace(cfg=make_cfg("experiment=smoke", "consolidation=route"),
                          inputs={"select": SimpleNamespace(path=select)})
    with pytest.raises(ConfigError, match="the selected capabilities cap0 have no description"):
        STRATEGIES["route"].consolidate(ctx, {"cap0": SimpleNamespace(path=tmp_path / "nowhere")})
    route = make_cfg("experiment=smoke", "consolidation=route")
    assert compose_inputs(route) == ("train", "select") and "consolidation.route" in compose_reads(route)
    assert STRATEGIES["route"].row_label(route) == "TRACE task router"


# --------------------------------------------------------------------------------------------- merge scales


def test_no_scale_search_keeps_every_merges_key_and_a_search_reads_its_settings(make_cfg):
    for name in ("merge_linear", "merge_core_tsv"):
        plain = make_cfg("experiment=smoke", f"consolidation={name}")
        mount = "merge" if name == "merge_linear" else "core_tsv"
        assert compose_reads(plain) == ("consolidation.method", "backbone", "seed", f"consolidation.{mount}")
        assert compose_inputs(plain) == ("train",)
        searched = make_cfg("experiment=smoke", f"consolidation={name}", "consolidation.lam_search.scales=[0.5,1.0]",
                            "consolidation.lam_search.validation_seeds=4")
        assert "consolidation.lam_search" in compose_reads(searched)
        assert compose_inputs(searched) == ("train", "synthesize")
        validate(searched)


@pytest.mark.parametrize("overrides,needle", [
    (["consolidation=merge_ties", "consolidation.lam_search.scales=[0.5,1.0]"],
     "consolidation.lam_search.validation_seeds=None is invalid: must be >= 1 with consolidation.lam_search.scales"),
    (["consolidation=merge_ties", "consolidation.lam_search.scales=[0.0]", "consolidation.lam_search.validation_seeds=4"],
     "consolidation.lam_search.scales=0.0 is invalid: must be > 0"),
    (["consolidation=moe", "consolidation.lam_search.scales=[0.5]", "consolidation.lam_search.validation_seeds=4"],
     "consolidation.lam_search.scales=[0.5] is invalid: must be null with consolidation=moe"),
])
def test_bad_scale_searches_are_one_line(make_cfg, overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", *overrides))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_scale_is_chosen_on_validation_seeds_and_named_in_the_row(dirs, tmp_path, monkeypatch, make_cfg):
    """Each scale's merged adapter is scored on seeds 0..n-1 of every ready environment; the best one is kept, named in
    the label and notes, and its episodes counted."""
    from tracekit.merging.lora_io import read_lora_adapter
    from tracekit.methods.consolidate.base import write_consolidated

    calls = []

    def fake_reward(ctx, kind, identity, adapter, pkg, seeds, meta):
        calls.append((kind, meta["lam"], meta["env"], tuple(seeds)))
        return {0.25: 0.1, 0.5: 0.4, 1.0: 0.4}[meta["lam"]] + (0.05 if meta["env"] == "b" else 0.0)

    monkeypatch.setattr(merge_module, "rollout_reward", fake_reward)
    monkeypatch.setattr(merge_module, "ready_capabilities", lambda syn: ["a", "b"])
    monkeypatch.setattr(merge_module, "adapters_budget", lambda adapters: merge_module.Budget(episodes=100))
    cfg = make_cfg("experiment=smoke", "consolidation=merge_linear", "consolidation.lam_search.scales=[0.25,1.0,0.5]",
                   "consolidation.lam_search.validation_seeds=3")
    work = tmp_path / "work"
    work.mkdir()
    ctx = SimpleNamespace(cfg=cfg, seed=0, work_dir=work, inputs={"synthesize": SimpleNamespace(path=tmp_path)})
    adapters = {c: SimpleNamespace(path=d.parent / f"{d.name}_art") for c, d in dirs.items()}
    for c, d in dirs.items():  # an adapter artifact holds its peft adapter under adapter/
        (adapters[c].path).mkdir(exist_ok=True)
        if not (adapters[c].path / "adapter").exists():
            (adapters[c].path / "adapter").symlink_to(d)
    strategy = STRATEGIES["merge_linear"]
    result = strategy.consolidate(ctx, adapters)
    assert {c[3] for c in calls} == {(0, 1, 2)} and {c[0] for c in calls} == {"merge_validation"}
    assert len(calls) == 6  # 3 scales x 2 environments
    assert result.label == "Merge: linear (lam 1 on validation)"  # 0.5 and 1.0 tie: the first listed wins
    assert result.budget.episodes == 100 + 3 * 2 * 3
    assert "lam 1 chosen on 3 validation seeds" in result.notes[1] and "lam 0.25: 0.125" in result.notes[1]
    ref = read_lora_adapter(work / "lam_search" / "lam_1")
    got = read_lora_adapter(work / "adapter")
    assert all(torch.equal(got[m].B, ref[m].B) for m in ref)  # the kept adapter is the chosen scale's merge
    write_consolidated(work, strategy, result, cfg)
    assert json.loads((work / "consolidated.json").read_text())["label"] == "Merge: linear (lam 1 on validation)"


def test_the_sweep_table_pairs_every_row_against_base_the_best_single_and_trace():
    from tracekit.report.sweep import paired_lines

    def row(method, outcomes):
        return {"method": method, "outcomes": {f"env/t{i}/0": o for i, o in enumerate(outcomes)}}

    rows = {"Base": row("base", [0, 0, 1, 0, 0, 1]), "Single (best: cap0)": row("single_capability", [1, 0, 1, 0, 0, 1]),
            "TRACE": row("trace", [1, 1, 1, 0, 0, 1]), "TRACE (turn routing)": row("trace", [1, 1, 1, 1, 0, 1])}
    text, paired = paired_lines(rows)
    assert set(paired) == {"vs_base", "vs_single", "vs_trace"}
    assert set(paired["vs_single"]) == set(rows) - {"Single (best: cap0)"}
    assert paired["vs_single"]["TRACE (turn routing)"]["diff"] == pytest.approx(2 / 6)
    assert paired["vs_trace"]["TRACE (turn routing)"]["fixed"] == 1
    assert "Paired vs Single (best: cap0)" in text and "Paired vs TRACE" in text and "Paired vs Base" in text


def test_the_routing_sweep_runs_every_variant_and_each_point_validates(tmp_path):
    """``-m experiment=micro sweep=routing``: one job per conf/composition variant, every point valid before job 0, and
    each variant's row label apart from the others'."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from tracekit.cli import CONF_DIR, sweep_points, sweep_problems

    variants = sorted(p.stem for p in (Path(CONF_DIR) / "composition").glob("*.yaml"))
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="tracekit"):
            hydra = GlobalHydra.instance().hydra
            master = hydra.compose_config("config", overrides=["sweep=routing", "experiment=micro", "logger=none",
                                                               f"paths.root_dir={tmp_path}"], run_mode=RunMode.MULTIRUN)
            points = sweep_points(master)
            assert sorted(p[0].removeprefix("+composition=") for p in points) == variants
            assert sweep_problems(master) == []
            labels = set()
            for v in variants:
                cfg = hydra.compose_config("config", overrides=["experiment=micro", f"+composition={v}"],
                                           run_mode=RunMode.RUN)
                labels.add(STRATEGIES[cfg.consolidation.method].row_label(cfg) if not cfg.consolidation.lam_search.scales
                           else f"{cfg.consolidation.method} (scale searched)")
            assert len(labels) == len(variants)
    finally:
        GlobalHydra.instance().clear()


def test_a_reproduced_consolidation_table_pairs_each_row_against_base_single_and_trace(tmp_path):
    from tracekit.reproduce.render import RowResult
    from tracekit.reproduce.runner import paired_rows
    from tracekit.reproduce.spec import Row

    def result(label, method, outcomes, block="Qwen3-30B-A3B"):
        row = Row(index=0, block=0, block_label=block, backbone=None, label=label, method=method, overrides=(), paper={})
        return RowResult(row=row, status="ok", extra={"outcomes": {f"env/t{i}/0": o for i, o in enumerate(outcomes)}})

    results = [result("Base", "base", [0, 0, 1, 0]), result("Single Capability GRPO", "single_capability", [1, 0, 1, 0]),
               result("TRACE", "trace", [1, 1, 1, 0]), result("TRACE (turn routing)", "trace", [1, 1, 1, 1]),
               result("Base", "base", [1, 1, 1, 1], block="other backbone")]
    text, paired = paired_rows(results)
    rows = paired["Qwen3-30B-A3B"]
    assert set(rows) == {"vs_base", "vs_single", "vs_trace"}
    assert rows["vs_single"]["TRACE (turn routing)"]["diff"] == pytest.approx(0.5)
    assert rows["vs_trace"]["TRACE (turn routing)"]["fixed"] == 1
    assert "other backbone" not in paired  # a block without rows to pair against keeps to itself
    assert "Paired vs Single Capability GRPO" in text


def test_the_classifier_prompt_fits_the_backbones_context(dirs, tok):
    model = _route_model(dirs, tok)
    encode = lambda m, t: encode_prompt(tok, m, t)  # noqa: E731
    spec = {"descriptions": {"cap0": "refuses locked items", "cap1": "finishes every write"}, "top_p": 0.9,
            "retrieve_k": 2, "corpus": []}
    router = TaskRouter(model, encode, tok, 0, spec, torch.zeros(0, model.config.hidden_size))
    long = [("cap0", "find(x); " * 400), ("cap1", "write(y); " * 400)]
    assert len(encode(router.prompt("do it " * 50, long), None)) > model.config.max_position_embeddings
    ids = router.fitted_prompt("do it " * 50, long)
    assert len(ids) <= model.config.max_position_embeddings


def test_a_merge_without_a_search_composes_in_its_stages_view(make_cfg, tmp_path, dirs, monkeypatch):
    """The compose stage's view masks consolidation.lam_search while no scale is searched: the merge reads it as off."""
    from tracekit.methods.consolidate.base import search_scales
    from tracekit.pipeline import read_view

    cfg = make_cfg("experiment=smoke", "consolidation=merge_linear")
    view = read_view(cfg, compose_reads(cfg))
    assert search_scales(view) is None and search_scales(cfg) is None
    adapters = {c: SimpleNamespace(path=d.parent / f"{d.name}_view") for c, d in dirs.items()}
    for c, d in dirs.items():
        adapters[c].path.mkdir(exist_ok=True)
        if not (adapters[c].path / "adapter").exists():
            (adapters[c].path / "adapter").symlink_to(d)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setattr(merge_module, "adapters_budget", lambda adapters: merge_module.Budget())
    result = STRATEGIES["merge_linear"].consolidate(SimpleNamespace(cfg=view, seed=0, work_dir=work, inputs={}), adapters)
    assert result.label is None and (work / "adapter" / "adapter_model.safetensors").is_file()
