"""The batched host step of decoding (issue 30) changes nothing: the same tokens, log-probs (bit for bit), finish
reasons and rollouts as the row-by-row reference (``HFChatClient.batched_host_step = False``), for greedy and
sampled rows, with and without grammars, on the host and on the accelerator path; its pieces (batched bitmask
fill, masking, in-place picks, batched grammar compiles, the ``</tool_call>`` precheck) equal what they replace.
Not timed: the speed is benchmarks/rollout_throughput.py's."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tracekit.llm.backbones import load_backbone
from tracekit.llm.base import ChatRequest
from tracekit.llm.hf import HFChatClient, _closers, _exp_lanes_independent, _pick_row, greedy_pick, pick_token, sample_pick
from tracekit.llm.tools import TOOL_CALL_CLOSE
from tracekit.types import Message

pytest.importorskip("xgrammar")
from tracekit.llm.constrained import ToolCallGrammar  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_order_details", "description": "Look an order up",
                                      "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                                                     "required": ["order_id"]}}},
    {"type": "function", "function": {"name": "set_mode", "description": "Switch the mode",
                                      "parameters": {"type": "object", "properties": {
                                          "mode": {"type": "string", "description": "either 'fast' or 'slow'"},
                                          "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "note": {"type": "string", "maxLength": 12}},
                                          "required": ["mode", "level"]}}},
]


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny")


def _requests(n: int) -> list[ChatRequest]:
    """Rows of every kind in one batch: tools or none, greedy / sampled / nucleus, JSON output, mixed lengths."""
    settings = [(0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (0.0, 1.0), (1.3, 1.0)]
    out = []
    for i in range(n):
        t, p = settings[i % len(settings)]
        msgs = [Message(role="system", content="Help."),
                Message(role="user", content=f"order #W{1000000 + 7 * i} " + "please " * (i % 7))]
        kind = i % 4
        out.append(ChatRequest(messages=msgs, tools=TOOLS if kind in (0, 1, 2) else None, temperature=t, top_p=p,
                               seed=10 + i, max_new_tokens=8 + 5 * (i % 6), return_tokens=True,
                               response_format={"type": "json_object"} if kind == 2 else None))
    return out


def _answers(resps):
    return [(r.completion_token_ids, [float(x).hex() for x in r.completion_logprobs], r.finish_reason, r.text)
            for r in resps]


def _both(client: HFChatClient, reqs: list[ChatRequest]):
    client.batched_host_step = False
    ref = _answers(client.chat(reqs))
    client.batched_host_step = True
    return ref, _answers(client.chat(reqs))


@pytest.mark.parametrize("tool_choice", ["required", "auto"])
@pytest.mark.parametrize("fast", ["auto", "off"])
def test_batched_host_step_equals_the_row_by_row_reference(tiny, tool_choice, fast):
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="smollm2", max_batch_size=24, constrained_tool_calls=True,
                          tool_choice=tool_choice, copy_ids=True, fast=fast)
    client.host_threads = 3  # 24 rows: three pick threads
    ref, new = _both(client, _requests(24))
    assert new == ref
    assert any(a[2] == "stop" for a in ref) and any(a[2] == "length" for a in ref)


def test_accelerator_path_masks_on_the_device_and_copies_only_unfinished_rows(tiny, monkeypatch):
    """The branch taken for CUDA logits (gather the unfinished rows, mask them with the bitmask unpacked there,
    copy them to the host), run on CPU tensors."""
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="qwen3", max_batch_size=16, constrained_tool_calls=True,
                          tool_choice="required", copy_ids=True)
    reqs = _requests(16)
    client.batched_host_step = False
    ref = _answers(client.chat(reqs))
    calls = []
    real = ToolCallGrammar.mask_rows_

    def spy(self, logits, bitmask, rows):
        calls.append((logits.shape[0], len(rows)))
        return real(self, logits, bitmask, rows)

    monkeypatch.setattr(ToolCallGrammar, "mask_rows_", spy)
    client.batched_host_step, client.mask_on_device = True, True
    assert _answers(client.chat(reqs)) == ref
    assert calls and any(n < 16 for n, _ in calls)  # finished rows were dropped before the copy
    assert any(m < n for n, m in calls)  # rows without a grammar (JSON-free text) left unmasked in the batch


def _close(ref, got, tol=1e-9):
    """The same tokens, finish reasons and texts; log-probs within ``tol`` (the device pick sums in another order)."""
    assert [(a[0], a[2], a[3]) for a in got] == [(a[0], a[2], a[3]) for a in ref]
    for a, b in zip(ref, got):
        assert np.allclose([float.fromhex(x) for x in b[1]], [float.fromhex(x) for x in a[1]], rtol=0, atol=tol)


@pytest.mark.parametrize("fast", ["auto", "off"])
def test_picks_on_the_device_give_the_host_picks(tiny, fast):
    """The branch taken for CUDA logits by default (mask and pick there, three numbers per row back), run on CPU
    tensors: the reference's tokens for every kind of row (greedy, sampled, nucleus, grammar, JSON), its log-probs
    to 1e-9."""
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="smollm2", max_batch_size=20, constrained_tool_calls=True,
                          tool_choice="auto", copy_ids=True, fast=fast)
    reqs = _requests(20)
    client.batched_host_step = False
    ref = _answers(client.chat(reqs))
    client.batched_host_step, client.pick_on_device = True, True
    _close(ref, _answers(client.chat(reqs)))
    assert any(a[2] == "stop" for a in ref) and any(a[2] == "length" for a in ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_picks_on_the_gpu_give_the_host_picks():
    """On CUDA the default is the device pick: the host pick's tokens (float32 model, so the same logits), its
    log-probs to 1e-9, prefix reuse on."""
    model, tok = load_backbone("tiny", "cuda", "float32")
    client = HFChatClient(model, tok, chat_format="smollm2", max_batch_size=20, constrained_tool_calls=True,
                          tool_choice="auto", copy_ids=True, prefix_cache_mib=64)
    reqs = _requests(20)
    client.pick_on_device = False
    host = _answers(client.chat(reqs))
    client.pick_on_device = None
    _close(host, _answers(client.chat(reqs)))


def test_batch_pick_is_pick_token_row_for_row():
    from tracekit.llm.picks import batch_pick

    rng = np.random.default_rng(5)
    V, n = 3001, 64
    x = rng.standard_normal((n, V)) * rng.uniform(0.3, 9, (n, 1))
    x[1::4][rng.random((n // 4, V)) < 0.995] = -np.inf  # grammars forcing a few tokens
    x[2, [4, 9, 700]] = x[2].max() + 1  # a tie: the first wins
    x[3] = -np.inf  # a grammar that allows nothing
    x = x.astype(np.float32)  # what the model gives
    temps = np.array([(0.0, 0.7, 1.0, 1.3)[i % 4] for i in range(n)])
    top_ps = np.array([(1.0, 0.9, 1.0, 0.5, 1.0)[i % 5] for i in range(n)])
    rngs = [np.random.default_rng(100 + i) for i in range(n)]
    u = np.array([rngs[i].random() if temps[i] > 0 else 0.0 for i in range(n)])
    tokens, logprobs, ok = batch_pick(torch.from_numpy(x), torch.from_numpy(temps), torch.from_numpy(top_ps),
                                      torch.from_numpy(u))
    assert not ok[3] and int(ok.sum()) == n - 1
    rngs = [np.random.default_rng(100 + i) for i in range(n)]
    for i in range(n):
        if i == 3:
            continue
        want = pick_token(x[i].astype(np.float64), temps[i], top_ps[i], rngs[i])
        assert int(tokens[i]) == want[0], i
        assert abs(float(logprobs[i]) - want[1]) < 1e-12, i
    assert int(tokens[2]) == 4


def test_a_rollout_is_the_same_with_either_host_step(make_cfg, tmp_path):
    """The default experiment's decoding (grammar, tool_choice=required, copy_ids, prefix cache) on the tiny
    backbone over tau2_mini episodes: the same trajectories, turn token ids and log-probs included."""
    from tracekit.rollout import read_trajectories, run_rollouts
    from tracekit.wiring import build_agent, build_suite

    cfg = make_cfg("backbone=tiny", "benchmark.limit=1", "eval.max_steps=2")
    suite, agent = build_suite(cfg), build_agent(cfg)
    agent.return_tokens = True  # the turns' token ids and log-probs in the trajectories
    got = {}
    for batched in (False, True):
        agent.client.batched_host_step = batched
        run_rollouts(suite, agent, tmp_path / str(batched), samples=1, seed=42, max_steps=2,
                     context_budget=cfg.eval.context_budget, batch_size=cfg.agent.batch_size, progress=False)
        got[batched] = [(t.task_id, [m.model_dump(mode="json") for m in t.messages], t.reward, t.info["turns"])
                        for t in read_trajectories(tmp_path / str(batched))]
    assert got[True] == got[False]
    assert sum(len(t["completion_ids"]) for *_, turns in got[True] for t in turns) > 0


# -- the pieces -------------------------------------------------------------------------------------------------


def test_in_place_picks_give_pick_tokens_bits():
    assert _exp_lanes_independent()  # else the batched step uses pick_token itself (still exact)
    rng = np.random.default_rng(3)
    V = 5003
    for trial in range(120):
        x = rng.standard_normal(V) * rng.uniform(0.3, 9)
        if trial % 4 == 1:
            x[rng.random(V) < 0.995] = -np.inf  # a grammar forcing a few tokens
        elif trial % 4 == 2:
            x[rng.random(V) < 0.3] = -np.inf
        elif trial % 4 == 3:
            x[[4, 9, 700]] = x.max() + 1  # ties: the first wins
        for T, p in ((0.0, 1.0), (0.7, 1.0), (1.0, 0.9), (1.7, 0.5)):
            seed = int(rng.integers(1 << 30))
            want = pick_token(x.copy(), T, p, np.random.Generator(np.random.PCG64(seed)))
            gen = np.random.Generator(np.random.PCG64(seed))
            s1, s2 = np.empty(V), np.empty(V)
            for sparse in (False, True):
                got = greedy_pick(x.copy(), None, s1, sparse) if T <= 0 else \
                    sample_pick(x.copy(), T, p, np.random.Generator(np.random.PCG64(seed)), s1, s2, sparse)
                assert got[0] == want[0] and float(got[1]).hex() == float(want[1]).hex()
            assert _pick_row(x.copy(), T, p, gen, True, s1, s2) == want
            lanes = np.flatnonzero(x != -np.inf)
            if lanes.size:
                gen = np.random.Generator(np.random.PCG64(seed))
                assert _pick_row(x.copy(), T, p, gen, True, s1, s2, lanes) == want
    none = np.full(V, -np.inf)
    assert _pick_row(none.copy(), 0.0, 1.0, None, True, s1, s2) is None
    assert _pick_row(none.copy(), 0.7, 1.0, None, True, s1, s2) is None


def test_batched_fill_and_masks_equal_the_per_row_ones(tiny):
    model, tok = tiny
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    g = ToolCallGrammar(tok, len(tok), [eos])
    msgs = [Message(role="user", content="order #W1234567 and #W7654321")]
    matchers = [g.matcher(TOOLS, "smollm2", "required", msgs) for _ in range(6)]
    rng = np.random.default_rng(0)
    for step in range(40):
        live = [m for m in matchers if not m.is_terminated()]
        if not live:
            break
        batch = g.fill(live)
        for i, m in enumerate(live):
            one = g._xgr.allocate_token_bitmask(1, len(tok))
            m.fill_next_token_bitmask(one, 0)
            assert np.array_equal(batch[i], one.numpy()[0])
        logits = rng.standard_normal((len(live), len(tok))).astype(np.float32)
        device = torch.from_numpy(logits.copy())
        rows = list(range(len(live)))[::2]
        g.mask_rows_(device, batch[::2], rows)
        for i, m in enumerate(live):
            ref = logits[i].astype(np.float64)
            g.mask_(m, ref)
            out = np.empty(len(tok))
            lanes = g.masked_row_(out, logits[i], batch[i])
            assert np.array_equal(out, ref)
            assert lanes is None or np.array_equal(lanes, np.flatnonzero(np.isfinite(ref)))
            if i in rows:
                assert np.array_equal(device[i].numpy().astype(np.float64), ref)
            else:
                assert np.array_equal(device[i].numpy(), logits[i])  # rows without a matcher stay as they are
            allowed = np.flatnonzero(np.isfinite(ref))
            assert m.accept_token(int(allowed[rng.integers(len(allowed))]))


def test_a_batch_of_grammars_compiled_on_threads_equals_one_at_a_time(tiny, monkeypatch):
    model, tok = tiny
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    specs = [(TOOLS, [Message(role="user", content=f"order #W{1000000 + i % 5}")]) for i in range(9)]
    serial, threaded = ToolCallGrammar(tok, len(tok), [eos]), ToolCallGrammar(tok, len(tok), [eos])
    one = [serial.matcher(t, "qwen3", "required", m) for t, m in specs]
    many = threaded.matchers(specs, "qwen3", "required", threads=3)
    assert list(serial._compiled) == list(threaded._compiled) and len(threaded._compiled) == 5
    assert np.array_equal(serial.fill(one), threaded.fill(many))
    for a, b in zip(one, many):
        assert a.accept_string('<tool_call>\n{"name": "get_order_details"') == b.accept_string('<tool_call>\n{"name": "get_order_details"')
    assert np.array_equal(serial.fill(one), threaded.fill(many))
    monkeypatch.setattr(ToolCallGrammar, "MAX_COMPILED", 2)  # more new grammars than the bound still serve the batch
    bounded = ToolCallGrammar(tok, len(tok), [eos])
    assert len(bounded.matchers(specs, "qwen3", "required", threads=2)) == 9 and len(bounded._compiled) == 2
    bounded.clear()
    assert len(bounded._compiled) == 0


def test_the_tool_call_end_precheck_never_skips_a_stop(tiny):
    """A row is checked for ``</tool_call>`` only after a token holding its last character: on random streams
    (the closing tag's pieces mixed in) the stop step is the one that decoding the tail at every token finds."""
    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="qwen3")
    closers = _closers(tok)
    pieces = tok(TOOL_CALL_CLOSE + "</tool_call> a>b </", add_special_tokens=False)["input_ids"]
    rng = np.random.default_rng(1)
    for trial in range(200):
        stream = [int(rng.choice(pieces)) if rng.random() < 0.6 else int(rng.integers(len(tok))) for _ in range(40)]
        every = next((t for t in range(1, 41) if client._ends_tool_call(stream[:t])), None)
        checked = next((t for t in range(1, 41) if closers[stream[t - 1]] and client._ends_tool_call(stream[:t])), None)
        assert checked == every


def test_a_prompt_counted_then_sent_is_rendered_once_with_the_same_ids(tiny, monkeypatch):
    import tracekit.llm.hf as hf
    from tracekit.llm.tools import encode_prompt

    model, tok = tiny
    client = HFChatClient(model, tok, chat_format="qwen3", max_batch_size=4)
    reqs = _requests(5)
    rendered = []
    real = hf.render_prompt
    monkeypatch.setattr(hf, "render_prompt", lambda *a: rendered.append(1) or real(*a))
    counts = [client.count_tokens(r.messages, r.tools) for r in reqs]
    assert counts == [len(encode_prompt(tok, r.messages, r.tools)) for r in reqs] and len(rendered) == 5
    resps = client.chat(reqs)
    assert len(rendered) == 5  # every prompt of the batch came from the count's render
    assert [r.prompt_token_ids for r in resps] == [encode_prompt(tok, r.messages, r.tools) for r in reqs]
    other = [replace(reqs[0], messages=reqs[0].messages + [Message(role="user", content="more")])]
    assert client.chat(other)[0].prompt_token_ids == encode_prompt(tok, other[0].messages, other[0].tools)
    assert len(rendered) == 6


# -- the benchmark's bookkeeping ----------------------------------------------------------------------------------


def test_benchmark_split_and_summary():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rollout_throughput as rt

    timers = rt.Timers(cuda=False)
    timers.t.update(chat=10.0, generate=8.0, prefill=2.0, decode=4.0, mask=0.5, remember=0.5, compile=1.0, count=0.5,
                    reset=0.1, step=0.2, open=0.05, end=0.15)
    split = timers.split(12.0)
    assert split == {"prefill": 2.5, "decode": 4.0, "mask": 0.5, "pick": 1.0, "compile": 1.0, "prompts": 1.5,
                     "env": 0.5, "other": 1.0}
    run = lambda s, ep: {"seconds": s, "split": split, "episodes": 2, "tokens": 40, "turns": 4, "errors": 0,  # noqa: E731
                         "mean_reward": 0.5, "prefix_cache": {}, "_episodes": ep}
    same = {("a", 0): 1, ("b", 0): 2}
    out = rt.summarize({"batched": [run(2.0, same), run(4.0, same)], "reference": [run(3.0, same), run(4.0, same)]})
    assert out["ratio_reference_over_batched"]["median"] == pytest.approx((1.5 + 1.0) / 2)
    assert out["identical"] == 2 and out["arms"]["batched"]["episodes_per_s"] == pytest.approx(2 / 3.0, abs=1e-4)
    other = rt.summarize({"batched": [run(2.0, same)], "reference": [run(3.0, {("a", 0): 1, ("b", 0): 3})]})
    assert other["identical"] == 1


def test_benchmark_compares_device_picks_within_their_tolerance():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rollout_throughput as rt

    turn = lambda lp, ids=(5, 6): {"completion_ids": list(ids), "completion_logprobs": lp}  # noqa: E731
    ep = (["m"], 1.0, [turn([-0.5, -1.25])])
    near = (["m"], 1.0, [turn([-0.5 + 1e-13, -1.25])])
    assert not rt.same_episode(ep, near, 0.0) and rt.same_episode(ep, near, rt.LOGPROB_TOL)
    assert not rt.same_episode(ep, (["m"], 1.0, [turn([-0.5, -1.2])]), rt.LOGPROB_TOL)  # beyond the tolerance
    assert not rt.same_episode(ep, (["m"], 1.0, [turn([-0.5, -1.25], ids=(5, 7))]), rt.LOGPROB_TOL)  # other tokens
    assert not rt.same_episode(ep, (["m"], 0.0, [turn([-0.5, -1.25])]), rt.LOGPROB_TOL)  # another reward
    assert rt.exact_arm(False, None, cuda=True) and rt.exact_arm(True, None, cuda=False)
    assert not rt.exact_arm(True, None, cuda=True) and rt.exact_arm(True, False, cuda=True)
    assert set(rt.arm_settings(cuda=True)) == {"batched", "reference", "host_pick"}


def test_benchmark_moe_arm_decodes_on_the_fast_path_and_ratios(make_cfg, tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rollout_throughput as rt

    from tracekit.wiring import build_agent, build_suite

    cfg = make_cfg("backbone=tiny", "benchmark.limit=1")
    agent = build_agent(cfg, moe=str(rt.random_moe(cfg, tmp_path, adapters=2)))
    rt.warm_up(cfg, build_suite(cfg), agent)
    dec = agent.client._decoder
    assert dec is not None and all(b is not None for b in dec.lora_moe)  # every block routes, in the fast decoder
    runs = [{"seconds": 3.0, "tokens": 30}, {"seconds": 2.0, "tokens": 10}]
    base = [{"seconds": 2.0, "tokens": 20}, {"seconds": 2.0, "tokens": 20}]
    r = rt.ratio(runs, base)
    assert r["per_repeat"] == [1.5, 1.0] and r["median"] == 1.25 and (r["min"], r["max"]) == (1.0, 1.5)
    assert (r["per_token_min"], r["per_token_max"]) == (1.0, 2.0)


def test_benchmark_warms_every_arm_with_an_untimed_rollout(tmp_path):
    """``--warmup rollout``: each arm rolls out once, untimed, before the timed repeats (every batch size the
    repeats meet is compiled there); the repeats then decode exactly what the warm-up decoded."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import rollout_throughput as rt

    args = SimpleNamespace(limit={"tau2_mini": 1}, overrides=["backbone=tiny", "eval.max_steps=2"], repeats=1,
                           warmup="rollout", lora=False, moe=False, lora_target="tau2_mini", moe_adapters=2)
    r = rt.run_target("tau2_mini", args, tmp_path)
    arms = set(r["arms"])
    assert r["warmup"] == "rollout" and set(r["warmup_seconds"]) == arms and len(arms) >= 2
    assert all(s > 0 for s in r["warmup_seconds"].values())
    for arm in arms:  # the warm-up's episodes are the timed repeat's, token for token
        warm = rt.episodes_of(tmp_path / f"tau2_mini-{arm}-warm")
        timed = rt.episodes_of(tmp_path / f"tau2_mini-{arm}0")
        assert warm.keys() == timed.keys() and [w[2] for w in warm.values()] == [t[2] for t in timed.values()]
