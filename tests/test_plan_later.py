"""Plans made after their layer's compute (``HybridRun.plan_pending``): the same plans, in the same
order, as planning each layer before it runs.

The CUDA executor computes a layer before its plan once every expert is resident on the GPU
(``moelab.hybrid.cuda.CudaExecutor.plan_later``; its own test needs a GPU). The runtime's half of
that contract is tested here on the CPU with an executor that lets chosen layers' plans wait and
hands the routing over as copies, as the CUDA executor's pinned copies are.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import moelab
from moelab.forward import Order
from moelab.hybrid.executors import EXECUTORS, FunctionalExecutor
from moelab.hybrid.runtime import active_hybrid
from moelab.models.tiny import build_tiny
from tests.test_hybrid import _inputs


class _Waits(FunctionalExecutor):
    """Lets the plans of ``LAYERS`` (None: every layer) wait until the forward's end; records the
    plans it received, in order, with the layer each was handed over for."""

    name = "test-plans-wait"
    LAYERS: set[int] | None = None
    seen: list = []

    def install(self, mgr):
        return [*super().install(mgr),
                mgr.add("forward_end", lambda ctx, ok: self.run.plan_pending(drop=not ok), order=Order.OBSERVE,
                        name="test plans wait")]

    def plan_later(self, ctx, layer, call):
        if self.LAYERS is not None and layer.index not in self.LAYERS:
            return None
        K = call.experts.shape[-1]
        ids = call.experts.reshape(-1, K).clone()
        w = call.weights.reshape(-1, K).clone()
        return ids, w, SimpleNamespace(synchronize=lambda: None), lambda lp: self.seen.append((layer.index, lp))


@pytest.fixture
def waits():
    _Waits.LAYERS, _Waits.seen = None, []
    with EXECUTORS.temporarily("test-plans-wait", _Waits):
        yield _Waits


def _plans(model, cfg, ids, mask, n=4):
    with moelab.hybrid(model, cfg) as run:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0)
    return run


@pytest.mark.parametrize("planner", ["compiled", "reference"])
@pytest.mark.parametrize("layers", [None, {0, 2}, {1}])
@pytest.mark.parametrize("B", [1, 3])
def test_plans_made_after_the_compute_equal_plans_made_before_it(waits, planner, layers, B):
    """Every policy decision depends on the routing and the cache's state only, and both are the
    same at the forward's end: the plans (hits, misses, transfers, evictions, placement) equal a
    synchronous run's. With some layers waiting and others planned at once, a plan made at once
    first makes the waiting ones (order kept). A padded forward plans at once (no wait)."""
    model = build_tiny("qwen3_moe", seed=0)
    assert len(moelab.moe_layers(model)) >= 3
    ids, mask = _inputs(B)
    base = {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}, "placement": "fetch-misses",
            "planner": planner}
    want = _plans(model, {**base, "executor": "functional"}, ids, mask)
    waits.LAYERS = layers
    got = _plans(model, {**base, "executor": "test-plans-wait"}, ids, mask)
    assert got.plans == want.plans
    assert got.timing["plans"] == want.timing["plans"] == len(want.plans)
    assert sum(bool(p.misses) for p in got.plans) > 0 and sum(bool(p.evictions) for p in got.plans) > 0
    # the chosen layers waited and received their own plans; a padded forward (the batch's prompt) planned at once
    chosen = [p for p in want.plans if (layers is None or p.layer in layers) and (B == 1 or p.phase == "decode")]
    assert [lp for _, lp in waits.seen] == chosen and chosen
    assert all(lp.layer == L for L, lp in waits.seen)


@pytest.mark.parametrize("cfg", [
    {"cache": {"capacity": 0.5, "policy": "lru"}, "routing": {"deferred": 1, "min_immediate": 1}},
    {"cache": {"capacity": 0.5, "policy": "mrs"}},
], ids=["deferral", "router-scores"])
def test_plans_do_not_wait_where_a_routing_policy_or_the_router_scores_decide(waits, cfg):
    """Deferral edits the slots in the planner's call, and an MRS cache reads the router's scores
    as the layer runs: with either, the run never offers the executor the wait (plans as they come,
    the executor's hook unused)."""
    model = build_tiny("qwen3_moe", seed=0)
    ids, mask = _inputs(1)
    want = _plans(model, {**cfg, "executor": "functional"}, ids, mask)
    got = _plans(model, {**cfg, "executor": "test-plans-wait"}, ids, mask)
    assert got.plans == want.plans and waits.seen == []
    assert got._plan_later is None and got._later == []


def test_a_plan_the_executor_refuses_fails_the_forward(waits):
    """The executor's check of a plan (the CUDA executor's: all hits on the device) raising fails the
    forward with that error, and the run is still removed cleanly."""
    model = build_tiny("qwen3_moe", seed=0)
    ids, mask = _inputs(1)

    def refuse(lp):
        raise moelab.MoelabError(f"plan of layer {lp.layer} refused")

    class Refuses(_Waits):
        def plan_later(self, ctx, layer, call):
            got = super().plan_later(ctx, layer, call)
            return (*got[:3], refuse)

    EXECUTORS.register("test-plans-wait", Refuses, overwrite=True)
    with pytest.raises(moelab.MoelabError, match="refused"):
        _plans(model, {"cache": {"capacity": 0.5}, "executor": "test-plans-wait"}, ids, mask)
    assert moelab.forward.forward_hooks(model, create=False) is None
    assert active_hybrid(model) is None
