"""The compiled cache's per-layer API (:mod:`moelab.caches._fast`: ``new_cache``, ``access``,
``prefetch``, ``mrs_scores``, ``victim``) driven one (forward, layer) at a time, as a planner
would, against the plain reference classes (``fast = False``): the same hits, counters,
contents, unused prefetches, journal of evictions and insertions, and victims."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from moelab.caches import _fast, get_policy
from moelab.caches.base import resolve_capacity
from moelab.caches.policies import mrs_p
from moelab.caches.stream import belady_future, stream_from_groups

pytestmark = pytest.mark.skipif(not _fast.HAVE_NUMBA, reason="numba is not installed")

NUMS = [8, 8, 12]
TOP_K = [2, 2, 3]


def _groups(rng, steps):
    """Random (layer, experts, scores) groups, layer by layer, with ties in some scores."""
    out = []
    for step in range(steps):
        for layer, E in enumerate(NUMS):
            experts = rng.permutation(E)[: int(rng.integers(0, 5))].tolist()
            scores = rng.random((int(rng.integers(1, 4)), E)).astype(np.float32)
            if step % 3 == 0:
                scores = np.round(scores * 4) / 4
            out.append((layer, experts, scores))
    return out


def _top_p(scores, p):
    """Each row's top-p scores and experts (score descending, ties: lower id), as top_p_rows."""
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores), axis=1)[:, :p]
    return np.take_along_axis(scores, order, 1).astype(np.float32), order.astype(np.int32)


def _pair(policy, cap, scope, insertion, groups, warm):
    cls = get_policy(policy)
    ref_cls = type(f"Reference{cls.__name__}", (cls,), {"fast": False})
    kw, extra = {}, {}
    offset = np.concatenate([[0], np.cumsum(NUMS)]).astype(np.int64)
    NK = int(offset[-1])
    if policy == "lfu":
        kw = {"reset_on_evict": True}
    if policy == "mrs":
        kw = {"top_k": TOP_K, "alpha": 0.3}
    if policy == "static":
        kw = {"pinned": [0, 3, 9, 20, 27]}
    if cls.needs_future:
        stream = stream_from_groups([(ly, e) for ly, e, _ in groups], NUMS, TOP_K)
        kw = {"stream": stream}
        unit = "group" if insertion == "always" else "access"
        nxt, first, never = belady_future(stream, unit, "stream")
        extra = {"future": first, "nxt": nxt, "never": never}
    ref = ref_cls(NUMS, cap, scope, insertion=insertion, warm=warm, **kw)
    slots = resolve_capacity(cap, NUMS, scope)
    key_layer = np.repeat(np.arange(len(NUMS)), NUMS)
    policy_ = _fast.make_policy(cls.kernel, NK, _fast.INSERTION_CODES[insertion], lfu_reset=policy == "lfu",
                                alpha=0.3, pinned=kw.get("pinned"), bypass=cls.bypasses,
                                never=extra.get("never", 0))
    fast = _fast.new_cache(policy_, key_layer if scope == "layer" else np.zeros(NK, np.int64), slots, offset,
                           warm or (), extra.get("future"))
    return ref, fast, extra.get("nxt")


def _journal(fast):
    entries = fast.journal[: fast.clock[_fast.LOGGED]].tolist()
    return [-1 - x for x in entries if x < 0], [x for x in entries if x >= 0]


def _same_state(ref, fast):
    counters = fast.counters
    assert counters[_fast.EVICTIONS] == ref.evictions
    assert counters[_fast.TRANSFERS] == ref.transfers
    assert counters[_fast.PREFETCHED] == ref.prefetched
    assert counters[_fast.PREFETCH_HITS] == ref.prefetch_hits
    assert counters[_fast.WASTED_EVICTED] == ref._wasted_evicted
    assert np.flatnonzero(fast.resident).tolist() == np.flatnonzero(ref.resident_keys()).tolist()
    assert np.flatnonzero(fast.spec).tolist() == sorted(ref.speculative)
    for part, keys in enumerate(ref._resident):  # the victim of every partition, nothing protected
        assert _fast.victim(fast, part) == (min(keys, key=ref._rank) if keys else -1)


@pytest.mark.parametrize("insertion", ["always", "protect-step"])
@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass"])
def test_compiled_access_equals_the_reference_layer_by_layer(policy, scope, insertion):
    rng = np.random.default_rng(zlib.crc32(f"{policy} {scope} {insertion}".encode()))
    ps = mrs_p(None, TOP_K, NUMS)
    offset = np.concatenate([[0], np.cumsum(NUMS)])
    for cap, warm in ((0.25, None), (0.5, [1, 9, 17, 18]), (3, None)):
        groups = _groups(rng, 40)
        ref, fast, nxt = _pair(policy, cap, scope, insertion, groups, warm)
        ref_ev, ref_ins = [], []
        ref.journal(ref_ev, ref_ins)
        pos = 0
        for layer, experts, scores in groups:
            keys = (offset[layer] + np.asarray(experts, dtype=np.int64)).astype(np.int64)
            hit = np.zeros(len(keys), dtype=np.uint8)
            future = nxt[pos : pos + len(keys)] if nxt is not None else np.zeros(0, np.int64)
            pos += len(keys)
            if policy == "mrs":
                _fast.mrs_scores(fast, layer, ps[layer], *_top_p(scores, ps[layer]))
            ref_ev.clear()
            ref_ins.clear()
            want = ref.access(layer, experts, scores)
            assert _fast.access(fast, keys, future, hit) == sum(want)
            assert hit.astype(bool).tolist() == want
            assert _journal(fast) == (ref_ev, ref_ins)
            if layer + 1 < len(NUMS) and rng.random() < 0.5:
                prop = rng.integers(0, NUMS[layer + 1], int(rng.integers(0, 5))).tolist()
                budget = None if rng.random() < 0.5 else int(rng.integers(0, 3))
                ref_ev.clear()
                ref_ins.clear()
                moved = ref.prefetch(layer + 1, prop, budget)
                pk = np.asarray(list(dict.fromkeys(prop)), dtype=np.int64) + offset[layer + 1]
                assert _fast.prefetch(fast, pk, -1 if budget is None else budget) == moved
                assert _journal(fast) == (ref_ev, ref_ins)
            _same_state(ref, fast)
