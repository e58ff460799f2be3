"""Routing granularity of the LoRA-MoE (issue 53) on a two-adapter toy: a turn routes to one expert for all its
tokens, a trajectory to one expert for all its turns, soft top-k weights sum to 1; the fast decoder under a pinned
decision is the chosen adapter alone; settings, keys, labels and bad input."""

from __future__ import annotations

import pytest
import torch

from tracekit.config import ConfigError
from tracekit.llm.base import ChatRequest, ChatResponse
from tracekit.llm.hf import HFChatClient
from tracekit.llm.tools import encode_prompt
from tracekit.moe.layer import decision_weights
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.moe.routed import PromptRoutedClient, routed_client
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.types import Message

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def toy(tmp_path_factory, tok):
    """(make(**MoEConfig) -> a LoRA-MoE over two random adapters, {name: adapter dir})."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("granularity")
    dirs = {}
    for i in range(2):
        torch.manual_seed(20 + i)
        get_peft_model(tiny_model(len(tok), seed=1), LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                                                 init_lora_weights=False)).save_pretrained(root / f"a{i}")
        dirs[f"cap{i}"] = root / f"a{i}"

    def make(**kw):
        kw.setdefault("gate_init_std", 2.0)
        return _balanced(build_lora_moe(tiny_model(len(tok), seed=1), dirs, MoEConfig(seed=5, **kw)).eval(), tok)

    return make, dirs


def _balanced(model, tok):
    """Shift slot 1's gate bias until the median turn decision over TEXTS is even, so that the gates decide
    differently on different prompts (random gates lean to one expert on average)."""
    from tracekit.moe.gate import prompt_decisions

    prompts = [encode_prompt(tok, _req("You are an agent.", t).messages, None) for t in TEXTS]
    base = {b: g.bias.detach().clone() for b, g in model.gates.items()}

    def median(delta):
        with torch.no_grad():
            for b, g in model.gates.items():
                g.bias.copy_(base[b])
                g.bias[1] += delta
        return float(prompt_decisions(model, prompts, [len(p) - 6 for p in prompts])[:, 1].median())

    lo, hi = -20.0, 20.0
    for _ in range(30):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if median(mid) < 0.5 else (lo, mid)
    median((lo + hi) / 2)
    return model


def _req(*contents: str) -> ChatRequest:
    """A request of a conversation: system, then user / assistant alternating."""
    roles = ["system"] + ["user" if i % 2 == 0 else "assistant" for i in range(len(contents) - 1)]
    return ChatRequest(messages=[Message(role=r, content=c) for r, c in zip(roles, contents)], max_new_tokens=4)


class Recorder:
    """An inner client that, for each request it is sent, runs the model over the request's prompt plus a few tokens
    (as generation would) and records the slot every token of every block routed to, and with what weight."""

    def __init__(self, model, encode):
        self.model, self.encode, self.calls = model, encode, []

    def chat(self, requests):
        for r in requests:
            ids = self.encode(r.messages, r.tools) + [7, 8, 9]
            with torch.no_grad():
                self.model(input_ids=torch.tensor([ids]))
            probs = self.model.gate_probs()
            self.calls.append({"slots": {int(s) for p in probs.values() for s in p.argmax(-1)},
                               "weights": torch.cat([p.max(-1).values for p in probs.values()])})
        return [ChatResponse(message=Message(role="assistant", content="x"), text="x") for _ in requests]


def _routed(model, tok, inner=None):
    encode = lambda m, t: encode_prompt(tok, m, t)  # noqa: E731
    inner = inner or Recorder(model, encode)
    return routed_client(inner, model, None, encode, 0), inner


def _decisions(client, requests):
    """Each request's chosen slot (hard routing), from one routed call each."""
    out = []
    for r in requests:
        before = dict(client.decisions)
        client.chat([r])
        (slot,) = [s for s, n in client.decisions.items() if n != before.get(s, 0)]
        out.append(slot)
    return out


TEXTS = ["check the locked item", "finish every write", "read record 3", "refuse it", "find all notes", "write x=1",
         "zz qq", "list the store", "stop now", "open entry 12", "lookup alpha", "the report please"]


def test_a_turn_routes_to_one_expert_for_all_its_tokens(toy, tok):
    make, _ = toy
    model = make(granularity="turn")
    client, rec = _routed(model, tok)
    assert isinstance(client, PromptRoutedClient)
    requests = [_req("You are an agent.", t) for t in TEXTS]
    client.chat(requests)  # one batch: grouped by decision, each group generated pinned
    assert len(rec.calls) == len(TEXTS)
    for call in rec.calls:  # every token of every block: one slot, at full weight
        assert len(call["slots"]) == 1 and torch.allclose(call["weights"], torch.ones_like(call["weights"]))
    chosen = _decisions(client, requests)
    assert set(chosen) == {"cap0", "cap1"}, chosen  # the gates decide differently on different prompts
    # unpinned, the same prompts' tokens are split over both experts: the pinning is what made each turn one expert
    with torch.no_grad():
        model(input_ids=torch.tensor([encode_prompt(tok, requests[0].messages, None) + [7, 8, 9]]))
    assert any(len(p.argmax(-1).unique()) == 2 for p in model.gate_probs().values())


def test_a_trajectory_routes_to_one_expert_for_all_its_turns(toy, tok):
    make, _ = toy
    turn_client, _ = _routed(make(granularity="turn"), tok)
    traj_model = make(granularity="trajectory")
    traj_client, rec = _routed(traj_model, tok)
    # an episode whose later turn, decided alone, goes to another expert than its opening
    by_turn = dict(zip(TEXTS, _decisions(turn_client, [_req("You are an agent.", t) for t in TEXTS])))
    first = TEXTS[0]
    later = next(t for t in TEXTS if by_turn[t] != by_turn[first])
    episode = [_req("You are an agent.", first), _req("You are an agent.", first, "ok", later),
               _req("You are an agent.", first, "ok", later, "done", later)]
    assert _decisions(turn_client, episode)[1] != _decisions(turn_client, episode)[0]  # turn routing switches
    assert _decisions(traj_client, episode) == [by_turn[first]] * 3  # trajectory routing does not
    assert all(len(c["slots"]) == 1 for c in rec.calls)


def test_soft_top_k_weights_sum_to_one(toy, tok):
    probs = torch.softmax(torch.randn(5, 3, generator=torch.Generator().manual_seed(0)), -1)
    for k, t in ((1, 1.0), (2, 1.0), (2, 0.3), (3, 4.0)):
        w = decision_weights(probs, k, t)
        assert torch.allclose(w.sum(-1), torch.ones(5)) and ((w > 0).sum(-1) == k).all()
        assert (w.argmax(-1) == probs.argmax(-1)).all()
    hard = decision_weights(probs, None)
    assert torch.equal(hard.sum(-1), torch.ones(5)) and ((hard > 0).sum(-1) == 1).all()
    sharp, flat = decision_weights(probs, 2, 0.1), decision_weights(probs, 2, 10.0)
    assert (sharp.max(-1).values > flat.max(-1).values).all()  # the temperature sharpens or flattens the mix
    # a soft turn mixes two experts: every token's block weights are the decision's, summing to 1
    make, _ = toy
    model = make(granularity="turn", soft_top_k=2, soft_temperature=0.5)
    client, rec = _routed(model, tok)
    client.chat([_req("You are an agent.", t) for t in TEXTS[:4]])
    assert all(k.count("+") == 1 for k in client.decisions)  # both adapters in every decision
    # token granularity: soft top-k is the model's inference spec (renormalized top-k), weights summing to 1
    tm = make(soft_top_k=2)
    assert tm.inference_spec.top_k == 2 and tm.inference_spec.renormalize
    with torch.no_grad():
        tm(input_ids=torch.tensor([[5, 6, 7, 8]]))
    from tracekit.moe.layer import adapter_weights

    for p in tm.gate_probs().values():
        assert torch.allclose(adapter_weights(p, 2, True, False).sum(-1), torch.ones(4))


def test_a_pinned_decision_decodes_as_the_chosen_adapter_alone_on_the_fast_path(toy, tok):
    from peft import PeftModel

    make, dirs = toy
    model = make(granularity="trajectory")
    inner = HFChatClient(model, tok, chat_format="qwen3", fast="on", prefix_cache_mib=8)
    client, _ = _routed(model, tok, inner)
    requests = [_req("You are an agent.", t) for t in TEXTS[:6]]
    got = client.chat(requests)
    chosen = _decisions(client, requests)
    for cap in set(chosen):
        alone = HFChatClient(PeftModel.from_pretrained(tiny_model(len(tok), seed=1), str(dirs[cap])).eval(), tok,
                             chat_format="qwen3", fast="on")
        rows = [i for i, c in enumerate(chosen) if c == cap]
        ref = alone.chat([requests[i] for i in rows])
        assert [got[i].text for i in rows] == [r.text for r in ref]


def test_token_granularity_needs_no_wrapper_and_bad_settings_are_refused(toy, tok):
    make, _ = toy
    model = make()
    inner = object()
    assert routed_client(inner, model, None, None, 0) is inner  # today's routing: the client as it was
    with pytest.raises(ValueError, match="granularity='phase' is invalid"):
        MoEConfig(granularity="phase")
    with pytest.raises(ValueError, match="soft_top_k=3 exceeds the number of gate slots 2"):
        decision_weights(torch.full((1, 2), 0.5), 3)
    with pytest.raises(ValueError, match="pinned weights"):
        with model.pinned(torch.tensor([0.7, 0.7])):
            pass


def test_a_tempered_token_model_is_an_inference_view(toy, tok, tmp_path):
    make, _ = toy
    model = make(soft_top_k=2, soft_temperature=0.5)
    model.backbone_spec = {"x": 1}
    w = {b: g.weight.clone() for b, g in model.gates.items()}
    model.apply_inference_temperature()
    assert all(torch.allclose(g.weight, 2 * w[b]) for b, g in model.gates.items())  # logits / 0.5
    with pytest.raises(ValueError, match="inference view"):
        model.save(tmp_path / "m")


# --------------------------------------------------------------------------------------------- config


def test_routing_settings_name_the_row_and_leave_tracess_key_alone(make_cfg):
    from tracekit.artifacts import Artifact
    from tracekit.methods.consolidate import STRATEGIES, compose_reads
    from tracekit.stages import build_pipeline

    pipe = build_pipeline()

    def key(c):
        return pipe.key(c, pipe.stages["compose"], {n: Artifact(n, "k", None, f"content-{n}", hit=True)
                                                    for n in pipe.inputs(c, "compose")})

    cfg = make_cfg("experiment=smoke")
    assert compose_reads(cfg) == ("consolidation.method", "backbone", "seed", "moe")
    variants = {
        "TRACE (turn routing)": ["consolidation.gate.routing.granularity=turn"],
        "TRACE (trajectory routing)": ["consolidation.gate.routing.granularity=trajectory"],
        "TRACE (soft top-2)": ["consolidation.gate.routing.soft_top_k=2"],
        "TRACE (turn routing, soft top-2 T=0.5)": ["consolidation.gate.routing.granularity=turn",
                                                   "consolidation.gate.routing.soft_top_k=2",
                                                   "consolidation.gate.routing.temperature=0.5"],
        "TRACE (soft-target gate, trajectory routing)": ["consolidation.gate.objective=soft_target",
                                                         "consolidation.gate.routing.granularity=trajectory"],
    }
    keys = {key(cfg)}
    for label, overrides in variants.items():
        c = make_cfg("experiment=smoke", *overrides)
        assert STRATEGIES["moe"].row_label(c) == label
        assert "consolidation.gate.routing" in compose_reads(c)
        keys.add(key(c))
    assert len(keys) == len(variants) + 1  # every variant its own compose


@pytest.mark.parametrize("overrides,needle", [
    (["consolidation.gate.routing.granularity=phase"], "consolidation.gate.routing.granularity='phase' is invalid"),
    (["consolidation.gate.routing.soft_top_k=0"], "consolidation.gate.routing.soft_top_k=0 is invalid"),
    (["consolidation.gate.routing.temperature=0.5"], "consolidation.gate.routing.temperature=0.5 is invalid"),
    (["consolidation.gate.routing.soft_top_k=50"], "consolidation.gate.routing.soft_top_k=50 is invalid: must be <= "),
])
def test_bad_routing_settings_are_one_line(make_cfg, overrides, needle):
    from tracekit.validate import validate

    with pytest.raises(ConfigError) as e:
        validate(make_cfg("experiment=smoke", *overrides))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_top_k_above_the_selected_adapters_is_refused_when_compose_starts(make_cfg):
    from types import SimpleNamespace

    from tracekit.methods.consolidate import STRATEGIES

    ctx = SimpleNamespace(cfg=make_cfg("experiment=smoke", "consolidation.gate.routing.soft_top_k=3"))
    with pytest.raises(ConfigError) as e:  # two adapters: nothing is loaded before the refusal
        STRATEGIES["moe"].consolidate(ctx, {"cap0": None, "cap1": None})
    assert str(e.value) == ("consolidation.gate.routing.soft_top_k=3 is invalid: must be <= 2, the composed model's "
                            "gate slots (the selected adapters, and the base slot)")
