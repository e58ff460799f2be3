"""The ladder chart (issue 50): each row's success with its interval, and its paired difference against Base."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.report.ladder import ladder_rows, wilson_interval, write_ladder_chart

MICRO = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "micro" / "final" / "runs" / "variant0-seed0"


def test_wilson_interval():
    lo, hi = wilson_interval(114, 270)  # micro Base: 42.2%
    assert (round(lo, 4), round(hi, 4)) == (0.3648, 0.4818)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    assert wilson_interval(10, 10)[0] < 1.0  # never a zero-width interval at the edges
    with pytest.raises(ValueError, match="total must be >= 1"):
        wilson_interval(0, 0)


def test_rows_carry_each_rows_interval_and_its_paired_difference():
    results = json.loads((MICRO / "results.json").read_text())
    rows = ladder_rows(results)
    assert [r["label"] for r in rows] == list(results)
    assert rows[0]["paired"] is None  # Base
    trace = next(r for r in rows if r["label"] == "TRACE")
    assert trace["paired"]["diff"] == pytest.approx(158 / 270 - 114 / 270)
    assert trace["paired"]["ci"] == results["TRACE"]["paired_vs_base"]["ci"]
    del results["TRACE"]["paired_vs_base"]  # rows gathered without it: computed from the outcomes
    again = next(r for r in ladder_rows(results) if r["label"] == "TRACE")
    assert again["paired"]["diff"] == pytest.approx(trace["paired"]["diff"])


def test_the_chart_is_written(tmp_path):
    results = json.loads((MICRO / "results.json").read_text())
    out = write_ladder_chart(results, tmp_path / "ladder.png", "micro, seed 0")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(ValueError, match="no rows"):
        write_ladder_chart({}, tmp_path / "none.png", "empty")
