"""The compiled planner's native entry (moelab.hybrid._entry, kernels/fastcall.cpp) plans exactly
what the numba dispatcher path plans from the same routing: the model's tensors handed over as they
are (int64 ids, float32 or bfloat16 weights, int8 slot states, float32 scores, an int64 proposal)
against the numpy views the runtime makes for the dispatcher path. Every cache policy, one token and
several, slot states read and a deferral made in the call, prefetch with budgets; plans, slot
states, compacted splits and caches compared call by call. What the entry does not take as it is
returns None before anything changed."""

from __future__ import annotations

import random

import numpy as np
import pytest

pytest.importorskip("numba")
torch = pytest.importorskip("torch")

from moelab.errors import MoelabError  # noqa: E402
from moelab.hybrid import _compiled, _entry  # noqa: E402
from moelab.hybrid.config import HybridConfig  # noqa: E402
from moelab.hybrid.planner import Planner  # noqa: E402
from moelab.timing.shapes import get_shape  # noqa: E402

L, E = 4, 8


@pytest.fixture(scope="module")
def entry():
    try:
        from moelab.kernels.build import load_extension

        load_extension()
    except MoelabError as exc:  # no C++ toolchain here: the dispatcher path is all there is
        pytest.skip(f"the kernels extension does not build here ({exc})")
    return _entry.native_entry()


def _pair(monkeypatch, cfg: dict, K: int, deferral=None):
    """Two compiled planners of ``cfg``: one with the native entry, one without (the dispatcher path)."""
    config = HybridConfig.from_dict(cfg)
    kw = dict(num_experts=[E] * L, top_k=[K] * L, expert_bytes=1000,
              shape=get_shape("mixtral-8x7b") if cfg.get("hardware") else None)
    monkeypatch.setenv(_compiled.ENV, "compiled")
    native = Planner.build(config, **kw)
    assert native._compiled.entry() is not None
    monkeypatch.setenv(_entry.ENV, "numba")
    numba = Planner.build(config, **kw)
    assert numba._compiled.entry() is None  # (resolved on first use: here, while the setting holds)
    monkeypatch.delenv(_entry.ENV)
    if deferral is not None:
        for p in (native, numba):
            p.defer_with(*deferral)
    return native, numba


def _as_dispatched(ids, w, st, sc):
    """What the runtime hands the dispatcher path for the same tensors (hybrid.runtime._plan_layer_arrays)."""
    wa = None if w is None else (w.view(torch.uint16) if w.dtype == torch.bfloat16 else w).numpy()
    return ids.numpy(), wa, (None if st is None else st.numpy()), (None if sc is None else np.asarray(sc))


def _drive(native, numba, K: int, seed: int, steps: int = 30, dtype=torch.float32, states: bool = True,
           prefetch: bool = True, defer: bool = False) -> int:
    """Plan the same random routing through both entries, comparing everything each call leaves;
    returns how many plans went through the native entry."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    taken = 0
    for f in range(steps):
        T = rng.choice([1, 1, 1, 2, 3, 5])
        for layer in range(L):
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
            w = torch.tensor([[rng.choice([0.1, 0.25, 0.5, 0.75]) for _ in range(K)] for _ in range(T)], dtype=dtype)
            st = None
            if states or defer:
                st = torch.tensor([[rng.choice([0, 0, 0, 1, 2]) for _ in range(K)] for _ in range(T)],
                                  dtype=torch.int8)
            sc = torch.tensor([[rng.choice([0.0, 0.1, 0.2, 0.3, 0.5]) for _ in range(E)] for _ in range(T)])
            pf = np.array(rng.sample(range(E), rng.choice([0, 1, 2, 3])), dtype=np.int64) if prefetch else None
            st2 = None if st is None else st.clone()
            ia, wa, sa, ca = _as_dispatched(ids, w, st2, sc)
            # the weights as the runtime passes them (one token's, too: neither entry reads them then,
            # without a deferral)
            a = native._compiled.plan_tensors(f, f, "decode", layer, ids, w, st, sc, pf, defer)
            assert a is not None, (f, layer)
            taken += 1
            b = numba.plan_layer(f, f, "decode", layer, ia, wa, sa, ca, pf, defer)
            assert a == b, (f, layer)
            if st is not None:  # the deferral's edit, made in place on the tensor and on the array
                assert st.tolist() == sa.tolist(), (f, layer)
            assert native._compiled.widths == numba._compiled.widths
            if T > 1 or defer:
                sa_ = native._compiled.split(layer, ids, w, dtype == torch.bfloat16)
                sb_ = numba._compiled.split(layer, ids, w, dtype == torch.bfloat16)
                assert (sa_ is None) == (sb_ is None)
                if sa_ is not None:
                    assert all(x is y or torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                                                     y.view(torch.uint8) if y.is_floating_point() else y)
                               for x, y in zip([*sa_[0], *(sa_[1] or ())], [*sb_[0], *(sb_[1] or ())], strict=True))
    rc, cc = native.cache, numba.cache
    assert (rc.hits, rc.misses, rc.evictions, rc.prefetched, rc.prefetch_hits) == \
        (cc.hits, cc.misses, cc.evictions, cc.prefetched, cc.prefetch_hits)
    assert rc.eviction_order() == cc.eviction_order() and rc.speculative == cc.speculative
    return taken


POLICIES = [("lru", {}), ("lfu", {"reset_on_evict": True}), ("fifo", {}), ("mrs", {}),
            ("static", {"pinned": [0, 3, 9, 12, 17, 30]}), ("lru", {"insertion": "protect-step"})]


@pytest.mark.parametrize("states", [True, False], ids=["states", "no-states"])
@pytest.mark.parametrize("policy,options", POLICIES)
@pytest.mark.parametrize("placement", ["host-misses", "greedy-hss"])
def test_the_native_entry_plans_what_the_dispatcher_path_plans(monkeypatch, entry, policy, options, placement,
                                                               states):
    # greedy-hss weighs copies with a cost model (whose mixtral-sized experts copy too slowly to
    # prefetch); host-misses, without one, prefetches within its budget of 2 experts a forward
    cfg = {"cache": {"capacity": 0.25, "policy": policy, "options": options}, "placement": placement,
           "prefetch": {"budget": 2, "budget_scope": "forward"}}
    if placement == "greedy-hss":
        cfg["hardware"] = "pcie4-x16"
    native, numba = _pair(monkeypatch, cfg, K=2)
    assert _drive(native, numba, K=2, seed=hash((policy, placement)) % 1000, states=states) == 30 * L
    if placement == "host-misses" and policy != "static":  # not vacuous: the budget bounds what moved
        assert 0 < native.cache.prefetched <= 2 * 30


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rule", ["per_token", "union"])
@pytest.mark.parametrize("K", [1, 2, 4])
def test_a_deferral_made_through_the_native_entry(monkeypatch, entry, dtype, rule, K):
    cfg = {"cache": {"capacity": 0.5, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           "prefetch": {"select": "impact", "distance": 1}}
    native, numba = _pair(monkeypatch, cfg, K=K, deferral=([1, 2, 0, 1], 1, rule == "union"))
    assert _drive(native, numba, K=K, seed=K, dtype=dtype, defer=True) == 30 * L


def _snapshot(p) -> tuple:
    c = p.cache
    return c.hits, c.misses, c.evictions, c.eviction_order(), c.speculative, p._compiled.out.rec.tolist()


def test_what_the_entry_does_not_take_returns_none_and_changes_nothing(monkeypatch, entry):
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "host-misses"}
    native, _ = _pair(monkeypatch, cfg, K=2)
    c = native._compiled
    ids = torch.tensor([[1, 2], [3, 4]])
    w = torch.tensor([[0.5, 0.5], [0.75, 0.25]])
    sc = torch.rand(2, E)
    assert c.plan_tensors(0, 0, "decode", 0, ids, w, None, sc, None) is not None
    before = _snapshot(native)
    wide = torch.zeros(2, 4, dtype=torch.int64)
    cases = {
        "int32 ids": (ids.int(), w, None, sc, None),
        "non-contiguous ids": (wide[:, ::2], w, None, sc, None),
        "1-D ids": (ids.reshape(-1), w, None, sc, None),
        "float64 weights": (ids, w.double(), None, sc, None),
        "weights of another shape": (ids, w[:1], None, sc, None),
        "several tokens without weights": (ids, None, None, sc, None),
        "int64 states": (ids, w, torch.zeros(2, 2, dtype=torch.int64), sc, None),
        "float64 scores": (ids, w, None, sc.double(), None),
        "int32 proposal": (ids, w, None, sc, np.array([1, 2], dtype=np.int32)),
        "list proposal": (ids, w, None, sc, [1, 2]),
        "no scores for MRS": (ids, w, None, None, None),
        "more tokens than the buffers hold": (torch.zeros(4096, 2, dtype=torch.int64), torch.ones(4096, 2), None,
                                              torch.rand(4096, E), None),
    }
    for name, (i, ww, st, s, pf) in cases.items():
        assert c.plan_tensors(0, 1, "decode", 0, i, ww, st, s, pf) is None, name
        assert _snapshot(native) == before, name
    # a layer out of range is the dispatcher path's error to raise
    assert c.plan_tensors(0, 1, "decode", L, ids, w, None, sc, None) is None
    # a deferral writes the slot states: a read-only array of them is refused
    frozen = np.zeros((2, 2), dtype=np.int8)
    frozen.flags.writeable = False
    assert c.plan_tensors(0, 1, "decode", 0, ids, w, frozen, sc, None, True) is None
    assert _snapshot(native) == before


def test_the_fast_calls_raise_instead_of_aborting(entry):
    """A C++ exception inside the extension's fast calls (plan_entry, params_key; not pybind11
    functions) becomes a Python error, not std::terminate: run in a subprocess, so an abort fails
    this test instead of losing a worker. An inference-mode parameter (no version counter) has a key."""
    import subprocess
    import sys

    code = '''
import warnings
import torch
warnings.simplefilter("ignore")
from moelab.kernels.build import load_extension
ext = load_extension()
with torch.inference_mode():
    p = torch.nn.Parameter(torch.zeros(3))
assert len(ext.params_key((p,))) == 5 * 8
sp = torch.sparse_coo_tensor(torch.tensor([[0], [1]]), torch.tensor([1]), (2, 2))
try:
    ext.params_key((sp,))
except RuntimeError:
    pass
else:
    raise SystemExit("params_key of a sparse tensor did not raise")
assert ext.plan_entry(0, 0, 0, 0, 64, 64, 4, 0, 0, -1, -1, sp, None, None, None, None) is None
print("ok")
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_an_expert_out_of_range_is_the_same_error_on_either_entry(monkeypatch, entry):
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses"}
    native, numba = _pair(monkeypatch, cfg, K=2)
    ids = torch.tensor([[1, E]])
    with pytest.raises(MoelabError) as a:
        native._compiled.plan_tensors(0, 0, "decode", 0, ids, None, None, None, None)
    with pytest.raises(MoelabError) as b:
        numba.plan_layer(0, 0, "decode", 0, ids.numpy(), None, None, None, None)
    assert str(a.value) == str(b.value) and str(E) in str(a.value)
    pf = np.array([E + 3], dtype=np.int64)
    with pytest.raises(MoelabError, match=str(E + 3)):
        native._compiled.plan_tensors(0, 0, "decode", 0, torch.tensor([[1, 2]]), None, None, None, pf)


def test_the_setting_chooses_the_entry(monkeypatch, entry):
    monkeypatch.setenv(_entry.ENV, "numba")
    assert _entry.native_entry() is None
    monkeypatch.setenv(_entry.ENV, "natve")
    with pytest.raises(MoelabError, match="MOELAB_PLANNER_ENTRY='natve'.*auto, native or numba"):
        _entry.native_entry()

    import moelab.kernels.build as build

    def broken():
        raise MoelabError("no toolchain")

    monkeypatch.setattr(build, "load_extension", broken)
    monkeypatch.setenv(_entry.ENV, "native")
    with pytest.raises(MoelabError, match="native planner entry is unavailable: no toolchain"):
        _entry.native_entry()
    monkeypatch.setenv(_entry.ENV, "auto")
    assert _entry.native_entry() is None  # auto: the dispatcher path, noted in the log


def test_a_hybrid_run_plans_through_the_native_entry_as_through_the_dispatcher(monkeypatch, entry):
    """A bundled model's hybrid run (MRS, deferral handed to the planner, a learned prefetch
    predictor) plans through the native entry at every decode layer and plans what a run without
    it plans."""
    from pathlib import Path

    from moelab.forward.bench import decode_loop
    from moelab.hybrid.runtime import HybridRun
    from moelab.loading import load

    model, tok = load("moelab-tiny-mixtral")
    ids = tok("Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:", return_tensors="pt").input_ids
    cfg = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
           "routing": {"deferred": 1, "min_immediate": 1}, "planner": "compiled", "executor": "real",
           "host_backend": "reference"}
    pred = Path(__file__).resolve().parents[1] / "predictors" / "moelab-tiny-mixtral" / "learned-d1"
    if pred.is_dir():
        cfg["prefetch"] = {"predictor": str(pred), "distance": 1}
    plans = {}
    for mode in ("auto", "numba"):
        monkeypatch.setenv(_entry.ENV, mode)
        run = HybridRun(model, cfg)
        taken = []
        with run:
            tensors = run.planner._compiled.plan_tensors

            def counted(*args, _f=tensors, _t=taken):
                lp = _f(*args)
                _t.append(lp is not None)
                return lp

            run.planner._compiled.plan_tensors = counted
            decode_loop(model, ids, 6)
        plans[mode] = [p.plain() if hasattr(p, "plain") else p for p in run.plans]
        if mode == "auto":
            assert taken and all(taken[-6 * 4:])  # every decode layer (prefill may grow the buffers first)
        else:  # the planner finds it has no entry on its first try; the runtime tries no more
            assert taken == [False]
    assert plans["auto"] == plans["numba"]
