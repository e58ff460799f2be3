"""The routing table at outcome-deciding tokens (issue 53, tracekit.report.routing) on a two-adapter toy: a hand-made
micro episode with a locked read, stored as a finished run's compose and episodes artifacts. The decision rows name
the turn after the locked read and the expert generation routes that turn's first token to; turn granularity gives
one expert for the whole turn; soft top-k weights sum to 1; the task router's weights are kept per episode; a run
without a compose artifact is one line."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tracekit.artifacts import StageCache, atomic_write_json, write_jsonl
from tracekit.llm.base import ChatRequest, ChatResponse
from tracekit.llm.tools import encode_prompt
from tracekit.moe.model import MoEConfig, build_lora_moe
from tracekit.moe.routed import PromptRoutedClient
from tracekit.moe.task_router import save_task_router
from tracekit.pipeline import RunRecord
from tracekit.report.routing import (DECISIONS_CSV, EPISODES_CSV, ROUTING_MD, RoutingTableError, decision_points,
                                     routing_table)
from tracekit.rl.toy import tiny_model, tiny_tokenizer
from tracekit.rollout import TRAJECTORIES
from tracekit.targets.micro.library import MicroFinishAllWrites, MicroRefuseLocked
from tracekit.types import Message, ToolCall, Trajectory

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tok):
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("routing_table")
    out = {}
    for i in range(2):
        torch.manual_seed(40 + i)
        get_peft_model(tiny_model(len(tok), seed=1), LoraConfig(r=4, lora_alpha=8, target_modules=ALL,
                                                                 init_lora_weights=False)).save_pretrained(root / f"a{i}")
        out[f"cap{i}"] = root / f"a{i}"
    return out


def locked_episode(tok) -> Trajectory:
    """A micro_refuse_locked episode: read the locked target, then say it is locked (turn 1 decides)."""
    env = MicroRefuseLocked(0)
    seed = next(s for s in range(100) if env.generate(s).params["locked"])
    instance, tools = env.generate(seed), env.tools()
    target = instance.params["locked"][0]
    item = instance.state["items"][target]
    messages = [Message(role="system", content=instance.system_prompt), Message(role="user", content=instance.user_goal),
                Message(role="assistant", tool_calls=[ToolCall(id="c1", name="read", arguments={"id": target})]),
                Message(role="tool", content=json.dumps({"value": item["value"], "locked": True}), tool_call_id="c1",
                        name="read"),
                Message(role="assistant", content=f"{target} is locked.")]
    turns = [{"prompt_ids": encode_prompt(tok, messages[:i], tools), "completion_ids": [5], "completion_logprobs": [0.0],
              "finish_reason": "stop"} for i, m in enumerate(messages) if m.role == "assistant"]
    return Trajectory(task_id="t0", env=env.name, seed=seed, messages=messages, reward=1.0, success=True,
                      termination="done", info={"seed": seed, "difficulty": 0, "turns": turns})


def finished_run(tmp_path, model, episodes, extra=None):
    """A run directory whose artifacts.json holds a compose artifact (``model`` saved as TRACE's LoRA-MoE) and the
    evaluation episodes of that row."""
    cache, run_dir = StageCache(tmp_path / "cache"), tmp_path / "run"
    run_dir.mkdir()

    def compose(work):
        model.save(work / "moe")
        if extra:
            extra(work / "moe")
        atomic_write_json(work / "consolidated.json", {"strategy": "moe", "label": "TRACE", "kind": "moe",
                                                       "subdir": "moe", "weights": None,
                                                       "budget": {"episodes": 0, "generated_tokens": 0,
                                                                  "optimizer_steps": 0}, "notes": []})

    art = cache.get_or_compute("compose", "c0", compose)
    policy = {"kind": "moe", "weights": art.content_key, "subdir": "moe"}

    def rollout(work):
        write_jsonl(work / TRAJECTORIES, episodes)
        atomic_write_json(work / "summary.json", {"policy": policy, "path": TRAJECTORIES})

    record = RunRecord(run_dir)
    record.used(art, 0.0)
    record.used(cache.get_or_compute("episodes", "e0", rollout, meta={"policy": policy}), 0.0)
    return run_dir


def _table(run_dir, out, tok):
    routing_table(run_dir, out, load=lambda ref, device: (tiny_model(len(tok), seed=1), tok))
    with open(out / DECISIONS_CSV) as f:
        return list(csv.DictReader(f))


def _moe(adapters, tok, **kw):
    return build_lora_moe(tiny_model(len(tok), seed=1), adapters, MoEConfig(gate_init_std=2.0, seed=5, **kw),
                          backbone_spec={"toy": 1}).eval()


def test_the_decision_rows_name_the_turn_after_the_locked_read_and_its_expert(adapters, tok, tmp_path):
    model = _moe(adapters, tok)
    episode = locked_episode(tok)
    rows = _table(finished_run(tmp_path, model, [episode]), tmp_path / "out", tok)
    assert {r["decision"] for r in rows} == {"locked"}
    assert {(r["turn"], r["message_index"]) for r in rows} == {("1", "4")}  # the assistant turn after the tool result
    assert [r["block"] for r in rows] == [str(b) for b in model.blocks] and all(r["passed"] == "1" for r in rows)
    # the expert generation routes the turn's first token to: the gates at the prompt's last token, per block
    ids = encode_prompt(tok, episode.messages[:4], MicroRefuseLocked(0).tools())
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    chosen = {str(b): model.slot_names[int(p[-1].argmax())] for b, p in model.gate_probs().items()}
    assert {r["block"]: r["expert"] for r in rows} == chosen
    for r in rows:  # hard top-1 keeps the chosen slot's raw probability, 0 elsewhere
        assert float(r[f"weight_{r['expert']}"]) == pytest.approx(float(r[f"prob_{r['expert']}"]), abs=1e-5)
    md = (tmp_path / "out" / ROUTING_MD).read_text()
    assert "| micro_refuse_locked | locked | 1 | 1 |" in md and "granularity token, hard top-1" in md


class Recorder:
    """An inner client recording the slots every token of every block routed to while the routed client pins a turn."""

    def __init__(self, model, encode):
        self.model, self.encode, self.slots = model, encode, []

    def chat(self, requests):
        for r in requests:
            with torch.no_grad():
                self.model(input_ids=torch.tensor([self.encode(r.messages, r.tools) + [7, 8, 9]]))
            self.slots.append({self.model.slot_names[int(s)] for p in self.model.gate_probs().values()
                               for s in p.argmax(-1)})
        return [ChatResponse(message=Message(role="assistant", content="x"), text="x") for _ in requests]


def test_turn_granularity_gives_one_expert_for_the_whole_turn(adapters, tok, tmp_path):
    from tracekit.moe.routed import GateDecider

    model = _moe(adapters, tok, granularity="turn")
    episode = locked_episode(tok)
    rows = _table(finished_run(tmp_path, model, [episode]), tmp_path / "out", tok)
    assert len(rows) == len(model.blocks) and len({r["expert"] for r in rows}) == 1
    assert all(float(r[f"weight_{r['expert']}"]) == 1.0 for r in rows)  # hard: the chosen adapter at full weight
    # the routed client, deciding that turn live, pins every token of every block of it to the same expert
    encode = lambda m, t: encode_prompt(tok, m, t)  # noqa: E731
    rec = Recorder(model, encode)
    client = PromptRoutedClient(rec, model, GateDecider(model, encode, 0))
    client.chat([ChatRequest(messages=episode.messages[:4], tools=MicroRefuseLocked(0).tools(), max_new_tokens=4)])
    assert rec.slots == [{rows[0]["expert"]}]


@pytest.mark.parametrize("granularity", ["token", "turn", "trajectory"])
def test_soft_top_k_weights_sum_to_one(adapters, tok, tmp_path, granularity):
    model = _moe(adapters, tok, granularity=granularity, soft_top_k=2, soft_temperature=0.5)
    rows = _table(finished_run(tmp_path, model, [locked_episode(tok)]), tmp_path / "out", tok)
    assert rows
    for r in rows:
        weights = [float(r[f"weight_{s}"]) for s in model.slot_names]
        assert sum(weights) == pytest.approx(1.0, abs=1e-4) and all(w > 0 for w in weights)  # both kept (k = 2)
    if granularity == "trajectory":  # one decision per episode: kept per episode too
        with open(tmp_path / "out" / EPISODES_CSV) as f:
            (episode,) = list(csv.DictReader(f))
        assert {s: episode[f"weight_{s}"] for s in model.slot_names} == {s: rows[0][f"weight_{s}"]
                                                                         for s in model.slot_names}


def test_the_task_routers_weights_are_kept_per_episode(adapters, tok, tmp_path):
    model = _moe(adapters, tok, include_base_slot=True, granularity="trajectory", decider="task")
    corpus = [{"capability": "cap0", "task": "refuse the locked item", "example": "x"},
              {"capability": "cap1", "task": "finish every write", "example": "y"}]

    def router_files(moe_dir):
        save_task_router(moe_dir, {"cap0": "refuses locked items", "cap1": "finishes every write"}, 0.9, 2, corpus,
                         torch.randn(2, model.config.hidden_size, generator=torch.Generator().manual_seed(0)))

    out = tmp_path / "out"
    rows = _table(finished_run(tmp_path, model, [locked_episode(tok)], router_files), out, tok)
    assert [r["block"] for r in rows] == ["all"]  # the router decides, no gate
    with open(out / EPISODES_CSV) as f:
        (episode,) = list(csv.DictReader(f))
    weights = [float(episode[f"weight_{s}"]) for s in model.slot_names]
    assert sum(weights) == pytest.approx(1.0, abs=1e-5) and model.slot_names == ["base", "cap0", "cap1"]
    md = (out / ROUTING_MD).read_text()
    assert "The episode's weights" in md and "the task router (one decision per episode, top-p 0.9" in md


def test_decision_points_of_a_several_write_request_and_a_question():
    env = MicroFinishAllWrites(0)
    instance = env.generate(3)
    a, b = instance.params["targets"]
    messages = [Message(role="system", content="s"), Message(role="user", content=instance.user_goal),
                Message(role="assistant", tool_calls=[ToolCall(id="w1", name="write", arguments={"id": a, "value": 1})]),
                Message(role="tool", content="ok", tool_call_id="w1", name="write"),
                Message(role="assistant", tool_calls=[ToolCall(id="w2", name="write", arguments={"id": b, "value": 1})]),
                Message(role="tool", content="ok", tool_call_id="w2", name="write"),
                Message(role="assistant", content="done")]
    (point,) = decision_points(messages, instance.params)
    assert (point.kind, point.message_index, point.turn) == ("first_write_ok", 4, 1)  # the first ok only
    assert decision_points(messages, {**instance.params, "values": [1]}) == []  # one write: nothing to go on with
    question = {"kinds": ["report_value"], "targets": ["k11"], "locked": []}
    asked = [Message(role="user", content="What is k11?"),
             Message(role="assistant", tool_calls=[ToolCall(id="r", name="read", arguments={"id": "k11"})]),
             Message(role="tool", content='{"value": 3, "locked": false}', tool_call_id="r", name="read")]
    assert decision_points(asked, question) == []  # the episode ended at the read: no turn decided there
    (point,) = decision_points(asked + [Message(role="assistant", content="k11 is 3")], question)
    assert (point.kind, point.turn) == ("asked_read", 1)


def test_a_run_without_a_compose_artifact_is_one_line(tmp_path, capsys):
    from tracekit.planted.routing import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    atomic_write_json(run_dir / "artifacts.json", {"rollout/r0": {"stage": "rollout", "key": "r0", "path": "x"}})
    with pytest.raises(RoutingTableError, match="no compose artifact"):
        routing_table(run_dir)
    assert main(["--run", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no compose artifact" in err
    assert main(["--run", str(tmp_path / "nowhere")]) == 2
    assert "no artifacts.json" in capsys.readouterr().err


def test_episodes_of_another_world_are_one_line_before_any_model_loads(adapters, tok, tmp_path):
    other = locked_episode(tok).model_copy(update={"env": "tau2_retail"})
    run_dir = finished_run(tmp_path, _moe(adapters, tok), [other])

    def load(ref, device):
        raise AssertionError("no model is loaded for episodes the table cannot read")

    with pytest.raises(RoutingTableError, match=r"tau2_retail/t0/0 \(environment tau2_retail\) is not a micro-world"):
        routing_table(run_dir, tmp_path / "out", load=load)
