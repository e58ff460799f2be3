"""Prompt-prefix reuse: the store's bookkeeping by hand, and decoding with reused K/V equal to decoding
without (the same greedy tokens, log-probs within float32 rounding) for shared system prompts, GRPO groups
and an episode's next turn; new weights forget what the old ones computed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracekit.llm.backbones import load_backbone
from tracekit.llm.base import ChatRequest
from tracekit.llm.decoding import FastDecoder, _prefill_runs
from tracekit.llm.hf import HFChatClient
from tracekit.llm.prefix_cache import PrefixStore, batch_shared_prefixes, common_prefix
from tracekit.rl.engines import sample_completions
from tracekit.types import Message

SYSTEM = list(range(5, 60))
PROMPTS = [SYSTEM + [70, 71, 72], SYSTEM + [80], SYSTEM[:30] + [90, 91, 92, 93], list(range(100, 140)), SYSTEM + [80]]


def _kv(n: int, fill: float = 0.0):
    return lambda: ([torch.full((1, n, 2), fill)], [torch.full((1, n, 2), fill)])  # 16 bytes per token


def test_common_prefix_and_the_prefixes_a_batch_shares():
    assert common_prefix(np.array([1, 2, 3]), np.array([1, 2, 4, 5])) == 2
    assert common_prefix(np.array([1, 2]), np.array([1, 2, 3])) == 2
    assert common_prefix(np.array([7]), np.array([1])) == 0
    # PROMPTS[1] == PROMPTS[4]: the whole prompt; SYSTEM+[70..] shares SYSTEM with them, a prefix of it (dropped);
    # PROMPTS[2] shares 30 tokens (inside the kept one); the last shares nothing
    assert batch_shared_prefixes(PROMPTS, [0] * 5, min_gain=16) == [SYSTEM + [80]]
    # what the store already covers is not worth a pass of its own
    assert batch_shared_prefixes(PROMPTS, [len(SYSTEM)] * 5, min_gain=16) == []
    assert batch_shared_prefixes([[1, 2, 3], [1, 2, 4]], [0, 0], min_gain=2) == [[1, 2]]
    assert batch_shared_prefixes([[1, 2, 3]], [0], min_gain=1) == []


def test_store_longest_match_limit_extension_and_lru_budget():
    store = PrefixStore(budget_bytes=16 * 10)
    assert store.add([1, 2, 3], _kv(3, 1.0))
    assert not store.add([1, 2], _kv(2))  # covered by [1, 2, 3]
    entry, n = store.lookup([1, 2, 3, 4])
    assert n == 3 and entry.k[0][0, 0, 0] == 1.0
    assert store.lookup([1, 2, 3, 4], limit=2)[1] == 2
    assert store.lookup([9, 9]) == (None, 0)
    assert store.add([1, 2, 3, 4, 5], _kv(5, 2.0))  # extends [1, 2, 3]: that entry is dropped
    assert len(store) == 1 and store.nbytes == 16 * 5
    assert store.add([7, 8, 9], _kv(3))
    store.lookup([1, 2])  # [1..5] is now the most recently used
    assert store.add([6, 6, 6], _kv(3))  # 5 + 3 + 3 > 10 tokens: the least recently used, [7, 8, 9], goes
    assert store.lookup([7, 8])[1] == 0 and store.lookup([1, 2, 3])[1] == 3 and store.nbytes == 16 * 8
    assert not store.add(list(range(20)), _kv(20))  # larger than the whole budget: not stored, nothing evicted
    assert len(store) == 2
    store.clear()
    assert len(store) == 0 and store.nbytes == 0
    with pytest.raises(ValueError, match="budget"):
        PrefixStore(-1)


@pytest.fixture(scope="module")
def tiny():
    return load_backbone("tiny")


def test_reused_prefixes_decode_as_a_full_prefill(tiny):
    """Shared prefixes computed once first, then a second batch continuing the first's sequences."""
    model, _ = tiny
    kw = dict(max_new_tokens=8, temperature=0.0)
    want = sample_completions(FastDecoder(model), PROMPTS, **kw)
    dec = FastDecoder(model, prefix_cache_mib=64)
    got = sample_completions(dec, PROMPTS, **kw)
    assert [c.ids for c in got] == [c.ids for c in want]
    for a, b in zip(got, want):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    store = dec.prefixes
    assert len(store) == 1  # the shared prefix SYSTEM + [80], computed by its own pass before the batch
    # its 56 tokens, then the rows in runs from the first slot a row of the run needs (width 58; rows need slots
    # 55, 57, 54, 18, 57): rows 0-2 from slot 54 (4 tokens each), row 3 (reuses nothing) alone, row 4's last token
    assert store.prompt_tokens == sum(map(len, PROMPTS)) == 244
    assert store.prefilled_tokens == 56 + 3 * 4 + 40 + 1 == 109

    # the next turn: each prompt continued by its answer and more tokens, after the batch was remembered
    sess = dec.session(PROMPTS, 0, 8)
    logits = sess.prefill()
    answers = [[int(logits[i].argmax())] for i in range(len(PROMPTS))]
    sess.step(torch.tensor([a[0] for a in answers]), torch.ones(len(PROMPTS), dtype=torch.bool))
    sess.remember([p + a for p, a in zip(PROMPTS, answers)])
    with pytest.raises(ValueError, match="not its prompt"):
        sess.remember([p + a + [1, 2] for p, a in zip(PROMPTS, answers)])  # more tokens than were fed
    before = store.prompt_tokens, store.prefilled_tokens
    turn2 = [p + a + [11, 12, 13] for p, a in zip(PROMPTS, answers)]
    want2 = sample_completions(FastDecoder(model), turn2, **kw)
    got2 = sample_completions(dec, turn2, **kw)
    assert [c.ids for c in got2] == [c.ids for c in want2]
    for a, b in zip(got2, want2):
        assert np.allclose(a.logprobs, b.logprobs, atol=1e-5)
    # each row continues its remembered sequence: 3 new tokens per row are computed
    assert store.prompt_tokens - before[0] == sum(map(len, turn2)) and store.prefilled_tokens - before[1] == 3 * len(turn2)


def test_prefill_runs_trade_recomputation_against_runs():
    assert _prefill_runs([10, 10, 10], 12) == [(0, 3, 10)]
    # a row needing everything, beside rows needing 2 slots: its own run (one run would compute 3 * 100)
    assert _prefill_runs([98, 0, 98], 100) == [(0, 1, 98), (1, 2, 0), (2, 3, 98)]
    assert _prefill_runs([50, 49], 100) == [(0, 2, 49)]  # splitting saves 1 token row, less than a run costs


def test_client_turns_reuse_the_conversation_and_new_weights_forget_it(tiny):
    from peft import LoraConfig, get_peft_model

    base, tok = tiny
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))

    def turn(messages_per_row):
        return [ChatRequest(messages=m, temperature=t, seed=3 + i, max_new_tokens=6, return_tokens=True)
                for i, (m, t) in enumerate(zip(messages_per_row, [0.0, 1.0, 0.0]))]

    system = Message(role="system", content="You are a careful agent. " * 8)
    first = [[system, Message(role="user", content=f"request number {i} " * (1 + i))] for i in range(3)]
    cached, plain = HFChatClient(model, tok, prefix_cache_mib=64), HFChatClient(model, tok)
    a, b = cached.chat(turn(first)), plain.chat(turn(first))
    assert [r.completion_token_ids for r in a] == [r.completion_token_ids for r in b]
    second = [m + [Message(role="assistant", content=r.text or "ok"), Message(role="user", content="and then?")]
              for m, r in zip(first, a)]
    a2, b2 = cached.chat(turn(second)), plain.chat(turn(second))
    assert [r.completion_token_ids for r in a2] == [r.completion_token_ids for r in b2]
    for x, y in zip(a2, b2):
        assert np.allclose(x.completion_logprobs, y.completion_logprobs, atol=1e-5)
    counts = cached.clear_prefix_cache()
    assert counts["prompt_tokens"] == sum(r.usage["prompt_tokens"] for r in a + a2)
    # the system prompt once, each row's own first-turn tail, then only each second turn's new messages
    first_turn = sum(r.usage["prompt_tokens"] for r in a)
    assert counts["prefilled_tokens"] < first_turn
    assert len(cached._decoder.prefixes) == 0 and cached.clear_prefix_cache() == {"prompt_tokens": 0, "prefilled_tokens": 0}

    cached.chat(turn(first))  # stored under the current weights ...
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    want = [r.completion_token_ids for r in HFChatClient(model, tok).chat(turn(first))]
    assert [r.completion_token_ids for r in cached.chat(turn(first))] == want  # ... and forgotten after the update
    assert HFChatClient(model, tok).clear_prefix_cache() == {}  # no decoder yet: nothing kept
    with pytest.raises(ValueError, match="prefix_cache_mib"):
        HFChatClient(model, tok, prefix_cache_mib=-1)
