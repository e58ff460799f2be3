"""On-policy distillation: the advantage and loss formulas, teacher adapters, KL reduction, exact resume."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tests import procs
from tracekit.rl.distill import (
    DISTILL_METRIC_COLUMNS,
    STUDENT,
    DistillSettings,
    active_adapter,
    attach_teachers,
    distill_advantages,
    importance_sampled_loss,
    sample_specs,
    score_rows,
    train_distill,
)
from tracekit.rl.settings import LoraSettings
from tracekit.rl.tokens import PolicyRow
from tracekit.rl.toy import KeywordSuite, tiny_model, tiny_tokenizer
from tracekit.rl.model import build_peft_model
from tracekit.synthesis.mixture import MixtureSuite

LORA = LoraSettings(rank=4, alpha=8)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _suite(names=("ping_a", "ping_b")) -> MixtureSuite:
    suites = []
    for n in names:
        s = KeywordSuite(n_tasks=4, turns=2)
        s.name = n
        suites.append(s)
    return MixtureSuite(suites)


def _teacher(tok, path, seed: int, std: float = 0.3):
    """A GRPO-like adapter over the tiny backbone: a fresh LoRA whose B factors are random (B = 0 when std = 0)."""
    pm = build_peft_model(tiny_model(len(tok), seed=0), LORA, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    pm.save_pretrained(str(path / "adapter"))
    return path


@pytest.fixture(scope="module")
def teachers(tok, tmp_path_factory):
    root = tmp_path_factory.mktemp("teachers")
    return {"ping_a": _teacher(tok, root / "a", 1), "ping_b": _teacher(tok, root / "b", 2)}


def _settings(**kw) -> DistillSettings:
    base = dict(iterations=3, groups=4, samples_per_task=4, max_new_tokens=12, max_steps=2, lr=1e-2, lora=LORA,
                checkpoint_every=2, seed=0, save_rollouts="none")  # fmt: skip
    base.update(kw)
    return DistillSettings(**base)


# ---- the formulas ------------------------------------------------------------------------------


def test_advantage_is_minus_the_reverse_kl_on_sampled_tokens_and_zero_elsewhere():
    g = torch.Generator().manual_seed(0)
    s, t = -torch.rand(3, 7, generator=g) * 4, -torch.rand(3, 7, generator=g) * 4
    mask = (torch.rand(3, 7, generator=g) > 0.4).float()
    s_off = torch.where(mask > 0, s, torch.full_like(s, -float("inf")))  # padding may hold anything
    a = distill_advantages(s_off.requires_grad_(), t, mask, coef=1.0)
    assert not a.requires_grad
    on = mask > 0
    assert torch.equal(a[on], -(s[on] - t[on])) and torch.all(a[~on] == 0)
    assert torch.allclose(distill_advantages(s, t, mask, coef=0.5), -0.5 * (s - t) * mask)
    assert torch.all(distill_advantages(t, t, mask, 1.0) == 0)  # the teacher's own tokens: no signal


def test_importance_sampled_loss_matches_its_formula_and_gradient():
    g = torch.Generator().manual_seed(1)
    sampler = -torch.rand(10, generator=g) * 3
    logp = (sampler + 0.1 * torch.randn(10, generator=g)).requires_grad_()
    adv = torch.randn(10, generator=g)
    w = torch.full((10,), 1 / 8)
    w[[2, 5]] = 0.0  # off the mask
    loss = importance_sampled_loss(logp, sampler, adv, w)
    ratio = torch.exp(logp.detach() - sampler)
    assert loss.item() == pytest.approx(-(w * ratio * adv).sum().item(), rel=1e-6)
    loss.backward()
    assert torch.allclose(logp.grad, -w * ratio * adv, atol=1e-7)  # d/dlogp of -w e^(logp - old) A
    assert logp.grad[2] == 0 and logp.grad[5] == 0
    # on fresh samples (logp == sampler) it is REINFORCE with the per-token advantage
    lp = sampler.clone().requires_grad_()
    importance_sampled_loss(lp, sampler, adv, w).backward()
    assert torch.allclose(lp.grad, -w * adv)
    bad = sampler.clone()
    bad[2] = float("inf")
    assert torch.isfinite(importance_sampled_loss(bad, sampler, adv, w))  # weight-0 tokens never leak


# ---- teachers ----------------------------------------------------------------------------------


def test_teachers_score_with_their_own_adapter_and_stay_frozen(tok, teachers):
    from peft import PeftModel

    model = build_peft_model(tiny_model(len(tok), seed=0), LORA, seed=0)
    names = attach_teachers(model, teachers)
    assert names == {"ping_a": "teacher0", "ping_b": "teacher1"}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(f".{STUDENT}." in n for n in trainable)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(10, 300, (20,), generator=g).tolist()
    row = PolicyRow(ids, [0] * 8 + [1] * 12, [0.0] * 20, 0.0, 0, 12)
    cpu = torch.device("cpu")
    student = score_rows(model, [row], tok.pad_token_id, cpu)[0]
    base = score_rows(tiny_model(len(tok), seed=0), [row], tok.pad_token_id, cpu)[0]
    assert torch.allclose(student, base, atol=1e-6)  # a fresh student (B = 0) is the backbone
    for env, name in names.items():
        with active_adapter(model, name):
            got = score_rows(model, [row], tok.pad_token_id, cpu)[0]
            assert not any(p.requires_grad for p in model.parameters())
        ref = PeftModel.from_pretrained(tiny_model(len(tok), seed=0), str(teachers[env] / "adapter")).eval()
        want = score_rows(ref, [row], tok.pad_token_id, cpu)[0]
        assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, base, atol=1e-2)
        assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the student trainable again
    assert model.active_adapter == STUDENT


def test_teacher_equal_to_the_student_gives_zero_kl(tok, tmp_path):
    same = {"ping_a": _teacher(tok, tmp_path / "a", 5, std=0.0), "ping_b": _teacher(tok, tmp_path / "b", 6, std=0.0)}
    s = _settings(iterations=1, groups=2, samples_per_task=2)
    summary = train_distill(tiny_model(len(tok), seed=0), tok, _suite(), same, s, tmp_path / "run")
    assert summary["reverse_kl_first"] == pytest.approx(0.0, abs=1e-4)  # sampler and teacher log-probs agree (fp32)


def test_tasks_are_drawn_uniformly_over_environments():
    suite = _suite(("e1", "e2", "e3"))
    s = DistillSettings(groups=300, samples_per_task=2)
    specs = sample_specs(suite, s, 0)
    assert len(specs) == 600 and [sp.sample for sp in specs[:4]] == [0, 1, 0, 1]
    counts = {e: sum(sp.task.env == e for sp in specs[::2]) for e in ("e1", "e2", "e3")}
    assert all(70 <= c <= 130 for c in counts.values()), counts
    assert [(sp.task.id, sp.seed) for sp in sample_specs(suite, s, 0)] == [(sp.task.id, sp.seed) for sp in specs]
    assert [sp.seed for sp in sample_specs(suite, s, 1)] != [sp.seed for sp in specs]


# ---- the recipe --------------------------------------------------------------------------------


def _exact_reverse_kl(model, teacher_dir, rows, pad_id) -> float:
    """Mean over the rows' generated positions of the full-vocabulary KL(student || teacher)."""
    from peft import PeftModel

    def logits(m):
        with torch.no_grad():
            out = []
            for r in rows:
                lg = m(input_ids=torch.tensor([r.token_ids])).logits[0, :-1]
                sel = torch.tensor(r.loss_mask[1:]) > 0
                out.append(torch.log_softmax(lg[sel].float(), -1))
            return torch.cat(out)

    teacher = PeftModel.from_pretrained(tiny_model(model.config.vocab_size, seed=0), str(teacher_dir / "adapter")).eval()
    ls, lt = logits(model.eval()), logits(teacher)
    return float((ls.exp() * (ls - lt)).sum(-1).mean())


def test_a_few_iterations_reduce_the_reverse_kl_to_the_teacher(tok, teachers, tmp_path):
    from peft import PeftModel

    from tracekit.artifacts import read_jsonl
    from tracekit.rl.tokens import Turn, rows_for_trajectory

    # both environments of the toy mixture show the agent the same prompts: one teacher for both,
    # so the student can match it exactly (two teachers on the same contexts could not both be met)
    one = {"ping_a": teachers["ping_a"], "ping_b": teachers["ping_a"]}
    s = _settings(iterations=6, save_rollouts="full", checkpoint_every=100)
    summary = train_distill(tiny_model(len(tok), seed=0), tok, _suite(), one, s, tmp_path)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert list(rows[0].keys()) == DISTILL_METRIC_COLUMNS + ["reverse_kl/ping_a", "reverse_kl/ping_b"]
    kl = [float(r["reverse_kl"]) for r in rows]
    print("reverse KL per iteration:", [round(k, 4) for k in kl])
    assert (kl[-1] + kl[-2]) / 2 < 0.6 * kl[0], kl
    assert summary["episodes"] == 6 * 16 and summary["optimizer_steps"] == 6
    assert summary["tokens_generated"] == sum(int(r["tokens_generated"]) for r in rows) > 0
    assert all(float(r["ratio_mean"]) == pytest.approx(1.0, abs=1e-4) for r in rows)  # one step on fresh samples

    # the exact (full-vocabulary) reverse KL on the first iteration's sampled sequences, before and after
    trajs = read_jsonl(tmp_path / "rollouts" / "iter_00000.jsonl")
    fixed = [r for t in trajs for r in rows_for_trajectory([Turn.from_dict(d) for d in t["info"]["turns"]], 0.0, 0)]
    before = _exact_reverse_kl(tiny_model(len(tok), seed=0), one["ping_a"], fixed, tok.pad_token_id)
    student = PeftModel.from_pretrained(tiny_model(len(tok), seed=0), summary["adapter"])
    after = _exact_reverse_kl(student, one["ping_a"], fixed, tok.pad_token_id)
    print("exact reverse KL", round(before, 4), "->", round(after, 4))
    assert after < 0.5 * before, (before, after)


def test_each_episode_is_scored_by_its_environments_teacher(tok, teachers, tmp_path):
    from peft import PeftModel

    from tracekit.artifacts import read_jsonl
    from tracekit.rl.tokens import Turn, rows_for_trajectory

    train_distill(tiny_model(len(tok), seed=0), tok, _suite(), teachers, _settings(iterations=1, save_rollouts="full"), tmp_path)
    (row,) = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    trajs = read_jsonl(tmp_path / "rollouts" / "iter_00000.jsonl")
    assert {t["info"]["task_env"] for t in trajs} == {"ping_a", "ping_b"}
    for env in ("ping_a", "ping_b"):
        rows = [r for t in trajs if t["info"]["task_env"] == env
                for r in rows_for_trajectory([Turn.from_dict(d) for d in t["info"]["turns"]], 0.0, 0)]  # fmt: skip
        teacher = PeftModel.from_pretrained(tiny_model(len(tok), seed=0), str(teachers[env] / "adapter"))
        t_lp = torch.cat(score_rows(teacher, rows, tok.pad_token_id, torch.device("cpu")))
        s_lp = torch.tensor([lp for r in rows for lp, m in zip(r.rollout_logprobs, r.loss_mask) if m])
        assert float(row[f"reverse_kl/{env}"]) == pytest.approx(float((s_lp - t_lp).mean()), rel=1e-4, abs=1e-6)


class _Kill(Exception):
    pass


def test_kill_and_resume_gives_the_same_adapter(tok, teachers, tmp_path):
    s = _settings(iterations=4, groups=2, samples_per_task=2, checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8, dropout=0.1))
    full = train_distill(tiny_model(len(tok), seed=0), tok, _suite(), teachers, s, tmp_path / "full")

    def kill_after_2(m):
        if m["iteration"] == 2:  # iteration 2 done, last checkpoint after iteration 1
            raise _Kill()

    with pytest.raises(_Kill):
        train_distill(tiny_model(len(tok), seed=0), tok, _suite(), teachers, s, tmp_path / "cut", callbacks=[kill_after_2])
    assert json.loads((tmp_path / "cut" / "checkpoints" / "latest.json").read_text())["iteration"] == 1
    cut = train_distill(tiny_model(len(tok), seed=0), tok, _suite(), teachers, s, tmp_path / "cut")
    from safetensors.torch import load_file

    a = load_file(full["adapter"] + "/adapter_model.safetensors")
    b = load_file(cut["adapter"] + "/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("teacher" in k for k in a)  # only the student is written
    ra = list(csv.DictReader((tmp_path / "full" / "metrics.csv").open()))
    rb = list(csv.DictReader((tmp_path / "cut" / "metrics.csv").open()))
    assert [r["iteration"] for r in rb] == ["0", "1", "2", "3"]
    assert [(r["reverse_kl"], r["loss"]) for r in ra] == [(r["reverse_kl"], r["loss"]) for r in rb]
    assert {k: v for k, v in full.items() if k != "adapter"} == {k: v for k, v in cut.items() if k != "adapter"}


def test_settings_and_teacher_map_are_checked(tok, teachers, tmp_path):
    with pytest.raises(ValueError, match=r"^distill\.lr=0 is invalid: must be > 0$"):
        DistillSettings(lr=0)
    with pytest.raises(ValueError, match=r"distill\.kl_coef=-1 is invalid: must be > 0"):
        DistillSettings(kl_coef=-1)
    with pytest.raises(ValueError, match=r"distill\.save_rollouts='all' is invalid"):
        DistillSettings(save_rollouts="all")
    d = DistillSettings()
    assert (d.temperature, d.kl_coef, d.lora.rank) == (1.0, 1.0, 32)
    with pytest.raises(ValueError, match=r"without a teacher \['ping_b'\]"):
        train_distill(tiny_model(len(tok), seed=0), tok, _suite(), {"ping_a": teachers["ping_a"]}, _settings(), tmp_path)
    with pytest.raises(ValueError, match="not a peft adapter"):
        bad = {"ping_a": tmp_path, "ping_b": tmp_path}
        train_distill(tiny_model(len(tok), seed=0), tok, _suite(), bad, _settings(), tmp_path)


_KILL_SCRIPT = """
import sys, torch
from pathlib import Path
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[3])
from test_rl_distill import _settings, _suite
from tracekit.rl.distill import train_distill
from tracekit.rl.settings import LoraSettings
from tracekit.rl.toy import tiny_model, tiny_tokenizer
tok = tiny_tokenizer()
t = Path(sys.argv[2])
s = _settings(iterations=8, checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8, dropout=0.1))
train_distill(tiny_model(len(tok), seed=0), tok, _suite(), {"ping_a": t / "a", "ping_b": t / "b"}, s, sys.argv[1])
"""


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted(tok, teachers, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT)
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=str(here.parent))
    args = [str(teachers["ping_a"].parent), str(here)]
    procs.run([sys.executable, str(script), str(tmp_path / "full"), *args], check=True, env=env, capture_output=True)
    p = procs.popen([sys.executable, str(script), str(tmp_path / "cut"), *args], env=env, stderr=subprocess.DEVNULL)
    latest = tmp_path / "cut" / "checkpoints" / "latest.json"
    procs.wait_for_path(latest, timeout=600, proc=p)  # the first checkpoint: an event, not a clock
    time.sleep(0.5)  # somewhere inside the next iterations
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not (tmp_path / "cut" / "adapter").exists(), "the run finished before it could be killed"
    procs.run([sys.executable, str(script), str(tmp_path / "cut"), *args], check=True, env=env, capture_output=True)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "full" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "adapter" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
