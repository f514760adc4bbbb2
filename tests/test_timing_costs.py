"""The one cost model: what a placement plans for an expert is what the simulator charges for it.

For every shipped profile, one expert's planned cost (``moelab.timing.costs.CostModel``, the
object ``greedy-hss``/``min-cost`` plan with) equals its simulated time when it runs alone — on
the host, on the device, and over the link — at a memory-bound and a compute-bound token count.
"""

from __future__ import annotations

import pytest

from moelab.hybrid.placement import get_placement
from moelab.hybrid.planner import LayerPlan, Transfer
from moelab.simulate.executor import simulate_plans
from moelab.timing import available_profiles, get_profile, get_shape
from moelab.timing.costs import CostModel

PROFILES = available_profiles()


def _alone(plan: LayerPlan, shape, profile, kind: str) -> float:
    ev = simulate_plans([plan], shape, profile).events
    rows = ev[ev["kind"] == kind]
    assert len(rows) == 1, f"expected one {kind} event, got {len(rows)}"
    return float(rows["t_end_us"].iloc[0] - rows["t_start_us"].iloc[0])


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("tokens", [1, 64])
def test_planned_expert_cost_equals_its_simulated_time_alone(profile, tokens):
    for name in ("mixtral-8x7b", "deepseek-v3"):  # without and with shared experts
        shape = get_shape(name)
        cost = CostModel.of(shape, profile)
        host = LayerPlan(0, 0, "decode", 0, tokens, host=[(3, tokens)])
        assert _alone(host, shape, profile, "expert-host") == pytest.approx(
            cost.host_call_us + cost.host_us(tokens), rel=1e-9)
        dev = LayerPlan(0, 0, "decode", 0, tokens, device=[(3, tokens)], hits=[3])
        # the device call's fixed cost is paid by the layer's first device task: the shared experts
        # where the model has them, else the expert
        first = 0.0 if cost.shared_bytes else cost.device_call_us
        assert _alone(dev, shape, profile, "expert-device") == pytest.approx(first + cost.device_us(tokens), rel=1e-9)
        if cost.shared_bytes:
            ev = simulate_plans([dev], shape, profile).events
            sh = ev[ev["cause"] == "shared-experts"]
            assert float(sh["t_end_us"].iloc[0] - sh["t_start_us"].iloc[0]) == pytest.approx(
                cost.device_call_us + cost.shared_us(tokens), rel=1e-9)
        fetch = LayerPlan(0, 0, "decode", 0, tokens, device=[(3, tokens)],
                          transfers=[Transfer(0, 3, int(cost.expert_bytes), "demand")])
        ev = simulate_plans([fetch], shape, profile).events
        tr = ev[ev["lane"].astype(str).str.startswith("copy")]
        assert float(tr["t_end_us"].iloc[0] - tr["t_start_us"].iloc[0]) == pytest.approx(cost.fetch_us(), rel=1e-9)


@pytest.mark.parametrize("profile", ["ktransformers-a100", "h100-pcie5-ddr5"])
def test_planned_layer_matches_the_simulated_layer_for_a_split(profile):
    # the lanes the placements minimise (CostModel.lanes_us) are the simulated lanes' finish times
    shape = get_shape("deepseek-v3")
    cost = CostModel.of(shape, profile)
    hits, fetch, host = [(0, 1), (1, 1)], [(2, 1)], [(3, 1), (4, 1), (6, 1)]
    plan = LayerPlan(0, 0, "decode", 0, 1, device=hits + fetch, host=host, hits=[0, 1],
                     transfers=[Transfer(0, 2, int(cost.expert_bytes), "demand")])
    ev = simulate_plans([plan], shape, profile).events
    start = float(ev[ev["kind"] == "dense"]["t_end_us"].iloc[0])  # the layer's dense work ends
    lane = ev["lane"].astype(str)
    dev_end = float(ev[(lane == "device") & (ev["kind"] != "wait")]["t_end_us"].max()) - start
    host_end = float(ev[lane.str.startswith("host")]["t_end_us"].max()) - start
    want_dev, want_host = cost.lanes_us(hits, fetch, host)
    assert dev_end + cost.profile.sync_us == pytest.approx(want_dev, rel=1e-9)  # + the control thread's sync
    want_host -= cost.profile.sync_us
    # NUMA nodes share a node's bandwidth with copies from it: alone-equality holds per node
    if get_profile(profile).numa_nodes == 1:
        assert host_end == pytest.approx(want_host, rel=1e-9)


def test_a_profile_changed_in_python_reaches_the_planner_and_the_simulator():
    # issue #25: a with_changes profile reached the simulator but not the planner
    shape = get_shape("deepseek-v3")
    hw = get_profile("h100-pcie5-ddr5")
    slow = hw.with_changes(numa_node_bandwidth_gbs=hw.numa_node_bandwidth_gbs / 8)
    fast_cost, slow_cost = CostModel.of(shape, hw), CostModel.of(shape, slow)
    assert slow_cost.host_us(1) > fast_cost.host_us(1)
    hits, misses = [], [(e, 1) for e in range(8)]
    greedy = get_placement("greedy-hss")
    fast_fetch = sum(v == "fetch" for v in greedy.place(hits, misses, fast_cost).values())
    slow_fetch = sum(v == "fetch" for v in get_placement("greedy-hss").place(hits, misses, slow_cost).values())
    assert slow_fetch >= fast_fetch  # a slower host sends at least as many misses over the link
