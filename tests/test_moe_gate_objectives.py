"""The moe gate's objectives beyond CE + LB (issue 39): soft targets and the trajectory expert policy against their
definitions, soft-target training that moves each environment's routing to its target, GRPO's hint and
reward-variance rules, hinted episodes, and the config: one-line refusals, and TRACE's key untouched by default."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from tracekit.config import ConfigError
from tracekit.methods.consolidate import STRATEGIES, compose_inputs, compose_reads
from tracekit.methods.consolidate.gate_objectives import HintedSuite, hint_schedule, hint_text, variance_sources
from tracekit.methods.consolidate.moe import gate_objective
from tracekit.moe.gate import (GateExample, GateTrainConfig, expert_logprobs, prompt_routing, soft_target_kl,
                               soft_targets, token_mean, train_gates_soft_target)
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.validate import validate

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# --------------------------------------------------------------------------------------------- pure math


def test_soft_targets_are_the_softmax_of_rewards_over_the_temperature():
    r = torch.tensor([[1.0, 0.5, 0.0], [0.3, 0.3, 0.3]])
    t = soft_targets(r, 0.5)
    e = [math.exp(2.0), math.exp(1.0), 1.0]
    assert torch.allclose(t[0], torch.tensor([x / sum(e) for x in e]), atol=1e-6)
    assert torch.allclose(t[1], torch.full((3,), 1 / 3))  # equal rewards: uniform
    assert soft_targets(r, 1e-3)[0].argmax() == 0 and soft_targets(r, 1e-3)[0, 0] > 0.999  # T -> 0: the argmax
    with pytest.raises(ValueError, match="temperature must be > 0"):
        soft_targets(r, 0.0)


def test_soft_target_kl_is_kl_of_the_target_to_the_token_mean():
    probs = torch.tensor([[[0.8, 0.2], [0.4, 0.6], [0.0, 1.0]]])  # B=1, L=3, S=2; the last token is padding
    mask = torch.tensor([[1, 1, 0]])
    q = token_mean(probs, mask)
    assert torch.allclose(q, torch.tensor([[0.6, 0.4]]))
    target = torch.tensor([[0.9, 0.1]])
    want = 0.9 * math.log(0.9 / 0.6) + 0.1 * math.log(0.1 / 0.4)
    assert abs(float(soft_target_kl(probs, mask, target)) - want) < 1e-6
    assert float(soft_target_kl(probs, mask, q)) == pytest.approx(0.0, abs=1e-7)  # at the target: 0
    one_hot = torch.tensor([[1.0, 0.0]])  # 0 log 0 = 0
    assert abs(float(soft_target_kl(probs, mask, one_hot)) - math.log(1 / 0.6)) < 1e-6
    with pytest.raises(ValueError, match="no token"):
        token_mean(probs, torch.zeros(1, 3))


def test_prompt_routing_averages_prompt_tokens_then_blocks():
    b0 = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.5, 0.5], [0.9, 0.1]]])
    b1 = torch.tensor([[[0.0, 1.0], [0.0, 1.0]], [[1.0, 0.0], [1.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    pi = prompt_routing([b0, b1], mask)
    assert torch.allclose(pi, torch.tensor([[0.25, 0.75], [0.75, 0.25]]))
    assert torch.allclose(pi.sum(-1), torch.ones(2))


def test_hint_schedule_follows_the_official_rule():
    assert hint_schedule(4, 0.5) == [True, True, False, False]
    assert hint_schedule(4, 0.0) == [False] * 4
    assert hint_schedule(4, 0.1) == [True, False, False, False]  # at least one once > 0
    assert hint_schedule(3, 1.0) == [True] * 3 and hint_schedule(1, 0.5) == [True]
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"hint fraction must be in \[0, 1\]"):
            hint_schedule(4, bad)


def test_variance_sources_name_what_can_make_a_groups_rewards_differ():
    assert variance_sources(1, 0.5, 0.9, 3) == []  # a group of one never varies
    assert variance_sources(2, 0.0, 0.0, 1) == []  # greedy, no hint, one expert
    assert variance_sources(2, 1.0, 0.0, 1) == []  # every rollout hinted: the hint splits nothing
    assert variance_sources(4, 0.5, 0.0, 1) == ["hints on 2 of 4"]
    assert variance_sources(2, 0.0, 0.9, 2) == ["token sampling at temperature 0.9", "the expert sampled among 2"]


def test_hinted_episodes_show_the_gold_actions_and_only_those():
    from tracekit.synthesis.library import library_env
    from tracekit.synthesis.suite import SyntheticSuite

    env = library_env("micro_lookup_by_name")
    suite = SyntheticSuite.from_env(env(env.default_difficulty), [7, 8])
    hinted = HintedSuite(suite, [("a", 7, True), ("b", 7, False)])
    inst = suite.instances([7])[0]
    eps = [hinted.episode(t) for t in hinted.tasks()]
    obs = [e.reset() for e in eps]
    assert obs[0].messages[0].content == inst.system_prompt + hint_text(inst.solution)
    assert obs[1].messages[0].content == inst.system_prompt and inst.solution[0].name in hint_text(inst.solution)
    for hint, o in ((True, obs[0]), (False, obs[1])):  # the routing prompt is the episode's first observation
        msgs, tools = hinted.opening(7, hint)
        assert [m.content for m in msgs] == [m.content for m in o.messages] and tools == o.tools
    suite.close()


# --------------------------------------------------------------------------------------------- on a tiny model


@pytest.fixture(scope="module")
def moe_factory(tmp_path_factory):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("objectives")
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(root / "base")
    dirs = {}
    for i in range(2):
        base = AutoModelForCausalLM.from_pretrained(root / "base")
        torch.manual_seed(10 + i)
        get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
                       ).save_pretrained(root / f"a{i}")
        dirs[f"cap{i}"] = root / f"a{i}"

    def make(**kw):
        return build_lora_moe(AutoModelForCausalLM.from_pretrained(root / "base"), dirs, MoEConfig(**kw))

    return make


def _examples(seed: int, first: int, n: int = 6) -> list[GateExample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = (torch.randint(0, 8, (10,), generator=g) + first).tolist()
        out.append(GateExample(ids, [0] * 4 + [1] * 6))
    return out


def test_soft_target_training_moves_each_environments_routing_to_its_target(moe_factory):
    model = moe_factory()
    ex = {"cap0": _examples(0, 0), "cap1": _examples(1, 30)}  # two environments, disjoint token ranges
    target = {"cap0": [0.9, 0.1], "cap1": [0.1, 0.9]}
    examples = ex["cap0"] + ex["cap1"]
    targets = [target["cap0"]] * 6 + [target["cap1"]] * 6
    cfg = GateTrainConfig(lr=5e-2, steps=40, batch_size=4)
    before = {c: torch.exp(expert_logprobs(model, [e.input_ids for e in xs])).mean(0) for c, xs in ex.items()}
    rows = train_gates_soft_target(model, examples, targets, cfg, seed=0)
    assert len(rows) == 40 and rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    with torch.no_grad():
        after = {c: torch.exp(expert_logprobs(model, [e.input_ids for e in xs])).mean(0) for c, xs in ex.items()}
    for c, t in target.items():  # each environment's mean routing reaches toward its own target
        assert abs(float(after[c][0]) - t[0]) < abs(float(before[c][0]) - t[0])
        assert after[c].argmax() == torch.tensor(t).argmax()
    model.assert_frozen()


def test_expert_logprobs_are_a_distribution_with_gradient_to_the_gates_only(moe_factory):
    model = moe_factory(gate_init_std=0.5)
    lp = expert_logprobs(model, [[1, 2, 3], [4, 5, 6, 7, 8]])
    assert lp.shape == (2, 2) and torch.allclose(lp.exp().sum(-1), torch.ones(2), atol=1e-5)
    lp[0, 0].backward()
    grads = {n: p.grad for n, p in model.trainable_parameters().items()}
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n.endswith("weight"))
    model.assert_frozen()


# --------------------------------------------------------------------------------------------- config


def test_ce_lb_keeps_tracess_compose_key_and_the_others_read_their_settings(make_cfg):
    from tracekit.artifacts import Artifact
    from tracekit.stages import build_pipeline

    cfg = make_cfg("experiment=smoke")
    assert cfg.consolidation.gate.objective == "ce_lb"
    assert compose_reads(cfg) == ("consolidation.method", "backbone", "seed", "moe")  # as before issue 39
    assert compose_inputs(cfg) == ("train",)
    from tracekit.pipeline import read_view

    assert gate_objective(read_view(cfg, compose_reads(cfg))) == "ce_lb"  # the stage's view masks the gate group
    pipe = build_pipeline()

    def key(c):  # compose's key over stand-in inputs
        return pipe.key(c, pipe.stages["compose"], {n: Artifact(n, "k", None, f"content-{n}", hit=True)
                                                    for n in pipe.inputs(c, "compose")})

    other = make_cfg("experiment=smoke", "consolidation.gate.soft_target.temperature=0.7",
                     "consolidation.gate.grpo.lr=0.5")
    assert key(other) == key(cfg)  # ce_lb reads none of the other objectives' settings
    soft = make_cfg("experiment=smoke", "consolidation.gate.objective=soft_target")
    assert compose_inputs(soft) == ("train", "synthesize")
    assert {"consolidation.gate.soft_target", "agent", "eval.max_steps"} <= set(compose_reads(soft))
    assert "consolidation.gate.grpo" not in compose_reads(soft)
    grpo_soft = make_cfg("experiment=smoke", "consolidation.gate.objective=grpo",
                         "consolidation.gate.grpo.warm_start=soft_target")
    assert {"consolidation.gate.grpo", "consolidation.gate.soft_target", "grpo.groups"} <= set(compose_reads(grpo_soft))
    assert len({key(soft), key(grpo_soft), key(cfg)}) == 3
    assert STRATEGIES["moe"].stage_inputs(grpo_soft) == ("synthesize",)
    labels = [STRATEGIES["moe"].row_label(c) for c in (cfg, soft, grpo_soft)]  # a sweep's rows stay apart
    assert labels == ["TRACE", "TRACE (soft-target gate)", "TRACE (GRPO gate)"]


@pytest.mark.parametrize("overrides,needle", [
    (["consolidation.gate.grpo.hint_fraction=1.5"], "consolidation.gate.grpo.hint_fraction=1.5 is invalid"),
    (["consolidation.gate.grpo.hint_fraction=-0.5"], "consolidation.gate.grpo.hint_fraction=-0.5 is invalid"),
    (["consolidation.gate.objective=grpo", "consolidation.gate.grpo.group_size=1"],
     "consolidation.gate.grpo.group_size=1 is invalid: must be >= 2 with consolidation.gate.objective=grpo"),
    (["consolidation.gate.objective=grpo", "moe.base_slot=true"], "moe.base_slot=True is invalid"),
    (["consolidation.gate.objective=kl"], "consolidation.gate.objective='kl' is invalid"),
    (["consolidation.gate.grpo.warm_start=grpo"], "consolidation.gate.grpo.warm_start='grpo' is invalid"),
    (["consolidation=arrow", "consolidation.arrow.top_k=0"], "consolidation.arrow.top_k=0 is invalid"),
    (["consolidation=arrow", "consolidation.arrow.temperature=0"], "consolidation.arrow.temperature=0"),
])
def test_bad_objective_settings_are_one_line(make_cfg, overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", *overrides))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_objectives_and_arrow_validate(make_cfg):
    for o in (["consolidation.gate.objective=soft_target"], ["consolidation.gate.objective=grpo"],
              ["consolidation.gate.objective=grpo", "consolidation.gate.grpo.hint_fraction=0"], ["consolidation=arrow"]):
        cfg = make_cfg("experiment=smoke", *o)
        validate(cfg)
    assert OmegaConf.select(make_cfg("consolidation=arrow"), "consolidation.arrow.top_k") == 3  # peft's default


def test_a_gate_grpo_update_raises_the_rewarded_experts_probability_within_the_clip(moe_factory):
    from tracekit.methods.consolidate.gate_objectives import gate_grpo_update

    model = moe_factory()  # zero gates: pi = (1/2, 1/2) on every prompt
    prompts = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 8, 7], [9, 8, 7]]
    experts = [0, 1, 1, 0]
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])  # expert 0 good on the first prompt, expert 1 on the second
    with torch.no_grad():
        old = expert_logprobs(model, prompts)
    old_lp = old[torch.arange(4), torch.tensor(experts)]
    opt = torch.optim.AdamW(list(model.trainable_parameters().values()), lr=1e-2)
    losses = gate_grpo_update(model, opt, prompts, experts, old_lp, adv, updates=8, clip_eps=0.2, max_grad_norm=1.0)
    assert len(losses) == 8 and losses[-1] < losses[0]
    with torch.no_grad():
        pi = expert_logprobs(model, prompts).exp()
    assert pi[0, 0] > 0.5 and pi[2, 1] > 0.5  # each prompt's rewarded expert gained
    assert float(pi[0, 0]) < 0.5 * 1.2 + 0.05  # the clip bounds how far the ratio moved in one batch (+ slack)
    model.assert_frozen()
