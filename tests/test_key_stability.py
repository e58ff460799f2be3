"""Cache keys stay put across refactors: 13 configs x every stage against a recorded table (issue 38).

`tests/data/stage_keys.json` holds the key of every stage of the pipeline under each config below. A change that
moves a key on purpose (a group's shape changed, a stage's version was bumped) regenerates the table with
`python tests/test_key_stability.py --write` and says in its commit which keys moved and why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

TABLE = Path(__file__).parent / "data" / "stage_keys.json"

CONFIGS = {
    "default": [],  # experiment=micro_ladder since issue 50: micro's keys but evaluate's (fewer rows)
    "embedded": ["experiment=embedded"],  # the default before issue 50: its keys as they were
    "smoke": ["experiment=smoke"],
    "micro": ["experiment=micro"],
    "paper": ["experiment=paper"],
    "paper_embedded": ["experiment=paper", "scale=embedded"],
    "planted": ["experiment=planted"],
    "toolsandbox": ["experiment=smoke", "benchmark=toolsandbox"],
    "coding": ["experiment=smoke", "benchmark=coding_toolz"],
    "swebench": ["experiment=smoke", "benchmark=swebench_verified"],
    "llm_generate": ["experiment=smoke", "analysis=llm", "synthesis=generate", "user=llm", "eval=stochastic"],
    "arrow_deepspeed": ["experiment=smoke", "consolidation=arrow", "launcher=deepspeed_zero2", "backbone=qwen3_8b"],
    "distill_airline": ["experiment=smoke", "consolidation=on_policy_distill", "benchmark=tau2_airline"],
}


def stage_keys(root: Path) -> dict[str, dict[str, str]]:
    from tests.conftest import compose_config
    from tracekit.artifacts import Artifact
    from tracekit.stages import build_pipeline

    pipe = build_pipeline()
    fake = {n: Artifact(n, "k", Path("/nonexistent") / n / "k", f"content-{n}", hit=True) for n in pipe.stages}
    out = {}
    for name, overrides in CONFIGS.items():
        cfg = compose_config(overrides, root)
        out[name] = {s: pipe.key(cfg, stage, {n: fake[n] for n in pipe.inputs(cfg, s)})
                     for s, stage in pipe.stages.items()}
    return out


def test_every_stage_key_of_every_config_is_the_recorded_one(tmp_path):
    recorded = json.loads(TABLE.read_text())
    now = stage_keys(tmp_path)
    moved = [f"{c}/{s}" for c in recorded for s in recorded[c] if now.get(c, {}).get(s) != recorded[c][s]]
    assert not moved, f"keys moved: {moved}"
    assert now.keys() == recorded.keys() and all(now[c].keys() == recorded[c].keys() for c in now)


if __name__ == "__main__" and "--write" in sys.argv:
    import tempfile

    sys.path.insert(0, str(Path(__file__).parent.parent))
    with tempfile.TemporaryDirectory() as d:
        TABLE.write_text(json.dumps(stage_keys(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE}")
