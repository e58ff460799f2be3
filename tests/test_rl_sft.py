"""The SFT recipe: assistant-token-only loss, its normalization, learning, exact resume, data from GRPO rollouts."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.nn.functional as F

from tracekit.rl.settings import LoraSettings
from tracekit.rl.sft import SFT_METRIC_COLUMNS, SFTSettings, lr_at, masked_nll, sft_examples, train_sft
from tracekit.rl.tokens import PolicyRow, Turn, build_rows, collate
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.model import build_peft_model


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _settings(**kw) -> SFTSettings:
    base = dict(lr=1e-2, epochs=2, batch_size=2, lora=LoraSettings(rank=4, alpha=8), checkpoint_every=2, seed=0)
    base.update(kw)
    return SFTSettings(**base)


def _examples(n: int, length: int = 14, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(10, 300, (length + i,), generator=g).tolist()
        mask = [0] * 5 + [1] * 5 + [0] * (len(ids) - 10)  # context, assistant reply, trailing context
        out.append((ids, mask))
    return out


def _nll(model, ids, mask, pad=0) -> torch.Tensor:
    b = collate([PolicyRow(ids, mask, [0.0] * len(ids), 0.0, 0, sum(mask))], pad)
    return masked_nll(model, b, torch.device("cpu"))


def test_loss_is_cross_entropy_on_assistant_tokens_only(tok):
    model = build_peft_model(tiny_model(len(tok), seed=0), LoraSettings(rank=4, alpha=8), seed=0).eval()
    ((ids, mask),) = _examples(1)  # 14 tokens: 0-4 context, 5-9 assistant, 10-13 context
    base = _nll(model, ids, mask)

    # the reference: token-level cross-entropy with every non-assistant target ignored (-100)
    labels = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    ref = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
    assert base.item() == pytest.approx(ref.item(), rel=1e-5)

    def perturbed(pos: int) -> float:
        ids2 = list(ids)
        ids2[pos] = ids[pos] + 1
        return _nll(model, ids2, mask).item()

    # a context token after the reply is only ever a target (and the input of later context targets):
    # changing it leaves the loss exactly as it was
    for pos in (10, 12, 13):
        assert perturbed(pos) == base.item()
    # an assistant token is a target of the loss: changing it changes the loss
    assert perturbed(9) != pytest.approx(base.item(), abs=1e-6)
    assert perturbed(5) != pytest.approx(base.item(), abs=1e-6)

    # gradients: d loss / d logits is zero on every row whose target is context
    model.zero_grad()
    lg = model(input_ids=torch.tensor([ids])).logits[0]
    lg.retain_grad()
    F.cross_entropy(lg[:-1], labels[1:], ignore_index=-100, reduction="sum").backward()  # the reference's gradient
    zero_rows = [t - 1 for t in range(1, len(ids)) if not mask[t]]
    assert torch.all(lg.grad[zero_rows] == 0) and lg.grad[[t - 1 for t in range(1, len(ids)) if mask[t]]].abs().sum() > 0
    model.zero_grad()
    _nll(model, ids, mask).backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad()
    lg = model(input_ids=torch.tensor([ids])).logits[0]
    F.cross_entropy(lg[:-1], labels[1:], ignore_index=-100, reduction="sum").backward()
    for n, p in model.named_parameters():
        if n in ours:
            assert torch.allclose(ours[n], p.grad, atol=1e-5), n


def test_loss_is_the_token_mean_over_the_batch_whatever_the_microbatches(tok, tmp_path):
    ex = _examples(3)
    one = train_sft(tiny_model(len(tok), seed=0), tok.pad_token_id, ex, _settings(epochs=1, batch_size=3), tmp_path / "a")
    split = train_sft(
        tiny_model(len(tok), seed=0), tok.pad_token_id, ex, _settings(epochs=1, batch_size=3, microbatch_tokens=16), tmp_path / "b"
    )
    ra = list(csv.DictReader((tmp_path / "a" / "metrics.csv").open()))
    rb = list(csv.DictReader((tmp_path / "b" / "metrics.csv").open()))
    assert len(ra) == len(rb) == 1 and int(ra[0]["tokens_trained"]) == 15  # 3 examples x 5 assistant tokens
    assert float(ra[0]["loss"]) == pytest.approx(float(rb[0]["loss"]), rel=1e-6)
    assert float(ra[0]["grad_norm"]) == pytest.approx(float(rb[0]["grad_norm"]), rel=1e-5)
    # the loss is the mean per-token NLL: for an untrained tiny model about log(vocab)
    assert 0.5 * torch.log(torch.tensor(float(len(tok)))) < float(ra[0]["loss"]) < 3 * torch.log(torch.tensor(float(len(tok))))
    from safetensors.torch import load_file

    a = load_file(one["adapter"] + "/adapter_model.safetensors")
    b = load_file(split["adapter"] + "/adapter_model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_memorizes_two_sequences_and_writes_a_peft_adapter(tok, tmp_path):
    ex = _examples(2)
    s = _settings(epochs=40, batch_size=2, lr=2e-2, lora=LoraSettings(rank=8, alpha=16), schedule="constant", checkpoint_every=100)
    model = tiny_model(len(tok), seed=0)
    summary = train_sft(model, tok.pad_token_id, ex, s, tmp_path)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert list(rows[0].keys()) == SFT_METRIC_COLUMNS and len(rows) == 40
    losses = [float(r["loss"]) for r in rows]
    assert losses[-1] < 0.2 * losses[0], losses
    assert summary["optimizer_steps"] == 40 and sum(int(r["optimizer_steps"]) for r in rows) == 40
    assert summary["tokens_generated"] == 0 and summary["episodes"] == 0

    from peft import PeftModel

    loaded = PeftModel.from_pretrained(tiny_model(len(tok), seed=0), summary["adapter"]).eval()
    ids, mask = ex[0]
    with torch.no_grad():
        nll = _nll(loaded, ids, mask).item() / sum(mask)
    assert nll == pytest.approx(losses[-1], abs=0.5)  # the saved adapter is the trained one
    fresh = tiny_model(len(tok), seed=0).state_dict()
    trained = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
    assert trained.keys() == fresh.keys() and all(torch.equal(trained[k], fresh[k]) for k in fresh)  # backbone untouched


class _Kill(Exception):
    pass


def test_kill_and_resume_gives_the_same_adapter(tok, tmp_path):
    ex = _examples(5)
    s = _settings(epochs=2, batch_size=2, lora=LoraSettings(rank=4, alpha=8, dropout=0.1), checkpoint_every=2)  # 6 steps
    full = train_sft(tiny_model(len(tok), seed=0), tok.pad_token_id, ex, s, tmp_path / "full")

    def kill_at_2(row):
        if row["step"] == 2:  # step 2 done but not checkpointed: it is redone
            raise _Kill()

    with pytest.raises(_Kill):
        train_sft(tiny_model(len(tok), seed=0), tok.pad_token_id, ex, s, tmp_path / "cut", callbacks=[kill_at_2])
    assert json.loads((tmp_path / "cut" / "checkpoints" / "latest.json").read_text())["iteration"] == 1
    assert not (tmp_path / "cut" / "adapter").exists()
    cut = train_sft(tiny_model(len(tok), seed=0), tok.pad_token_id, ex, s, tmp_path / "cut")
    from safetensors.torch import load_file

    a = load_file(full["adapter"] + "/adapter_model.safetensors")
    b = load_file(cut["adapter"] + "/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra = list(csv.DictReader((tmp_path / "full" / "metrics.csv").open()))
    rb = list(csv.DictReader((tmp_path / "cut" / "metrics.csv").open()))
    assert [r["step"] for r in rb] == [str(i) for i in range(6)]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["iter_00003", "iter_00005", "latest.json"]


def _traj(turns, success, env="cap_a"):
    return {"task_id": "t", "env": env, "success": success, "reward": float(success), "info": {"turns": turns}}


def test_sft_examples_take_successful_trajectories_of_every_adapter(tmp_path):
    t1 = [{"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "completion_logprobs": [-0.1, -0.2]},
          {"prompt_ids": [1, 2, 3, 4, 5, 6], "completion_ids": [7], "completion_logprobs": [-0.3]}]  # fmt: skip
    t2 = [{"prompt_ids": [9, 8], "completion_ids": [7], "completion_logprobs": [-1.0]}]
    t3 = [{"prompt_ids": [5, 5], "completion_ids": [6, 6], "completion_logprobs": [-1.0, -1.0]}]
    a, b = tmp_path / "cap_a", tmp_path / "cap_b"
    (a / "rollouts").mkdir(parents=True)
    (b / "rollouts").mkdir(parents=True)
    (a / "rollouts" / "iter_00000.jsonl").write_text(json.dumps(_traj(t1, True)) + "\n" + json.dumps(_traj(t2, False)) + "\n")
    (b / "rollouts" / "iter_00001.jsonl").write_text(json.dumps(_traj(t3, True, "cap_b")) + "\n")
    got = sft_examples([a, b])
    want = [(r.token_ids, r.loss_mask) for t in (t1, t3) for r in build_rows([Turn.from_dict(d) for d in t])]
    assert got == want
    assert got[0] == ([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 1, 0, 1])  # two turns merged: the tool result is context
    assert len(sft_examples([a, b], successes_only=False)) == 3

    (tmp_path / "msgs" / "rollouts").mkdir(parents=True)
    row = _traj(t1, True)
    row["info"] = {}
    (tmp_path / "msgs" / "rollouts" / "iter_00000.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"has no token turns \(written with GRPOSettings.save_rollouts='messages'"):
        sft_examples([tmp_path / "msgs"])
    with pytest.raises(ValueError, match="no rollouts"):
        sft_examples([tmp_path / "nothing"])


def test_sft_examples_from_a_real_grpo_run(tok, tmp_path):
    from tracekit.rl.toy import KeywordSuite
    from tracekit.rl.trainer import GRPOSettings, GRPOTrainer

    s = GRPOSettings(iterations=1, groups=2, group_size=2, max_new_tokens=6, max_steps=2, lora=LoraSettings(rank=4, alpha=8),
                     save_rollouts="full", num_minibatches=1)  # fmt: skip
    GRPOTrainer(tiny_model(len(tok), seed=0), tok, KeywordSuite(turns=2), s, tmp_path / "grpo").train()
    ex = sft_examples([tmp_path / "grpo"], successes_only=False)
    rows = list(csv.DictReader((tmp_path / "grpo" / "metrics.csv").open()))
    assert ex and sum(sum(m) for _, m in ex) == int(rows[0]["tokens_generated"])  # every sampled token, once
    summary = train_sft(tiny_model(len(tok), seed=0), tok.pad_token_id, ex, _settings(epochs=1), tmp_path / "sft")
    assert summary["tokens_trained"] == int(rows[0]["tokens_generated"])


def test_settings_are_checked_with_one_line_errors():
    with pytest.raises(ValueError, match=r"^sft\.lr=0 is invalid: must be > 0$"):
        SFTSettings(lr=0)
    with pytest.raises(ValueError, match=r"sft\.batch_size=0 is invalid"):
        SFTSettings(batch_size=0)
    with pytest.raises(ValueError, match=r"sft\.schedule='cosine' is invalid: must be one of linear, constant"):
        SFTSettings(schedule="cosine")
    assert SFTSettings().lr == 2e-5 and SFTSettings().lora.rank == 32
    assert SFTSettings(lora={"rank": 8, "alpha": 16}).lora.rank == 8


def test_linear_schedule_with_warmup():
    s = SFTSettings(lr=1.0, warmup_ratio=0.2)
    lrs = [lr_at(i, 10, s) for i in range(10)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0 and lrs[-1] == pytest.approx(1 / 8)
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert [lr_at(i, 4, SFTSettings(lr=1.0, schedule="constant")) for i in range(4)] == [1.0] * 4
