"""GRPO run health and control: the health columns of the metrics row, task retirement (skip_saturated),
early stop, and the health panel of the curves."""

from __future__ import annotations

import csv
import json
import math
import random

import pytest
import torch

from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.rl import grpo
from tracekit.rl.model import sequence_logprobs
from tracekit.rl.settings import LoraSettings
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.trainer import METRIC_COLUMNS, GRPOSettings, GRPOTrainer
from tracekit.types import Message, Task, stable_hash

HEALTH = ["entropy", "logprob_gap_mean", "logprob_gap_abs", "kl_ref", "informative_groups", "clip_frac", "grad_norm",
          "reward_mean", "reward_std", "frac_groups_dropped", "tasks_retired", "retired_fallbacks"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class _Episode(Episode):
    """``live``: reward = vowel share of the reply's letters (groups almost never tie); ``easy``: reward 1,
    success, whatever the agent says (every group solved: zero variance at the top)."""

    def __init__(self, kind: str, log: list, key: tuple):
        self.kind, self.scores = kind, []
        log.append(key)

    def reset(self) -> Observation:
        return Observation(messages=[Message(role="user", content="Say something with many vowels.")], tools=[])

    def step(self, action: Message) -> StepResult:
        letters = [c for c in (action.content or "") if c.isalpha()]
        vowels = sum(c in "aeiouAEIOU" for c in letters) / len(letters) if letters else 0.0
        self.scores.append(1.0 if self.kind == "easy" else vowels)
        return StepResult(messages=[], done=True)

    def outcome(self) -> Outcome:
        return Outcome(reward=self.scores[0], success=self.kind == "easy")


class _Suite(EnvSuite):
    """``live-*`` and ``easy-*`` tasks; ``log`` records each episode's (task id, env seed)."""

    def __init__(self, n_live: int, n_easy: int):
        self.name = "health"
        self._tasks = [Task(id=f"live-{i}", env=self.name) for i in range(n_live)] + [
            Task(id=f"easy-{i}", env=self.name) for i in range(n_easy)
        ]
        self.log: list[tuple[str, int]] = []

    def tasks(self) -> list[Task]:
        return self._tasks

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return _Episode(task.id.split("-")[0], self.log, (task.id, seed))


def _settings(**kw) -> GRPOSettings:
    base = dict(
        iterations=3, groups=2, group_size=4, max_new_tokens=8, max_steps=1, lr=1e-2, num_minibatches=2,
        checkpoint_every=2, lora=LoraSettings(rank=4, alpha=8), seed=0, save_rollouts="none", dtype="float32",
    )  # fmt: skip
    base.update(kw)
    return GRPOSettings(**base)


def _trainer(tok, out, suite, callbacks=(), **kw) -> GRPOTrainer:
    return GRPOTrainer(tiny_model(len(tok), seed=0), tok, suite, _settings(**kw), out, callbacks=callbacks)


def _rows(path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(path / "metrics.csv", newline="")))


def _groups(log: list[tuple[str, int]], k: int) -> list[str]:
    """Task ids of the groups, in draw order (each group is k consecutive episodes of one (task, seed))."""
    assert len(log) % k == 0 and all(len(set(log[i : i + k])) == 1 for i in range(0, len(log), k))
    return [log[i][0] for i in range(0, len(log), k)]


# ---- the metrics row ------------------------------------------------------------------------


def test_every_metrics_row_has_finite_health_columns(tok, tmp_path):
    seen = []
    tr = _trainer(tok, tmp_path, _Suite(4, 0), callbacks=[seen.append], health_kl_ref=True)
    tr.train()
    rows = _rows(tmp_path)
    assert [int(r["iteration"]) for r in rows] == [0, 1, 2]
    assert set(HEALTH) <= set(METRIC_COLUMNS) and list(rows[0]) == METRIC_COLUMNS
    for r, m in zip(rows, seen):
        for col in HEALTH:
            assert r[col] != "" and math.isfinite(float(r[col])), (col, r[col])
            assert math.isfinite(float(m[col])), col
        assert int(r["informative_groups"]) == int(r["groups"]) - int(r["groups_dropped"]) == 2
        assert 0 < float(r["entropy"]) <= math.log(len(tok)) + 1e-6
        assert float(r["kl_ref"]) >= 0 and float(r["grad_norm"]) > 0
    # the adapter starts at B = 0 (policy == base); after two iterations of steps it has moved off the base
    assert float(rows[2]["kl_ref"]) > 1e-6


def test_kl_ref_is_an_empty_cell_unless_measured(tok, tmp_path):
    seen = []
    _trainer(tok, tmp_path, _Suite(4, 0), callbacks=[seen.append], iterations=1).train()
    (row,) = _rows(tmp_path)
    assert row["kl_ref"] == "" and "kl_ref" not in seen[0]
    assert math.isfinite(float(row["entropy"]))


def test_kl_ref_is_measured_with_kl_beta_without_health_kl_ref(tok, tmp_path):
    # the adapter starts at B = 0: policy == base, k3 == 0; once it moved, both KL columns are positive
    tr = _trainer(tok, tmp_path, _Suite(4, 0), kl_beta=0.1, num_minibatches=1)
    m0 = tr.iteration(0)
    assert m0["kl_ref"] == pytest.approx(0.0, abs=1e-7) and m0["kl"] == pytest.approx(0.0, abs=1e-7)
    m1 = tr.iteration(1)
    assert m1["kl_ref"] > 0 and m1["kl"] > 0


def test_grad_norm_is_the_norm_before_clipping(tok, tmp_path):
    m = _trainer(tok, tmp_path, _Suite(4, 0), max_grad_norm=1e-4).iteration(0)
    assert m["optimizer_steps"] == 2 and m["grad_norm"] > 1e-3  # a clipped norm would read <= 1e-4


def test_entropy_matches_the_full_softmax(tok):
    torch.manual_seed(0)
    model = tiny_model(len(tok), seed=1)
    ids = torch.randint(5, len(tok), (3, 11))
    attn = torch.ones_like(ids)
    attn[2, 8:] = 0  # right padding
    mask = torch.zeros(3, 11)
    mask[0, 4:] = 1
    mask[1, 2:7] = 1
    mask[2, 5:8] = 1
    T = 0.7
    lp, ent = sequence_logprobs(model, ids, attn, mask, temperature=T, chunk=3, entropy=True)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float() / T
        logq = torch.log_softmax(logits[:, :-1], -1)
        sel = mask[:, 1:] > 0
        want_ent = -(logq.exp() * logq).sum(-1)[sel]
        want_lp = logq.gather(2, ids[:, 1:, None]).squeeze(2)[sel]
    assert ent.shape == want_ent.shape == (int(mask.sum()),)
    assert torch.allclose(ent, want_ent, atol=1e-5), (ent - want_ent).abs().max()
    assert torch.allclose(lp, want_lp, atol=1e-5)
    assert not ent.requires_grad
    # the log-probs (and their gradient) are those of the plain path
    plain = sequence_logprobs(model, ids, attn, mask, temperature=T, chunk=3)
    assert torch.equal(lp.detach(), plain.detach())


def test_entropy_pass_leaves_the_gradient_unchanged(tok):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_model(len(tok), seed=2), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1)
    ids = torch.randint(5, len(tok), (2, 9))
    mask = torch.zeros(2, 9)
    mask[:, 3:] = 1
    grads = []
    for with_entropy in (False, True):
        model.zero_grad(set_to_none=True)
        out = sequence_logprobs(model, ids, torch.ones_like(ids), mask, chunk=4, entropy=with_entropy)
        lp = out[0] if with_entropy else out
        (lp * torch.linspace(-1, 1, lp.numel())).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


def test_entropy_from_logits_is_the_definition():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [30.0, 0.0, -5.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    p = torch.softmax(logits, -1)
    want = -(p * torch.log(p)).sum(-1)
    got = grpo.entropy_from_logits(logits, torch.logsumexp(logits, -1))
    assert torch.allclose(got, want, atol=1e-5)
    assert got[0] == pytest.approx(math.log(4), abs=1e-6)


@pytest.mark.parametrize("old_logprobs", ["rollout", "recompute"])
def test_logprob_gap_is_zero_for_unconstrained_rollouts_of_the_same_weights(tok, tmp_path, old_logprobs):
    # CPU float32: the rollout engine decodes with the adapter merged into a working copy; it agrees with
    # the trainer's unmerged forward to ~1e-6 (llm/decoding.py), before and after updates
    tr = _trainer(tok, tmp_path, _Suite(4, 0), old_logprobs=old_logprobs)
    for it in range(2):
        m = tr.iteration(it)
        assert m["optimizer_steps"] == 2  # tokens were scored: the gap cells are measured, not left out
        assert m["logprob_gap_abs"] < 1e-5 and abs(m["logprob_gap_mean"]) <= m["logprob_gap_abs"]


def test_masked_rollout_logprobs_cancel_out_of_the_recomputed_ratio(tok, tmp_path):
    """Rollout log-probs raised as a grammar mask raises them (renormalized over fewer tokens): with
    old_logprobs=recompute the first step's ratio is still exactly 1 and the gap columns show the shift;
    with old_logprobs=rollout the ratio takes it in."""
    shift = 0.3
    results = {}
    for mode in ("recompute", "rollout"):
        tr = _trainer(tok, tmp_path / mode, _Suite(4, 0), old_logprobs=mode, num_minibatches=1)
        trajs, _ = tr.collect(0)
        assert trajs
        for t in trajs:
            for turn in t.info["turns"]:
                turn["completion_logprobs"] = [lp + shift for lp in turn["completion_logprobs"]]
        results[mode] = tr.update_on(trajs, 0)
    rec, rol = results["recompute"], results["rollout"]
    assert rec["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert rec["logprob_gap_mean"] == pytest.approx(shift, abs=1e-5) and rec["logprob_gap_abs"] == pytest.approx(shift, abs=1e-5)
    assert rol["ratio_mean"] == pytest.approx(math.exp(-shift), rel=1e-4)
    assert rol["logprob_gap_mean"] == pytest.approx(shift, abs=1e-5)


def test_logprob_gap_of_a_masked_distribution_is_nonnegative():
    torch.manual_seed(0)
    logits = torch.randn(6, 20)
    allowed = torch.rand(6, 20) < 0.4
    allowed[:, 0] = True
    targets = torch.zeros(6, dtype=torch.long)  # an allowed token of each row
    full = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    masked = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1).gather(1, targets[:, None]).squeeze(1)
    gap, gap_abs = grpo.logprob_gap_sums(masked, full)
    assert gap > 0 and gap == pytest.approx(float(gap_abs))
    gap, gap_abs = grpo.logprob_gap_sums(full, masked)
    assert gap < 0 and gap_abs == pytest.approx(-float(gap))


# ---- skip_saturated -------------------------------------------------------------------------


def test_sampling_without_retired_tasks_is_the_paper_recipe(tok, tmp_path):
    tr = _trainer(tok, tmp_path, _Suite(3, 2), skip_saturated=True)
    tasks = tr.suite.tasks()
    for it, rnd in [(0, 0), (5, 1)]:
        rng = random.Random(int(stable_hash([0, it, rnd], 15), 16))
        want = [(tasks[rng.randrange(len(tasks))], rng.randrange(2**31)) for _ in range(4)]
        assert tr._sample_groups(it, rnd, 4) == (want, False)


def test_update_retired_keeps_the_last_group_outcome():
    assert grpo.update_retired([], [("a", True), ("b", False)]) == ["a"]
    assert grpo.update_retired(["a", "c"], [("a", False), ("b", True)]) == ["b", "c"]
    assert grpo.update_retired(["a"], [("a", False), ("a", True)]) == ["a"]
    assert grpo.update_retired(["a"], [("a", True), ("a", False)]) == []


def test_solved_groups_need_every_success_and_one_reward():
    rewards = torch.tensor([[1.0, 1.0], [1.0, 0.5], [0.0, 0.0], [0.8, 0.8]])
    success = torch.tensor([[True, True], [True, True], [False, False], [True, False]])
    assert grpo.solved_groups(rewards, success).tolist() == [True, False, False, False]


class _Recording(GRPOTrainer):
    """Records, for each round's draw, the retired record it drew against and the drawn task keys."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.draws: list[tuple[list[str], list[str], bool]] = []

    def _sample_groups(self, it, rnd, n):
        pairs, fallback = super()._sample_groups(it, rnd, n)
        self.draws.append((list(self.retired), [self.task_key(t) for t, _ in pairs], fallback))
        return pairs, fallback


def _recording(tok, out, suite, callbacks=(), **kw) -> _Recording:
    return _Recording(tiny_model(len(tok), seed=0), tok, suite, _settings(**kw), out, callbacks=callbacks)


def _run_saturated(tok, out, iterations=6, callbacks=(), **kw):
    suite = _Suite(3, 3)
    tr = _recording(tok, out, suite, callbacks=callbacks, iterations=iterations, groups=3, skip_saturated=True, **kw)
    return tr, suite


def test_skip_saturated_retires_solved_tasks_and_later_draws_avoid_them(tok, tmp_path):
    seen = []
    tr, suite = _run_saturated(tok, tmp_path / "a", callbacks=[seen.append])
    tr.train()
    groups = _groups(suite.log, 4)
    per_it = [groups[i : i + 3] for i in range(0, len(groups), 3)]  # no resampling: 3 groups per iteration
    assert len(per_it) == 6
    retired: set[str] = set()
    for it, drawn in enumerate(per_it):
        assert not retired & {f"health/{t}" for t in drawn}, (it, drawn, retired)  # never a retired task
        retired |= {f"health/{t}" for t in drawn if t.startswith("easy")}  # an easy group is always solved
        assert seen[it]["tasks_retired"] == len(retired) and seen[it]["retired_fallbacks"] == 0
    assert retired, "no easy task was drawn: the test retires nothing"
    assert tr.retired == sorted(retired)
    assert all(not set(r) & set(d) for r, d, _ in tr.draws)

    # deterministic: a second run draws the same groups
    tr2, suite2 = _run_saturated(tok, tmp_path / "b")
    tr2.train()
    assert suite2.log == suite.log and tr2.retired == tr.retired
    assert [r["reward_mean"] for r in _rows(tmp_path / "b")] == [r["reward_mean"] for r in _rows(tmp_path / "a")]


def test_skip_saturated_off_draws_retirable_tasks_again(tok, tmp_path):
    suite = _Suite(3, 3)
    _trainer(tok, tmp_path, suite, iterations=6, groups=3).train()
    easy = [t for t in _groups(suite.log, 4) if t.startswith("easy")]
    assert len(easy) > len(set(easy))  # the paper's draws repeat solved tasks


class _Stop(Exception):
    pass


def test_skip_saturated_survives_resume_from_a_checkpoint(tok, tmp_path):
    full, suite_full = _run_saturated(tok, tmp_path / "full")
    full.train()

    def stop_after_2(m):
        if m["iteration"] == 2:  # the last checkpoint is after iteration 1 (checkpoint_every=2)
            raise _Stop()

    cut, _ = _run_saturated(tok, tmp_path / "cut", callbacks=[stop_after_2])
    with pytest.raises(_Stop):
        cut.train()
    state = json.loads((tmp_path / "cut" / "checkpoints" / "iter_00001" / "state.json").read_text())
    assert state["retired_tasks"] and len(state["retired_tasks"]) == int(_rows(tmp_path / "full")[1]["tasks_retired"])
    assert cut.retired != state["retired_tasks"]  # iteration 2 retired more: the resume must not see those
    resumed, suite_res = _run_saturated(tok, tmp_path / "cut")
    resumed.train()
    assert resumed.start_iteration == 2
    k, per_it = 4, 3
    assert suite_res.log == suite_full.log[2 * per_it * k :]  # iterations 2..5 draw as the uninterrupted run's
    assert resumed.retired == full.retired
    assert [r["tasks_retired"] for r in _rows(tmp_path / "cut")] == [r["tasks_retired"] for r in _rows(tmp_path / "full")]
    assert [r["loss"] for r in _rows(tmp_path / "cut")] == [r["loss"] for r in _rows(tmp_path / "full")]


def test_every_task_retired_falls_back_to_all_tasks(tok, tmp_path):
    suite = _Suite(0, 1)
    tr = _trainer(tok, tmp_path, suite, skip_saturated=True, groups=1)
    m0, m1 = tr.iteration(0), tr.iteration(1)
    assert (m0["tasks_retired"], m0["retired_fallbacks"]) == (1, 0)
    assert (m1["tasks_retired"], m1["retired_fallbacks"]) == (1, 1)  # drawn anyway, solved again: still retired
    assert m1["informative_groups"] == 0 and m1["optimizer_steps"] == 0


def test_skip_saturated_with_dynamic_resampling_keeps_iterations_informative(tok, tmp_path):
    seen = []
    tr = _recording(tok, tmp_path, _Suite(2, 4), callbacks=[seen.append], iterations=4, groups=2, skip_saturated=True,
                    dynamic_resampling=True, max_resample_rounds=8)
    tr.train()
    assert all(m["informative_groups"] == 2 and m["optimizer_steps"] == 2 for m in seen)
    assert any(rnd_retired for rnd_retired, _, _ in tr.draws)
    for retired, drawn, fallback in tr.draws:  # refill rounds and later iterations avoid what was retired
        assert not fallback and not set(retired) & set(drawn), (retired, drawn)


# ---- early stop -----------------------------------------------------------------------------


def test_early_stop_rule():
    f = grpo.early_stop_reason
    assert f([0, 0, 0], [0.0, 0.0, 0.0], 0, 0.0) is None  # off
    assert f([1, 0, 0], [0.1, 0.2, 0.3], 2, 0.0) == "no_informative_groups"
    assert f([1, 0], [0.1, 0.2], 3, 0.0) is None
    # moving average over 2: m1 = .15, m2 = .25 (the last best), m3 = .25 (a tie is no gain), m4 = .2:
    # after iteration 3, 3 - 2 < 2; after iteration 4, 4 - 2 >= 2: plateau
    assert f([1] * 4, [0.1, 0.2, 0.3, 0.2], 2, 0.0) is None
    assert f([1] * 5, [0.1, 0.2, 0.3, 0.2, 0.2], 2, 0.0) == "reward_plateau"
    assert f([1] * 5, [0.1, 0.2, 0.3, 0.2, 0.5], 2, 0.0) is None  # m4 = .35 is a new best
    # min_delta .25: no later m_t exceeds m1 = .15 by more than .25 (m4 = .35), so the best stays at 1
    assert f([1] * 4, [0.1, 0.2, 0.3, 0.2], 2, 0.25) == "reward_plateau"
    assert f([1] * 5, [0.1, 0.2, 0.3, 0.2, 0.5], 2, 0.25) == "reward_plateau"
    # a flat reward: m1 is the only best; the earliest stop is after iteration 2p - 1
    assert f([1] * 3, [1.0] * 3, 2, 0.0) is None and f([1] * 4, [1.0] * 4, 2, 0.0) == "reward_plateau"
    with pytest.raises(ValueError):
        f([1], [0.1, 0.2], 1, 0.0)


def test_pool_reward_counts_retired_tasks_as_solved():
    # the H200 run of experiment=gain: tool_calling_precision drew ever harder tasks (67 of 320 retired), its
    # drawn reward 0.33 -> 0.31 looked flat while the pool's rose; the plateau rule must read the pool's
    assert grpo.pool_reward(0.5, 0, 10) == 0.5
    assert grpo.pool_reward(0.0, 5, 10) == 0.5 and grpo.pool_reward(1.0, 3, 10) == 1.0
    assert grpo.pool_reward(0.312, 67, 320) == pytest.approx(67 / 320 + (1 - 67 / 320) * 0.312)
    with pytest.raises(ValueError):
        grpo.pool_reward(0.5, 11, 10)
    rewards = [0.33, 0.55, 0.59, 0.35, 0.48, 0.33, 0.48, 0.50, 0.53, 0.45, 0.34, 0.46, 0.31]
    retired = [1, 4, 7, 8, 15, 18, 24, 29, 38, 47, 51, 61, 67]
    pooled = [grpo.pool_reward(r, n, 320) for r, n in zip(rewards, retired)]
    assert grpo.early_stop_reason([1] * 13, rewards, 6, 0.0) == "reward_plateau"  # what stopped that run
    assert grpo.early_stop_reason([1] * 13, pooled, 6, 0.0) is None


def test_early_stop_after_patience_iterations_without_an_informative_group(tok, tmp_path):
    seen = []
    tr = _trainer(tok, tmp_path, _Suite(0, 2), callbacks=[seen.append], iterations=10, early_stop_patience=3,
                  checkpoint_every=5)
    adapter = tr.train()
    assert [m["iteration"] for m in seen] == [0, 1, 2]
    assert json.loads((tmp_path / "stopped.json").read_text()) == {
        "iteration": 2, "reason": "no_informative_groups", "iterations_run": 3}
    rows = _rows(tmp_path)
    assert len(rows) == 3 and sum(int(r["optimizer_steps"]) for r in rows) == 0  # the budget it ran
    assert (adapter / "adapter_model.safetensors").exists()
    assert json.loads((tmp_path / "checkpoints" / "latest.json").read_text())["iteration"] == 2  # final checkpoint
    # a rerun resumes into the stopped state: nothing more runs
    again = _trainer(tok, tmp_path, _Suite(0, 2), callbacks=[seen.append], iterations=10, early_stop_patience=3,
                     checkpoint_every=5)
    again.train()
    assert again.start_iteration == 3 and len(seen) == 3 and len(_rows(tmp_path)) == 3


def test_no_early_stop_when_off_or_informative(tok, tmp_path):
    _trainer(tok, tmp_path / "off", _Suite(0, 2), iterations=4).train()
    assert len(_rows(tmp_path / "off")) == 4 and not (tmp_path / "off" / "stopped.json").exists()
    # informative groups every iteration, and 3 iterations are too few for a plateau with patience 2
    _trainer(tok, tmp_path / "on", _Suite(4, 0), iterations=3, early_stop_patience=2).train()
    assert len(_rows(tmp_path / "on")) == 3 and not (tmp_path / "on" / "stopped.json").exists()


def test_settings_validation():
    for kw, key in [(dict(early_stop_patience=-1), "early_stop_patience"), (dict(early_stop_patience=1.5), "early_stop_patience"),
                    (dict(early_stop_min_delta=-0.1), "early_stop_min_delta"), (dict(skip_saturated="yes"), "skip_saturated"),
                    (dict(health_kl_ref=1), "health_kl_ref")]:
        with pytest.raises(ValueError, match=f"grpo.{key}="):
            GRPOSettings(**kw)
    s = GRPOSettings()
    assert (s.health_kl_ref, s.skip_saturated, s.early_stop_patience, s.early_stop_min_delta) == (False, False, 0, 0.0)


def test_the_paper_recipe_has_the_settings_off(make_cfg):
    """The grpo group (conf/grpo/paper.yaml over the class defaults) leaves every health and control setting off."""
    cfg = make_cfg("experiment=paper").grpo
    assert (cfg.health_kl_ref, cfg.skip_saturated, cfg.early_stop_patience, cfg.early_stop_min_delta) == (False, False, 0, 0.0)


# ---- curves ---------------------------------------------------------------------------------


def test_curves_health_panel_png_and_csv(tok, tmp_path):
    from tracekit.planted.curves import panels, read_curve, write_curves

    _trainer(tok, tmp_path / "a", _Suite(4, 0), iterations=2, health_kl_ref=True).train()
    _trainer(tok, tmp_path / "b", _Suite(4, 0), iterations=2).train()
    old = tmp_path / "old"  # a metrics.csv of before the health columns
    old.mkdir()
    (old / "metrics.csv").write_text("iteration,reward_mean,success_rate,groups,frac_groups_dropped\n0,0.5,0.2,4,0.25\n")
    curves = {"a": read_curve(tmp_path / "a" / "metrics.csv"), "b": read_curve(tmp_path / "b" / "metrics.csv"),
              "old": read_curve(old / "metrics.csv")}
    assert math.isfinite(curves["a"][0]["kl_ref"]) and math.isnan(curves["b"][0]["kl_ref"])
    assert math.isnan(curves["old"][0]["entropy"]) and curves["old"][0]["informative"] == 0.75
    keys = [k for k, _ in panels(curves)]
    assert keys == ["reward", "informative", "entropy", "kl_ref", "clip_frac", "grad_norm", "logprob_gap_mean", "logprob_gap_abs"]
    assert "kl_ref" not in [k for k, _ in panels({"b": curves["b"]})]
    png, out_csv = tmp_path / "out" / "curves.png", tmp_path / "out" / "curves.csv"
    write_curves(curves, png, out_csv, title="health")
    assert png.stat().st_size > 10_000
    rows = list(csv.DictReader(open(out_csv, newline="")))
    assert [r["run"] for r in rows] == ["a", "a", "b", "b", "old"]
    assert float(rows[0]["entropy"]) > 0 and float(rows[0]["kl_ref"]) >= 0 and rows[2]["kl_ref"] == ""
    assert rows[4]["entropy"] == "" and float(rows[4]["reward"]) == 0.5
