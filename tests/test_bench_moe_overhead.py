"""benchmarks/moe_overhead.py: the verdict per implementation and a smoke run that writes JSON and a plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import moe_overhead  # noqa: E402

from tests import procs  # noqa: E402


def _row(phase, grouped, grouped_mm=1.0, masked_dense=1.0):
    return {"phase": phase, "moe_grouped/peft_1": grouped, "moe_grouped_mm/peft_1": grouped_mm,
            "moe_masked_dense/peft_1": masked_dense}  # fmt: skip


def test_worst_ratios_judge_eager_rows_only():
    rows = [_row("prefill", 1.10), _row("decode", 1.14, grouped_mm=1.16), _row("decode_graph", 1.30)]
    got = {(impl, label): (round(w, 3), met) for impl, label, w, met in moe_overhead.worst_ratios(rows)}
    assert got[("grouped", "eager")] == (1.14, True)
    assert got[("grouped_mm", "eager")] == (1.16, False)
    assert got[("grouped", "CUDA-graph decode")] == (1.3, None)  # reported, no target
    rows[0]["moe_masked_dense/peft_1"] = None  # a failed variant: its group is not judged
    assert ("masked_dense", "eager") not in {(i, label) for i, label, _, _ in moe_overhead.worst_ratios(rows)}


@pytest.mark.filterwarnings("ignore")
def test_smoke_run_writes_results_and_plot(tmp_path):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "moe_overhead.py"), "--smoke", "--prefill", "1x8",
           "--decode", "1", "--steps", "2", "--repeats", "1", "--warmup", "0", "--out", str(out), "--plot", str(png)]  # fmt: skip
    run = procs.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["phase"], r["batch"]) for r in result["rows"]] == [("prefill", 1), ("decode", 1)]
    for row in result["rows"]:
        assert row["peft_1"] > 0 and row["moe_grouped/peft_1"] == pytest.approx(row["moe_grouped"] / row["peft_1"])
    assert "moe_grouped, eager: worst ratio to peft_1" in run.stdout
    assert png.stat().st_size > 0
