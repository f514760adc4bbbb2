"""One prefetch protocol: the routing-reading kinds are predictor kinds, one context type in the
cache simulator and the offline planner, and no second registry of prefetchers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moelab
from moelab.caches import PrefetchConfig, simulate, stream_from_groups
from moelab.caches.prefetch import proposals
from moelab.errors import MoelabError
from moelab.hybrid.offline import plan_routing
from moelab.predictors import OraclePredictor, RepeatPredictor, make_predictor
from moelab.predictors.protocol import PredictContext
from tests.test_hybrid_offline import SHAPE2 as SHAPE
from tests.test_hybrid_offline import _routing

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    model, _ = moelab.load("tiny-random-mixtral")
    path = tmp_path_factory.mktemp("pp") / "trace"
    with moelab.record(model, path, model_name="tiny-random-mixtral") as rec:
        for i in range(3):
            ids = torch.randint(3, 250, (1, 5), generator=torch.Generator().manual_seed(i))
            model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    return rec.trace


def test_the_routing_reading_kinds_are_predictor_kinds_usable_unfitted():
    assert OraclePredictor.reads_routing == "same" and RepeatPredictor.reads_routing == "previous"
    assert make_predictor("repeat").reads_routing == "previous"
    assert make_predictor("learned").reads_routing is None
    # on a stream: layer 0 of step s proposes layer 1 of step s (oracle) or of step s - 1 (repeat)
    stream = stream_from_groups([(0, [0]), (1, [2]), (0, [1]), (1, [3]), (0, [0]), (1, [1])], [4, 4])
    ptr, keys = proposals("oracle", stream, 1)
    assert [(keys[ptr[g]:ptr[g + 1]] - 4).tolist() for g in range(6)] == [[2], [], [3], [], [1], []]
    ptr, keys = proposals(RepeatPredictor(), stream, 1)
    assert [(keys[ptr[g]:ptr[g + 1]] - 4).tolist() for g in range(6)] == [[], [], [2], [], [3], []]


def test_repeat_predicts_the_previous_steps_experts_of_the_same_sequence(trace):
    p = RepeatPredictor(distance=1).fit(trace)
    tok, pred = p.predict_trace(trace, 0)
    seq, step, layer = (trace.column(c) for c in ("seq", "step", "moe_layer"))
    experts = trace.experts_array()
    checked = 0
    for t, row in zip(tok.tolist(), pred, strict=True):
        s, st = int(p_idx(trace).seq[t]), int(p_idx(trace).step[t])
        prev = np.flatnonzero((seq == s) & (step == st - 1) & (layer == 1))
        if st >= 2 and len(prev) == 1:  # a decode step after a decode step: one token, its own top-k
            assert sorted(row.tolist()) == sorted(experts[prev[0]][experts[prev[0]] >= 0].tolist())
            checked += 1
    assert checked >= 6


def p_idx(trace):
    from moelab.predictors.base import as_trace_data

    return as_trace_data(trace).index


def test_a_propose_object_gets_the_same_context_type_in_the_planner():
    seen: list[PredictContext] = []

    class Always3:
        def propose(self, context):
            seen.append(context)
            return [3]

    routing = _routing([[[0], [1]], [[2], [3]]])
    cfg = {"cache": {"capacity": 0.5, "policy": "lru"}, "prefetch": {"predictor": None}}
    plans = plan_routing(routing, cfg, predictor=Always3(), **SHAPE)
    assert [type(c) for c in seen] == [PredictContext, PredictContext]  # layer 0 of each forward only
    c = seen[0]
    assert (c.layer, c.target_layer, c.step, c.experts.tolist(), c.stream) == (0, 1, 1, [0], None)
    assert c.routing is routing[0] and c.group == 0 and seen[1].group == 2
    pf = [t for p in plans for t in p.transfers if t.priority == "prefetch"]
    assert pf and all(t.expert == 3 and t.layer == 1 for t in pf)
    # per-token rows are unioned in order, as in the cache simulator
    seen.clear()

    class Rows(Always3):
        def propose(self, context):
            return np.array([[2, 3], [-1, -1]])

    plans = plan_routing(_routing([[[0], [1]]]), cfg, predictor=Rows(), **SHAPE)
    assert [t.expert for p in plans for t in p.transfers if t.priority == "prefetch"] == [2, 3]  # union order


def test_removed_protocol_objects_are_refused_with_the_fix():
    class Old:
        def predict(self, context):
            return [1]

    stream = stream_from_groups([(0, [0]), (1, [2])], [4, 4])
    with pytest.raises(MoelabError, match=r"propose\(context\)"):
        simulate(stream, "lru", 1, prefetch=PrefetchConfig(Old(), 1))
    with pytest.raises(MoelabError, match=r"propose\(context\)"):
        plan_routing(_routing([[[0], [1]]]), {"cache": {"capacity": 0.5}}, predictor=Old(), **SHAPE)
    import moelab.caches as caches

    for gone in ("PREFETCHERS", "ExpertPredictor", "register_prefetcher", "OraclePrefetcher"):
        assert not hasattr(caches, gone)


def test_one_prefetch_config_for_the_cache_simulator_the_planner_and_a_run():
    from moelab.caches import PrefetchConfig as Caches
    from moelab.hybrid import HybridConfig
    from moelab.hybrid import PrefetchConfig as Hybrid

    assert Caches is Hybrid
    routing = _routing([[[0], [1]], [[2], [3]], [[0], [2]]])
    base = {"cache": {"capacity": 0.5, "policy": "lru"}}

    def prefetched(prefetch):
        plans = plan_routing(routing, {**base, "prefetch": prefetch}, **SHAPE)
        return [(t.layer, t.expert) for p in plans for t in p.transfers if t.priority == "prefetch"]

    # a budget in bytes (150 B of 100-B experts: one expert) or from a link equals one in experts
    one = prefetched({"predictor": "oracle", "budget": 1})
    assert one and prefetched({"predictor": "oracle", "budget_bytes": 150}) == one
    link = {"predictor": "oracle", "link": {"bandwidth_gbs": 0.15, "latency_us": 0.0}, "window_us": 1.0}
    assert prefetched(link) == one  # at 0.15 GB/s a 100-B expert takes 0.67 µs: one fits in 1 µs
    cfg = HybridConfig.from_dict({**base, "prefetch": link})
    assert HybridConfig.from_dict(cfg.to_dict()) == cfg  # the link survives a round trip through plain data
    # no source: no prefetch, in the cache simulator as in the planner
    stream = stream_from_groups([(0, [0]), (1, [2])], [4, 4])
    assert simulate(stream, "lru", 1, prefetch=PrefetchConfig()).prefetched == 0
    assert prefetched({}) == []
