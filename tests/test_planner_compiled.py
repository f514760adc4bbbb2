"""The compiled per-layer planner (moelab.hybrid._compiled) plans exactly what the Python
planner (the reference) plans: field by field over synthetic routings (one token and several,
deferred and dropped slots, prefetch proposals), for every cache policy a running model allows,
both scopes, both admissions, each compiled placement, prefetch on and off; and a hybrid run
of a bundled model gives the same plan table on either path."""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from dataclasses import asdict

import pytest

pytest.importorskip("numba")

from moelab.errors import MoelabError  # noqa: E402
from moelab.hybrid import _compiled  # noqa: E402
from moelab.hybrid.config import HybridConfig  # noqa: E402
from moelab.hybrid.planner import Planner  # noqa: E402
from moelab.timing.shapes import get_shape  # noqa: E402

L, E, K = 4, 8, 2


def _slow_device_profile(tmp_path) -> str:
    """pcie4-x16 with a device slower than its host: greedy-hss then steals hits for the host."""
    import yaml

    from moelab.timing.profiles import __file__ as where

    data = yaml.safe_load((__import__("pathlib").Path(where).parent / "pcie4-x16.yaml").read_text())
    data["name"] = "slow-device"
    data["gpu_memory_bandwidth_gbs"]["value"] = 5.0
    data["cpu_memory_bandwidth_gbs"]["value"] = 2000.0
    data["cpu_peak_tflops"]["value"] = 200.0
    out = tmp_path / "slow-device.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


def _planners(monkeypatch, cfg: dict, **extra):
    config = HybridConfig.from_dict(cfg)
    shape = get_shape("mixtral-8x7b") if cfg.get("hardware") else None
    kw = dict(num_experts=[E] * L, top_k=[K] * L, expert_bytes=1000, shape=shape, **extra)
    monkeypatch.setenv(_compiled.ENV, "reference")
    ref = Planner.build(config, **kw)
    monkeypatch.setenv(_compiled.ENV, "compiled")
    comp = Planner.build(config, **kw)
    monkeypatch.delenv(_compiled.ENV)
    assert (ref.path, comp.path) == ("reference", "compiled")
    return ref, comp


def _routing(rng: random.Random, tokens: int, states: bool):
    ids, w, st = [], [], []
    for _ in range(tokens):
        row = rng.sample(range(E), K)
        ids.append(row)
        # weights from a few values: ties between tokens' experts happen
        w.append([rng.choice([0.1, 0.25, 0.5, 0.75]) for _ in row])
        st.append([rng.choice([0, 0, 0, 1, 2]) for _ in row] if states else [0] * K)
    return ids, w, (st if states else None)


def _scores(rng: random.Random, tokens: int):
    import numpy as np

    s = np.array([[rng.choice([0.0, 0.1, 0.2, 0.3, 0.5]) for _ in range(E)] for _ in range(tokens)], dtype=np.float32)
    return s


def _drive(ref, comp, seed: int, steps: int = 40, prefetch: bool = False) -> Counter:
    """Plan the same random routing with both planners, comparing every plan; returns counts of
    what the plans did (transfers by priority, stolen hits)."""
    rng = random.Random(seed)
    seen: Counter = Counter()
    for f in range(steps):
        tokens = rng.choice([1, 1, 1, 2, 3, 5])
        for layer in range(L):
            ids, w, st = _routing(rng, tokens, states=rng.random() < 0.5)
            sc = _scores(rng, tokens)
            pf = rng.sample(range(E), rng.choice([0, 1, 2, 3])) if prefetch else None
            a = ref.plan_layer(f, f, "decode", layer, ids, w if tokens > 1 else None, st, sc, pf)
            b = comp.plan_layer(f, f, "decode", layer, ids, w if tokens > 1 else None, st, sc, pf)
            assert asdict(a) == asdict(b), (f, layer)
            assert a == b
            seen.update(t.priority for t in a.transfers)
            seen["stolen"] += len(set(a.hits) & {e for e, _ in a.host})
    rc, cc = ref.cache, comp.cache
    assert (rc.hits, rc.misses, rc.evictions, rc.transfers, rc.prefetched, rc.prefetch_hits) == \
        (cc.hits, cc.misses, cc.evictions, cc.transfers, cc.prefetched, cc.prefetch_hits)
    assert rc.contents() == cc.contents()
    assert rc.speculative == cc.speculative
    assert rc.eviction_order() == cc.eviction_order()
    return seen


POLICIES = [("lru", {}), ("lfu", {}), ("lfu", {"reset_on_evict": True}), ("fifo", {}), ("mrs", {}),
            ("mrs", {"alpha": 1.0, "p": 2}), ("static", {"pinned": [0, 3, 9, 12, 17, 30]}),
            ("lru", {"insertion": "protect-step"})]


@pytest.mark.parametrize("policy,options", POLICIES)
@pytest.mark.parametrize("scope", ["layer", "global"])
@pytest.mark.parametrize("admission", ["placement", "all"])
def test_policies_scopes_admissions(monkeypatch, policy, options, scope, admission):
    cfg = {"cache": {"capacity": 0.25 if scope == "layer" else 0.3, "policy": policy, "scope": scope,
                     "options": options, "admission": admission},
           "placement": "host-misses", "prefetch": {"budget": 2}}
    ref, comp = _planners(monkeypatch, cfg)
    _drive(ref, comp, seed=hash((policy, scope, admission)) % 1000, prefetch=True)


@pytest.mark.parametrize("placement", ["host-misses", "fetch-misses", "greedy-hss"])
@pytest.mark.parametrize("prefetch", [None, "order", "impact"])
@pytest.mark.parametrize("policy", ["lru", "mrs"])
@pytest.mark.parametrize("hardware", ["pcie4-x16", "gh200", "slow-device"])
def test_placements_prefetch(monkeypatch, tmp_path, placement, prefetch, policy, hardware):
    # impact-driven selection looks ahead by distance × the profile's decode layer time: a
    # distance of 3 lets it choose several experts on a fast link
    if hardware == "slow-device":
        hardware = _slow_device_profile(tmp_path)
    # a slow device fetches nothing: admission "all" fills its cache (then hits exist to steal)
    admission = "all" if "slow-device" in hardware else "placement"
    cfg = {"cache": {"capacity": 0.5, "policy": policy, "admission": admission}, "placement": placement,
           "hardware": hardware,
           "prefetch": {"select": prefetch or "order", "distance": 1 if prefetch != "impact" else 3}}
    ref, comp = _planners(monkeypatch, cfg)
    seen = _drive(ref, comp, seed=7, steps=60, prefetch=prefetch is not None)
    # the cases are not vacuous: what each placement does shows up in the plans
    if placement == "greedy-hss":  # a fast device fetches misses; a slow one gives the host hits
        assert seen["stolen" if "slow-device" in str(hardware) else "demand"] > 0
    if prefetch == "impact" and hardware == "gh200":
        assert seen["prefetch"] > 0


@pytest.mark.parametrize("budget_scope,budget", [("forward", 3), ("layer", 1), ("layer", None)])
def test_prefetch_budgets(monkeypatch, budget_scope, budget):
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses",
           "prefetch": {"budget": budget, "budget_scope": budget_scope, "distance": 2}}
    ref, comp = _planners(monkeypatch, cfg)
    _drive(ref, comp, seed=3, prefetch=True)


DEFER_WEIGHTS = [0.5, 0.25, 0.25, 0.0, -0.0, 0.125, 1.0, float("nan"), float("-inf"), 0.75]


@pytest.mark.parametrize("rule", ["per_token", "union"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("K", [1, 2, 4, 6])
def test_deferral_made_in_the_plan_call_edits_the_states_as_the_policy_does(monkeypatch, K, dtype, rule):
    """``plan_layer(defer=True)`` (the run's deferral handed to the planner): the slot states the
    compiled call leaves are those :class:`~moelab.policies.ExpertDeferral` leaves on the plan's
    tensors (the tensor path, and the list path of small plans), the reference planner's too, and
    both planners' plans are equal. Ties, zeros of both signs, NaN and -inf weights, slots an
    earlier policy deferred or dropped, one token and several; bfloat16 weights reach the
    planners as their bit patterns (uint16), as the runtime hands them over. (The plans are
    compared where no weight is NaN: the union of several tokens is ordered by weight.)"""
    from types import SimpleNamespace

    import numpy as np
    import torch

    import moelab.forward.plan as plan_mod
    from moelab.forward.plan import SlotPlan
    from moelab.forward.points import _split_plan
    from moelab.policies.deferral import DeferralConfig, ExpertDeferral

    E2, L2 = 12, 3
    config = HybridConfig.from_dict({"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses"})
    kw = dict(num_experts=[E2] * L2, top_k=[K] * L2, expert_bytes=1000)
    monkeypatch.setenv(_compiled.ENV, "reference")
    ref = Planner.build(config, **kw)
    monkeypatch.setenv(_compiled.ENV, "compiled")
    comp = Planner.build(config, **kw)
    tdtype = getattr(torch, dtype)
    rng = random.Random(K * 7 + (rule == "union") + 100 * (dtype == "bfloat16"))
    moved = 0
    for f in range(60):
        d, mi = rng.randrange(0, K + 1), rng.randrange(0, K + 1)
        deferred = [d, rng.randrange(0, K + 1), 0]
        for p in (ref, comp):
            p.defer_with(deferred, mi, rule == "union")
        pol = ExpertDeferral.__new__(ExpertDeferral)
        pol.config = DeferralConfig(deferred=d, min_immediate=mi, batch_rule=rule)
        pol.deferred_ = deferred
        T = rng.choice([1, 1, 2, 3, 5])
        layer = rng.randrange(L2)
        ids = torch.tensor([rng.sample(range(E2), K) for _ in range(T)], dtype=torch.int64)
        w = torch.tensor([[rng.choice(DEFER_WEIGHTS) for _ in range(K)] for _ in range(T)], dtype=tdtype)
        st0 = torch.tensor([[rng.choice((0, 0, 0, 1, 2)) for _ in range(K)] for _ in range(T)], dtype=torch.int8)
        want = []
        for small in (True, False):  # the policy on the plan's tensors: list path, tensor path
            monkeypatch.setattr(plan_mod, "SMALL", 64 if small else 0)
            sp = SlotPlan(SimpleNamespace(index=layer, top_k=K), ids, w.clone(), st0.clone(),
                          torch.ones(T, dtype=torch.bool), "decode")
            pol._plan(sp)
            want.append(sp.state.tolist())
        monkeypatch.setattr(plan_mod, "SMALL", 64)
        assert want[0] == want[1]
        wa = w.view(torch.uint16).numpy() if dtype == "bfloat16" else w.numpy()
        got, plans = [], []
        for p in (ref, comp):
            st = st0.numpy().copy()
            plans.append(p.plan_layer(f, f, "decode", layer, ids.numpy(), wa, st, None, None, True))
            got.append(st.tolist())
        assert got[0] == got[1] == want[0], (w.tolist(), st0.tolist(), d, mi, layer)
        # the compacted routing the compiled call leaves for the seam: the seam's own compaction
        sp = SlotPlan(SimpleNamespace(index=layer, top_k=K), ids, w, torch.tensor(want[0], dtype=torch.int8),
                      torch.ones(T, dtype=torch.bool), "decode")
        split = comp._compiled.split(layer, ids, w, dtype == "bfloat16")
        assert (split is not None) == sp.changed
        if split is not None:
            for a, b in zip(_flat(split), _flat(_split_plan(ids, sp)), strict=True):
                assert _same(a, b), (a, b)
        if not bool(w.isnan().any()):  # (a NaN weight has no place in the union's order by weight)
            assert asdict(plans[0]) == asdict(plans[1])
        moved += int((np.array(want[0]) != st0.numpy()).sum())
    assert moved > 0


def _flat(split) -> list:
    now, late = split
    return [*now, *(late if late is not None else (None, None))]


def _same(a, b) -> bool:
    """Both None, or the same dtype, shape and bits."""
    import torch

    if a is None or b is None:
        return a is b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
        return torch.equal(a.view(bits), b.view(bits))
    return torch.equal(a, b)


def test_plan_layer_with_defer_needs_what_it_edits(monkeypatch):
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses"}
    ref, comp = _planners(monkeypatch, cfg)
    for p in (ref, comp):
        with pytest.raises(MoelabError, match="defer_with"):
            p.defer_with([1, 1], 0, False)
    import numpy as np

    ids, w = np.array([[1, 2]]), np.array([[0.5, 0.25]], dtype=np.float32)
    with pytest.raises(MoelabError, match="defer_with"):
        ref.plan_layer(0, 0, "decode", 0, ids, w, np.zeros((1, 2), np.int8), None, None, True)
    for p in (ref, comp):
        p.defer_with([1] * L, 0, False)
    with pytest.raises(MoelabError, match="in place"):
        comp.plan_layer(0, 0, "decode", 0, ids, w, [[0, 0]], None, None, True)
    st = np.zeros((1, 2), np.int8)
    comp.plan_layer(0, 0, "decode", 0, ids, w, st, None, None, True)
    assert st.tolist() == [[0, 1]]


def test_warm_start(monkeypatch):
    cfg = {"cache": {"capacity": 0.25, "policy": "lfu"}, "placement": "fetch-misses"}
    ref, comp = _planners(monkeypatch, cfg, warm=[1, 2, 9, 10, 20, 30])
    assert ref.cache.contents() == comp.cache.contents()
    _drive(ref, comp, seed=11)


def test_hand_computed_case(monkeypatch):
    # LRU, 2 slots in layer 0, host-misses: token 0 needs 3 then 1; token 1 needs 1 then 5;
    # union by largest weight: 1 (0.6), 3 (0.4), 5 (0.3); all misses on the host, none admitted
    cfg = {"cache": {"capacity": 2, "policy": "lru"}, "placement": "host-misses"}
    _, comp = _planners(monkeypatch, cfg)
    lp = comp.plan_layer(0, 0, "decode", 0, [[3, 1], [1, 5]], [[0.4, 0.2], [0.6, 0.3]], [[0, 1], [0, 2]], None, None)
    assert lp.accessed == [1, 3]  # 5's slot dropped
    assert lp.deferred == [(1, 1)] and lp.skipped == 1
    assert lp.host == [(1, 2), (3, 1)] and lp.device == [] and lp.misses == [1, 3] and lp.transfers == []
    assert comp.cache.contents(0) == []
    # fetch-misses: both fetched and admitted, then a hit
    cfg["placement"] = "fetch-misses"
    _, comp = _planners(monkeypatch, cfg)
    comp.plan_layer(0, 0, "decode", 0, [[3, 1]], None, None, None, None)
    lp = comp.plan_layer(1, 1, "decode", 0, [[1, 6]], None, None, None, None)
    assert lp.hits == [1] and lp.misses == [6] and lp.evictions == [(0, 3)]
    assert comp.cache.contents(0) == [1, 6]


def test_prefill_sized_plans_and_long_proposals_after_decode_ones(monkeypatch, tmp_path):
    """The compiled planner's tables and scratch (MRS's top-p table, the prefetch keys, the plan's
    record) are sized for 64 tokens at first and regrown, handle and all, for a larger call (or more
    rows of scores); a
    proposal longer than the cache's keys (repeats) gets its own keys array. Both paths still plan
    the same, before and after the growth."""
    import numpy as np

    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           "prefetch": {"distance": 1}}
    ref, comp = _planners(monkeypatch, cfg)
    rng = random.Random(5)
    grown = False
    for f, tokens in enumerate([1, 3, 70, 1, 200, 2, 1]):
        for layer in range(L):
            ids, w, st = _routing(rng, tokens, states=True)
            sc = _scores(rng, 90 if f == 0 else tokens)  # f = 0: more scores rows than the tables' 64 tokens
            pf = [rng.randrange(E) for _ in range(3 * L * E if f == 5 else 3)]  # f = 5: longer than NK
            h0 = comp._compiled._h
            a = ref.plan_layer(f, f, "decode", layer, ids, w if tokens > 1 else None, st, sc, pf)
            b = comp.plan_layer(f, f, "decode", layer, ids, w if tokens > 1 else None, st, sc, pf)
            assert asdict(a) == asdict(b), (f, layer)
            grown |= comp._compiled._h is not h0
    assert grown and comp._compiled._ntab > 200
    assert ref.cache.contents() == comp.cache.contents() and ref.cache.eviction_order() == comp.cache.eviction_order()
    assert np.array_equal(comp._compiled.out.rows, np.arange(comp._compiled._ntab))


def test_the_state_handle_names_each_array_and_refuses_what_the_kernel_cannot_read(monkeypatch):
    """The handle holds, per field, an array's address and shape or a setting's value; an array that
    is not C-contiguous, or a field of another type than the kernel's, is refused with its name."""
    import numpy as np

    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses"}
    _, comp = _planners(monkeypatch, cfg)
    c = comp._compiled
    h = c._h.tolist()
    # Cache: code, insertion, lfu_reset, alpha (its float's bits), bypass, never, then pinned's address and length
    assert h[:6] == [c.state.code, 0, 0, int(np.float64(c.state.alpha).view(np.int64)), 0, 0]
    assert h[6:8] == [c.state.pinned.ctypes.data, c.state.pinned.shape[0]]
    assert c.out.rec.ctypes.data in h and c.static.layer_hm.ctypes.data in h
    i = h.index(c.static.layer_hm.ctypes.data)
    assert h[i + 1 : i + 3] == [L, 2]
    with pytest.raises(MoelabError, match=r"Static\.costs: .*1d, A.*C-contiguous"):
        _compiled.handle(c.state, c.static._replace(costs=np.zeros(20)[::2]), c.out)
    with pytest.raises(MoelabError, match=r"Static\.top_k: array\(int32"):
        _compiled.handle(c.state, c.static._replace(top_k=c.static.top_k.astype(np.int32)), c.out)


def test_unsupported_falls_back_and_forcing(monkeypatch):
    cfg = HybridConfig.from_dict({"cache": {"capacity": 0.25}, "placement": "min-cost", "hardware": "pcie4-x16"})
    kw = dict(num_experts=[E] * L, top_k=[K] * L, expert_bytes=1000, shape=get_shape("mixtral-8x7b"))
    monkeypatch.delenv(_compiled.ENV, raising=False)
    p = Planner.build(cfg, **kw)
    assert p.path == "reference" and "min-cost" in p.path_reason
    monkeypatch.setenv(_compiled.ENV, "compiled")
    with pytest.raises(MoelabError, match="cannot run compiled"):
        Planner.build(cfg, **kw)
    monkeypatch.setenv(_compiled.ENV, "fast")
    with pytest.raises(MoelabError, match="MOELAB_PLANNER"):
        Planner.build(cfg, **kw)


def test_the_config_chooses_the_path_and_auto_compiles_only_the_real_executors(monkeypatch):
    kw = dict(num_experts=[E] * L, top_k=[K] * L, expert_bytes=1000)
    monkeypatch.delenv(_compiled.ENV, raising=False)

    def path(**cfg):
        p = Planner.build(HybridConfig.from_dict({"cache": {"capacity": 0.25}, **cfg}), **kw)
        return p.path, p.path_reason

    got, why = path()  # functional executor, planner: auto
    assert got == "reference" and "planner: auto" in why and "functional" in why
    assert path(executor="real", device="cpu") == ("compiled", None)
    assert path(planner="compiled") == ("compiled", None)
    assert path(executor="real", device="cpu", planner="reference") == ("reference", "planner: reference")
    monkeypatch.setenv(_compiled.ENV, "compiled")  # the environment overrides the config
    assert path(planner="reference")[0] == "compiled"
    with pytest.raises(MoelabError, match="planner 'compild'.*'compiled'"):
        HybridConfig.from_dict({"planner": "compild"})


def test_bad_input_is_refused(monkeypatch):
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "host-misses"}
    ref, comp = _planners(monkeypatch, cfg)
    import numpy as np

    with pytest.raises(MoelabError, match="out of range"):
        comp.plan_layer(0, 0, "decode", 0, [[1, E]], None, None, np.zeros((1, E), np.float32), None)
    with pytest.raises(MoelabError, match="scores"):
        comp.plan_layer(0, 0, "decode", 0, [[1, 2]], None, None, None, None)
    bad = np.zeros((1, E), np.float32)
    bad[0, 3] = np.nan
    with pytest.raises(MoelabError):
        comp.plan_layer(0, 0, "decode", 0, [[1, 2]], None, None, bad, None)


def test_lazy_plan_copies_as_a_layer_plan(monkeypatch):
    import copy
    import pickle

    from moelab.hybrid.planner import LayerPlan

    cfg = {"cache": {"capacity": 2, "policy": "lru"}, "placement": "fetch-misses", "prefetch": {"budget": 1}}
    ref, comp = _planners(monkeypatch, cfg)
    args = (0, 0, "decode", 0, [[3, 1]], None, [[0, 1]], None, [5, 6])
    a, b = ref.plan_layer(*args), comp.plan_layer(*args)
    # the plan outlives the planner's buffers: a second plan does not change the first
    comp.plan_layer(1, 1, "decode", 0, [[2, 7]], None, None, None, None)
    ref.plan_layer(1, 1, "decode", 0, [[2, 7]], None, None, None, None)
    for x in (pickle.loads(pickle.dumps(b)), copy.deepcopy(b), b):
        assert type(x) is LayerPlan or isinstance(x, LayerPlan)
        assert x == a and a == x
        assert not x != a  # noqa: SIM202 - __ne__ of the lazy plan
        assert repr(x) == repr(a)
    assert b.transfers[-1].priority == "prefetch" and b.deferred == [(1, 1)]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("model_name", ["moelab-tiny-mixtral", "moelab-tiny-qwen2moe"])
def test_a_hybrid_run_plans_the_same_on_both_paths(monkeypatch, tmp_path, model_name, batch):
    """The bench's full configuration (MRS cache, greedy-hss, deferral, learned prefetch where the
    bundled predictor exists) in a running model: the compiled path's plan table, outputs and
    cache counters equal the reference's; the reference planner, offline over the compiled run's
    recorded trace, plans the same again."""
    from pathlib import Path

    import moelab
    from moelab.hybrid.offline import plan_routing, routing_from_trace
    from moelab.timing.shapes import ModelShape

    model, tok = moelab.load(model_name)
    layers = moelab.moe_layers(model)
    k = min(ly.top_k for ly in layers)
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           "routing": {"deferred": 1 if k <= 2 else 2, "min_immediate": 1}}
    pred = Path(__file__).resolve().parent.parent / "predictors" / model_name / "learned-d1"
    if pred.is_dir():
        cfg["prefetch"] = {"predictor": str(pred), "distance": 1}
    prompts = ["Question: Tom has 3 apples and 4 more?\nAnswer:", "Question: 7 + 8 =?\nAnswer:",
               "Question: 12 - 5?\nAnswer:"]
    got = {}
    for path in ("reference", "compiled"):
        monkeypatch.setenv(_compiled.ENV, path)
        seqs = []
        with (moelab.record(model, tmp_path / path, hidden_states=True, hidden_dtype="float32") as rec,
              moelab.hybrid(model, cfg) as run):
            assert run.planner.path == path
            for i in range(0, 3, batch):
                enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
                seqs.append(model.generate(**enc, max_new_tokens=6, do_sample=False,
                                           pad_token_id=tok.pad_token_id).tolist())
        c = run.cache
        got[path] = (run.plan_table(), seqs, (c.hits, c.misses, c.evictions, c.transfers, c.prefetched),
                     c.contents(), rec.trace, run)
    ref, comp = got["reference"], got["compiled"]
    assert ref[0].equals(comp[0]) and len(ref[0]) > 0
    assert ref[1:4] == comp[1:4]
    assert any(d for d in comp[0]["deferred"])
    if model_name == "moelab-tiny-mixtral":  # (impact-driven selection prefetches nothing for qwen2moe here)
        assert any(t[3] == "prefetch" for ts in comp[0]["transfers"] for t in ts)
    # the reference planner offline over the compiled run's trace
    monkeypatch.setenv(_compiled.ENV, "reference")
    run = comp[5]
    offline = plan_routing(routing_from_trace(comp[4]), cfg, expert_bytes=run.expert_bytes,
                           num_experts=[ly.num_experts for ly in layers], top_k=[ly.top_k for ly in layers],
                           shape=ModelShape.from_model(model))
    assert [asdict(p) for p in offline] == [asdict(p) for p in run.plans]


@pytest.mark.parametrize("between", [None, "observer", "policy", "after"])
def test_the_run_hands_its_deferral_to_the_compiled_planner_only_where_nothing_runs_between(monkeypatch, between):
    """With the compiled planner, the run's Expert Deferral is made in the planner's call (the
    policy's own ``_plan`` does not run on a real decode step; padded prefill rows go back to the
    policy) with the reference path's tokens, plan table and deferred slots; where another plan
    handler sits between the two (an observer of the states) or another policy acts after the
    deferral, the policy edits the plan itself, so what runs in between sees its edit. Either way
    the compiled planner, the last plan handler, hands the seam the compacted routing."""
    import torch

    import moelab
    from moelab.forward import Order, forward_hooks
    from moelab.models.tiny import build_tiny
    from moelab.policies import ExpertSkipping
    from moelab.policies.deferral import ExpertDeferral

    model = build_tiny("qwen2_moe", seed=0, dtype=torch.bfloat16)  # bf16 router weights
    calls = Counter()
    plan_of = ExpertDeferral._plan

    def counted(self, plan):
        calls[plan.phase] += 1
        return plan_of(self, plan)

    monkeypatch.setattr(ExpertDeferral, "_plan", counted)
    import moelab.forward.points as points

    split_of = points._split_plan

    def counted_split(experts, plan):
        calls["split-" + plan.phase] += 1
        return split_of(experts, plan)

    monkeypatch.setattr(points, "_split_plan", counted_split)
    ids = torch.randint(3, 250, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding: the prefill's padded rows
    cfg = {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}, "placement": "host-misses",
           "routing": {"deferred": 1, "min_immediate": 1, "phase": "all"}}
    got = {}
    for path in ("reference", "compiled"):
        monkeypatch.setenv(_compiled.ENV, path)
        calls.clear()
        seen: list[int] = []
        with moelab.hybrid(model, cfg) as run, contextlib.ExitStack() as stack:
            if between == "observer":
                h = forward_hooks(model).add("plan", lambda ctx, layer, call, seen=seen: seen.append(
                    int(call.plan.state.sum())), order=Order.ROUTING + 50)
                stack.callback(h.remove)
            if between == "policy":
                stack.enter_context(ExpertSkipping(model, skipped=1))
            if between == "after":  # a handler after the planner takes layer 0's deferral back
                def undefer(ctx, layer, call):
                    if layer.index == 0:
                        call.plan.state = torch.zeros_like(call.plan.state)

                h = forward_hooks(model).add("plan", undefer, order=Order.BACKEND)
                stack.callback(h.remove)
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
        got[path] = (out.tolist(), run.plan_table(), dict(calls), seen)
    ref, comp = got["reference"], got["compiled"]
    assert ref[0] == comp[0] and ref[1].equals(comp[1]) and ref[3] == comp[3]
    assert sum(len(d) for d in comp[1]["deferred"]) > 0
    assert ref[2]["decode"] > 0 and comp[2].get("prefill", 0) > 0
    assert comp[2].get("decode", 0) == (0 if between in (None, "after") else ref[2]["decode"])
    # where the compiled planner is the last plan handler it compacts the decode steps' routing for
    # the seam; where a handler follows it, the seam compacts the plan as that handler leaves it
    assert ref[2]["split-decode"] > 0
    assert comp[2].get("split-decode", 0) == (ref[2]["split-decode"] if between == "after" else 0)
    if between == "observer":
        assert any(seen)  # it saw the deferred slots


_NO_COMPILE = """
import os, sys
os.environ["MOELAB_PLANNER"] = "compiled"
import numpy as np
from moelab.hybrid import _compiled
from moelab.hybrid.config import HybridConfig
from moelab.hybrid.planner import Planner

config = HybridConfig.from_dict({"cache": {"policy": "lru", "capacity": 0.5}})
p = Planner.build(config, num_experts=[8] * 4, top_k=[2] * 4, expert_bytes=1000)
p.plan_layer(0, 0, "decode", 0, np.array([[1, 2]]), np.array([[0.5, 0.5]], dtype=np.float32))
if sys.argv[1] == "check":
    missed = {f.__name__: len(f.stats.cache_misses) for f in (_compiled.run,)}
    assert not any(missed.values()) and all(f.stats.cache_hits for f in (_compiled.run,)), missed
print("ok")
"""


def test_a_new_process_loads_the_compiled_planner_from_the_disk_cache(tmp_path):
    """The planner's entry point is cached on disk (a jitclass made every process compile for
    seconds): after one process has planned, the next one loads it and compiles nothing for it
    (numba's dispatcher statistics, in a fresh interpreter)."""
    import subprocess
    import sys

    script = tmp_path / "plan_once.py"
    script.write_text(_NO_COMPILE)
    for mode in ("warm", "check"):
        r = subprocess.run([sys.executable, str(script), mode], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_the_bench_replays_a_run_whose_deferral_the_planner_makes():
    """``moelab bench hybrid``'s planner cost replays the run's recorded plan calls through a fresh
    planner and checks it plans the same: with the deferral handed to the planner, the fresh one
    gets it too (the replay raised before); so does its replay with the caches evicted before each
    plan."""
    from moelab.hybrid.bench import planner_cost

    r = planner_cost("moelab-tiny-mixtral", steps=4, repeats=1)
    assert r["path"] == "compiled" and r["plans"] > 0 and r["planner_alone_us"] > 0
    assert r["planner_alone_cold_us"] > 0 and 8 <= r["evict_mib"] <= 256


def test_the_cold_replay_evicts_twice_the_largest_cache_within_bounds(tmp_path):
    """The bench's cold replay reads a buffer twice the largest cache sysfs reports, at least 8 MiB
    and at most 256 MiB; unreadable sizes are skipped and no sizes at all assume a 16 MiB cache."""
    from moelab.hybrid.bench import _evictor

    def cache_dir(name: str, **sizes: str):
        d = tmp_path / name
        for index, size in sizes.items():
            (d / index).mkdir(parents=True)
            (d / index / "size").write_text(size + "\n")
        return d

    mib = 2**20
    assert _evictor(cache_dir("l3", index0="32K", index2="1024K", index3="36608K")).nbytes == 2 * 36608 * 1024
    assert _evictor(cache_dir("small", index0="32K", index1="1M")).nbytes == 8 * mib
    assert _evictor(cache_dir("huge", index3="1G")).nbytes == 256 * mib
    assert _evictor(cache_dir("bytes", index3="12582912", index4="n/a", index5="")).nbytes == 24 * mib
    assert _evictor(tmp_path / "none").nbytes == 32 * mib
