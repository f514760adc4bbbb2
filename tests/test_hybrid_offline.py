"""Offline planning (moelab.hybrid.offline): the plans of a running hybrid model equal the
offline plans of its own recorded trace field by field; oracle prefetch, Belady, budgets and
prefetch hits by their definitions on hand-made routing."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.hybrid.offline import ForwardRouting, plan_routing, routing_from_trace
from moelab.models.tiny import build_tiny
from moelab.timing.shapes import ModelShape

PRED_DIR = Path(__file__).resolve().parent.parent / "predictors" / "moelab-tiny-mixtral" / "learned-d1"


def _inputs(B=3, S=5, seed=0):
    ids = torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if B > 1:
        mask[1, :2] = 0
        ids[1, :2] = 0
    return ids, mask


def _shape(model):
    layers = moelab.moe_layers(model)
    return {"num_experts": [ly.num_experts for ly in layers], "top_k": [ly.top_k for ly in layers],
            "shape": ModelShape.from_model(model)}


def _offline_equals_online(model, cfg, tmp_path, run_forwards, *, hidden=False):
    with (moelab.record(model, tmp_path / "t", hidden_states=hidden, hidden_dtype="float32") as rec,
          moelab.hybrid(model, cfg) as run):
        run_forwards()
    plans = plan_routing(routing_from_trace(rec.trace), cfg, expert_bytes=run.expert_bytes, **_shape(model))
    online = [asdict(p) for p in run.plans]
    offline = [asdict(p) for p in plans]
    assert len(online) == len(offline) > 0
    for a, b in zip(online, offline, strict=True):
        assert a == b, (a, b)
    if run.cache is not None:  # the plans account for the cache's own counters
        assert sum(len(p.hits) for p in run.plans) == run.cache.hits
        assert sum(len(p.prefetch_hits) for p in run.plans) == run.cache.prefetch_hits
        assert sum(len(p.evictions) for p in run.plans) <= run.cache.evictions
    return run.plans


@pytest.fixture(scope="module")
def mixtral():
    return build_tiny("mixtral", seed=0)


GRID = {
    "lru-host": {"cache": {"capacity": 0.25, "policy": "lru"}},
    "lru-fetch-deferral": {"cache": {"capacity": 0.5, "policy": "lru"}, "placement": "fetch-misses",
                           "routing": {"deferred": 1, "min_immediate": 1}},
    "mrs-global-greedy-deferral": {"cache": {"capacity": 0.25, "policy": "mrs", "scope": "global"},
                                   "placement": "greedy-hss", "hardware": "pcie4-x16",
                                   "routing": {"deferred": 1, "min_immediate": 1, "phase": "all"}},
    "lfu-mincost-skipping": {"cache": {"capacity": 0.25, "policy": "lfu"}, "placement": "min-cost",
                             "hardware": "pcie4-x16", "routing": {"skipped": 1}},
    "no-cache-fetch": {"cache": {"capacity": 0}, "placement": "fetch-misses", "routing": {"deferred": 1,
                                                                                          "min_immediate": 1}},
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(GRID))
def test_a_runs_plans_equal_the_offline_plans_of_its_own_trace(mixtral, tmp_path, name, batch):
    ids, mask = _inputs(batch)

    def go():
        mixtral.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)

    plans = _offline_equals_online(mixtral, GRID[name], tmp_path, go)
    if "deferred" in GRID[name].get("routing", {}):
        assert any(p.deferred for p in plans)
    if "skipped" in GRID[name].get("routing", {}):
        assert any(p.skipped for p in plans)


@pytest.mark.parametrize("scope", ["layer", "forward"])
@pytest.mark.parametrize("batch", [1, 3])
def test_learned_predictor_prefetch_plans_equal_offline_from_the_traces_hidden_states(tmp_path, batch, scope):
    model, tok = moelab.load("moelab-tiny-mixtral")
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           "routing": {"deferred": 1, "min_immediate": 1},
           "prefetch": {"predictor": str(PRED_DIR), "distance": 1, "budget": 1, "budget_scope": scope}}
    prompts = ["Question: Tom has 3 apples and 4 more?\nAnswer:", "Question: 7 + 8 =?\nAnswer:",
               "Question: 12 - 5?\nAnswer:"]

    def go():
        for i in range(0, 3, batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
            model.generate(**enc, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)

    plans = _offline_equals_online(model, cfg, tmp_path, go, hidden=True)
    pf = [t for p in plans for t in p.transfers if t.priority == "prefetch"]
    assert pf, "the predictor prefetched"
    per_forward: dict[int, int] = {}
    for p in plans:
        n = sum(1 for t in p.transfers if t.priority == "prefetch")
        assert n <= 1  # budget 1 per layer
        per_forward[p.forward] = per_forward.get(p.forward, 0) + n
    if scope == "forward":
        assert max(per_forward.values()) <= 1
    else:
        assert max(per_forward.values()) > 1
    for p in plans:
        assert set(p.prefetch_hits) <= set(p.hits)


# ---------------------------------------------------------------------- definitions, hand-made routing
def _routing(layers_per_forward, E=4):
    """ForwardRoutings of one token per forward: ``[[experts of layer 0], [of layer 1], ...] per forward``."""
    out = []
    for f, layers in enumerate(layers_per_forward):
        ids = [np.array([ex], dtype=np.int64) for ex in layers]
        w = [np.array([np.linspace(0.9, 0.1, len(ex))], dtype=np.float32) for ex in layers]
        sc = [np.full((1, E), 1.0 / E, dtype=np.float32) for _ in layers]
        out.append(ForwardRouting(forward=f, step=f + 1, phase="decode", tokens=1, ids=ids, weights=w, scores=sc))
    return out


SHAPE2 = {"num_experts": [4, 4], "top_k": [1, 1], "expert_bytes": 100}


def test_prefetch_hits_are_hits_only_a_prefetch_made():
    routing = _routing([[[0], [3]], [[0], [3]], [[1], [2]]])
    cfg = {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}, "prefetch": {"predictor": "oracle"}}
    p = plan_routing(routing, cfg, **SHAPE2)
    # forward 0: layer 0 misses 0 (run on the host, then cached), then prefetches 3 into layer 1,
    # where 3 is a (prefetch) hit
    assert p[0].misses == [0] and [(t.layer, t.expert, t.priority) for t in p[0].transfers] == [
        (0, 0, "insert"), (1, 3, "prefetch")]
    assert p[1].hits == [3] and p[1].prefetch_hits == [3]
    # forward 1: 0 and 3 are ordinary hits (3 was used since its prefetch); nothing to prefetch
    assert p[2].hits == [0] and p[2].prefetch_hits == [] and p[3].hits == [3] and p[3].prefetch_hits == []
    assert not [t for t in p[2].transfers if t.priority == "prefetch"]
    # forward 2: 1 misses, 2 is prefetched and is a prefetch hit
    assert p[4].misses == [1] and p[5].prefetch_hits == [2]
    none = plan_routing(routing, {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}}, **SHAPE2)
    assert all(not q.prefetch_hits for q in none) and none[1].misses == [3]
    # admission by placement (the default): the host-computed miss 0 is not copied in, so forward
    # 1's layer 0 misses it again; the prefetched 3 is still a hit
    default = plan_routing(routing, {"cache": {"capacity": 0.5, "policy": "lru"}, "prefetch": {"predictor": "oracle"}},
                           **SHAPE2)
    assert [(t.layer, t.expert, t.priority) for t in default[0].transfers] == [(1, 3, "prefetch")]
    assert default[2].misses == [0] and default[3].hits == [3]


def test_the_oracle_prefetch_makes_every_later_layer_a_hit_when_the_slots_suffice():
    rng = np.random.default_rng(0)
    fw = [[sorted(rng.choice(8, 2, replace=False).tolist(), reverse=True) for _ in range(3)] for _ in range(20)]
    routing = _routing(fw, E=8)
    shape = {"num_experts": [8] * 3, "top_k": [2] * 3, "expert_bytes": 1}
    for policy in ("lru", "mrs", "belady", "belady-bypass"):
        plans = plan_routing(routing, {"cache": {"capacity": 0.25, "policy": policy},
                                       "prefetch": {"predictor": "oracle"}}, **shape)
        later = [p for p in plans if p.layer > 0]
        assert all(not p.misses for p in later), policy
        assert sum(len(p.prefetch_hits) for p in later) > 0


def test_prefetch_budget_is_per_layer_by_default_and_per_forward_as_an_option():
    fw = [[[0], [1], [2]], [[3], [0], [1]]]
    routing = _routing(fw)
    shape = {"num_experts": [4] * 3, "top_k": [1] * 3, "expert_bytes": 1}

    def moved(scope):
        cfg = {"cache": {"capacity": 0.5, "policy": "lru"},
               "prefetch": {"predictor": "oracle", "budget": 1, "budget_scope": scope}}
        plans = plan_routing(routing, cfg, **shape)
        return [sum(1 for t in p.transfers if t.priority == "prefetch") for p in plans]

    assert moved("layer") == [1, 1, 0, 1, 1, 0]
    assert moved("forward") == [1, 0, 0, 1, 0, 0]


def test_belady_offline_equals_the_cache_simulation_and_bounds_the_online_policies(mixtral, tmp_path):
    from moelab.caches import simulate

    ids, mask = _inputs(3)
    with moelab.record(mixtral, tmp_path / "t") as rec:
        mixtral.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    shape = {**_shape(mixtral), "expert_bytes": 1}
    from moelab.adapters import expert_bytes
    from moelab.hybrid.offline import trace_shape

    sizes = {k: v for k, v in _shape(mixtral).items() if k != "shape"}
    assert {k: v for k, v in trace_shape(rec.trace).items() if k != "shape"} == {**sizes,
                                                                                 "expert_bytes": max(expert_bytes(ly) for ly in moelab.moe_layers(mixtral))}
    hits = {}
    for policy in ("lru", "lfu", "fifo", "mrs", "belady", "belady-bypass"):
        plans = plan_routing(routing_from_trace(rec.trace),
                             {"cache": {"capacity": 0.25, "policy": policy, "admission": "all"}}, **shape)
        hits[policy] = [int(e in p.hits) for p in plans for e in p.accessed]
        off = simulate(rec.trace, policy, 0.25, include_prefill=True, keep_hits=True)
        assert hits[policy] == off.hit.tolist(), policy
    assert all(sum(hits["belady-bypass"]) >= sum(h) for h in hits.values())


def test_offline_planning_refuses_what_it_cannot_do(mixtral):
    routing = _routing([[[0], [3]]])
    for r in routing:
        r.scores = None
    with pytest.raises(MoelabError, match="reads the router scores"):
        plan_routing(routing, {"cache": {"capacity": 0.5, "policy": "mrs"}}, **SHAPE2)
    with pytest.raises(MoelabError, match="expected one per MoE layer"):
        plan_routing(_routing([[[0]]]), {}, **SHAPE2)
    with pytest.raises(MoelabError, match="needs the model's shape for its cost model; pass shape="):
        plan_routing(_routing([[[0], [3]]]), {"placement": "greedy-hss", "hardware": "pcie4-x16"}, **SHAPE2)
    with pytest.raises(MoelabError, match="neither 'oracle', 'repeat', 'activation' nor a saved predictor"):
        plan_routing(_routing([[[0], [3]]]), {"prefetch": {"predictor": "orcale"}}, **SHAPE2)
    with pytest.raises(MoelabError, match="works only offline"):
        moelab.hybrid(mixtral, {"cache": {"capacity": 0.25, "policy": "belady"}}).apply()
    with pytest.raises(MoelabError, match="budget_scope"):
        plan_routing(_routing([[[0], [3]]]), {"prefetch": {"predictor": "oracle", "budget_scope": "step"}}, **SHAPE2)


def test_slots_and_union_follows_its_definition_on_random_routing():
    from moelab.forward.plan import DEFERRED, DROPPED, IMMEDIATE
    from moelab.hybrid.planner import slots_and_union

    rng = np.random.default_rng(0)
    for _ in range(400):
        T, K, E = int(rng.integers(1, 4)), int(rng.integers(1, 5)), 10
        ids = [rng.permutation(E)[:K].tolist() for _ in range(T)]
        w = [sorted(np.round(rng.random(K), 1).tolist(), reverse=True) for _ in range(T)]
        state = None if rng.random() < 0.3 else [
            rng.choice([IMMEDIATE, DEFERRED, DROPPED], K, p=[0.6, 0.25, 0.15]).tolist() for _ in range(T)]
        needed, tokens, deferred, skipped = slots_and_union(ids, w, state)
        st = state or [[IMMEDIATE] * K for _ in range(T)]
        run = [(e, x) for r, wr, sr in zip(ids, w, st) for e, x, s in zip(r, wr, sr) if s != DROPPED]
        best = {}
        for e, x in run:
            best[e] = max(best.get(e, -1.0), x)
        # one token: its own (router) order; several: by descending largest weight, ties lower id
        want = [e for e, _ in run] if T == 1 else sorted(best, key=lambda e: (-best[e], e))
        assert needed == want
        assert tokens == {e: sum(1 for f, _ in run if f == e) for e in want}
        dfr = [e for r, sr in zip(ids, st) for e, s in zip(r, sr) if s == DEFERRED]
        assert deferred == sorted((e, dfr.count(e)) for e in set(dfr))
        assert skipped == sum(s == DROPPED for sr in st for s in sr)


@pytest.mark.parametrize("scope,predictor", [("layer", "oracle"), ("forward", "oracle"), ("layer", "repeat")])
def test_the_planners_prefetch_budget_is_the_cache_simulations(mixtral, tmp_path, scope, predictor):
    from moelab.caches import PrefetchConfig, simulate

    ids, mask = _inputs(3)
    with moelab.record(mixtral, tmp_path / "t") as rec:
        mixtral.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cfg = {"cache": {"capacity": 0.5, "policy": "mrs", "admission": "all"},  # under lru, 'repeat' proposes only cached experts
           "prefetch": {"predictor": predictor, "budget": 1, "budget_scope": scope}}
    plans = plan_routing(routing_from_trace(rec.trace), cfg, **_shape(mixtral), expert_bytes=1)
    off = simulate(rec.trace, "mrs", 0.5, include_prefill=True, keep_hits=True,
                   prefetch=PrefetchConfig(predictor, 1, budget=1, budget_scope=scope))
    assert [int(e in p.hits) for p in plans for e in p.accessed] == off.hit.tolist()
    assert sum(1 for p in plans for t in p.transfers if t.priority == "prefetch") == off.prefetched > 0
    assert sum(len(p.prefetch_hits) for p in plans) == off.prefetch_hits


def test_any_object_with_the_routing_attributes_is_a_routing_source():
    from types import SimpleNamespace

    fw = [[[0], [3]], [[1], [2]]]
    want = plan_routing(_routing(fw), {"cache": {"capacity": 0.5, "policy": "mrs"},
                                       "prefetch": {"predictor": "oracle"}}, **SHAPE2)
    bare = [SimpleNamespace(forward=r.forward, step=r.step, phase=r.phase, tokens=r.tokens, ids=r.ids,
                            weights=r.weights, scores=r.scores) for r in _routing(fw)]
    got = plan_routing(iter(bare), {"cache": {"capacity": 0.5, "policy": "mrs"},
                                    "prefetch": {"predictor": "oracle"}}, **SHAPE2)
    assert [asdict(p) for p in got] == [asdict(p) for p in want] and len(got) == 4


@pytest.mark.parametrize("routing", [{"deferred": 2, "min_immediate": 1}, {"skipped": 1}, {"deferred": 1, "phase": "all"}])
def test_slot_states_of_many_forwards_at_once_equal_one_forward_at_a_time(routing):
    from moelab.hybrid.config import RoutingConfig
    from moelab.hybrid.offline import OfflineRouting

    rng = np.random.default_rng(1)
    pol = OfflineRouting(RoutingConfig(**routing), [4, 4, 4])
    ids = [np.stack([rng.permutation(8)[:4] for _ in range(int(rng.integers(1, 4)))]) for _ in range(20)]
    w = [np.sort(np.round(rng.random(i.shape), 1).astype(np.float32), axis=1)[:, ::-1].copy() for i in ids]
    for phase in ("decode", "prefill"):
        many = pol.states_many(0, phase, ids, w)
        one = [pol.states(0, phase, i, x) for i, x in zip(ids, w)]
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(many, one, strict=True))
        assert (phase == "decode" or routing.get("phase") == "all") == (many[0] is not None)
