"""benchmarks/gpu_idle.py: busy-interval union, idle gaps and their attribution to host frames."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu_idle  # noqa: E402


def _k(ts, dur):
    return {"cat": "kernel", "ts": ts, "dur": dur, "name": "k"}


def test_busy_union_gaps_and_attribution():
    events = [_k(0, 10), _k(5, 10), _k(30, 5), _k(36, 4), _k(100, 1)]
    busy = gpu_idle.busy_intervals(events, device_events=True)
    assert busy == [(0, 15), (30, 35), (36, 40), (100, 101)]
    idle = gpu_idle.gaps(busy, min_us=2)
    assert idle == [(15, 30), (40, 100)]  # the 1 us gap at 35..36 is below the threshold
    host = [
        {"cat": "python_function", "ts": 0, "dur": 200, "name": "tracekit/rl/trainer.py(1): update_on"},
        {"cat": "python_function", "ts": 10, "dur": 25, "name": "tracekit/rl/trainer.py(2): step"},
        {"cat": "cpu_op", "ts": 20, "dur": 5, "name": "aten::_foreach_norm"},
        {"cat": "python_function", "ts": 0, "dur": 300, "name": "/usr/lib/python3/threading.py(9): run"},
    ]
    by_frame = gpu_idle.attribute(host, idle)
    # gap 15..30 (mid 22.5): inside step and the foreach op; gap 40..100 (mid 70): only update_on
    assert by_frame == {
        "tracekit/rl/trainer.py(1): update_on": 60,
        "tracekit/rl/trainer.py(2): step < tracekit/rl/trainer.py(1): update_on | aten::_foreach_norm": 15,
    }
