"""The Agent Data Protocol loader: a small file in ADP's standardized schema (written here) round-trips into
chat messages and exact token rows whose loss mask covers the assistant's tokens only; malformed records are
counted with their line numbers and the rest used; the adp_sft stage trains a LoRA adapter on them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.methods.adp_data import AdpReport, load_adp, resolve_source, sft_rows, to_messages

RETAIL = {
    "schema_version": "1.2.0", "id": "retail-1", "details": {"dataset": "handwritten"},
    "content": [
        {"class_": "text_observation", "content": "Hi, I want to return order #W123.", "source": "user"},
        {"class_": "api_action", "function": "get_order_details", "kwargs": {"order_id": "#W123"},
         "description": "Let me look up the order.", "tool_call_id": "call_1"},
        {"class_": "text_observation", "content": '{"status": "delivered", "payment": "credit_card_1"}',
         "source": "environment", "tool_call_id": "call_1"},
        {"class_": "message_action", "content": "It was delivered; shall I return it to credit_card_1?"},
        {"class_": "text_observation", "content": "Yes please.", "source": "user"},
        {"class_": "api_action", "function": "return_delivered_order_items",
         "kwargs": {"order_id": "#W123", "item_ids": ["1"], "payment_method_id": "credit_card_1"},
         "tool_call_id": "call_2", "reasoning_content": "the user confirmed"},
        {"class_": "text_observation", "content": '{"status": "return requested"}', "source": "environment",
         "tool_call_id": "call_2"},
        {"class_": "message_action", "content": "The return is requested."},
    ]}
CODE = {  # ADP 1.0 style: no schema_version, no tool_call_id
    "id": "code-1", "content": [
        {"class_": "text_observation", "content": "List the files.", "source": "user"},
        {"class_": "code_action", "language": "bash", "content": "ls -la", "description": "Listing them."},
        {"class_": "text_observation", "content": "a.txt b.txt", "source": "environment"},
        {"class_": "message_action", "content": "Two files: a.txt and b.txt."}]}
BAD = [
    '{"id": "no-kwargs", "content": [{"class_": "api_action", "function": "f"}]}',
    "this is not json",
    '{"id": "extra", "content": [{"class_": "message_action", "content": "x", "mood": "happy"}]}',
    '{"id": "orphan", "content": [{"class_": "text_observation", "content": "r", "source": "environment", '
    '"tool_call_id": "nope"}, {"class_": "message_action", "content": "x"}]}',
    '{"id": "obs-only", "content": [{"class_": "text_observation", "content": "r", "source": "user"}]}',
]


def write_adp_sample(path: Path) -> Path:
    """A small ADP file: two well-formed trajectories (lines 1, 2), five malformed records (lines 3-7)."""
    path.write_text("\n".join([json.dumps(RETAIL), json.dumps(CODE), *BAD]) + "\n")
    return path


def _tokenizer():
    from tracekit.llm.backbones import bundled_tokenizer

    return bundled_tokenizer("qwen3")


def test_malformed_records_are_counted_with_their_line_numbers_and_the_rest_used(tmp_path):
    records, report = load_adp([str(write_adp_sample(tmp_path / "d.jsonl"))])
    assert [r["id"] for r in records] == ["retail-1", "code-1"]
    assert report.records == 7 and [m["line"] for m in report.malformed] == [3, 4, 5, 6, 7]
    reasons = [m["reason"] for m in report.malformed]
    assert "'kwargs' (dict) is required" in reasons[0] and reasons[1].startswith("not JSON")
    assert "unknown key(s) ['mood']" in reasons[2] and "answers no preceding action" in reasons[3]
    assert "no action" in reasons[4]
    assert "d.jsonl:3, d.jsonl:4" in report.summary()
    assert load_adp([str(tmp_path / "d.jsonl")], max_records=1)[0][0]["id"] == "retail-1"


def test_adp_converts_to_chat_messages_with_tool_calls_and_results():
    msgs, tools = to_messages(RETAIL)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant"]
    call = msgs[1].tool_calls[0]
    assert (call.name, call.arguments, call.id, msgs[1].content) == (
        "get_order_details", {"order_id": "#W123"}, "call_1", "Let me look up the order.")
    assert msgs[2].tool_call_id == "call_1" and msgs[2].name == "get_order_details"
    props = {t["function"]["name"]: t["function"]["parameters"]["properties"] for t in tools}
    assert props["return_delivered_order_items"]["item_ids"] == {"type": "array"}
    code, _ = to_messages(CODE)
    assert code[1].tool_calls[0].name == "execute_bash" and code[1].tool_calls[0].arguments == {"command": "ls -la"}
    assert code[2].role == "tool" and code[2].tool_call_id == code[1].tool_calls[0].id


def test_token_rows_mask_in_exactly_the_assistants_tokens():
    tok = _tokenizer()
    report = AdpReport()
    rows = sft_rows([RETAIL, CODE], tok, max_tokens=4096, report=report)
    assert report.used == 2 and report.rows == len(rows) >= 2 and report.dropped["reasoning_content"] == 1
    text = {"assistant": "", "context": ""}
    for ids, mask in rows:
        assert len(ids) == len(mask) and mask[0] == 0 and any(mask)
        text["assistant"] += tok.decode([t for t, m in zip(ids, mask) if m])
        text["context"] += tok.decode([t for t, m in zip(ids, mask) if not m])
    for said in ("Let me look up the order.", "get_order_details", "The return is requested.", "ls -la",
                 "return_delivered_order_items", "Two files: a.txt and b.txt."):
        assert said in text["assistant"]
    for heard in ("Hi, I want to return order #W123.", "return requested", "Yes please.", "a.txt b.txt",
                  "List the files."):
        assert heard in text["context"] and heard not in text["assistant"]
    assert text["assistant"].count("<|im_end|>") == 6  # each assistant turn ends with its end-of-turn token

    cut = sft_rows([RETAIL], tok, max_tokens=40, report=AdpReport())  # a row past max_tokens is cut
    assert all(len(ids) <= 40 for ids, _ in cut)


def test_hub_ids_name_the_subsets_standardized_file(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kw: calls.append(kw) or str(tmp_path / "f"))
    resolve_source("hf://neulab/agent-data-collection/codeactinstruct")
    resolve_source("hf://neulab/agent-data-collection/x/part.jsonl")
    assert calls == [
        {"repo_id": "neulab/agent-data-collection", "filename": "codeactinstruct/full_std.jsonl", "repo_type": "dataset"},
        {"repo_id": "neulab/agent-data-collection", "filename": "x/part.jsonl", "repo_type": "dataset"}]
    with pytest.raises(ValueError, match="hf://<owner>/<dataset>/<subset>"):
        resolve_source("hf://neulab/agent-data-collection")


def test_the_adp_sft_stage_trains_an_adapter_and_reports_the_bad_lines(make_cfg, tmp_path):
    from tracekit.artifacts import StageCache
    from tracekit.methods import METHODS
    from tracekit.pipeline import RunRecord
    from tracekit.stages import build_pipeline

    data = write_adp_sample(tmp_path / "adp.jsonl")
    cfg = make_cfg("experiment=smoke", "eval.methods=[adp_sft]", f"baselines.adp_sft.data=[{data}]",
                   "baselines.adp_sft.batch_size=2")
    record = RunRecord(tmp_path / "run")
    (tmp_path / "run").mkdir()
    record.logger = type("L", (), {"scalars": lambda *a, **k: None, "image": lambda *a: None,
                                   "table": lambda *a: None})()
    done = build_pipeline().run(cfg, ["adp_sft"], StageCache(tmp_path / "cache"), record)
    art = done["adp_sft"]
    report = json.loads((art.path / "adp_report.json").read_text())
    assert report["used"] == 2 and [m["line"] for m in report["malformed"]] == [3, 4, 5, 6, 7]
    assert (art.path / "sft" / "adapter" / "adapter_model.safetensors").exists()
    ctx = type("C", (), {"inputs": {"adp_sft": art}})()
    (row,) = METHODS["adp_sft"].rows(ctx)
    assert row.policy.kind == "adapter" and row.budget.optimizer_steps == 1 and row.budget.episodes == 0
    assert "5 malformed record(s) left out (adp.jsonl:3" in row.notes[0]
    # editing the data file recomputes the stage (its content is part of the key)
    data.write_text(json.dumps(CODE) + "\n")
    again = build_pipeline().run(cfg, ["adp_sft"], StageCache(tmp_path / "cache"), record)["adp_sft"]
    assert again.key != art.key
