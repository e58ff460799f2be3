"""Token bookkeeping: exact rows from multi-turn episodes, no re-tokenization drift."""

from __future__ import annotations

import copy

import pytest
import torch

from tracekit.rl.engines import Completion, HFEngine, PolicyChat
from tracekit.rl.episodes import EpisodeSpec, run_episodes
from tracekit.rl.model import build_peft_model, sequence_logprobs
from tracekit.rl.settings import LoraSettings
from tracekit.rl.tokens import (
    PolicyRow,
    Turn,
    build_rows,
    collate,
    pack_microbatches,
    rows_for_trajectory,
)
from tracekit.rl.toy import KeywordSuite, tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def test_build_rows_merges_prefix_extensions():
    turns = [
        Turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
        Turn([1, 2, 3, 10, 11, 4, 5], [12], [-0.3]),  # extends the previous prompt + completion
        Turn([1, 2, 3, 10, 11, 4, 5, 12, 6], [13, 14], [-0.4, -0.5]),
    ]
    (row,) = build_rows(turns)
    assert row.token_ids == [1, 2, 3, 10, 11, 4, 5, 12, 6, 13, 14]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 0, 1, 1]
    assert row.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.3, 0, -0.4, -0.5]


def test_build_rows_splits_where_prefix_extension_breaks():
    turns = [
        Turn([1, 2, 3], [10, 11], [-0.1, -0.2]),
        Turn([1, 2, 3, 99, 4], [12], [-0.3]),  # the template re-rendered turn 1 differently
        Turn([1, 2, 3, 99, 4, 12, 7], [13], [-0.4]),  # extends row 2
        Turn([5], [], []),  # nothing generated: nothing to train
    ]
    rows = build_rows(turns)
    assert [r.token_ids for r in rows] == [[1, 2, 3, 10, 11], [1, 2, 3, 99, 4, 12, 7, 13]]
    assert [r.loss_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1, 0, 1]]
    trows = rows_for_trajectory(turns, advantage=0.7, traj_index=3)
    assert [r.traj_tokens for r in trows] == [4, 4]  # T_traj counts generated tokens over all rows
    assert all(r.advantage == 0.7 and r.traj_index == 3 for r in trows)


def test_turn_validation():
    with pytest.raises(ValueError, match="return_tokens"):
        Turn.from_dict({"prompt_ids": [1]})
    with pytest.raises(ValueError, match="log-probs"):
        Turn.from_dict({"prompt_ids": [1], "completion_ids": [2, 3], "completion_logprobs": [0.0]})
    with pytest.raises(ValueError, match="no preceding context"):
        build_rows([Turn([], [1], [0.0])])


def test_pack_microbatches_respects_budget_and_covers_all():
    lengths = [5, 30, 12, 12, 7, 40, 3]
    batches = pack_microbatches(lengths, token_budget=40)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(len(lengths)))
    for b in batches:
        assert max(lengths[i] for i in b) * len(b) <= 40 or len(b) == 1
    assert batches[0] == [5]  # longest first
    assert pack_microbatches([100, 10], token_budget=50) == [[0], [1]]  # an over-budget row goes alone


def test_collate_shapes_and_padding():
    rows = [PolicyRow([1, 2, 3], [0, 1, 1], [0, -1, -2], 0.5, 0, 2), PolicyRow([4, 5], [0, 1], [0, -3], -1.0, 1, 1)]
    b = collate(rows, pad_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert b.loss_mask.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert b.advantages.tolist() == [0.5, -1.0]
    assert b.traj_tokens.tolist() == [2, 1]


def _canonical_policy(tok) -> PolicyChat:
    """A scripted 'model' that always answers with a well-formed ping call in canonical tokens."""
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def generate(prompts, temperature, top_p, max_new, seed):
        out = []
        for p in prompts:
            host = "alpha"
            text = '<tool_call>\n{"name": "ping", "arguments": {"host": "' + host + '"}}\n</tool_call>'
            ids = tok(text, add_special_tokens=False)["input_ids"] + [end]
            out.append(Completion(ids, [-0.5] * len(ids), "stop"))
        return out

    return PolicyChat(tok, generate, [end])


def test_rows_equal_the_chat_template_of_the_final_conversation(tok):
    suite = KeywordSuite(turns=3)
    task = next(t for t in suite.tasks() if t.data["host"] == "alpha")
    (traj,) = run_episodes(_canonical_policy(tok), suite, [EpisodeSpec(task, 0, 0, 0)], temperature=1.0, max_new_tokens=64)
    assert traj.reward == 1.0 and traj.success
    turns = [Turn.from_dict(d) for d in traj.info["turns"]]
    assert len(turns) == 3
    # each turn's prompt is a prefix-extension of the previous prompt + completion ...
    for a, b in zip(turns, turns[1:]):
        assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] == a.prompt_ids + a.completion_ids
    (row,) = build_rows(turns)
    # ... and the one row is exactly the template's rendering of the conversation up to the last reply
    last_assistant = max(i for i, m in enumerate(traj.messages) if m.role == "assistant")
    text = tok.apply_chat_template(
        [m.to_chat() for m in traj.messages[: last_assistant + 1]], tools=suite.interface()["tools"], tokenize=False
    )
    rendered = tok(text, add_special_tokens=False)["input_ids"]
    assert rendered[: len(row.token_ids)] == row.token_ids
    assert tok.decode(rendered[len(row.token_ids) :]) == "\n"  # only the template's newline after <|im_end|>
    assert sum(row.loss_mask) == sum(len(t.completion_ids) for t in turns)
    assert [lp for lp, m in zip(row.logprobs, row.loss_mask) if m] == [-0.5] * sum(row.loss_mask)


# Qwen3's template drops reasoning from earlier assistant turns and puts an empty think block in the
# generation prompt only, so a turn's prompt does not extend the previous prompt + completion.
QWEN3_LIKE = (
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{- '<|im_start|>assistant\\n' + (m.content or '').split('</think>')[-1].lstrip('\\n') }}"
    "{%- for c in (m.tool_calls or []) %}{%- if c.function %}{%- set c = c.function %}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.name + '\", \"arguments\": ' + (c.arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)


def test_template_that_breaks_prefix_extension_trains_each_turn_as_seen(tok):
    qtok = copy.deepcopy(tok)
    qtok.chat_template = QWEN3_LIKE
    suite = KeywordSuite(turns=2)
    (traj,) = run_episodes(_canonical_policy(qtok), suite, [EpisodeSpec(suite.tasks()[0], 0, 0, 0)], temperature=1.0)
    turns = [Turn.from_dict(d) for d in traj.info["turns"]]
    a, b = turns
    assert b.prompt_ids[: len(a.prompt_ids) + len(a.completion_ids)] != a.prompt_ids + a.completion_ids
    rows = rows_for_trajectory(turns, advantage=1.0, traj_index=0)
    assert [r.token_ids for r in rows] == [t.prompt_ids + t.completion_ids for t in turns]
    assert all(r.traj_tokens == len(a.completion_ids) + len(b.completion_ids) for r in rows)


def test_trainer_logprobs_on_rows_equal_rollout_logprobs(tok):
    """The strongest no-drift check: re-scoring the built rows reproduces the sampled log-probs."""
    model = build_peft_model(tiny_model(len(tok), seed=1), LoraSettings(rank=4, alpha=8), seed=0)
    suite = KeywordSuite(turns=3)
    engine = HFEngine(model, tok)
    specs = [EpisodeSpec(suite.tasks()[i % 4], 7, i, i // 2) for i in range(6)]
    trajs = run_episodes(engine.client, suite, specs, temperature=1.0, max_new_tokens=12, sample_seed=3)
    rows = [r for t in trajs for r in rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], 0.0, 0)]
    assert len(rows) >= len(trajs)  # random text re-tokenizes differently: rows split, still exact
    b = collate(rows, tok.pad_token_id)
    with torch.no_grad():
        lp = sequence_logprobs(model, b.input_ids, b.attention_mask, b.loss_mask, chunk=7)
    want = b.rollout_logprobs[:, 1:][b.loss_mask[:, 1:] > 0]
    assert lp.shape == want.shape and lp.numel() == sum(sum(r.loss_mask) for r in rows)
    assert torch.allclose(lp, want, atol=1e-4)


def test_a_failing_environment_ends_only_its_episode(tok):
    class Flaky(KeywordSuite):
        def episode(self, task, seed=0):
            ep = super().episode(task, seed)
            if task.id == "ping-1":
                def boom(action):
                    raise RuntimeError("db exploded")

                ep.step = boom
            return ep

    suite = Flaky(turns=2)
    specs = [EpisodeSpec(suite.tasks()[i], 0, 0, i) for i in range(2)]
    ok, bad = run_episodes(_canonical_policy(tok), suite, specs, temperature=1.0)
    assert ok.termination == "all_turns_done" and ok.error is None and len(ok.info["turns"]) == 2
    assert bad.termination == "error" and "db exploded" in bad.error and bad.reward == 0.0
    assert len(bad.info["turns"]) == 1  # the turn it generated is kept
