"""ROUGE (plugins/rouge.py)."""

import pytest

from plugins.rouge import rouge


def test_identical_summaries_score_100_and_disjoint_ones_0():
    assert rouge(["the cat sat on the mat"], ["the cat sat on the mat"]) == {"rouge1": 100.0, "rouge2": 100.0,
                                                                            "rougeL": 100.0}
    assert rouge(["dogs bark"], ["the cat sat"])["rouge1"] == 0.0


def test_no_references_is_an_error():
    with pytest.raises(ValueError, match="no reference summaries"):
        rouge([], [])
