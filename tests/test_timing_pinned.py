"""GoodPred schedules and prefetch budgets pinned from main before the timing package.

The values below were computed with ``moelab.predictors.timing.in_time_schedule`` and
``PrefetchConfig.from_link(...).experts_budget`` on main (commit bf9359c), before both moved
onto the one link model in :mod:`moelab.timing`. Where the old models agreed (a FIFO link for
GoodPred, bandwidth × step time with no latency for budgets), the results must not change.
"""

from __future__ import annotations

import numpy as np
import pytest

from moelab.caches.simulation import PrefetchConfig
from moelab.predictors.timing import in_time_schedule, transfer_model

PINNED_SCHEDULES = [
    (("pcie4-x16", 17301504, 30.0, "layer", 2, [6] * 8), 702.06016,
     [[0] * 6, [0] * 6, [1, 0, 0, 0, 0, 0]] + [[0] * 6] * 5),
    (("pcie3-x16", 2097152, 5.0, "iteration", 1, [4] * 6), 184.76266666666666,
     [[1, 1, 0, 0]] * 3 + [[1, 1, 1, 0]] * 3),
    (("pcie4-x16", 2000000, 20.0, "layer", 1, [4] * 5), 90.0,
     [[0, 0, 0, 0]] + [[1, 1, 1, 1]] * 4),
    (("pcie5-x16", 4000000, 0.0, "static", 1, [2, 4, 2, 4]), 88.0,
     [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]]),
    (("pcie4-x16", 17301504, 100.0, "iteration", 1, [6] * 4), 702.06016, [[0] * 6] * 4),
]


@pytest.mark.parametrize("args, transfer_us, expected", PINNED_SCHEDULES)
def test_goodpred_schedule_unchanged(args, transfer_us, expected):
    hw, eb, lat, timing, d, top_k = args
    tm = transfer_model(hw, eb, lat)
    assert tm.transfer_us == pytest.approx(transfer_us, rel=1e-12)
    got = in_time_schedule(timing, d, top_k, tm)
    assert got.astype(int).tolist() == expected


@pytest.mark.parametrize(
    "gb_per_s, step_ms, expert_bytes, budget",
    [(25, 0.5, 1_000_000, 12), (2.5e-3, 1.0, 1000, 2), (12, 0.8, 2 * 1024 * 1024, 4), (450, 0.3, 17301504, 7)],
)
def test_prefetch_budget_from_link_unchanged(gb_per_s, step_ms, expert_bytes, budget):
    cfg = PrefetchConfig.from_link("oracle", 1, gb_per_s=gb_per_s, step_ms=step_ms)
    assert cfg.experts_budget(expert_bytes) == budget


def test_pinned_schedules_are_not_trivial():
    # guard: the pins above exercise both in-time and late transfers
    flat = np.concatenate([np.ravel(e) for _, _, e in PINNED_SCHEDULES])
    assert 0 < flat.sum() < len(flat)
