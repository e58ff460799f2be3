"""SWE-RL's reward (tracekit/targets/coding/reward.py) against values computed by hand from its definition."""

from __future__ import annotations

import pytest

from tracekit.targets.coding.reward import (
    FORMAT_ERROR,
    change_similarities,
    file_diff,
    swe_rl_reward,
    swe_rl_score,
)


def test_file_diff_drops_the_two_header_lines():
    # unified diff of ["a"] -> ["b"]: "--- old", "+++ new", "@@ -1 +1 @@", "-a", "+b"
    assert file_diff("a\n", "b\n") == "@@ -1 +1 @@\n-a\n+b"
    assert file_diff("same\n", "same\n") == ""


def test_identical_change_scores_one():
    ctx = {"m.py": "x = 1\n"}
    assert swe_rl_score(ctx, {"m.py": "x = 2\n"}, {"m.py": "x = 2\n"}) == (1.0, {"m.py": 1.0})


def test_one_character_off_scores_by_hand():
    # pred diff "@@ -1 +1 @@\n-a\n+c", oracle "@@ -1 +1 @@\n-a\n+b": 17 characters each, the longest common block
    # is the first 16, the last characters differ: ratio = 2 * 16 / (17 + 17) = 16 / 17
    reward, sims = swe_rl_score({"f": "a\n"}, {"f": "b\n"}, {"f": "c\n"})
    assert reward == pytest.approx(16 / 17)
    assert sims == {"f": pytest.approx(16 / 17)}


def test_mean_over_the_union_of_changed_files():
    ctx = {"x.py": "a\n", "y.py": "k\n", "z.py": "q\n"}
    oracle = {"x.py": "b\n", "z.py": "r\n"}
    # x identical (1), y only predicted (0), z only in the oracle (0): (1 + 0 + 0) / 3
    reward, sims = swe_rl_score(ctx, oracle, {"x.py": "b\n", "y.py": "kk\n"})
    assert sims == {"x.py": 1.0, "y.py": 0.0, "z.py": 0.0}
    assert reward == pytest.approx(1 / 3)
    # a file the prediction lists unchanged is not a change: (1 + 0) / 2 with z
    assert swe_rl_score(ctx, oracle, {"x.py": "b\n", "y.py": "k\n"})[0] == pytest.approx(1 / 2)


def test_format_errors_score_minus_one():
    ctx = {"f": "a\n"}
    assert swe_rl_reward(ctx, {"f": "b\n"}, {"f": "a\n"}) == FORMAT_ERROR  # nothing changed
    assert swe_rl_reward(ctx, {"f": "b\n"}, {}) == FORMAT_ERROR  # empty submission
    assert swe_rl_reward(ctx, {"f": "b\n"}, None) == FORMAT_ERROR  # unreadable prediction
    assert swe_rl_reward(ctx, {"f": "b\n"}, {"f": "b\n"}, malformed=True) == FORMAT_ERROR


def test_change_similarity_of_an_empty_side_is_zero():
    assert change_similarities({"f": ""}, {"f": "@@"}) == {"f": 0.0}
    assert change_similarities({"f": "@@ -1 +1 @@\n-a\n+b"}, {}) == {"f": 0.0}


def test_new_and_deleted_files_count_as_changes():
    # a new file: context "" -> "n": diff "@@ -0,0 +1 @@\n+n"; the oracle changes another file: (0 + 0) / 2
    reward, sims = swe_rl_score({"a": "1\n"}, {"a": "2\n"}, {"new.py": "n\n"})
    assert sims == {"a": 0.0, "new.py": 0.0} and reward == 0.0
