"""Standard errors and intervals behind every accuracy moelab reports (moelab.stats)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moelab.stats import clustered_stderr, format_score, iid_stderr, wilson_interval


def test_clustered_stderr_with_one_item_per_cluster_is_the_plain_one():
    x = np.array([1, 0, 1, 1, 0, 1, 0, 0, 1, 1], float)
    plain = math.sqrt(((x - x.mean()) ** 2).sum()) / len(x)
    assert clustered_stderr(x, np.arange(len(x))) == pytest.approx(plain)
    assert iid_stderr(x) == pytest.approx(x.std(ddof=1) / math.sqrt(len(x)))


def test_clustered_stderr_grows_when_items_within_a_cluster_agree():
    # 4 sequences of 50 tokens, each sequence all right or all wrong: effectively n = 4
    x = np.repeat([1.0, 0.0, 1.0, 0.0], 50)
    seq = np.repeat(np.arange(4), 50)
    clustered, naive = clustered_stderr(x, seq), iid_stderr(x)
    assert clustered == pytest.approx(math.sqrt(4 * 0.5**2 * 50**2) / 200)  # = 0.25
    assert clustered > 5 * naive
    assert math.isnan(clustered_stderr(x[:50], seq[:50]))  # one cluster: undefined, not 0


def test_wilson_interval_is_informative_at_zero_and_all_correct():
    lo, hi = wilson_interval(0.0, 3)
    assert lo == 0.0 and hi == pytest.approx(0.5615, abs=1e-4)
    lo, hi = wilson_interval(1.0, 20)
    assert hi == 1.0 and lo == pytest.approx(0.8389, abs=1e-4)
    lo, hi = wilson_interval(0.5, 100)
    assert (lo, hi) == (pytest.approx(0.4038, abs=1e-4), pytest.approx(0.5962, abs=1e-4))
    assert all(math.isnan(v) for v in wilson_interval(0.5, 0))


def test_format_score_marks_a_zero_stderr_from_an_all_or_nothing_score():
    assert format_score(0.65, 0.109, 20) == "0.650±0.109 (n=20)"
    assert format_score(0.0, 0.0, 3) == "0.000±0.000 [95% CI 0.000–0.561] (n=3)"
    assert format_score(1.0, 0.0, 3).startswith("1.000±0.000 [95% CI 0.439–1.000]")
    assert format_score(0.5, None, 4) == "0.500±n/a (n=4)"


def test_demo_accuracy_cell_adds_the_wilson_interval_at_zero():
    from moelab.evals.report import _se_text

    assert _se_text(0.5, 0.2887, 4) == "± 0.289"
    assert _se_text(0.0, 0.0, 3) == "± 0.000 (Wilson 95% CI 0.000–0.561)"
    assert _se_text(0.0, None, 3) == ""
