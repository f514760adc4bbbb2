"""The streamlined ``ExpertCache.access`` / MRS score update against their plain reference
definitions (``fast = False``): identical decisions, counters, contents and journals over
random streams with prefetches, for every online policy, scope and insertion rule."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.caches import get_policy
from moelab.errors import MoelabError


def _pair(policy, nums, cap, scope, insertion, **kw):
    cls = get_policy(policy)
    ref_cls = type(f"Reference{cls.__name__}", (cls,), {"fast": False})
    caches = [c(nums, cap, scope, insertion=insertion, **kw) for c in (cls, ref_cls)]
    logs = []
    for c in caches:
        ev, ins = [], []
        c.journal(ev, ins)
        logs.append((ev, ins))
    return caches, logs


def _state(c):
    return (c.hits, c.misses, c.evictions, c.transfers, c.prefetched, c.prefetch_hits, c._wasted_evicted,
            list(c.layer_hits), list(c.layer_misses), c.contents(), sorted(c.speculative), c._clock,
            list(c._last_use), list(c._inserted_at), list(getattr(c, "_score", [])), list(getattr(c, "_freq", [])))


@pytest.mark.parametrize("insertion", ["always", "protect-step"])
@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "mrs", "static"])
def test_fast_access_equals_the_reference_on_random_streams(policy, scope, insertion):
    rng = np.random.default_rng(hash((policy, scope, insertion)) % 2**32)
    nums = [8, 8, 12]
    kw = {}
    if policy == "mrs":
        kw = {"top_k": [2, 2, 3], "alpha": 0.3}
    if policy == "static":
        kw = {"pinned": [0, 3, 9, 20]}
    if policy == "lfu":
        kw = {"reset_on_evict": True}
    for cap in (0.25, 0.5, 3):
        (fast, ref), (flog, rlog) = _pair(policy, nums, cap, scope, insertion, **kw)
        for step in range(150):
            for layer, E in enumerate(nums):
                T = int(rng.integers(1, 4))
                experts = rng.permutation(E)[: int(rng.integers(0, 5))].tolist()
                scores = rng.random((T, E)).astype(np.float32)
                if step % 3 == 0:  # ties, which the top-p order must break by the lower id
                    scores = np.round(scores * 4) / 4
                if step % 5 == 0:
                    scores = scores[0]  # one token's vector
                for log in (flog, rlog):
                    log[0].clear()
                    log[1].clear()
                assert fast.access(layer, experts, scores) == ref.access(layer, experts, scores)
                assert flog == rlog
                if rng.random() < 0.5 and layer + 1 < len(nums):
                    tgt = layer + 1
                    prop = rng.integers(0, nums[tgt], int(rng.integers(0, 5))).tolist()
                    budget = None if rng.random() < 0.5 else int(rng.integers(0, 3))
                    assert fast.prefetch(tgt, prop, budget) == ref.prefetch(tgt, prop, budget)
                    assert flog == rlog
                assert _state(fast) == _state(ref)


def test_fast_access_refuses_bad_input_exactly_as_the_reference():
    (fast, ref), _ = _pair("mrs", [4, 4], 0.5, "layer", "always", top_k=[1, 1])
    for args in ((0, [1, 1], np.ones(4)), (0, [4], np.ones(4)), (2, [0], np.ones(4)), (0, [0], None),
                 (0, [0], np.array([np.nan, 0, 0, 0]))):
        msgs = []
        for c in (fast, ref):
            with pytest.raises(MoelabError) as e:
                c.access(*args)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]
    assert fast.access(0, [np.int64(1)], np.ones(4)) == ref.access(0, [np.int64(1)], np.ones(4))  # numpy ids
