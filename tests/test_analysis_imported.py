"""The official TRACE labeling runs (pipeline/run_NN.json) imported as labels: select on them, bad input refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.analysis.imported import compare_selections, comparison_markdown, import_runs, main
from tracekit.analysis.select import Thresholds, select
from tracekit.artifacts import StageCache, read_json
from tracekit.config import ConfigError
from tracekit.pipeline import RunRecord
from tracekit.report.logging import RunLogger
from tracekit.stages import build_pipeline
from tracekit.types import Capability, LabelValue
from tracekit.validate import validate

CANDIDATES = [Capability(name=n, description=f"capability {n}") for n in ("alpha", "beta", "gamma")]
NAMES = [c.name for c in CANDIDATES]
FAILED = ["airline:1", "airline:2", "airline:3", "airline:10"]
PASSED = ["retail:0", "retail:1"]
LIST_OF = {"L": "lacking", "P": "present", "N": "na"}

# per run, per capability: the label of each task in FAILED + PASSED order ("-": not listed in that run)
RUNS = {
    1: {"alpha": "LLLP PP", "beta": "LNNN PN", "gamma": "LLPP LP"},
    2: {"alpha": "LLLP PP", "beta": "LLNN PP", "gamma": "LLPP LP"},
    3: {"alpha": "LPPP PP", "beta": "LNNN PP", "gamma": "LLPP L-"},
}


def run_file(attempt: int, spec: dict[str, str]) -> dict:
    labels = {}
    for cap, codes in spec.items():
        lists: dict[str, list[str]] = {f"{v}_{side}": [] for v in LIST_OF.values() for side in ("failed", "passed")}
        for task, code in zip(FAILED + PASSED, codes.replace(" ", "")):
            if code != "-":
                lists[f"{LIST_OF[code]}_{'passed' if task in PASSED else 'failed'}"].append(task)
        labels[cap] = lists
    return {"attempt": attempt, "totals": {"total_failed": len(FAILED), "total_passed": len(PASSED)}, "labels": labels}


def write_folder(folder: Path, runs: dict[int, dict] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for attempt, obj in (runs or {a: run_file(a, spec) for a, spec in RUNS.items()}).items():
        (folder / f"run_{attempt:02d}.json").write_text(json.dumps(obj))
    (folder / "candidate_capabilities.json").write_text(json.dumps(
        {"candidates": [{**c.model_dump(), "example_trajectories": []} for c in CANDIDATES]}))
    return folder


def test_import_then_select_gives_the_hand_computed_selection(tmp_path):
    labels, report = import_runs(write_folder(tmp_path / "pipeline"), NAMES)
    assert len(labels) == 3 * 6 * 3 and report["tasks"] == 6 and report["failed_tasks"] == 4
    assert report["missing_by_file"] == {"run_03.json": 1}  # gamma does not list retail:1 in run 3
    first = next(lab for lab in labels if (lab.run, lab.trajectory, lab.capability) == (1, "airline:10", "alpha"))
    assert first.value == LabelValue.PRESENT and first.success is False
    assert [lab.trajectory for lab in labels[: 6 * 3 : 3]] == FAILED + PASSED  # airline:2 before airline:10

    sel = select(labels, CANDIDATES, Thresholds(delta=0.2, rho=0.3, k=2, n=3))
    by = {c["name"]: c for c in sel["candidates"]}
    # alpha: ER- 3/4, 3/4, 1/4 and ER+ 0 -> Delta = Cov = .75, .75, .25: passes runs 1, 2 (Cov .25 < rho in run 3)
    assert by["alpha"]["deltas"] == pytest.approx([0.75, 0.75, 0.25]) and by["alpha"]["selected_runs"] == [1, 2]
    # beta: Delta 1 in every run (NA where not lacking), Cov 1/4, 2/4, 1/4: only run 2 reaches rho
    assert by["beta"]["covs"] == pytest.approx([0.25, 0.5, 0.25]) and by["beta"]["selected_runs"] == [2]
    # gamma: ER- 2/4 and ER+ 1/2 -> Delta 0 (run 3: retail:1 missing, ER+ 1/1 -> Delta -0.5)
    assert by["gamma"]["deltas"] == pytest.approx([0.0, 0.0, -0.5]) and by["gamma"]["selection_count"] == 0
    assert sel["missing_labels"]["by_capability"] == {"alpha": 0, "beta": 0, "gamma": 1}
    assert [c["name"] for c in sel["selected"]] == ["alpha"]
    assert by["alpha"]["mean_delta"] == pytest.approx(1.75 / 3)
    loose = select(labels, CANDIDATES, Thresholds(delta=0.2, rho=0.3, k=1, n=3))
    assert [c["name"] for c in loose["selected"]] == ["beta", "alpha"]  # ranked by mean Delta: 1 before 0.58


def _bad(tmp_path: Path, edit) -> str:
    runs = {a: run_file(a, spec) for a, spec in RUNS.items()}
    edit(runs)
    with pytest.raises(ValueError) as e:
        import_runs(write_folder(tmp_path / "bad", runs), NAMES)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_a_run_whose_capabilities_are_not_the_candidates_is_refused(tmp_path):
    def extra(runs):
        runs[2]["labels"]["delta_cap"] = runs[2]["labels"]["alpha"]

    message = _bad(tmp_path, extra)
    assert message.startswith(str(tmp_path / "bad" / "run_02.json"))
    assert "capability 'delta_cap' is not among the 3 candidates (alpha, beta, gamma)" in message

    def missing(runs):
        del runs[3]["labels"]["beta"]

    assert _bad(tmp_path, missing).endswith("run_03.json: candidate 'beta' has no labels in this run")


def test_a_task_counted_twice_within_a_capability_is_refused(tmp_path):
    def twice(runs):
        runs[1]["labels"]["beta"]["na_failed"].append("airline:1")  # also in beta.lacking_failed

    assert _bad(tmp_path, twice).endswith("run_01.json: task 'airline:1' is counted twice in capability 'beta' "
                                          "(lacking_failed and na_failed)")


def test_a_task_whose_outcome_differs_between_runs_is_refused(tmp_path):
    def flipped(runs):
        runs[2]["labels"]["alpha"]["lacking_failed"].remove("airline:2")
        runs[2]["labels"]["alpha"]["lacking_passed"].append("airline:2")

    message = _bad(tmp_path, flipped)
    assert message.startswith(str(tmp_path / "bad" / "run_02.json"))
    assert ("task 'airline:2' is passed in alpha.lacking_passed but failed in alpha.lacking_failed in run_01.json"
            in message)


@pytest.mark.parametrize("edit,reason", [
    (lambda runs: runs[1]["totals"].update(total_failed=5), "run_01.json: totals.total_failed=5 but the run lists 4 "
                                                            "failed tasks"),
    (lambda runs: runs[3].update(attempt=1), "run_03.json: attempt 1 is also run_01.json's"),
    (lambda runs: runs[2].update(attempt="2"), "run_02.json: \"attempt\" must be an integer >= 0"),
    (lambda runs: runs[1]["labels"]["alpha"].update(missing_failed=[]), "labels.alpha has an unknown list "
                                                                       "'missing_failed'"),
    (lambda runs: runs[1]["labels"]["alpha"]["na_passed"].append(7), "labels.alpha.na_passed[0] is not a task id: 7"),
    (lambda runs: runs[2].pop("labels"), "run_02.json: not a labeling run"),
])
def test_other_malformed_runs_are_refused_naming_the_file(tmp_path, edit, reason):
    assert reason in _bad(tmp_path, edit)


def test_a_folder_without_runs_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no labeling run files"):
        import_runs(tmp_path, NAMES)
    (tmp_path / "run_01.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"run_01\.json: not JSON"):
        import_runs(tmp_path, NAMES)


# ---------------------------------------------------------------- through the config and the pipeline


def imported_cfg(make_cfg, folder: Path, *more: str):
    return make_cfg("analysis=imported", f"analysis.labels_from={folder}", "thresholds.n=3", "thresholds.k=2",
                    "thresholds.delta=0.2", "thresholds.rho=0.3", *more)


def test_the_config_checks_the_runs_before_any_stage(make_cfg, tmp_path):
    folder = write_folder(tmp_path / "pipeline")
    validate(imported_cfg(make_cfg, folder))
    with pytest.raises(ConfigError, match=r"thresholds\.n=10 is invalid: must be 3 with analysis\.labeler=imported"):
        validate(imported_cfg(make_cfg, folder, "thresholds.n=10"))
    with pytest.raises(ConfigError, match=r"analysis\.labels_from=None is invalid"):
        validate(make_cfg("analysis=imported"))
    with pytest.raises(ConfigError, match=r"analysis\.discovery='reference' is invalid: must be pinned"):
        validate(imported_cfg(make_cfg, folder, "analysis.discovery=reference"))
    runs = json.loads((folder / "run_02.json").read_text())
    runs["labels"]["beta"]["present_passed"].append("retail:0")  # also beta.present_passed: twice
    (folder / "run_02.json").write_text(json.dumps(runs))
    with pytest.raises(ConfigError) as e:
        validate(imported_cfg(make_cfg, folder))
    assert str(e.value) == (f"analysis.labels_from: {folder / 'run_02.json'}: task 'retail:0' is counted twice in "
                            "capability 'beta' (present_passed and present_passed)")


def test_select_runs_on_imported_labels_without_a_rollout(make_cfg, tmp_path):
    folder = write_folder(tmp_path / "pipeline")
    cfg = imported_cfg(make_cfg, folder)
    pipe = build_pipeline()
    assert pipe.order(cfg, ["select"]) == ["discover", "label", "select"]  # no rollout, no analysis endpoint
    (tmp_path / "run").mkdir()
    record = RunRecord(tmp_path / "run")
    record.logger = RunLogger(cfg, tmp_path / "run")  # logger=none: a no-op sink
    done = pipe.run(cfg, ["select"], StageCache(tmp_path / "cache"), record)
    assert "| alpha | 2/3 | 0.58 | 0.58 | yes |" in "\n".join(text for _, text in record.sections)
    assert [c["name"] for c in read_json(done["select"].path / "selected.json")["selected"]] == ["alpha"]
    report = read_json(done["label"].path / "labeling_report.json")
    assert report["labeler"] == "imported" and report["missing"] == 1 and report["runs"] == [1, 2, 3]

    def label_key(c) -> str:
        return pipe.key(c, pipe.stages["label"], {"discover": done["discover"]})

    before = label_key(cfg)
    # a threshold sweep or another master seed reuses the imported labels
    assert label_key(imported_cfg(make_cfg, folder, "seed=7", "thresholds.delta=0.3")) == before
    runs = json.loads((folder / "run_03.json").read_text())
    runs["labels"]["gamma"]["present_passed"].append("retail:1")  # the missing label, given
    (folder / "run_03.json").write_text(json.dumps(runs))
    assert label_key(cfg) != before  # the runs' contents are in the label stage's key


def test_compare_selections_sets_ours_beside_theirs(tmp_path):
    labels, _ = import_runs(write_folder(tmp_path / "pipeline"), NAMES)
    ours = select(labels, CANDIDATES, Thresholds(delta=0.2, rho=0.3, k=2, n=3))
    theirs = [{"skill": "alpha", "n_runs_passed": 2, "mean_delta": 0.58, "mean_cov": 0.58},
              {"skill": "other", "n_runs_passed": 3, "mean_delta": 0.9, "mean_cov": 0.4}]
    cmp = compare_selections(ours, theirs)
    assert (cmp["agree"], cmp["only_ours"], cmp["only_theirs"]) == (False, [], ["other"])
    rows = {r["name"]: r for r in cmp["rows"]}
    assert rows["alpha"]["ours_runs"] == 2 and rows["alpha"]["theirs_kept"] and not rows["beta"]["theirs_kept"]
    assert rows["other"]["ours_runs"] is None and rows["other"]["theirs_runs"] == 3
    assert "| alpha | yes | 2/3 | 0.583 | 0.583 | yes | 2/3 | 0.580 | 0.580 |" in comparison_markdown(cmp, 3)
    assert compare_selections(ours, theirs[:1])["agree"]


def test_the_compare_cli_prints_both_and_refuses_bad_runs_in_one_line(tmp_path, capsys):
    folder = write_folder(tmp_path / "pipeline")
    (folder / "selected_capabilities.json").write_text(json.dumps([{"skill": "alpha", "n_runs_passed": 2}]))
    assert main([str(folder), "--rho", "0.3", "--k", "2"]) == 0
    assert "same selection" in capsys.readouterr().out
    (folder / "selected_capabilities.json").unlink()
    assert main([str(folder), "--rho", "0.3", "--k", "2"]) == 0
    assert "tracekit keeps ['alpha'] (no official selection to compare)" in capsys.readouterr().out
    (folder / "run_01.json").write_text("[]")
    assert main([str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "run_01.json: not a labeling run" in err
