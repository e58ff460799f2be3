"""benchmarks/micro_issue53.py: issue 53's per-seed tables from a sweep dir and a GRPO-on-target run dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import micro_issue53

FR = "micro_combo_finish_all_writes__refuse_locked"  # world A's within-episode kind
FP = "micro_combo_finish_all_writes__report_value"  # the untouched kind


def outcomes(solved_fr: int, solved_fp: int = 0, n: int = 10) -> dict[str, int]:
    rows = {f"{FR}/{FR}/seed-{i}/0": int(i < solved_fr) for i in range(n)}
    rows.update({f"{FP}/{FP}/seed-{i}/0": int(i < solved_fp) for i in range(n)})
    return rows


def write(path: Path, rows: dict[str, dict[str, int]]) -> None:
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps({label: {"outcomes": o, "overall": {"solved": sum(o.values()), "total": len(o)}}
                                                   for label, o in rows.items()}))


@pytest.fixture
def dirs(tmp_path):
    sweep, g = tmp_path / "sweep", tmp_path / "g"
    write(sweep / "0", {"Base": outcomes(0), "Single Capability GRPO (x)": outcomes(1), "TRACE": outcomes(4)})
    write(sweep / "1", {"Base": outcomes(0), "Single Capability GRPO (x)": outcomes(1), "TRACE (turn routing)": outcomes(2)})
    (sweep / "2").mkdir()  # a job that failed before evaluate: named in a note, not a row
    write(g, {"Base": outcomes(0), "GRPO on Target": outcomes(6, 1)})
    return sweep, g


def test_each_row_is_paired_against_the_four_references_on_the_within_episode_kinds(dirs, tmp_path):
    sweep, g = dirs
    assert micro_issue53.main(["--world", "A", "--out", str(tmp_path / "out"), "--seed", "0", str(sweep), str(g)]) == 0
    seed = json.loads((tmp_path / "out" / "tables.json").read_text())["seeds"]["0"]
    within, turn = seed["within"], seed["within"]["TRACE (turn routing)"]
    assert within["TRACE"]["rate"] == 40.0 and within["best Single"]["rate"] == 10.0  # 4 of 10, 1 of 10: FR only
    assert turn["vs TRACE"]["diff"] == pytest.approx(-0.2) and turn["vs GRPO on target"]["diff"] == pytest.approx(-0.4)
    assert turn["vs Base"]["fixed"] == 2 and turn["vs Base"]["broken"] == 0
    assert seed["overall"]["GRPO on target"]["rate"] == 35.0  # 7 of 20
    assert seed["untouched"]["GRPO on target"]["rate"] == 10.0
    assert seed["per_kind"]["TRACE"] == {FR: 40.0, FP: 0.0}
    assert "| TRACE (turn routing) | 20.0 | 0.0 | 10.0 |" in (tmp_path / "out" / "tables.md").read_text()


def test_a_seed_without_g_leaves_its_column_empty(dirs, tmp_path):
    sweep, _ = dirs
    micro_issue53.main(["--world", "A", "--out", str(tmp_path / "out"), "--seed", "0", str(sweep), "-"])
    seed = json.loads((tmp_path / "out" / "tables.json").read_text())["seeds"]["0"]
    assert "vs GRPO on target" not in seed["within"]["TRACE"] and "GRPO on target" not in seed["within"]


def test_a_g_run_on_other_episodes_is_refused(dirs, tmp_path):
    sweep, _ = dirs
    write(tmp_path / "other", {"Base": outcomes(0, n=5), "GRPO on Target": outcomes(3, n=5)})
    with pytest.raises(SystemExit, match="its Base scored other episodes"):
        micro_issue53.main(["--world", "A", "--out", str(tmp_path / "out"), "--seed", "0", str(sweep),
                            str(tmp_path / "other")])
    assert not (tmp_path / "out").exists()
