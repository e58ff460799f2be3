"""Memory of the GRPO update: a token budget per microbatch and checkpointing change how the update is
computed, never what it computes; releasing the rollout engine's decoder between phases changes nothing."""

from __future__ import annotations

import pytest
import torch

from tracekit.envs.base import EnvSuite, Episode, Observation, Outcome, StepResult
from tracekit.rl.settings import LoraSettings
from tracekit.rl.tokens import Turn, pack_microbatches, rows_for_trajectory
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rl.trainer import GRPOSettings, GRPOTrainer
from tracekit.types import Message, Task


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


class _Letters(Episode):
    """Reward = share of the letter 'e' among the reply's characters, over one or two turns (dense rewards:
    groups almost never tie); the prompt's length depends on the seed (rows of several lengths)."""

    def __init__(self, turns: int, pad: int):
        self.turns, self.pad, self.scores = turns, pad, []

    def reset(self) -> Observation:
        return Observation(messages=[Message(role="user", content="Write something" + " now" * self.pad + ".")], tools=[])

    def step(self, action: Message) -> StepResult:
        text = action.content or ""
        self.scores.append(text.count("e") / max(len(text), 1))
        done = len(self.scores) >= self.turns
        return StepResult(messages=[] if done else [Message(role="user", content="Again.")], done=done)

    def outcome(self) -> Outcome:
        r = sum(self.scores) / self.turns
        return Outcome(reward=r, success=r > 0.2)


class _LetterSuite(EnvSuite):
    name = "letters"

    def tasks(self) -> list[Task]:
        return [Task(id=f"t{i}", env=self.name) for i in range(3)]

    def episode(self, task: Task, seed: int = 0) -> Episode:
        return _Letters(turns=1 + int(task.id[1:]) % 2, pad=seed % 7)  # prompts of several lengths


class _Recording:
    """A backend that records each optimizer step's gradients (and the number of backward passes)
    instead of stepping: the update's gradients, compared across microbatch splits."""

    loss_scale = 1.0

    def __init__(self, model: torch.nn.Module, s: GRPOSettings):
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.steps: list[dict[str, torch.Tensor]] = []
        self.backwards = 0

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        self.backwards += 1
        loss.backward()

    def step(self) -> float:
        grads = {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for n, p in self.named}
        self.steps.append(grads)
        for _, p in self.named:
            p.grad = None
        return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))


def _settings(**kw) -> GRPOSettings:
    base = dict(
        iterations=1, groups=2, group_size=4, max_new_tokens=12, max_steps=3, lr=1e-2, num_minibatches=2,
        lora=LoraSettings(rank=4, alpha=8), seed=0, save_rollouts="none", old_logprobs="recompute",
    )  # fmt: skip
    base.update(kw)
    return GRPOSettings(**base)


def _trainer(tok, out, **kw) -> GRPOTrainer:
    return GRPOTrainer(tiny_model(len(tok), seed=0), tok, _LetterSuite(), _settings(**kw), out, backend_factory=_Recording)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("num_minibatches", [1, 2])
def test_chunked_update_gives_the_unchunked_gradients(tok, tmp_path, checkpointing, num_minibatches):
    """The same trajectories, one microbatch per minibatch vs a 1-token budget (every row its own
    microbatch, gradients accumulated): equal gradients, losses and statistics (fp32 rounding)."""
    whole = _trainer(tok, tmp_path / "whole", microbatch_tokens=10**6, num_minibatches=num_minibatches)
    trajs, _ = whole.collect(0)
    assert trajs, "no informative group: the test needs a gradient"
    rows = [r for i, t in enumerate(trajs)
            for r in rows_for_trajectory([Turn.from_dict(d) for d in t.info["turns"]], 0.0, i)]
    assert len({len(r) for r in rows}) > 1  # rows of different lengths: padding differs between the splits
    ref = whole.update_on(trajs, 0)

    chunked = _trainer(tok, tmp_path / "chunked", microbatch_tokens=1, num_minibatches=num_minibatches,
                       gradient_checkpointing=checkpointing)
    got = chunked.update_on(trajs, 0)

    assert whole.backend.backwards == num_minibatches  # one microbatch per minibatch
    assert chunked.backend.backwards == len(rows)  # one per row
    assert len(whole.backend.steps) == len(chunked.backend.steps) == num_minibatches
    for want_step, got_step in zip(whole.backend.steps, chunked.backend.steps):
        assert want_step.keys() == got_step.keys()
        assert any(g.abs().max() > 0 for g in want_step.values())
        for name in want_step:
            torch.testing.assert_close(got_step[name], want_step[name], rtol=1e-4, atol=1e-7, msg=name)
    for key in ("loss", "policy_loss", "clip_frac", "ratio_mean", "approx_kl", "grad_norm"):
        assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-7), key
    for key in ("optimizer_steps", "tokens_forward", "rows"):
        assert got[key] == ref[key], key


def test_budget_splits_rows_never_a_row():
    lengths = [5, 9, 3, 9, 1]
    for budget in (1, 4, 9, 10, 18, 100):
        batches = pack_microbatches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))  # every row exactly once
        for b in batches:
            assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= budget  # padded size within budget


def _train_adapter(tok, out, engine: str, release: bool) -> dict[str, torch.Tensor]:
    factory = None
    if engine == "client":
        from tracekit.llm.hf import HFChatClient
        from tracekit.rl.engines import ClientEngine

        def factory(model, t):
            return ClientEngine(HFChatClient(model, t, chat_format="qwen3", max_batch_size=8))

    tr = GRPOTrainer(tiny_model(len(tok), seed=0), tok, _LetterSuite(),
                     _settings(iterations=3, release_rollout_memory=release), out, engine_factory=factory)
    tr.train()
    return tr.adapter_state()


@pytest.mark.parametrize("engine", ["hf", "client"])
def test_releasing_the_rollout_decoder_changes_nothing(tok, tmp_path, engine):
    """Dropping the fast decoder before each update (rebuilt from the current weights at the next
    rollouts) trains the same adapter as keeping and re-merging it."""
    kept = _train_adapter(tok, tmp_path / "kept", engine, release=False)
    released = _train_adapter(tok, tmp_path / "released", engine, release=True)
    assert kept.keys() == released.keys()
    for k in kept:
        assert torch.equal(kept[k], released[k]), k


def test_release_rollout_memory_drops_the_decoder_until_the_next_rollouts(tok, tmp_path):
    tr = GRPOTrainer(tiny_model(len(tok), seed=0), tok, _LetterSuite(), _settings(release_rollout_memory=True),
                     tmp_path, backend_factory=_Recording)
    assert tr.engine.decoder is not None
    tr.collect(0)
    assert tr.engine.decoder.cap_s > 0  # a static KV cache was allocated
    tr.release_rollout_memory()
    assert tr.engine.decoder is None
    tr.collect(1)
    assert tr.engine.decoder is not None


def test_release_rollout_memory_setting_is_checked():
    with pytest.raises(ValueError, match="release_rollout_memory"):
        GRPOSettings(release_rollout_memory="yes")
