"""MoE-Infinity's activation-aware prefetch (moelab.caches.activation), from its definition: each
sequence's expert activation matrix (EAM: tokens per layer and expert); after layer l the running
sequence's EAM over layers 0..l is matched by cosine similarity against the EAMs of the sequences
served before, and the best match's most used experts of layer l + d are proposed; with no earlier
sequence, the sequence's own past steps predict. The expected proposals below are worked out by
hand from that rule."""

from __future__ import annotations

import numpy as np
import pytest

import moelab
from moelab.caches import PrefetchConfig, simulate, stream_from_groups
from moelab.caches.activation import ActivationAware
from moelab.errors import MoelabError
from moelab.hybrid.offline import ForwardRouting, plan_routing
from moelab.predictors.protocol import PredictContext


def _forward(f: int, step: int, layers: list[list[int]]) -> ForwardRouting:
    """One forward of one token per layer (``layers``: the experts each MoE layer chose)."""
    ids = [np.array([ex], dtype=np.int64) for ex in layers]
    w = [np.array([np.linspace(0.9, 0.1, len(ex))], dtype=np.float32) for ex in layers]
    return ForwardRouting(forward=f, step=step, phase="prefill" if step == 0 else "decode", tokens=1, ids=ids,
                          weights=w)


def _ask(pf: ActivationAware, i: int, r: ForwardRouting, layer: int, d: int = 1) -> list[int]:
    L = len(r.ids)
    return pf.propose(PredictContext(stream=None, group=i * L + layer, seq=-1, step=r.step, layer=layer,
                                     target_layer=layer + d, experts=r.ids[layer].reshape(-1), scores=None,
                                     routing=r))


def _sequence(f0: int, pattern: list[list[int]], steps: int = 2) -> list[ForwardRouting]:
    return [_forward(f0 + s, s, pattern) for s in range(steps)]


def _served(*patterns: list[list[int]]) -> tuple[ActivationAware, int]:
    """A prefetcher (m = 1) asked after layers 0 and 1 (d = 1) of every forward of sequences of
    these patterns (two forwards each, one after the other); the next forward's index."""
    pf = ActivationAware([4, 4, 4], m=1)
    forwards = [r for n, p in enumerate(patterns) for r in _sequence(2 * n, p)]
    for i, r in enumerate(forwards):
        for ly in range(2):
            _ask(pf, i, r, ly)
    return pf, len(forwards)


def test_the_best_matching_earlier_sequence_predicts_the_next_layer():
    # sequence A: layer 0 → expert 0, layer 1 → 1, layer 2 → 2; sequence B: 3, 2, 0 (E = 4)
    a, b = [[0], [1], [2]], [[3], [2], [0]]
    pf, i = _served(a, b)
    # a new sequence (a prefill) whose layer 0 chose expert 3, as B did: B's layer 1 is proposed
    c = _forward(4, 0, [[3], [0], [0]])
    assert _ask(pf, i, c, 0) == [2]
    assert len(pf.eams) == 2  # A and B ended (each at the next prefill)
    # the collection holds A and B whole: layer 2, never asked about at d = 1, was counted too
    assert [m[2].tolist() for m in pf.eams] == [[0, 0, 2, 0], [2, 0, 0, 0]]
    # layer 0 = expert 0 matches A instead: A's layer 1 (expert 1)
    pf2, i = _served(a, b)
    assert _ask(pf2, i, _forward(4, 0, [[0], [3], [3]]), 0) == [1]


def test_the_match_uses_every_layer_seen_so_far():
    # A and B agree on layer 0 and differ on layer 1; after layer 1 of a sequence that followed B's
    # layer 1, B's layer 2 is proposed
    pf, i = _served([[0], [1], [2]], [[0], [2], [3]])
    c = _forward(4, 0, [[0], [2], [1]])
    _ask(pf, i, c, 0)
    assert _ask(pf, i, c, 1) == [3]


def test_without_earlier_sequences_its_own_steps_predict_most_used_first():
    pf = ActivationAware([4, 4], m=2)
    steps = [[[0], [1]], [[0], [1]], [[0], [2]], [[0], [1]]]  # layer 1: expert 1 three times, 2 once
    got = []
    for s, layers in enumerate(steps):
        got.append(_ask(pf, s, _forward(s, s, layers), 0))
    # step 0 knows nothing of layer 1 yet; then the counts so far, the most used first (ties: lower id)
    assert got == [[], [1], [1], [1, 2]]


def test_m_defaults_to_the_experts_the_layer_used_and_bad_settings_are_refused():
    pf = ActivationAware([8, 8])
    r0 = ForwardRouting(forward=0, step=0, phase="prefill", tokens=2,
                        ids=[np.array([[0, 1], [2, 3]]), np.array([[4, 5], [6, 7]])],
                        weights=[np.ones((2, 2), np.float32)] * 2)
    r1 = ForwardRouting(forward=1, step=1, phase="decode", tokens=1, ids=[np.array([[0, 1]]), np.array([[4, 5]])],
                        weights=[np.ones((1, 2), np.float32)] * 2)
    _ask(pf, 0, r0, 0)
    assert _ask(pf, 1, r1, 0) == [4, 5]  # two experts used at layer 0 now: two proposed (4, 5 count 2, 6, 7 one)
    for bad in ({"m": 0}, {"collection": 0}, {"m": 1.5}):
        with pytest.raises(MoelabError, match="activation-aware prefetch"):
            ActivationAware(**bad)


def test_it_drives_the_offline_planner_the_cache_simulator_and_not_a_live_run():
    # sequences alternating two patterns, one expert slot per layer: the third (and fourth) match the
    # first (second) at layer 0 and have layer 1's expert prefetched where the other pattern left its own
    routing = []
    for seq in range(4):
        routing += _sequence(2 * seq, [[seq % 2], [2 + seq % 2]])
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses",
           "prefetch": {"predictor": "activation", "select": "order"}}
    plans = plan_routing(routing, cfg, num_experts=[4, 4], top_k=[1, 1], expert_bytes=100)
    assert any(t.priority == "prefetch" for p in plans for t in p.transfers)
    assert sum(len(p.prefetch_hits) for p in plans) >= 1
    stream = stream_from_groups([(0, [0]), (1, [2]), (0, [0]), (1, [2]), (0, [1]), (1, [3])], num_experts=[4, 4],
                                top_k=[1, 1])
    res = simulate(stream, "lru", 0.25, prefetch=PrefetchConfig(predictor="activation"))
    assert res is not None
    from moelab.caches.prefetch import get_prefetcher

    assert get_prefetcher("activation", m=2).m == 2 and get_prefetcher("activation").m is None  # prefetch.m
    with pytest.raises(MoelabError, match="'activation' works only offline"):
        moelab.hybrid(moelab.models.tiny.build_tiny("mixtral", seed=0),
                      {"cache": {"capacity": 0.25}, "prefetch": {"predictor": "activation"}}).apply()


def test_the_what_if_grid_offers_it():
    from moelab.simulate.whatif import parse_grid

    assert parse_grid(["prefetch=none,activation"])["prefetch"] == ["none", "activation"]
    with pytest.raises(MoelabError, match="not a prefetch source"):
        parse_grid(["prefetch=activaton"])


def test_each_forward_is_counted_once_even_when_steps_repeat():
    """In the planner every forward is its own (its seq id is -1): three one-prefill sequences are
    three EAMs, each with the layer never asked about (the last, at d = 1) counted."""
    pf = ActivationAware([4, 4, 4], m=1)
    forwards = [_forward(f, 0, [[f], [f], [f]]) for f in range(3)]  # step 0 every time
    for i, r in enumerate(forwards):
        for ly in range(2):
            _ask(pf, i, r, ly)
    _ask(pf, 3, _forward(3, 0, [[0], [0], [0]]), 0)
    assert len(pf.eams) == 3
    assert [m[2].tolist() for m in pf.eams] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]


def test_a_trace_warm_start_does_not_show_the_planned_routing_to_the_prefetcher():
    """``cache.warm: trace`` replays the routing once to warm the cache; the activation-aware source
    must not carry that pass's sequences into the planned one (each would then match itself): the
    planned pass proposes exactly what it proposes cold."""
    import moelab.hybrid.offline as offline

    routing = []
    for seq in range(3):
        routing += _sequence(2 * seq, [[seq % 4], [(seq + 1) % 4]], steps=3)
    made = []
    real = offline._proposer

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    proposals = {}
    for warm in ("empty", "trace"):
        cfg = {"cache": {"capacity": 0.25, "policy": "lru", "warm": warm}, "placement": "fetch-misses",
               "prefetch": {"predictor": "activation", "select": "order"}}
        offline._proposer = spy
        try:
            plans = plan_routing(routing, cfg, num_experts=[4, 4], top_k=[1, 1], expert_bytes=100)
        finally:
            offline._proposer = real
        proposals[warm] = [t.expert for p in plans for t in p.transfers if t.priority == "prefetch"]
        assert len(made[-1].eams) == 2  # the planned pass saw the first two sequences end, nothing more
    assert sum(len(v) for v in proposals.values()) > 0
