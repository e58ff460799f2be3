"""The tau^2 reference labeler on gold replays and deliberately perturbed replays (real tau2 data)."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # tau2 imports litellm: no price-map download

from tracekit.analysis.rules import agreement, cohen_kappa  # noqa: E402
from tracekit.targets.tau2.labels import (  # noqa: E402
    MSC,
    PV,
    SDR,
    TCP,
    ReferenceLabeler,
    reference_dictionary,
    reference_labels,
    tau2_gold,
    trajectory_task,
)
from tracekit.targets.tau2.replay import Call, gold_calls, replay_trajectory  # noqa: E402
from tracekit.types import Capability, Label, LabelValue  # noqa: E402

L, P, N = LabelValue.LACKING, LabelValue.PRESENT, LabelValue.NA


@pytest.fixture(scope="module", autouse=True)
def quiet_tau2():
    from loguru import logger

    logger.disable("tau2")  # tau2 logs every tool response at DEBUG
    yield
    logger.enable("tau2")


@pytest.fixture(scope="module")
def gold():
    return tau2_gold(["retail", "airline"])


def values(traj, gold) -> dict[str, LabelValue]:
    spec = gold[trajectory_task(traj)]
    return {c: v for c, (v, _) in reference_labels(traj, spec).items()}


# retail 0: one exchange; retail 11: two returns; airline 7: three writes + communicate_info;
# airline 1: a cancellation the policy forbids (no gold write); airline 13: transfer only
GOLD_CASES = [("retail", "0"), ("retail", "11"), ("airline", "7"), ("airline", "1"), ("airline", "13")]


@pytest.mark.parametrize("domain, task", GOLD_CASES)
def test_gold_replay_labels_nothing_lacking(gold, domain, task):
    t = replay_trajectory(domain, task)
    assert t.success
    got = values(t, gold)
    assert L not in got.values(), got
    spec = gold[(domain, task)]
    assert (got[MSC] == P) == bool(spec.writes)  # NA exactly when the task has no write


def test_dropped_write_is_multi_step_lacking(gold):
    calls = gold_calls("retail", "11")
    assert [c.name for c in calls][-2:] == ["return_delivered_order_items"] * 2
    t = replay_trajectory("retail", "11", calls[:-1])  # a strict prefix of the writes, then stop
    assert not t.success
    got = values(t, gold)
    assert got[MSC] == L
    assert got[TCP] == P and got[PV] == P  # nothing else went wrong
    calls7 = gold_calls("airline", "7")
    t7 = replay_trajectory("airline", "7", calls7[:3], final_message="I cancelled nothing else. 1628")
    assert values(t7, gold)[MSC] == L


def test_wrong_variant_is_precision_and_data_reasoning_lacking(gold):
    calls = gold_calls("retail", "0")
    ex = calls[-1]
    replay = replay_trajectory("retail", "0")
    keyboard = next(
        json.loads(m.content)
        for m in replay.messages
        if m.role == "tool" and m.name == "get_product_details" and "1656367028" in m.content
    )
    other = next(i for i, v in keyboard["variants"].items() if i != ex.arguments["new_item_ids"][0] and v["available"])
    args = {**ex.arguments, "new_item_ids": [other, ex.arguments["new_item_ids"][1]]}
    t = replay_trajectory("retail", "0", [*calls[:-1], Call(ex.name, args)])
    assert not t.success
    got = values(t, gold)
    assert got[TCP] == L and got[SDR] == L  # the right variant id was in the product record
    assert got[MSC] == P and got[PV] == P


def test_user_given_value_typo_is_precision_not_data_reasoning(gold):
    calls = gold_calls("retail", "0")
    ex = calls[-1]
    bad = Call(ex.name, {**ex.arguments, "order_id": "#W2378157"})  # the user said #W2378156
    got = values(replay_trajectory("retail", "0", [*calls[:-1], bad]), gold)
    assert got[TCP] == L and got[SDR] == P


def test_forbidden_cancellation_is_precondition_lacking(gold):
    calls = gold_calls("airline", "1")
    t = replay_trajectory("airline", "1", [*calls, Call("cancel_reservation", {"reservation_id": "Q69X3R"})])
    assert not t.success and not t.messages[-2].error
    got = values(t, gold)
    assert got[PV] == L
    assert got[MSC] == N  # the correct resolution changes nothing


def test_unparsable_call_is_precision_lacking(gold):
    t = replay_trajectory("retail", "0", parse_error_turn=True)
    assert t.success  # it recovered
    assert values(t, gold)[TCP] == L


def test_agent_that_does_nothing(gold):
    t = replay_trajectory("retail", "11", [], final_message="How can I help?")
    got = values(t, gold)
    assert got[MSC] == L and got[TCP] == L and got[SDR] == L  # needed, never exercised
    assert got[PV] == P  # no unauthorized state change


def test_untold_information_is_data_reasoning_lacking(gold):
    t = replay_trajectory("airline", "7", final_message="All set.")
    assert not t.success
    assert values(t, gold)[SDR] == L


def test_labeler_runs_noise_and_missing_gold(gold, tmp_path):
    trajs = [replay_trajectory("retail", "11"), replay_trajectory("retail", "11", gold_calls("retail", "11")[:-1], sample=1)]
    d = reference_dictionary()
    res = ReferenceLabeler(gold).label_runs(trajs, d, [0, 1, 2], 0, tmp_path)
    assert len(res.labels) == 2 * 4 * 3 and res.report["missing"] == 0
    per_run = [[x.value for x in res.labels if x.run == r] for r in range(3)]
    assert per_run[0] == per_run[1] == per_run[2]  # deterministic without noise

    noisy = ReferenceLabeler(gold, noise=0.3)
    a = noisy.label_runs(trajs, d, list(range(10)), 1, tmp_path).labels
    assert a == noisy.label_runs(trajs, d, list(range(10)), 1, tmp_path).labels  # seeded
    base = {(x.trajectory, x.capability): x.value for x in res.labels}
    flipped = [x for x in a if x.value != base[(x.trajectory, x.capability)]]
    assert 0 < len(flipped) < len(a)
    assert all(base[(x.trajectory, x.capability)] != N for x in flipped)  # NA never flipped

    odd = trajs[0].model_copy(update={"task_id": "retail/9999", "info": {"domain": "retail"}})
    res2 = ReferenceLabeler(gold).label_runs([odd], d, [0], 0, tmp_path)
    assert res2.report["missing"] == 4 and res2.report["trajectories_without_gold"] == [odd.uid]
    with pytest.raises(ValueError, match="rules only for"):
        ReferenceLabeler(gold).label_runs(trajs, [Capability(name="other", description="x")], [0], 0, tmp_path)


def test_cohen_kappa_and_agreement_by_hand():
    # 10 pairs, 7 agree: p_o = 0.7 ; marginals a: L5 P3 N2, b: L5 P4 N1
    pairs = [(L, L)] * 4 + [(P, P)] * 2 + [(N, N)] + [(L, P), (P, L), (N, P)]
    # p_e = (5*5 + 3*4 + 2*1) / 100 = 0.39 ; kappa = (0.7 - 0.39) / (1 - 0.39)
    assert cohen_kappa(pairs) == pytest.approx(0.31 / 0.61)
    assert cohen_kappa([(L, L), (L, L)]) is None  # p_e = 1: undefined
    assert cohen_kappa([]) is None

    def lab(t, c, r, v):
        return Label(trajectory=t, capability=c, run=r, value=v, success=False)

    la = [lab("t1", "a", 0, L), lab("t2", "a", 0, P), lab("t3", "a", 0, None), lab("t1", "b", 0, N)]
    lb = [lab("t1", "a", 0, L), lab("t2", "a", 0, L), lab("t3", "a", 0, P), lab("t1", "b", 0, N), lab("t9", "b", 0, N)]
    ag = agreement(la, lb)
    assert ag["per_capability"]["a"]["n"] == 2 and ag["per_capability"]["a"]["agreement"] == 0.5
    assert ag["per_capability"]["b"] == {"n": 1, "agreement": 1.0, "kappa": None}
    assert ag["overall"]["n"] == 3 and ag["unpaired"] == 2  # t3 (missing on one side), t9 (no partner)


@pytest.mark.slow
def test_all_tasks_gold_vs_dropped_write(gold):
    """Every airline and retail task: gold replay -> no LACKING; last write dropped -> MSC LACKING."""
    for (domain, task), spec in gold.items():
        g = replay_trajectory(domain, task)
        assert g.success and L not in values(g, gold).values(), (domain, task)
        calls = gold_calls(domain, task)
        w = [i for i, c in enumerate(calls) if c.name in spec.write_tools]
        if w:
            dropped = replay_trajectory(domain, task, [c for i, c in enumerate(calls) if i != w[-1]])
            assert values(dropped, gold)[MSC] == L, (domain, task)


def test_trajectory_task_naming():
    from tracekit.types import Trajectory

    assert trajectory_task(Trajectory(task_id="retail/5", env="tau2_retail")) == ("retail", "5")
    assert trajectory_task(Trajectory(task_id="7", env="tau2_airline")) == ("airline", "7")
    t = Trajectory(task_id="x", env="tau2", info={"domain": "airline", "tau2_task_id": "3"})
    assert trajectory_task(t) == ("airline", "3")
    with pytest.raises(ValueError, match="cannot tell the tau2 domain"):
        trajectory_task(Trajectory(task_id="1", env="toolsandbox"))
