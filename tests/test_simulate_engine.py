"""The simulator's engine and executor: hand-worked cases, invariants, reference/fast parity.

Every expected number below is worked out by hand in the comment beside it (µs; a pool or
cap of B bytes/µs reads b bytes in b / B µs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from moelab.errors import MoelabError
from moelab.hybrid.events import COLUMNS
from moelab.hybrid.runtime import LayerPlan, Transfer
from moelab.simulate import _native
from moelab.simulate.engine import Graph, simulate, simulate_reference, water_fill
from moelab.timing import HardwareProfile

ENGINES = ["reference", pytest.param("fast", marks=pytest.mark.skipif(
    not _native.available(), reason="no C compiler here: the fast engine falls back to the reference"))]


def graph(tasks: list[dict], servers=(1,), pool_bw=(1.0,)) -> Graph:
    """Tasks as dicts: res, prio, fixed, bytes, cap, pool, deps."""
    deps = [t.get("deps", []) for t in tasks]
    return Graph(
        resource=[t.get("res", 0) for t in tasks], priority=[t.get("prio", 0) for t in tasks],
        fixed_us=[t.get("fixed", 0.0) for t in tasks], nbytes=[t.get("bytes", 0.0) for t in tasks],
        cap=[t.get("cap", 1.0) for t in tasks], pool=[t.get("pool", -1) for t in tasks],
        dep_ptr=np.cumsum([0] + [len(d) for d in deps]), dep_idx=[x for d in deps for x in d],
        servers=list(servers), pool_bw=list(pool_bw),
    )


# ---------------------------------------------------------------------- engine, by hand
@pytest.mark.parametrize("engine", ENGINES)
def test_dependencies_are_honoured(engine):
    # A (lane 0, 10 µs) -> B (lane 1, 5 µs); C (lane 1, 3 µs, no deps) runs first on lane 1
    g = graph([{"res": 0, "fixed": 10}, {"res": 1, "fixed": 5, "deps": [0]}, {"res": 1, "fixed": 3}],
              servers=(1, 1))
    s = simulate(g, engine)
    assert s.start.tolist() == [0, 10, 0] and s.end.tolist() == [10, 15, 3]
    assert s.crit.tolist() == [-1, 0, -1]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_readers_halve_the_bandwidth(engine):
    # pool of 100 B/µs; each reads 1000 B with cap 100: alone 10 µs each; together 50 B/µs each -> both end at 20
    both = graph([{"res": 0, "bytes": 1000, "cap": 100, "pool": 0}, {"res": 1, "bytes": 1000, "cap": 100, "pool": 0}],
                 servers=(1, 1), pool_bw=(100.0,))
    s = simulate(both, engine)
    assert s.end.tolist() == pytest.approx([20.0, 20.0])
    # B starts its read at 5 (a 5 µs fixed phase): A reads 500 alone by 5, then 50 B/µs each:
    # A's last 500 B take 10 µs -> A ends 15; B has read 500 by 15, its last 500 alone -> ends 20
    stagger = graph([{"res": 0, "bytes": 1000, "cap": 100, "pool": 0},
                     {"res": 1, "fixed": 5, "bytes": 1000, "cap": 100, "pool": 0}], servers=(1, 1), pool_bw=(100.0,))
    s = simulate(stagger, engine)
    assert s.end.tolist() == pytest.approx([15.0, 20.0])
    # private memory (pool -1): no sharing, each 10 µs
    private = graph([{"res": 0, "bytes": 1000, "cap": 100}, {"res": 1, "bytes": 1000, "cap": 100}], servers=(1, 1))
    assert simulate(private, engine).end.tolist() == pytest.approx([10.0, 10.0])


def test_water_filling_gives_a_capped_reader_its_cap_and_the_rest_to_the_other():
    # a copy capped at 32 GB/s beside a CPU kernel on a 220 GB/s node: 32 and 188
    assert water_fill([220.0, 32.0], 220.0) == pytest.approx([188.0, 32.0])
    assert water_fill([100.0, 100.0], 100.0) == pytest.approx([50.0, 50.0])
    assert water_fill([10.0, 10.0, 10.0], 100.0) == pytest.approx([10.0, 10.0, 10.0])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_copy_beside_a_cpu_kernel_by_hand(engine):
    # node pool 220 B/µs; kernel reads 2200 B (cap 220), copy 320 B (cap 32), both from t=0:
    # rates 188 and 32 -> the copy ends at 10 (kernel has read 1880); then the kernel alone at 220:
    # 320 B more -> ends at 10 + 320/220
    g = graph([{"res": 0, "bytes": 2200, "cap": 220, "pool": 0}, {"res": 1, "bytes": 320, "cap": 32, "pool": 0}],
              servers=(1, 1), pool_bw=(220.0,))
    s = simulate(g, engine)
    assert s.end.tolist() == pytest.approx([10 + 320 / 220, 10.0])


@pytest.mark.parametrize("engine", ENGINES)
def test_a_demand_copy_overtakes_queued_prefetches_but_not_a_running_one(engine):
    # one copy engine; prefetches P1, P2 (priority 1) ready at 0; a demand copy (priority 0) ready at 5
    # (after a 5 µs task on another lane). P1 runs 0-10; the demand 10-20 (before P2, queued); P2 20-30
    g = graph([{"res": 0, "prio": 1, "fixed": 10}, {"res": 0, "prio": 1, "fixed": 10}, {"res": 1, "fixed": 5},
               {"res": 0, "prio": 0, "fixed": 10, "deps": [2]}], servers=(1, 1))
    s = simulate(g, engine)
    assert s.start.tolist() == [0, 20, 0, 10]


@pytest.mark.parametrize("engine", ENGINES)
def test_several_servers_take_the_lowest_free_one(engine):
    g = graph([{"fixed": 10}, {"fixed": 4}, {"fixed": 3}], servers=(2,))
    s = simulate(g, engine)
    assert s.server.tolist() == [0, 1, 1] and s.start.tolist() == [0, 0, 4]


def test_a_cycle_is_reported():
    g = graph([{"deps": [1]}, {"deps": [0]}])
    with pytest.raises(MoelabError, match="never ran"):
        simulate_reference(g)
    if _native.available():
        with pytest.raises(MoelabError, match="never ran"):
            _native.simulate_fast(g)


def random_graph(rng, n: int) -> Graph:
    R, P = int(rng.integers(1, 5)), int(rng.integers(1, 3))
    deps = [sorted(set(rng.integers(0, j, rng.integers(0, 4)).tolist())) if j else [] for j in range(n)]
    return Graph(
        resource=rng.integers(0, R, n), priority=rng.integers(0, 3, n),
        fixed_us=np.where(rng.random(n) < 0.3, 0.0, rng.random(n) * 10),
        nbytes=np.where(rng.random(n) < 0.2, 0.0, rng.random(n) * 1e4), cap=rng.random(n) * 100 + 1,
        pool=rng.integers(-1, P, n), dep_ptr=np.cumsum([0] + [len(d) for d in deps]),
        dep_idx=np.array([x for d in deps for x in d], dtype=np.int64), servers=rng.integers(1, 3, R),
        pool_bw=rng.random(P) * 150 + 10,
    )


def test_no_lane_is_double_booked_and_deps_hold_on_random_graphs():
    rng = np.random.default_rng(0)
    for _ in range(40):
        g = random_graph(rng, int(rng.integers(1, 120)))
        s = simulate(g)
        for j in range(g.n):
            for k in range(g.dep_ptr[j], g.dep_ptr[j + 1]):
                assert s.start[j] >= s.end[g.dep_idx[k]]
        for r in range(len(g.servers)):
            for srv in range(int(g.servers[r])):
                m = (g.resource == r) & (s.server == srv)
                a, b = s.start[m], s.end[m]
                o = np.lexsort((b, a))
                assert (a[o][1:] >= b[o][:-1] - 1e-9).all()
            assert not ((g.resource == r) & (s.server >= g.servers[r])).any()


@pytest.mark.skipif(not _native.available(), reason="no C compiler here: nothing to compare the reference with")
def test_fast_engine_equals_the_reference_on_random_graphs():
    rng = np.random.default_rng(1)
    for _ in range(150):
        g = random_graph(rng, int(rng.integers(1, 150)))
        a, b = simulate_reference(g), _native.simulate_fast(g)
        assert np.array_equal(a.start, b.start) and np.array_equal(a.end, b.end)
        assert np.array_equal(a.server, b.server) and np.array_equal(a.crit, b.crit) and a.events == b.events


# ---------------------------------------------------------------------- executor, by hand
@dataclass(frozen=True)
class HandShape:
    """A stand-in for ModelShape whose costs are round numbers: experts of 1e6 bytes and no FLOPs
    worth counting, attention of 5e6 bytes, a negligible router and LM head."""

    num_layers: int = 2
    num_experts: int = 8
    top_k: int = 2
    hidden_size: int = 1
    expert_intermediate: int = 1
    num_shared_experts: int = 0
    shared_intermediate: int = 0
    dense_intermediate: int = 0
    vocab_size: int = 1
    dtype: str = "bf16"
    name: str = "hand"

    @property
    def moe_layers(self):
        return tuple(range(self.num_layers))

    def bytes_per_param(self, dtype=None):
        return 2.0

    def expert_params(self):
        return 1

    def expert_bytes(self):
        return 1_000_000

    def expert_flops(self, tokens=1):
        return 2 * tokens

    def shared_bytes(self):
        return 0

    def shared_flops(self, tokens=1):
        return 0

    def dense_mlp_bytes(self):
        return 0

    def dense_mlp_flops(self, tokens=1):
        return 0

    def router_bytes(self):
        return self.num_experts * self.hidden_size * 2  # bf16 router weights

    def attention_bytes(self, context, batch=1):
        return 5_000_000

    def attention_flops(self, context, batch=1, layer=None, prefill=False):
        return 2.0 * batch


def hand_profile(**changes) -> HardwareProfile:
    # device reads 1e5 B/µs (100 GB/s, efficiency 1): attention 50 µs, an expert 10 µs;
    # link 1e4 B/µs: a copy 100 µs; a host expert is capped at 1e4 B/µs (1000 GB/s × 0.01): 100 µs;
    # the node's 1e6 B/µs leaves copies and host kernels uncontended; no fixed costs
    base = dict(name="hand", link_bandwidth_gbs=10.0, link_latency_us=0.0, gpu_memory_bandwidth_gbs=100.0,
                gpu_memory_efficiency=1.0, gpu_compute_efficiency=1.0, gpu_peak_tflops=1000.0, gpu_launch_us=0.0,
                cpu_peak_tflops=1000.0, cpu_memory_efficiency=0.01, numa_nodes=1, numa_node_bandwidth_gbs=1000.0,
                cpu_dispatch_us=0.0, cpu_call_us=0.0, gpu_call_us=0.0, sync_us=0.0, copy_engines=1)
    base.update(changes)
    return HardwareProfile(**base)


def plan(layer, forward=0, device=(), host=(), deferred=(), hits=(), transfers=()) -> LayerPlan:
    lp = LayerPlan(forward=forward, step=forward, phase="decode", layer=layer, tokens=1)
    lp.device, lp.host, lp.deferred = list(device), list(host), list(deferred)
    lp.hits = list(hits)
    lp.misses = [e for e, _ in lp.device if e not in lp.hits] + [e for e, _ in lp.host]
    lp.transfers = [Transfer(*t) for t in transfers]
    return lp


def rows(res, **match):
    ev = res.events
    m = np.ones(len(ev), bool)
    for k, v in match.items():
        m &= (ev[k].astype(str) if isinstance(v, str) else ev[k]).to_numpy() == v
    return ev[m]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_fetched_expert_computes_after_its_copy_ends(engine):
    from moelab.simulate.executor import simulate_plans

    # dense 0-50; the demand copy of expert 3: 50-150; hit expert 1: 50-60; fetched expert 3: 150-160;
    # the control thread waits 50-160 for the copy; the device lane idles 60-150 waiting for it
    p = plan(0, device=[(1, 1), (3, 1)], hits=[1], transfers=[(0, 3, 1_000_000, "demand")])
    res = simulate_plans([p], HandShape(num_layers=1), hand_profile(), engine=engine)
    assert list(res.events.columns) == list(COLUMNS)
    hit = rows(res, kind="expert-device", expert=1)
    fetched = rows(res, kind="expert-device", expert=3)
    copy = rows(res, kind="transfer-demand")
    assert (hit["t_start_us"].item(), hit["t_end_us"].item()) == pytest.approx((50, 60), abs=1e-3)
    assert (copy["t_start_us"].item(), copy["t_end_us"].item()) == pytest.approx((50, 150), abs=1e-3)
    assert (fetched["t_start_us"].item(), fetched["t_end_us"].item()) == pytest.approx((150, 160), abs=1e-3)
    assert hit["cause"].item() == "hit" and fetched["cause"].item() == "miss-fetch" and copy["lane"].item() == "copy"
    wait = rows(res, lane="control", kind="wait")
    assert (wait["t_start_us"].item(), wait["t_end_us"].item()) == pytest.approx((50, 160), abs=1e-3)
    assert wait["cause"].item() == "copy"
    idle = rows(res, lane="device", kind="wait")
    assert (idle["t_start_us"].item(), idle["t_end_us"].item()) == pytest.approx((60, 150), abs=1e-3)
    assert res.summary()["stall_us"] == pytest.approx({"copy": 110.0}, abs=1e-2)


@pytest.mark.parametrize("engine", ENGINES)
def test_deferred_work_overlaps_the_next_attention_and_is_merged_at_its_output(engine):
    from moelab.simulate.executor import simulate_plans

    # layer 0: dense 0-50, host expert 2: 50-150, deferred expert 5: 150-250 (after it, same lane);
    # the wait of layer 0 ends with the host expert at 150 (cause host); layer 1's dense 150-200
    # overlaps the deferred expert; layer 1's wait ends when the deferred expert does, 250 (cause deferred)
    plans = [plan(0, host=[(2, 1)], deferred=[(5, 1)]), plan(1, device=[(0, 1)], hits=[0])]
    res = simulate_plans(plans, HandShape(), hand_profile(), engine=engine)
    h = rows(res, kind="expert-host")
    f = rows(res, kind="expert-deferred")
    assert (h["t_start_us"].item(), h["t_end_us"].item(), h["lane"].item()) == (pytest.approx(50, abs=1e-3),
                                                                              pytest.approx(150, abs=1e-3), "host")
    assert (f["t_start_us"].item(), f["t_end_us"].item()) == pytest.approx((150, 250), abs=1e-3)
    d1 = rows(res, kind="dense", layer=1)
    assert (d1["t_start_us"].item(), d1["t_end_us"].item()) == pytest.approx((150, 200), abs=1e-3)
    waits = rows(res, lane="control", kind="wait").sort_values("t_start_us")
    assert waits["cause"].astype(str).tolist() == ["host", "deferred"]
    assert waits["t_end_us"].tolist() == pytest.approx([150, 250], abs=1e-3)
    s = res.summary()
    assert s["overlap_pct"] > 0 and set(s["stall_us"]) == {"host", "deferred"}


@pytest.mark.parametrize("engine", ENGINES)
def test_a_device_expert_waits_for_its_prefetch_still_in_flight(engine):
    from moelab.simulate.executor import simulate_plans

    # layer 0 prefetches expert 4 of layer 1 (copy 50-150); layer 1's dense ends at 100 (50 + 50), its
    # hit on expert 4 must wait for the copy: 150-160
    plans = [plan(0, transfers=[(1, 4, 1_000_000, "prefetch")]), plan(1, device=[(4, 1)], hits=[4])]
    plans[1].prefetch_hits = [4]
    res = simulate_plans(plans, HandShape(), hand_profile(), engine=engine)
    e = rows(res, kind="expert-device")
    assert (e["t_start_us"].item(), e["cause"].item()) == (pytest.approx(150, abs=1e-3), "prefetch-hit")
    assert rows(res, kind="transfer-prefetch")["layer"].item() == 1


@pytest.mark.parametrize("engine", ENGINES)
def test_an_experts_call_pays_its_fixed_cost_once_per_layer_and_lane(engine):
    from moelab.simulate.executor import simulate_plans

    # the real executor makes one backend call per layer on the device and one on the host: dense 0-50;
    # device experts 1, 2 (10 µs each) + one call of 4 µs: 50-64, 64-74; host experts 3, 4 (100 µs each,
    # 1 µs dispatch each) + one call of 7 µs: 50-158, 158-259; next layer: the same again after its dense work
    hw = hand_profile(gpu_call_us=4.0, cpu_call_us=7.0, cpu_dispatch_us=1.0)
    ps = [plan(k, device=[(1, 1), (2, 1)], hits=[1, 2], host=[(3, 1), (4, 1)]) for k in range(2)]
    res = simulate_plans(ps, HandShape(num_layers=2), hw, engine=engine)
    dev = rows(res, kind="expert-device", layer=0)
    host = rows(res, kind="expert-host", layer=0)
    assert [*dev["t_start_us"], *dev["t_end_us"]] == pytest.approx([50, 64, 64, 74], abs=1e-3)
    assert [*host["t_start_us"], *host["t_end_us"]] == pytest.approx([50, 158, 158, 259], abs=1e-3)
    dev1 = rows(res, kind="expert-device", layer=1)
    host1 = rows(res, kind="expert-host", layer=1)
    assert (dev1["t_end_us"] - dev1["t_start_us"]).tolist() == pytest.approx([14, 10], abs=1e-3)
    assert (host1["t_end_us"] - host1["t_start_us"]).tolist() == pytest.approx([108, 101], abs=1e-3)


@pytest.mark.parametrize("engine", ENGINES)
def test_on_a_cpu_only_machine_busy_lanes_share_the_cores(engine):
    from moelab.simulate.executor import simulate_plans

    # every lane is a CPU thread on 2 cores: dense 0-50 alone; then the device expert (10 µs alone) and the
    # host expert (100 µs alone) run together at half speed each: the device one ends at 70 (10 µs of work
    # in 20), the host one has done 10 of its 100 µs by then and ends alone at 70 + 90 = 160
    hw = hand_profile(device_shares_host_memory=True, cpu_cores=2)
    res = simulate_plans([plan(0, device=[(1, 1)], hits=[1], host=[(3, 1)])], HandShape(num_layers=1), hw,
                         engine=engine)
    dev, host = rows(res, kind="expert-device"), rows(res, kind="expert-host")
    assert (dev["t_start_us"].item(), dev["t_end_us"].item()) == pytest.approx((50, 70), abs=1e-3)
    assert (host["t_start_us"].item(), host["t_end_us"].item()) == pytest.approx((50, 160), abs=1e-3)
    assert host["bytes"].item() == 1_000_000  # the events keep the bytes read, not the core-µs of work


def test_ktransformers_style_saturation_deferral_cuts_layer_time_to_the_cpu_busy_share():
    from moelab.simulate.executor import simulate_plans

    # a CPU-bound layer: attention 50 µs on the device side, 4 host experts of 100 µs each (with 2 µs
    # dispatch). Without deferral a layer is 50 + 4 × 102 = 458 µs and the CPU is busy 408 / 458 = 89 %.
    # Deferring 2 experts runs them beside the next layer's attention: the CPU never idles, so a
    # layer tends to the CPU's 408 µs = the CPU-busy share of the undeferred layer.
    L, steps = 16, 4
    hw = hand_profile(cpu_dispatch_us=2.0)
    shape = HandShape(num_layers=L)

    def run(deferred: int):
        plans = []
        for f in range(steps):
            for layer in range(L):
                d = deferred if layer < L - 1 else 0
                plans.append(plan(layer, forward=f, host=[(e, 1) for e in range(4 - d)],
                                  deferred=[(e, 1) for e in range(4 - d, 4)]))
        return simulate_plans(plans, shape, hw)

    base, dfr = run(0), run(2)
    t0, t1 = base.summary()["decode_step_us"], dfr.summary()["decode_step_us"]
    cpu_share = base.summary()["busy_pct"]["host"] / 100
    assert cpu_share == pytest.approx(408 / 458, rel=0.01)
    assert base.summary()["host_side_busy_pct"] == pytest.approx(100 * 408 / 458, rel=0.01)
    assert base.summary()["device_side_busy_pct"] == pytest.approx(100 * 50 / 458, rel=0.01)
    assert t1 / t0 == pytest.approx(cpu_share, rel=0.03)
    assert dfr.summary()["busy_pct"]["host"] > 97


# ---------------------------------------------------------------------- ProMoE's chunked copies
@pytest.mark.parametrize("engine", ENGINES)
def test_a_demand_copy_waits_for_one_chunk_of_a_prefetch_not_the_whole_expert(engine):
    """ProMoE §5 (docs/techniques.md §4): prefetches are chunked per projection, so a miss waits at
    most one chunk. Layer 0 prefetches a 3 MB expert of layer 1 (300 µs on the 10 GB/s link, from 50);
    layer 1's dense work ends at 100 and its miss on expert 2 needs a 1 MB demand copy (100 µs)."""
    from moelab.simulate.executor import simulate_plans

    plans = [plan(0, transfers=[(1, 4, 3_000_000, "prefetch")]),
             plan(1, device=[(2, 1)], transfers=[(1, 2, 1_000_000, "demand")])]
    whole = simulate_plans(plans, HandShape(), hand_profile(), engine=engine)
    chunked = simulate_plans(plans, HandShape(), hand_profile(), engine=engine, copy_chunks=3)
    # whole: the demand copy queues behind the whole prefetch (50-350), runs 350-450, the expert 450-460
    d = rows(whole, kind="transfer-demand")
    assert (d["t_start_us"].item(), d["t_end_us"].item()) == pytest.approx((350, 450), abs=1e-3)
    assert rows(whole, kind="expert-device")["t_start_us"].item() == pytest.approx(450, abs=1e-3)
    # chunked: the first chunk (50-150) finishes, the demand copy overtakes the other two (150-250)
    d = rows(chunked, kind="transfer-demand")
    assert (d["t_start_us"].item(), d["t_end_us"].item()) == pytest.approx((150, 250), abs=1e-3)
    assert d["t_start_us"].item() - 100 <= 100 + 1e-3  # waited at most one chunk
    assert rows(chunked, kind="expert-device")["t_start_us"].item() == pytest.approx(250, abs=1e-3)
    pf = rows(chunked, kind="transfer-prefetch").sort_values("t_start_us")
    assert pf["bytes"].tolist() == [1_000_000] * 3 and (pf["expert"] == 4).all() and (pf["layer"] == 1).all()
    assert list(zip(pf["t_start_us"], pf["t_end_us"])) == [pytest.approx(v, abs=1e-3)
                                                           for v in ((50, 150), (250, 350), (350, 450))]
    for res in (whole, chunked):  # the same bytes cross the link either way
        assert rows(res, kind="transfer-prefetch")["bytes"].sum() == 3_000_000


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefetched_expert_waits_for_the_last_chunk_and_each_chunk_pays_the_link_latency(engine):
    from moelab.simulate.executor import simulate_plans

    # a 10 µs link latency: whole, the copy is 50-360 (10 + 300); in 3 chunks 50-380 (3 × (10 + 100));
    # layer 1's hit on the prefetched expert starts when the last chunk ends
    plans = [plan(0, transfers=[(1, 4, 3_000_000, "prefetch")]), plan(1, device=[(4, 1)], hits=[4])]
    plans[1].prefetch_hits = [4]
    hw = hand_profile(link_latency_us=10.0)
    for chunks, end in ((1, 360), (3, 380)):
        res = simulate_plans(plans, HandShape(), hw, engine=engine, copy_chunks=chunks)
        assert rows(res, kind="transfer-prefetch")["t_end_us"].max() == pytest.approx(end, abs=1e-3)
        e = rows(res, kind="expert-device")
        assert (e["t_start_us"].item(), e["cause"].item()) == (pytest.approx(end, abs=1e-3), "prefetch-hit")


def test_chunks_split_low_priority_copies_only_and_keep_their_bytes():
    from moelab.simulate.executor import XKIND, chunk_copies, encode

    plans = [plan(0, transfers=[(1, 4, 1_000_001, "prefetch"), (0, 1, 7, "demand")]),
             plan(1, transfers=[(1, 5, 10, "insert")])]
    enc = encode(plans, 8, 2, has_shared=False)
    got = chunk_copies(enc, 3)
    assert got.nx.tolist() == [4, 3] and enc.nx.tolist() == [2, 1]
    assert got.x[:, 2].tolist() == [333_333, 333_333, 333_335, 7, 3, 3, 4]
    assert got.x[:, 3].tolist() == [XKIND["prefetch"]] * 3 + [XKIND["demand"]] + [XKIND["insert"]] * 3
    assert chunk_copies(enc, 1) is enc
    for bad in (0, -1, 1.5, True):
        with pytest.raises(MoelabError, match="copy_chunks=.*integer ≥ 1"):
            chunk_copies(enc, bad)


def test_prefetch_chunks_is_a_configuration_setting_and_a_grid_axis():
    from moelab.caches.prefetch import PrefetchConfig
    from moelab.hybrid.config import HybridConfig
    from moelab.simulate.whatif import parse_grid

    assert HybridConfig.from_dict({"prefetch": {"chunks": 3}}).prefetch.chunks == 3
    assert PrefetchConfig().chunks == 1
    with pytest.raises(MoelabError, match="chunks=0: expected an integer ≥ 1"):
        PrefetchConfig(chunks=0)
    assert parse_grid(["chunks=1,3"])["chunks"] == [1, 3] and parse_grid([])["chunks"] == [1]
    with pytest.raises(MoelabError, match="chunks=0: expected ≥ 1"):
        parse_grid(["chunks=0"])


# ---------------------------------------------------------------------- executor: parity and bad input
@pytest.mark.skipif(not _native.available(), reason="no C compiler here: nothing to compare the reference with")
def test_fast_path_events_equal_the_reference_over_random_plans():
    import transformers

    from moelab.simulate.bench import bench_config, events_equal, random_plans
    from moelab.simulate.executor import build_graph, chunk_copies, encode, simulate_plans
    from moelab.timing.costs import CostModel
    from moelab.timing.shapes import ModelShape

    # 5 layers (the first dense), 4 MoE layers of 16 experts top-4 and one shared expert
    shape = ModelShape.from_hf_config(transformers.Qwen2MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, num_hidden_layers=5,
        shared_expert_intermediate_size=128, intermediate_size=512, vocab_size=1000, mlp_only_layers=[0],
        num_attention_heads=4, num_key_value_heads=2))
    assert shape.moe_layers == (1, 2, 3, 4) and shape.num_shared_experts == 1
    rng = np.random.default_rng(0)
    for seed in range(12):
        hw = hand_profile(numa_nodes=int(rng.integers(1, 3)), copy_engines=int(rng.integers(1, 3)),
                          cpu_memory_efficiency=float(rng.uniform(0.3, 1)), link_latency_us=float(rng.uniform(0, 5)),
                          numa_node_bandwidth_gbs=float(rng.uniform(5, 50)), sync_us=2.0, gpu_launch_us=1.0,
                          device_shares_host_memory=bool(seed % 3 == 0))
        config = bench_config(capacity=float(rng.choice([0.0, 0.25, 0.5])), deferred=int(rng.integers(0, 3)),
                              placement=str(rng.choice(["host-misses", "fetch-misses", "greedy-hss", "min-cost"])),
                              policy=str(rng.choice(["lru", "lfu", "fifo"])), prefetch=int(rng.integers(0, 3)),
                              predictor=str(rng.choice(["repeat", "oracle"])))
        plans = random_plans(shape, config, steps=int(rng.integers(1, 6)), seed=seed, tokens=int(rng.integers(1, 3)))
        chunks = 1 + seed % 3  # ProMoE's chunked low-priority copies too
        ref = simulate_plans(plans, shape, hw, engine="reference", reference_graph=True, copy_chunks=chunks)
        fast = simulate_plans(plans, shape, hw, engine="fast", copy_chunks=chunks)
        assert events_equal(ref.events, fast.events), seed
        enc = chunk_copies(encode(plans, 16, 4, has_shared=True), chunks)
        g1, _, _ = build_graph(enc, CostModel.of(shape, hw))
        g2, _, _ = build_graph(enc, CostModel.of(shape, hw), reference=True)
        assert np.array_equal(g1.dep_ptr, g2.dep_ptr)
        for j in range(g1.n):  # the same dependencies (each task's in any order)
            a, b = g1.dep_ptr[j], g1.dep_ptr[j + 1]
            assert sorted(g1.dep_idx[a:b]) == sorted(g2.dep_idx[a:b])


def test_plans_that_do_not_fit_the_shape_are_refused_in_one_line():
    from moelab.simulate.executor import simulate_plans

    with pytest.raises(MoelabError, match="expert 9 does not exist: the model shape has 8 experts") as info:
        simulate_plans([plan(0, host=[(9, 1)])], HandShape(), hand_profile())
    assert "\n" not in str(info.value)
    with pytest.raises(MoelabError, match="MoE layer 5 but the model shape has 2 MoE layers"):
        simulate_plans([plan(5)], HandShape(), hand_profile())


def test_events_table_has_the_parquet_schema():
    from moelab.hybrid.events import EventLog
    from moelab.simulate.executor import simulate_plans

    res = simulate_plans([plan(0, host=[(2, 1)]), plan(1, device=[(1, 1)], hits=[1])], HandShape(), hand_profile())
    assert res.table().schema == EventLog("x").table().schema


# ---------------------------------------------------------------------- online, beside a running model
def test_online_simulated_executor_writes_simulated_events_for_every_forward():
    import torch

    import moelab
    from moelab.models.tiny import build_tiny

    model = build_tiny("mixtral", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    cfg = {"executor": "simulated", "hardware": "ktransformers-a100", "cache": {"capacity": 0.5}}
    with moelab.hybrid(model, cfg) as run, torch.no_grad():
        out = model(ids).logits
        model(ids[:, :1])
    assert torch.equal(out, ref)  # the model computes as the functional executor does
    ev = run.events_table()
    assert list(ev.columns) == list(COLUMNS) and len(ev)
    assert set(ev["step"]) == {0, 1}
    assert {"dense", "wait"} <= set(ev["kind"]) and set(ev["lane"]) <= {"control", "device", "copy", "host", "host0",
                                                                          "host1"}
    n_moe = len({p.layer for p in run.plans})
    assert len(ev[(ev["kind"] == "dense") & (ev["layer"] >= 0)]) == 2 * n_moe
    # the second forward starts where the first ended (one clock)
    first_end = ev[ev["step"] == 0]["t_end_us"].max()
    assert ev[ev["step"] == 1]["t_start_us"].min() == pytest.approx(first_end)
    with pytest.raises(MoelabError, match="needs a hardware profile"):
        moelab.hybrid(model, {"executor": "simulated"}).apply()


# ---------------------------------------------------------------------- calibrate
def test_calibrate_writes_a_profile_that_loads_with_every_number_stated(tmp_path, monkeypatch):
    from moelab import measure
    from moelab.simulate import calibrate as C
    from moelab.simulate.calibrate import CalibrateConfig, calibrate, write_profile
    from moelab.timing import load_profile

    # a quiet machine (faked: the load is what this test does not control); the tiny sizes fit values no real
    # machine has, so they are written flagged (tests/test_calibration_trust.py checks the refusal)
    quiet = {"load1": 0.1, "cpus": 2, "per_cpu": 0.05, "own": 0.0, "other": 0.1, "other_per_cpu": 0.05}
    monkeypatch.setattr(measure, "machine_load", lambda: dict(quiet))
    monkeypatch.setattr(C, "machine_load", lambda: dict(quiet))
    monkeypatch.setattr(C, "MAX_SPREAD", float("inf"))

    cfg = CalibrateConfig(repeat=1, experts=8, host_backend="reference", device_backend="reference", memory_mib=8,
                          batches=(1,), dtypes=("fp32",), call_sizes=((32, 32), (128, 64)),
                          device_call_sizes=((32, 32), (128, 64)), call_tokens=(1, 2), dense_sizes=(64, 128),
                          dense_contexts=(8,), expert_hidden=256, expert_intermediate=128)
    profile, raw = calibrate(cfg, progress=False, allow_out_of_bounds=True)
    out = write_profile(profile, raw, tmp_path / "box.yaml")
    hw = load_profile(out)
    assert hw.name == "box" and hw.device_shares_host_memory and hw.copy_engines == 1
    oob = "stated: OUT OF BOUNDS (written with --allow-out-of-bounds): "
    assert all(v.startswith("stated: measured by moelab calibrate on ") or (v.startswith(oob) and k in profile
               and "measured by moelab calibrate on " in v) for k, v in hw.provenance.items()
               if k not in ("decode_layer_time_us", "attention_fraction"))
    assert hw.runtime_layer_us > 0 and hw.runtime_call_us > 0  # moelab's executor, measured on a tiny model
    assert raw["load_before"] == quiet and raw["busy"] == ""
    assert "1 timed calls, median" in hw.provenance["link_bandwidth_gbs"]
    fits = raw["fits"]
    assert set(fits) == {"host_call", "device_call", "dense"}
    assert all(len(f["points"]) == (4 if k != "dense" else 2) for k, f in fits.items())
    assert all("residual_pct" in p for f in fits.values() for p in f["points"])
    assert (tmp_path / "box.raw.json").is_file() and not list(tmp_path.glob(".*partial"))
    with pytest.raises(MoelabError, match="exists; pass --overwrite"):
        write_profile(profile, raw, out)
    with pytest.raises(MoelabError, match="give a .yaml file name"):
        write_profile(profile, raw, tmp_path / "box.txt")


def test_the_c_engine_source_is_package_data():
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moelab"]
    assert "simulate/*.c" in globs and (root / "moelab" / "simulate" / "_engine.c").is_file()


def test_the_runs_summary_counts_every_numa_host_lane_as_host():
    from moelab.hybrid.events import summarize
    from moelab.simulate.executor import simulate_plans

    # two NUMA nodes: experts 2, 4 on host0 and 3 on host1; the deferred expert 4 runs after expert 2 on
    # host0, beside layer 1's dense work
    plans = [plan(0, host=[(2, 1), (3, 1)], deferred=[(4, 1)]), plan(1, device=[(0, 1)], hits=[0])]
    res = simulate_plans(plans, HandShape(), hand_profile(numa_nodes=2, numa_node_bandwidth_gbs=500.0))
    assert {"host0", "host1"} <= set(res.events["lane"].astype(str))
    assert summarize(res.events)["overlap_pct"] > 0
