"""SWE-bench Verified adapter: the loader on a small file in the dataset's schema, predictions in the official
format, and the harness refused with one line where Docker is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.targets.swebench import suite as sb

SAMPLE = Path(__file__).parent / "data" / "swebench_verified_sample.jsonl"


def test_loader_reads_the_schema_and_counts_malformed_rows():
    loaded = sb.load_instances(str(SAMPLE))
    assert [i.instance_id for i in loaded.instances] == ["example__demo-1", "example__demo-2"]
    first = loaded.instances[0]
    assert first.FAIL_TO_PASS == ["tests/test_core.py::test_add"]  # JSON-encoded on the hub, a list here
    assert first.PASS_TO_PASS == ["tests/test_core.py::test_sub"] and first.repo == "example/demo"
    assert first.extra["difficulty"] == "<15 min fix" and first.version == "1.0"
    assert set(loaded.skipped) == {"example__demo-3", "example__demo-4", "line 5"}
    assert "base_commit" in loaded.skipped["example__demo-3"]
    assert "JSON-encoded" in loaded.skipped["example__demo-4"] and "not JSON" in loaded.skipped["line 5"]
    assert [i.instance_id for i in sb.load_instances(str(SAMPLE), limit=1).instances] == ["example__demo-1"]
    assert [i.instance_id for i in sb.load_instances(str(SAMPLE), ids=["example__demo-2"]).instances] == [
        "example__demo-2"]


def test_missing_file_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file"):
        sb.load_instances(str(tmp_path / "nope.jsonl"))


def test_predictions_file_is_the_official_format(tmp_path):
    path = sb.write_predictions(tmp_path / "preds.jsonl", [
        {"instance_id": "example__demo-1", "model_name_or_path": "tracekit", "model_patch": "diff --git a/x b/x\n",
         "extra": 1}])
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"instance_id": "example__demo-1", "model_name_or_path": "tracekit",
                     "model_patch": "diff --git a/x b/x\n"}]
    with pytest.raises(ValueError, match="model_patch must be strings"):
        sb.write_predictions(tmp_path / "bad.jsonl", [{"instance_id": "a", "model_name_or_path": "m"}])


def test_harness_without_docker_is_skipped_with_a_clear_line(tmp_path):
    why = sb.docker_problem()
    if why is None:
        pytest.skip("Docker is available: the harness itself would run")
    path = sb.write_predictions(tmp_path / "p.jsonl", [{"instance_id": "example__demo-1", "model_name_or_path": "m",
                                                        "model_patch": ""}])
    with pytest.raises(RuntimeError, match="SWE-bench harness skipped: ") as e:
        sb.run_harness(path, str(SAMPLE), "t")
    assert "\n" not in str(e.value)
