"""Invariants of the planner + simulator, as properties over a seeded generator (issue #25).

Every case draws a model shape (and expert dtype), a shipped profile with its link, host and
device bandwidths rescaled, a skewed synthetic routing of a few MoE layers and decode steps, a
placement and a cache, plans it with the real offline planner and simulates it with the real
simulator (graph + engine, the path ``simulate_plans`` takes), and checks one invariant:

* **more GPU capacity, a faster link, more CPU or GPU bandwidth never make a step slower** under
  the admission-aware placement that is exact per layer on the one cost model, ``min-cost`` (a
  miss computed on the host is not copied in, and the host may take cached experts). HybriMoE's
  ``greedy-hss`` is a heuristic: a faster host or one more hit can send it down another path
  (found here: up to 3.4 % slower); it is not claimed with a static cache started warm
  by measured frequency (KTransformers' static placement: the resident sets of two capacities are
  nested, and a fetched miss does not change them). A faster link is checked where copies cannot
  contend with host experts for their NUMA node's memory (link + host read ≤ the node's
  bandwidth): where they do, the simulator shares the node max-min fair, and a faster copy takes
  bandwidth from a host lane that may be the critical one (up to a few % slower here) — what DMA
  and CPU kernels reading one memory do; a planner that throttled its copies could avoid it.
  A dynamic cache (LRU, LFU) admits the misses
  a placement fetched, so two settings lead to different contents and a later step may be slower
  by a cache effect (as FIFO shows Belady's anomaly); those are not claimed.
* **oracle prefetch is never slower than none** (impact-driven, the default ``select``) on a
  warm static cache beside a dynamic one: checked for LRU and LFU on the cells of the issue in
  tests/test_simulate_violations.py.
* **a simulated schedule never double-books a lane**: on every schedule of every case, the tasks
  one server of one resource ran never overlap.
* **a cache never holds more than its capacity**: random access/prefetch/admit sequences on
  every built-in policy and scope.

``MOELAB_INVARIANT_CASES`` (default 10,000) sets how many schedule cases run, split into
:data:`CHUNKS` tests so ``pytest -n 2`` shares them. A violation found later becomes a fixed case
in tests/test_simulate_violations.py first.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from moelab.caches import available_policies, make_cache
from moelab.caches.base import get_policy
from moelab.hybrid.offline import plan_routing
from moelab.routing import ForwardRouting
from moelab.simulate.engine import simulate
from moelab.simulate.executor import build_graph, encode
from moelab.timing import available_profiles, get_profile, get_shape
from moelab.timing.costs import CostModel

CASES = int(os.environ.get("MOELAB_INVARIANT_CASES", "10000"))
CHUNKS = 20
SEED = 2511
SHAPES = ("mixtral-8x7b", "deepseek-v2-lite", "qwen2-57b-a14b", "olmoe-1b-7b", "qwen3-30b-a3b")
DTYPES = ("bf16", "int8", "int4")
PROFILES = tuple(available_profiles())
KINDS = ("capacity", "link", "cpu", "gpu")
REL = 1e-9  # the engine's relative tolerance

_shapes = {(n, d): get_shape(n).with_dtype(d) for n in SHAPES for d in DTYPES}


def _routing(rng: np.random.Generator, E: int, K: int, L: int, steps: int) -> list[ForwardRouting]:
    """Decode steps at batch 1 with Zipf-skewed expert popularity per layer."""
    out = []
    pops = []
    for _ in range(L):
        p = rng.zipf(1.2 + rng.random(), E).astype(float)
        pops.append(p / p.sum())
    for f in range(steps):
        ids, ws = [], []
        for ly in range(L):
            e = rng.choice(E, K, replace=False, p=pops[ly])
            w = np.sort(rng.random(K).astype(np.float32) + 1e-3)[::-1]
            ids.append(e.reshape(1, K).astype(np.int64))
            ws.append((w / w.sum()).reshape(1, K))
        out.append(ForwardRouting(f, f, "decode", 1, ids, ws))
    return out


def _profile(rng: np.random.Generator):
    hw = get_profile(PROFILES[rng.integers(len(PROFILES))])
    s = lambda: float(2.0 ** rng.uniform(-2, 2))  # noqa: E731 - a scale in [1/4, 4]
    node = hw.numa_node_bandwidth_gbs * s()
    return hw.with_changes(link_bandwidth_gbs=hw.link_bandwidth_gbs * s(), numa_node_bandwidth_gbs=node,
                           cpu_memory_bandwidth_gbs=node * hw.numa_nodes,
                           gpu_memory_bandwidth_gbs=hw.gpu_memory_bandwidth_gbs * s())


def _no_double_booking(g, s) -> None:
    """No server of any resource runs two tasks at once."""
    key = g.resource.astype(np.int64) * 1024 + s.server
    order = np.lexsort((s.start, key))
    k, st, en = key[order], s.start[order], s.end[order]
    same = k[1:] == k[:-1]
    overlap = same & (st[1:] < en[:-1] - 1e-6 * np.maximum(1.0, np.abs(en[:-1])))
    assert not overlap.any(), f"resource {int(k[1:][overlap][0]) // 1024} runs two tasks at once"


def step_us(shape, hw, routing, cache: dict, placement: str, prefetch: str | None = None) -> float:
    """Mean decode step (µs) of ``routing`` planned under ``cache``/``placement`` and simulated."""
    L = len(routing[0].ids)
    cfg = {"cache": cache, "placement": placement, "hardware": hw, "prefetch": {"predictor": prefetch}}
    plans = plan_routing(routing, cfg, num_experts=[shape.num_experts] * L, top_k=[shape.top_k] * L,
                         expert_bytes=shape.expert_bytes(), shape=shape)
    costs = CostModel.of(shape, hw)
    enc = encode(plans, costs.num_experts, costs.num_moe_layers, has_shared=costs.shared_bytes > 0)
    g, lay, _ = build_graph(enc, costs)
    s = simulate(g)
    _no_double_booking(g, s)
    ends = s.end[lay.T[enc.last]]
    return float(ends[-1] / len(ends))


def _case(i: int) -> tuple[str, float, float, str]:
    """Case ``i``: (invariant, baseline step, changed step, description)."""
    rng = np.random.default_rng([SEED, i])
    kind = KINDS[(i // CHUNKS) % len(KINDS)]  # every chunk mixes the invariants
    name, dtype = SHAPES[rng.integers(len(SHAPES))], DTYPES[rng.integers(len(DTYPES))]
    shape = _shapes[(name, dtype)]
    hw = _profile(rng)
    L, steps = int(rng.integers(2, 4)), int(rng.integers(3, 6))
    routing = _routing(rng, shape.num_experts, shape.top_k, L, steps)
    # claimed for the exact placement: greedy-hss is a heuristic that one more hit or a faster host
    # can send down another path (case 7960: olmoe int4 on nvlink-c2c, host bandwidth × 1.2 made the
    # first fetch not pay for the device call on its own, so it fetched none: 3.4 % slower)
    placement = "min-cost"
    E = shape.num_experts
    cap = int(rng.integers(0, E + 1))
    cache = lambda c: {"capacity": c, "policy": "static", "warm": "frequency"}  # noqa: E731
    base = step_us(shape, hw, routing, cache(cap), placement)
    if kind == "capacity":
        more = int(rng.integers(cap, E + 1))
        changed, what = step_us(shape, hw, routing, cache(more), placement), f"capacity {cap} → {more} experts"
    else:
        f = float(2.0 ** rng.uniform(0.05, 2))
        if kind == "link":
            hw2 = hw.with_changes(link_bandwidth_gbs=hw.link_bandwidth_gbs * f)
            node = hw.numa_node_bandwidth_gbs
            if min(hw2.link.bandwidth_gbs, node) + node * hw.cpu_memory_efficiency > node:
                # copies and host experts contend for the node's memory (max-min fair): a faster copy
                # takes bandwidth from a host lane that may be critical — a real effect, not claimed
                return "skip", base, base, "link contends with host reads"
        elif kind == "cpu":
            hw2 = hw.with_changes(numa_node_bandwidth_gbs=hw.numa_node_bandwidth_gbs * f,
                                  cpu_memory_bandwidth_gbs=hw.cpu_memory_bandwidth_gbs * f)
        else:
            hw2 = hw.with_changes(gpu_memory_bandwidth_gbs=hw.gpu_memory_bandwidth_gbs * f)
        changed, what = step_us(shape, hw2, routing, cache(cap), placement), f"{kind} bandwidth × {f:.2f}"
    desc = f"case {i}: {name} {dtype} on {hw.name}, {placement}, static cache {cap}/{E}, {L} layers × {steps} steps"
    return kind, base, changed, f"{desc}; {what}"


@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_more_resources_never_make_a_step_slower(chunk):
    bad, checked = [], 0
    for i in range(chunk, CASES, CHUNKS):
        kind, base, changed, desc = _case(i)
        checked += kind != "skip"
        if changed > base * (1 + REL) + 1e-6:
            bad.append(f"{desc}: {base:.3f} → {changed:.3f} µs")
    assert not bad, f"{len(bad)} violations, first: {bad[:3]}"
    assert checked >= 0.7 * len(range(chunk, CASES, CHUNKS)) - 1, f"only {checked} cases checked"


@pytest.mark.parametrize("policy", sorted(p for p in available_policies() if not get_policy(p).needs_future))
@pytest.mark.parametrize("scope", ["layer", "global"])
def test_a_cache_never_holds_more_than_its_capacity(policy, scope):
    rng = np.random.default_rng([SEED, len(policy), scope == "layer"])
    cls = get_policy(policy)
    for _ in range(60):
        L, E = int(rng.integers(1, 4)), int(rng.integers(2, 17))
        cap = int(rng.integers(1, E + 1)) if rng.random() < 0.5 else float(rng.uniform(0.05, 1.0))
        kw: dict = {}
        if cls.needs_profile:
            kw["profile"] = rng.random(L * E)
        if cls.needs_scores:
            kw["top_k"] = [2] * L
        warm = rng.permutation(L * E)[: int(rng.integers(0, L * E))].tolist() if rng.random() < 0.5 else None
        c = make_cache(policy, [E] * L, cap, scope, warm=warm, **kw)
        slots = list(c.slots_)
        for _ in range(40):
            layer = int(rng.integers(L))
            experts = rng.permutation(E)[: int(rng.integers(1, min(E, 4) + 1))].tolist()
            if rng.random() < 0.7:
                admit = None if rng.random() < 0.5 else [e for e in experts if rng.random() < 0.5]
                scores = rng.random(E) if cls.needs_scores else None
                c.access(layer, experts, scores, admit)
            elif cls.accepts_prefetch:
                c.prefetch(layer, experts, int(rng.integers(0, 3)) if rng.random() < 0.5 else None)
            for part, res in enumerate(c._resident):
                assert len(res) <= slots[part], f"{policy}/{scope}: partition {part} holds {len(res)} > {slots[part]}"
