"""The list paths of decode-sized plans make the tensor paths' decisions.

A plan of at most ``moelab.forward.plan.SMALL`` CPU slots is edited as Python lists (deferral's
demotion and union rule, the seam's compaction of immediate and deferred slots, the real
executor's device/host split). Each is checked here against the tensor path on random routings
with ties, zero, negative-zero, NaN and -inf weights, several tokens and padding rows, by forcing
the tensor path (``SMALL = 0``) on a copy of the same plan.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

import moelab.forward.plan as plan_mod
import moelab.hybrid.real as real_mod
from moelab.forward.plan import (
    DEFERRED,
    DROPPED,
    IMMEDIATE,
    SlotPlan,
    compact_rows,
    demote_lowest_rows,
)
from moelab.forward.points import _compact, _split_plan
from moelab.policies.deferral import DeferralConfig, ExpertDeferral

WEIGHTS = [0.5, 0.25, 0.25, 0.0, -0.0, 0.125, 1.0, float("nan"), float("-inf"), 0.75]


def _routing(rng: random.Random, T: int, K: int, E: int, dtype: torch.dtype):
    ids = torch.tensor([rng.sample(range(E), K) for _ in range(T)], dtype=torch.int64)
    w = torch.tensor([[rng.choice(WEIGHTS) for _ in range(K)] for _ in range(T)], dtype=dtype)
    state = torch.tensor([[rng.choice((IMMEDIATE, IMMEDIATE, DEFERRED, DROPPED)) for _ in range(K)]
                          for _ in range(T)], dtype=torch.int8)
    valid = torch.tensor([rng.random() < 0.8 for _ in range(T)])
    return ids, w, state, valid


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values bit for bit (signed zeros told apart), NaN equal to NaN (a NaN
    from a Python float has the canonical payload)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return torch.equal(nan, b.isnan()) and torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def _plan(ids, w, state, valid, index: int = 0) -> SlotPlan:
    layer = SimpleNamespace(index=index, top_k=ids.shape[1])
    return SlotPlan(layer=layer, experts=ids, weights=w.clone(), state=state.clone(), valid=valid, phase="decode")


@pytest.fixture
def tensor_path(monkeypatch):
    """Run the block on the tensor path (no plan is small)."""

    def force():
        monkeypatch.setattr(plan_mod, "SMALL", 0)
        monkeypatch.setattr(real_mod, "SMALL", 0)

    return force


CASES = list(itertools.product((1, 2, 5), (1, 2, 4, 6), (torch.float32, torch.bfloat16)))


@pytest.mark.parametrize("T,K,dtype", CASES)
def test_demote_lowest_rows_equals_the_tensor_ranking(T, K, dtype):
    rng = random.Random(T * 100 + K)
    for _ in range(40):
        ids, w, state, valid = _routing(rng, T, K, 12, dtype)
        counts = torch.tensor([rng.randrange(-1, K + 1) for _ in range(T)])
        p = _plan(ids, w, state, valid)
        p.demote_lowest(counts, IMMEDIATE, DEFERRED)
        rows = state.tolist()
        demote_lowest_rows(rows, w.float().tolist(), counts.tolist(), IMMEDIATE, DEFERRED)
        assert rows == p.state.tolist(), (w.tolist(), state.tolist(), counts.tolist())


@pytest.mark.parametrize("rule", ["per_token", "union"])
@pytest.mark.parametrize("T,K,dtype", CASES)
def test_deferral_list_path_equals_the_tensor_path(T, K, dtype, rule, monkeypatch):
    rng = random.Random(T * 10 + K + (rule == "union"))
    for _ in range(30):
        ids, w, state, valid = _routing(rng, T, K, 12, dtype)
        d, mi = rng.randrange(0, K + 1), rng.randrange(0, K + 1)
        pol = ExpertDeferral.__new__(ExpertDeferral)
        pol.config = DeferralConfig(deferred=d, min_immediate=mi, batch_rule=rule)
        pol.deferred_ = [d]
        small, big = _plan(ids, w, state, valid), _plan(ids, w, state, valid)
        assert small.small
        pol._plan(small)
        monkeypatch.setattr(plan_mod, "SMALL", 0)
        assert not big.small
        pol._plan(big)
        monkeypatch.setattr(plan_mod, "SMALL", 64)
        assert small.state.dtype == big.state.dtype == torch.int8
        assert small.state.tolist() == big.state.tolist(), (w.tolist(), state.tolist(), d, mi)


@pytest.mark.parametrize("T,K,dtype", CASES)
def test_compaction_on_lists_equals_the_tensor_compaction(T, K, dtype):
    rng = random.Random(7 * T + K)
    for _ in range(40):
        ids, w, state, _ = _routing(rng, T, K, 12, dtype)
        for which in (IMMEDIATE, DEFERRED):
            keep = state == which
            ti, tw = _compact(ids, w, keep)
            got = compact_rows(ids.tolist(), w.tolist(), keep.tolist())
            if got is None:
                assert ti is ids and tw is w
                continue
            assert got[0] == ti.tolist()
            assert _same(torch.tensor(got[1], dtype=dtype), tw)


@pytest.mark.parametrize("T,K,dtype", CASES)
def test_the_seam_splits_a_small_plan_as_the_tensor_path_does(T, K, dtype, tensor_path):
    rng = random.Random(3 * T + K)
    plans = []
    for _ in range(30):
        ids, w, state, valid = _routing(rng, T, K, 12, dtype)
        p = _plan(ids, w, state, valid)
        plans.append((ids, p, _split_plan(ids, p), p.changed))
    tensor_path()
    for ids, p, (now, late), changed in plans:
        assert not p.small
        now_t, late_t = _split_plan(ids, p)
        assert changed == p.changed
        assert (late is None) == (late_t is None)
        for a, b in zip(now + (late or ()), now_t + (late_t or ()), strict=True):
            assert _same(a, b)


@pytest.mark.parametrize("T,K,dtype", CASES)
def test_the_real_executor_counts_pairs_on_lists_as_in_numpy(T, K, dtype, tensor_path):
    rng = random.Random(11 * T + K)
    calls = []
    for _ in range(30):
        ids, w, _, _ = _routing(rng, T, K, 12, dtype)
        device = sorted(rng.sample(range(12), rng.randrange(0, 12)))
        calls.append((ids, w, device, real_mod._split(12, device, ids, w)))
    tensor_path()
    for ids, w, device, (dm, hm, dev, host) in calls:
        dm_t, hm_t, dev_t, host_t = real_mod._split(12, device, ids, w)
        assert (dev, host) == (dev_t, host_t)
        assert dm.tolist() == dm_t.tolist() and hm.tolist() == hm_t.tolist()


@pytest.mark.parametrize("small", [True, False])
def test_a_slot_of_weight_minus_inf_ranks_above_the_slots_outside_the_ranking(small, monkeypatch):
    """Slots outside ``among`` rank after every slot in it, even one of weight -inf: demoting 0 (or
    1) of a token's immediate slots moves none (or the -inf one), never by position next to a
    dropped slot of the same key."""
    if not small:
        monkeypatch.setattr(plan_mod, "SMALL", 0)
    ids = torch.tensor([[3, 5, 7]])
    w = torch.tensor([[0.5, float("-inf"), 0.25]])
    state = torch.tensor([[DROPPED, IMMEDIATE, IMMEDIATE]], dtype=torch.int8)
    valid = torch.tensor([True])
    assert _plan(ids, w, state, valid).rank(state == IMMEDIATE).tolist() == [[2, 1, 0]]
    for count, want in ((0, [DROPPED, IMMEDIATE, IMMEDIATE]), (1, [DROPPED, DEFERRED, IMMEDIATE]),
                        (2, [DROPPED, DEFERRED, DEFERRED]), (5, [DROPPED, DEFERRED, DEFERRED])):
        p = _plan(ids, w, state, valid)
        assert p.small == small
        p.demote_lowest(torch.tensor([count]), IMMEDIATE, DEFERRED)
        assert p.state.tolist() == [want], count
        rows = state.tolist()
        demote_lowest_rows(rows, w.tolist(), [count], IMMEDIATE, DEFERRED)
        assert rows == [want], count
