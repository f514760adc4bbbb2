"""``min-cost``'s fast search (the cost model's arithmetic inline) makes exactly the decisions of
its plain definition (:meth:`MinCost.place_reference`: every split's lanes from the cost model),
over random layers on every shipped profile, with and without shared experts, on one and two
NUMA nodes, with a device that shares host memory, and at the size limit of the exact search."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.hybrid.placement import MinCost, get_placement
from moelab.timing import available_profiles, get_profile, get_shape
from moelab.timing.costs import CostModel

SHAPES = ("deepseek-v2-lite", "mixtral-8x7b", "qwen3-30b-a3b")  # shared experts, none, none


def _layer(rng, num_experts: int, limit: int) -> tuple[list, list]:
    k = int(rng.integers(1, limit + 1))
    experts = rng.choice(num_experts, size=k, replace=False)
    pairs = [(int(e), int(rng.integers(1, 9))) for e in experts]
    n_hits = int(rng.integers(0, k + 1))
    return pairs[:n_hits], pairs[n_hits:]


@pytest.mark.parametrize("profile", available_profiles())
def test_fast_search_equals_the_plain_definition(profile):
    rng = np.random.default_rng(abs(hash(profile)) % 2**32)
    mc = get_placement("min-cost")
    assert isinstance(mc, MinCost)
    for shape_name in SHAPES:
        shape = get_shape(shape_name)
        for hw in (get_profile(profile), get_profile(profile).with_changes(device_shares_host_memory=True),
                   get_profile(profile).with_changes(numa_nodes=2)):
            cost = CostModel.of(shape, hw)
            for _ in range(12):
                hits, misses = _layer(rng, shape.num_experts, 7)
                assert mc.place(hits, misses, cost) == mc.place_reference(hits, misses, cost), (hits, misses)


def test_at_the_exact_limit_and_beyond_it():
    rng = np.random.default_rng(7)
    cost = CostModel.of(get_shape("deepseek-v2-lite"), get_profile("ktransformers-a100"))
    mc = MinCost()
    for size in (MinCost.exact_limit, MinCost.exact_limit + 1):
        experts = rng.choice(64, size=size, replace=False)
        pairs = [(int(e), int(rng.integers(1, 5))) for e in experts]
        hits, misses = pairs[:3], pairs[3:]
        assert mc.place(hits, misses, cost) == mc.place_reference(hits, misses, cost)


def test_plain_definition_is_the_cheapest_split_by_the_cost_model():
    # independent of both searches: the reference's choice is no worse than every split tried here
    cost = CostModel.of(get_shape("deepseek-v2-lite"), get_profile("hybrimoe-a6000"))
    hits, misses = [(3, 2), (9, 1)], [(1, 4), (5, 1), (7, 2)]
    got = MinCost().place(hits, misses, cost)

    def makespan(fetch, stolen):
        kept = [p for p in hits if p[0] not in stolen]
        host = [p for p in sorted(misses, key=lambda p: (-p[1], p[0])) if p[0] not in fetch] + \
            [p for p in hits if p[0] in stolen]
        chosen = [p for p in sorted(misses, key=lambda p: (-p[1], p[0])) if p[0] in fetch]
        return max(cost.lanes_us(kept, chosen, host, tokens=4))

    best = makespan({e for e, w in got.items() if w == "fetch"}, {e for e, _ in hits if got.get(e) == "host"})
    for mask in range(2 ** 5):
        fetch = {misses[i][0] for i in range(3) if mask >> i & 1}
        stolen = {hits[i][0] for i in range(2) if mask >> (3 + i) & 1}
        assert best <= makespan(fetch, stolen) + 1e-9
