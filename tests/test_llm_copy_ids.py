"""Schema tightening for small agents: identifier arguments copied from the conversation, listed values as enums."""

from __future__ import annotations

import pytest

from tracekit.config import ConfigError
from tracekit.validate import validate
from tracekit.llm.constrained import identifier_candidates, structural_tag, tighten_tools
from tracekit.types import Message

CANCEL = {"type": "function", "function": {"name": "cancel_pending_order", "parameters": {"type": "object", "properties": {
    "order_id": {"type": "string", "description": "The order id, such as '#W0000000'."},
    "reason": {"type": "string", "description": "The reason, which should be either 'no longer needed' or 'ordered by mistake'."},
    "item_ids": {"type": "array", "items": {"type": "string"}},
    "summary": {"type": "string", "description": "Free text."},
}, "required": ["order_id", "reason"]}}}


def test_identifiers_come_from_user_and_tool_messages_only():
    messages = [Message(role="system", content="Example order '#W0000000', reservation ZFA04Y."),
                Message(role="user", content="Cancel order #W3504831, my email is mia.thomas6124@example.com."),
                Message(role="tool", content='{"items": [{"item_id": "1008292230"}], "user_id": "mia_thomas_6124"}'),
                Message(role="user", content="Reservation SV2FPD again: #W3504831.")]
    assert identifier_candidates(messages) == ["#W3504831", "mia.thomas6124@example.com", "1008292230",
                                               "mia_thomas_6124", "SV2FPD"]


def test_tighten_narrows_ids_and_listed_values_and_leaves_the_rest():
    [tool] = tighten_tools([CANCEL], ["#W3504831", "1008292230"])
    props = tool["function"]["parameters"]["properties"]
    assert props["order_id"]["enum"] == ["#W3504831", "1008292230"]
    assert props["item_ids"]["items"]["enum"] == ["#W3504831", "1008292230"]
    assert props["reason"]["enum"] == ["no longer needed", "ordered by mistake"]
    assert "enum" not in props["summary"]
    assert "enum" not in CANCEL["function"]["parameters"]["properties"]["order_id"]  # the caller's schema is untouched
    [bare] = tighten_tools([CANCEL], [])  # nothing seen yet: ids stay free, listed values still apply
    assert "enum" not in bare["function"]["parameters"]["properties"]["order_id"]
    assert bare["function"]["parameters"]["properties"]["reason"]["enum"] == ["no longer needed", "ordered by mistake"]


def test_tightened_schema_compiles_to_a_grammar_that_rejects_an_invented_id():
    xgr = pytest.importorskip("xgrammar")
    tag = structural_tag(tighten_tools([CANCEL], ["#W3504831"]), "smollm2", "required")
    grammar = xgr.Grammar.from_structural_tag(tag) if hasattr(xgr.Grammar, "from_structural_tag") else None
    if grammar is None:
        pytest.skip("this xgrammar has no Grammar.from_structural_tag")
    ok = '<tool_call>[{"name": "cancel_pending_order", "arguments": {"order_id": "#W3504831", "reason": "ordered by mistake"}}]</tool_call>'
    bad = ok.replace("#W3504831", "#W1111111")
    assert xgr.testing._is_grammar_accept_string(grammar, ok)
    assert not xgr.testing._is_grammar_accept_string(grammar, bad)


def test_required_tool_choice_and_copy_ids_need_the_grammar(make_cfg):
    validate(make_cfg("experiment=embedded"))  # the embedded preset sets all three
    with pytest.raises(ConfigError, match=r"agent\.constrained_tool_calls"):
        validate(make_cfg("experiment=embedded", "agent.constrained_tool_calls=false"))
    with pytest.raises(ConfigError, match=r"grpo\.old_logprobs"):
        validate(make_cfg("experiment=embedded", "grpo.old_logprobs=rollout"))


def test_compiled_grammars_are_bounded(monkeypatch):
    pytest.importorskip("xgrammar")
    from tracekit.llm.backbones import load_backbone
    from tracekit.llm.constrained import ToolCallGrammar

    model, tok = load_backbone("tiny")
    grammars = ToolCallGrammar(tok, model.config.vocab_size, [tok.eos_token_id])
    monkeypatch.setattr(ToolCallGrammar, "MAX_COMPILED", 3)
    for i in range(5):  # five different id sets seen: five grammars, the oldest two dropped
        grammars.matcher([CANCEL], "smollm2", "required", [Message(role="user", content=f"order #W{1000000 + i}")])
    assert len(grammars._compiled) == 3


def test_agent_engine_takes_the_agents_decoding(make_cfg):
    from tracekit.wiring import AGENT_ENGINE_READS, engine_spec

    spec = engine_spec(make_cfg("experiment=embedded"))  # the embedded preset trains with grpo.engine=agent
    assert spec == {"kind": "agent", "constrained_tool_calls": True, "tool_choice": "required", "copy_ids": True,
                    "max_batch_size": 8, "prefix_cache_mib": 1024.0}
    assert "agent.copy_ids" in AGENT_ENGINE_READS  # a change of the agent's decoding retrains the adapters
    assert "agent.prefix_cache_mib" in AGENT_ENGINE_READS  # reused K/V round differently: in the key too
    assert engine_spec(make_cfg("grpo.engine=hf")) == {"kind": "hf"}
