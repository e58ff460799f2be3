"""Synthesis chaining (issue 53, beyond the paper): two environments in one conversation, generic over the protocol;
conflicting tools refused in one line; the synthesize stage samples each chain and records it."""

from __future__ import annotations

from typing import Any

import pytest
from tracekit.agents import Agent, AgentState
from tracekit.llm.base import ChatResponse
from tracekit.synthesis.chain import (CHAINS, ChainedSuite, chain_records, chain_sampler, chain_trajectories,
                                      merged_tools, parse_chain)
from tracekit.synthesis.library import library_env
from tracekit.synthesis.protocol import Instance, SyntheticEnv, World
from tracekit.synthesis.settings import SynthesisConfig
from tracekit.synthesis.stage import SynthesisSettings, synthesize
from tracekit.synthesis.suite import SyntheticSuite
from tracekit.types import Capability, Message, ToolCall

REFUSE, FINISH = "micro_refuse_locked", "micro_finish_all_writes"


def _suite(name: str, seeds, user: str = "scripted") -> SyntheticSuite:
    return SyntheticSuite.from_env(library_env(name)(0), seeds, user=user)


def _script(inst: Instance, drop_last_write: bool = False) -> list[Message]:
    calls = [c for c in inst.solution]
    if drop_last_write:
        calls = calls[:max(i for i, c in enumerate(calls) if c.name == "write")]
    said = " ".join(g[0] for g in inst.expected_outputs) or "Done, that's all."
    return ([Message(role="assistant", tool_calls=[ToolCall(id=f"c{i}", name=c.name, arguments=c.arguments)])
             for i, c in enumerate(calls)] + [Message(role="assistant", content=f"Your request is done. {said}")])


def _play(suite: ChainedSuite, z: int, second_flawed: bool = False):
    a, b = (p.instances([z])[0] for p in suite.parts)
    ep = suite.episode(next(t for t in suite.tasks() if t.data["seed"] == z))
    obs = ep.reset()
    conversation = list(obs.messages)
    for action in _script(a) + _script(b, drop_last_write=second_flawed):
        r = ep.step(action)
        conversation += [action, *r.messages]
        if r.done:
            break
    return ep, obs, conversation


def _locked_seed(suite: SyntheticSuite) -> int:
    return next(z for z in suite.seeds if suite.instances([z])[0].params["locked"])


def test_a_chain_runs_both_parts_in_one_conversation_and_succeeds_only_when_both_do():
    seeds = list(range(12))
    chain = ChainedSuite(_suite(REFUSE, seeds), _suite(FINISH, seeds), seeds)
    z = _locked_seed(chain.parts[0])
    ep, obs, conversation = _play(chain, z)
    out = ep.outcome()
    assert (out.reward, out.success) == (1.0, True), out.info
    assert obs.tools == library_env(REFUSE)(0).tools() and chain.capability == "refuse_locked+finish_all_writes"
    goal_b = chain.parts[1].instances([z])[0].user_goal
    users = [m.content for m in conversation if m.role == "user"]
    assert users[0] == chain.parts[0].instances([z])[0].user_goal
    assert users[1] == goal_b  # B's request follows A's report
    assert [p["success"] for p in out.info["parts"]] == [True, True] and ep.termination == "user_stop"
    ep, _, _ = _play(chain, z, second_flawed=True)  # A right, B's last write skipped
    out = ep.outcome()
    assert (out.reward, out.success) == (0.0, False) and [p["success"] for p in out.info["parts"]] == [True, False]


def test_a_chain_cut_before_its_second_part_fails_and_the_limit_is_both_parts():
    seeds = [0, 1]
    chain = ChainedSuite(_suite(REFUSE, seeds), _suite(FINISH, seeds), seeds, max_turns=2)
    ep = chain.episode(chain.tasks()[0])
    ep.reset()
    read = Message(role="assistant", tool_calls=[ToolCall(id="c", name="read", arguments={"id": "k10"})])
    assert not ep.step(read).done and ep.step(read).done
    out = ep.outcome()
    assert not out.success and out.info["parts"][1]["reached"] is False and ep.termination == "max_steps"
    both = ChainedSuite(_suite(REFUSE, seeds), _suite(FINISH, seeds), seeds)
    assert both.max_turns == 2 * library_env(REFUSE).max_turns


class _Echo(SyntheticEnv):
    """A minimal environment of another schema for the same tool name (a generated environment's, say)."""

    name, capability, target = "echo_env", "echo", "micro"

    def generate(self, seed: int) -> Instance:
        return Instance(seed=seed, system_prompt="", user_goal="Echo.", state={}, solution=[])

    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "read", "description": "Echo.", "parameters": {
            "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]

    def new_world(self, instance: Instance) -> World:
        raise NotImplementedError("never opened: the chain is refused first")

    def verify(self, instance, final_state, messages):
        return 1.0, True


def test_conflicting_tools_are_refused_in_one_line_before_any_episode():
    with pytest.raises(ValueError, match=r"^chained environment micro_refuse_locked\+echo_env: the two capabilities' "
                                         r"tools conflict: 'read' has one schema in") as e:
        ChainedSuite(_suite(REFUSE, [0]), SyntheticSuite.from_env(_Echo(), [0]), [0])
    assert "\n" not in str(e.value)
    tools = library_env(REFUSE)(0).tools()
    assert merged_tools("a", tools, "b", tools) == tools  # one world's tools twice: no conflict, no duplicate


def test_chain_settings_are_refused_in_one_line_and_off_by_default():
    assert SynthesisConfig().chains == []
    for bad in ("refuse_locked", "refuse_locked+refuse_locked", "a+b+c"):
        with pytest.raises(ValueError, match=r"^synthesis.chains: .* is not <capability>\+<other capability>"):
            SynthesisConfig(chains=[bad])
    SynthesisConfig(chains=["refuse_locked+finish_all_writes"])
    assert parse_chain("refuse_locked+finish_all_writes") == ("refuse_locked", "finish_all_writes")


def test_a_library_chain_whose_tools_conflict_is_refused_at_validation(monkeypatch, make_cfg):
    from tracekit.config import ConfigError
    from tracekit.synthesis import library
    from tracekit.validate import validate

    real = library.find_library_env
    monkeypatch.setattr(library, "find_library_env",
                        lambda cap, target=None: _Echo if cap == "echo" else real(cap, target))
    with pytest.raises(ConfigError, match="the two capabilities' tools conflict: 'read'") as e:
        validate(make_cfg("experiment=micro", "synthesis.chains=[refuse_locked+echo]"))
    assert "\n" not in str(e.value)


class _ChainGold(Agent):
    """Plays each part's ground truth, reporting after each part (the second part's last write skipped for odd
    seeds): a scripted stand-in for the base policy."""

    name = "chain-gold"

    def __init__(self, chain: ChainedSuite):
        self.chain = chain

    def act(self, states: list[AgentState]) -> list[ChatResponse]:
        out = []
        for s in states:
            z = s.task.data["seed"]
            a, b = (p.instances([z])[0] for p in self.chain.parts)
            script = _script(a) + _script(b, drop_last_write=z % 2 == 1)
            msg = script[s.turn] if s.turn < len(script) else Message(role="assistant", content="###STOP###")
            out.append(ChatResponse(message=msg, text=msg.content or ""))
        return out


def test_the_synthesize_stage_samples_each_chain_and_skips_one_without_both_packages(tmp_path):
    selected = [Capability(name="refuse_locked", description="r"),
                Capability(name="finish_all_writes", description="f")]
    settings = SynthesisSettings.of(SynthesisConfig(validation_seeds=5, difficulty=0, chain_seeds=4, chain_samples=2,
                                                    chains=["refuse_locked+finish_all_writes",
                                                            "finish_all_writes+report_value"]), None)
    seen: list[ChainedSuite] = []

    def sample(suite, seeds, k, folder):
        seen.append(suite)
        return chain_sampler(_ChainGold(suite), max_steps=16, batch_size=4, progress=False)(suite, seeds, k, folder)

    manifest = synthesize(selected, "micro", tmp_path, settings, chain_fn=sample)
    assert [e["capability"] for e in manifest["environments"]] == ["refuse_locked", "finish_all_writes"]
    ready, skipped = manifest[CHAINS]
    assert ready["status"] == "ready" and ready["episodes"] == 8 and ready["successes"] == 4  # even seeds succeed
    assert skipped["status"] == "skipped" and "no ready environment for report_value" in skipped["reason"]
    record = chain_records(tmp_path)["refuse_locked+finish_all_writes"]
    assert record["parts"] == ["refuse_locked", "finish_all_writes"] and record["seeds"][0] == 5_000_000
    trajs = chain_trajectories(tmp_path, "refuse_locked+finish_all_writes")
    assert len(trajs) == 4 and all(t.success for t in trajs)
    assert len(chain_trajectories(tmp_path, "refuse_locked+finish_all_writes", successes_only=False)) == 8
    assert len(seen) == 1
    with pytest.raises(ValueError, match="synthesis.chains needs a rollout function"):
        synthesize(selected, "micro", tmp_path / "again", settings)


def test_the_gate_trains_on_each_chains_successes_and_counts_every_episode(tmp_path, make_cfg):
    from tracekit.methods.consolidate.composite import (COMPOSITE_SETTINGS, chain_examples, composite_inputs,
                                                        composite_reads, with_chains)
    from tracekit.moe.gate import GateExample
    from tracekit.warmstart.planted import world_tokenizer

    settings = SynthesisSettings.of(SynthesisConfig(validation_seeds=5, difficulty=0, chain_seeds=4, chain_samples=2,
                                                    chains=["refuse_locked+finish_all_writes"]), None)
    selected = [Capability(name="refuse_locked", description="r"),
                Capability(name="finish_all_writes", description="f")]
    synthesize(selected, "micro", tmp_path, settings, chain_fn=lambda suite, seeds, k, folder: chain_sampler(
        _ChainGold(suite), max_steps=16, batch_size=4, progress=False)(suite, seeds, k, folder))
    tok = world_tokenizer("micro", "qwen3", 2048)
    groups, budget, note = chain_examples(tmp_path, tok)
    (chain, examples), = groups.items()
    assert chain == "refuse_locked+finish_all_writes" and len(examples) == 4  # one row per successful episode
    assert budget.episodes == 8 and "4 of 8 base-policy episodes succeed" in note and "beyond the paper" in note
    text = tok.decode([i for i, m in zip(examples[0].input_ids, examples[0].loss_mask) if m])
    assert "is locked" in text and text.count('"write"') >= 1  # the refusal and the other part's writes are trained on
    assert len(chain_examples(tmp_path, tok, successes_only=False)[0][chain]) == 8
    capability = [GateExample([1, 2], [0, 1]) for _ in range(3)]
    mixed = with_chains(capability, groups, per_group=2, seed=0)
    assert len(mixed) == 5 and sum(ex in examples for ex in mixed) == 2
    off = make_cfg("experiment=micro")
    on = make_cfg("experiment=micro", "synthesis.chains=[refuse_locked+finish_all_writes]")
    assert composite_reads(off) == () and composite_inputs(off) == ()
    assert composite_reads(on) == COMPOSITE_SETTINGS and composite_inputs(on) == ("synthesize",)
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "environments.json").write_text('{"environments": [], "chains": []}')
    with pytest.raises(RuntimeError, match="synthesis.chains is set but .* has no ready chain"):
        chain_examples(tmp_path / "none", tok)


def test_trace_with_composite_gate_data_names_its_row_and_reads_the_chains(make_cfg):
    from tracekit.methods.consolidate import STRATEGIES

    moe = STRATEGIES["moe"]
    off = make_cfg("experiment=micro")
    on = make_cfg("experiment=micro", "synthesis.chains=[refuse_locked+finish_all_writes]")
    assert moe.row_label(off) == "TRACE" and "synthesis.chains" not in moe.reads(off)
    assert moe.row_label(on) == "TRACE (composite gate data, beyond the paper)"
    assert {"synthesis.chains", "synthesis.chain_seeds", "synthesis.chain_samples"} <= set(moe.reads(on))
    assert moe.stage_inputs(off) == () and moe.stage_inputs(on) == ("synthesize",)
