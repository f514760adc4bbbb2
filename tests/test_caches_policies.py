"""Hand-worked traces: the expected values are derived by hand from the policy definitions."""

import numpy as np
import pytest

from moelab.caches import make_cache, simulate, stream_from_groups

# One MoE layer, 4 experts, one expert per step: accesses 0 1 0 2 1 0, capacity 2.
SEQ = [0, 1, 0, 2, 1, 0]


def _groups(seq):
    return [(0, [e]) for e in seq]


def _run(policy, seq=SEQ, capacity=2, **kw):
    stream = stream_from_groups(_groups(seq), num_experts=[4])
    return simulate(stream, policy, capacity, keep_hits=True, **kw)


def test_lru_evicts_least_recent():
    # 0 miss [0]; 1 miss [0 1]; 0 hit; 2 miss evicts 1 (0 was used more recently) -> [0 2];
    # 1 miss evicts 0 -> [2 1]; 0 miss evicts 2.
    r = _run("lru")
    assert r.hit.tolist() == [0, 0, 1, 0, 0, 0]
    assert (r.hits, r.misses, r.evictions, r.transfers) == (1, 5, 3, 5)


def test_lfu_evicts_least_frequent_counting_history():
    # counts after each access: 0:1 | 1:1 | 0:2 (hit) | 2 miss: evict 1 (count 1 < 2) |
    # 1 miss (count 2): evict 2 (count 1 < 2) | 0 hit.
    r = _run("lfu")
    assert r.hit.tolist() == [0, 0, 1, 0, 0, 1]
    assert (r.hits, r.evictions) == (2, 2)


def test_lfu_breaks_ties_by_recency():
    # 0 1 2: at the third access 0 and 1 both have count 1; 0 is less recent -> evicted.
    cache = make_cache("lfu", [4], 2)
    for e in [0, 1, 2]:
        cache.access(0, [e])
    assert cache.contents(0) == [1, 2]


def test_fifo_evicts_earliest_inserted_even_if_recently_hit():
    # 0 miss; 1 miss; 0 hit (no reordering); 2 miss evicts 0 (oldest) -> [1 2]; 1 hit;
    # 0 miss evicts 1 -> [2 0].
    r = _run("fifo")
    assert r.hit.tolist() == [0, 0, 1, 0, 1, 0]


def test_belady_bypass_does_not_insert_experts_never_used_again():
    # 2 is never used again: not inserted; 1 and 0 stay -> hits at positions 2, 4, 5.
    r = _run("belady-bypass")
    assert r.hit.tolist() == [0, 0, 1, 0, 1, 1]
    assert r.transfers == 2


def test_belady_inserts_every_miss_evicting_the_farthest_next_use():
    # 2 must be inserted: next uses are 0 -> 5, 1 -> 4, so 0 is evicted; 1 hits, 0 misses.
    r = _run("belady")
    assert r.hit.tolist() == [0, 0, 1, 0, 1, 0]


def test_static_keeps_only_pinned_experts():
    # Pinned {0, 1} (most popular: 0 x3, 1 x2); 2 is never inserted.
    r = _run("static")
    assert r.hit.tolist() == [0, 0, 1, 0, 1, 1]
    assert r.evictions == 0


def test_protect_step_experts_of_the_same_step_never_evict_each_other():
    cache = make_cache("lru", [4], 1, insertion="protect-step")
    assert cache.access(0, [0, 1]) == [False, False]
    assert cache.contents(0) == [0]  # 1 could only evict 0, which the step still needs
    assert cache.access(0, [1]) == [False]
    assert cache.contents(0) == [1]


def test_always_every_miss_is_inserted_even_over_the_steps_own_experts():
    cache = make_cache("lru", [4], 1)
    assert cache.access(0, [0, 1]) == [False, False]
    assert cache.contents(0) == [1]  # 0 was inserted, then evicted by 1 (the only resident)
    assert cache.access(0, [1]) == [True]
    # Hits are served before misses: 2 misses but evicts 1 only after 1 was served as a hit.
    assert cache.access(0, [2, 1]) == [False, True]
    assert cache.contents(0) == [2]
    assert (cache.hits, cache.misses, cache.transfers, cache.evictions) == (2, 3, 3, 2)


def test_always_victim_may_be_a_hit_of_the_same_step():
    # capacity 2, LRU. Step A: [0, 1] -> [0 1]. Step B: [2, 0]: 0 is a hit (served first, now
    # most recent), then 2 misses and evicts the least recent resident, 1.
    # Step C: [1, 2, 0]: hits 2 and 0 first (0 the most recent), then 1 evicts 2.
    cache = make_cache("lru", [4], 2)
    cache.access(0, [0, 1])
    assert cache.access(0, [2, 0]) == [False, True]
    assert cache.contents(0) == [0, 2]
    assert cache.access(0, [1, 2, 0]) == [False, True, True]
    assert cache.contents(0) == [0, 1]
    # Under protect-step the same stream keeps a step's experts: in step C, 1 finds no victim.
    old = make_cache("lru", [4], 2, insertion="protect-step")
    old.access(0, [0, 1])
    assert old.access(0, [2, 0]) == [False, True] and old.contents(0) == [0, 2]
    assert old.access(0, [1, 2, 0]) == [False, True, True] and old.contents(0) == [0, 2]


def test_mrs_keeps_high_scoring_unselected_expert():
    # alpha 0.5, p 2. S after step 1: [.3 .15 0 0]; step 2: [.15 .325 .2 0];
    # step 3: [.175 .1625 .4 0]: expert 2 misses, candidates 0 (.175) and 1 (.1625) -> 1 goes.
    # Step 4 uses 0: a hit for MRS, a miss for LRU (which evicted 0, least recent).
    scores = [
        [0.6, 0.3, 0.1, 0.0],
        [0.1, 0.5, 0.4, 0.0],
        [0.2, 0.1, 0.6, 0.1],
        [0.7, 0.1, 0.1, 0.1],
    ]
    stream = stream_from_groups(_groups([0, 1, 2, 0]), [4], top_k=[1], scores=[np.asarray(s) for s in scores])
    mrs = simulate(stream, "mrs", 2, alpha=0.5, p=2, keep_hits=True)
    lru = simulate(stream, "lru", 2, keep_hits=True)
    assert mrs.hit.tolist() == [0, 0, 0, 1]
    assert lru.hit.tolist() == [0, 0, 0, 0]
    cache = make_cache("mrs", [4], 2, alpha=0.5, p=2)
    for g, s in enumerate(scores):
        cache.access(0, [[0, 1, 2, 0][g]], np.asarray(s, dtype=np.float32))
    assert cache._score == pytest.approx([0.5 * 0.7 + 0.5 * 0.175, 0.5 * 0.1625 + 0.05, 0.2, 0.0])


def test_mrs_with_alpha_one_and_p_topk_is_lru_under_step_protection():
    from moelab.caches.synthetic import synthetic_stream

    s = synthetic_stream(num_layers=3, num_experts=8, top_k=2, num_seqs=2, steps=40, prefill_tokens=4,
                         include_prefill=True, seed=3)
    for scope, cap in [("layer", 0.25), ("layer", 0.5), ("layer", 3)]:
        mrs = simulate(s, "mrs", cap, scope, alpha=1.0, p=2, keep_hits=True, insertion="protect-step")
        lru = simulate(s, "lru", cap, scope, keep_hits=True, insertion="protect-step")
        assert np.array_equal(mrs.hit, lru.hit), (scope, cap)


def test_prefetch_hits_and_wasted_prefetches_are_counted():
    # Two layers, 4 experts each, capacity 1 per layer. Oracle d=1 prefetches layer 1's expert
    # after layer 0 is served: every layer-1 access becomes a prefetch hit.
    from moelab.caches import PrefetchConfig

    groups = [(0, [0]), (1, [2]), (0, [1]), (1, [3])]
    stream = stream_from_groups(groups, [4, 4])
    r = simulate(stream, "lru", 1, prefetch=PrefetchConfig("oracle", 1), keep_hits=True)
    assert r.hit.tolist() == [0, 1, 0, 1]
    assert (r.prefetched, r.prefetch_hits, r.wasted_prefetches) == (2, 2, 0)
    # A predictor that always guesses expert 1 for layer 1: each guess is inserted, then
    # evicted unused by the real need (early preemption) -> 2 prefetched, 2 wasted.

    class AlwaysOne:
        def propose(self, context):
            return [1]

    for backend in ("fast", "reference"):
        r = simulate(stream, "lru", 1, prefetch=PrefetchConfig(AlwaysOne(), 1), backend=backend)
        assert (r.prefetched, r.prefetch_hits, r.wasted_prefetches, r.hits) == (2, 0, 2, 0)
        assert r.transfers == 4 + 2 and r.prefetch_bytes == 2
    # A zero budget disables prefetching.
    r = simulate(stream, "lru", 1, prefetch=PrefetchConfig("oracle", 1, budget=0))
    assert r.prefetched == 0 and r.hits == 0


def test_warm_cache_starts_with_popular_experts():
    r = _run("lru", warm=True)  # warm with {0, 1}: 0 and 1 hit from the start
    assert r.hit.tolist()[:3] == [1, 1, 1]
    assert r.transfers == r.misses  # warm loading is not a transfer


@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_belady_evicts_warm_experts_not_yet_used(backend):
    # Accesses 1 0 with one slot warmed with 0 (the most popular on ties: lowest id), no bypass:
    # 1 misses and evicts 0 (next use at 2 is the only one, but it must make room); 0 then
    # misses and evicts 1 (never used again). Two misses, two evictions.
    r = _run("belady", seq=[1, 0], capacity=1, warm=True, backend=backend)
    assert r.hit.tolist() == [0, 0] and r.evictions == 2


def test_user_policy_plugs_in_by_subclassing():
    from moelab.caches import POLICIES, ExpertCache, register_policy

    @register_policy("mru-test")
    class MRU(ExpertCache):
        def _priority(self, key):
            return (-self._last_use[key],)

    try:
        r = _run("mru-test")
    finally:
        POLICIES.unregister("mru-test")  # a second registration of another class would raise
    # 0 m; 1 m; 0 h; 2 m evicts 0 (most recent) -> [1 2]; 1 h; 0 m evicts 1 -> [2 0]
    assert r.hit.tolist() == [0, 0, 1, 0, 1, 0] and r.backend == "reference"
