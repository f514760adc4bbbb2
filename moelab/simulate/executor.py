"""The simulated executor: the planner's plans on a hardware profile, as the real executor's events.

>>> res = simulate_plans(plans, shape, "ktransformers-a100")
>>> res.events              # the columns of moelab.hybrid.events.COLUMNS, one row per unit of work
>>> res.summary()           # tokens/s, decode step time, lane busy %, overlap %, stalls by cause

**What runs where** (per MoE layer ``l`` of one forward, as :mod:`moelab.hybrid.real` does):

1. ``control`` runs the dense work up to layer ``l``'s router — the attention of every
   decoder layer since the previous MoE block (by context length, from the shape), dense
   MLPs of non-MoE layers, the router — and synchronises to read the routing (a ``dense``
   event; on a GPU box it is GPU time launched by the control thread);
2. the plan's transfers go to the copy engines (``copy``/``copy0``..): demand copies at
   priority 0, prefetches at 1, inserts (``cache.admission: all``) at 2, so a demand copy
   overtakes queued prefetches and inserts wait behind both; with ``copy_chunks`` > 1 the
   prefetches and inserts go in chunks (ProMoE's, :func:`chunk_copies`), so a demand copy also
   overtakes the rest of one already on the link;
3. ``device`` runs the shared experts (a ``dense`` event, cause ``shared-experts``) and each
   device expert (``expert-device``; cause ``hit``, ``prefetch-hit`` or ``miss-fetch``); an
   expert starts only after the latest copy of it issued so far has ended — a demand
   fetch, or a prefetch or insert still in flight;
4. ``host``/``host0``.. (one lane per NUMA node; expert ``e`` lives on node
   ``e % numa_nodes``) run the host misses (``expert-host``, ``miss-host``) and then the
   deferred experts (``expert-deferred``, ``deferred``);
5. ``control`` waits (a ``wait`` event) for the layer's device and host experts and the
   *previous* layer's deferred experts — deferred work of layer ``l`` overlaps layer
   ``l + 1``'s attention and is merged at ``l + 1``'s output. Its cause names the last
   thing it waited for: ``copy`` (a device expert held up by its copy), ``device``,
   ``host`` or ``deferred``.

After the last MoE layer, ``control`` runs the remaining layers and the LM head (``dense``
at layer -1, cause ``tail+lm-head``), after the last layer's deferred experts. The device
lane's idle time before a copied expert is a ``wait`` event on ``device`` (cause ``copy``).

**Costs** (:class:`moelab.timing.costs.CostModel`, the one cost model the placements plan with):
a roofline ``max(bytes / (bandwidth × efficiency), FLOPs / (peak × efficiency))`` per kernel, plus launch (``gpu_launch_us`` × kernels), dispatch
(``cpu_dispatch_us`` per host expert), a fixed cost per experts call (``gpu_call_us`` once per
layer on the device, ``cpu_call_us`` once per layer and host lane — the real executor makes one
backend call per layer and lane), copy latency and synchronisation (``sync_us``). Host experts and
copies read their NUMA node's memory and share its bandwidth (:mod:`moelab.simulate.engine`).
With ``device_shares_host_memory`` (a CPU-only machine: a CPU worker stands in for the GPU) every
lane is a CPU thread, and what they share is the cores: each task's whole work (fixed + bytes
at its rate, alone) becomes core-µs in one pool of ``cpu_cores``, shared max-min fair (two busy
lanes each run at half speed); the events still report the bytes read.

**Context.** Attention cost grows with the context: a prefill of ``T`` tokens adds ``T``
(its attention is costed at half the context, the causal average); each decode forward
adds one token per sequence (``tokens`` sequences). ``context`` sets the tokens already
cached before the first plan.

The graph is built twice — :func:`build_graph_reference` (a loop, the definition) and
:func:`build_graph` (numpy, the default) — and run by :func:`moelab.simulate.engine.simulate`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.events import busy_spans, lane_group, length, summarize
from moelab.hybrid.events import COLUMNS
from moelab.simulate.engine import Graph, Schedule, simulate
from moelab.timing import HardwareProfile
from moelab.timing.costs import CostModel, cost_model

# task categories, in their order within a layer's block
CAT_D, CAT_X, CAT_S, CAT_V, CAT_H, CAT_F, CAT_W, CAT_T = range(8)
#: copy priorities (lowest first): demand, then prefetch, then the low-priority inserts of
#: ``cache.admission: all`` (a copy never pre-empts one already running)
PRIO = {"demand": 0, "prefetch": 1, "insert": 2}
XKIND = {"demand": 0, "insert": 1, "prefetch": 2}
XNAMES = ("demand", "insert", "prefetch")
FATES = ("hit", "prefetch-hit", "miss-fetch")
RES_CONTROL, RES_DEVICE, RES_COPY = 0, 1, 2


# ---------------------------------------------------------------------- encoding of plans
@dataclass
class Encoded:
    """Plans as flat arrays (one row per plan, per transfer, per expert item)."""

    forward: np.ndarray
    step: np.ndarray
    layer: np.ndarray
    tokens: np.ndarray
    prefill: np.ndarray
    nx: np.ndarray
    nv: np.ndarray
    nh: np.ndarray
    nf: np.ndarray
    ns: int
    last: np.ndarray
    """True for the last plan of its forward (a tail task follows it)."""
    x: np.ndarray
    """[n, 4]: target layer, expert, bytes, kind (0 demand, 1 insert, 2 prefetch)."""
    v: np.ndarray
    """[n, 3]: expert, tokens, fate (0 hit, 1 prefetch-hit, 2 miss-fetch)."""
    h: np.ndarray
    f: np.ndarray

    @property
    def n_plans(self) -> int:
        return len(self.layer)


def _flat_pairs(lists: list) -> np.ndarray:
    """[n, 2] int64 of the (a, b) pairs in a list of lists of pairs (C-level iteration)."""
    n = sum(map(len, lists))
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(lists)), dtype=np.int64, count=2 * n)
    return flat.reshape(n, 2)


def _immediate_items(n: int, E: int, v: np.ndarray, nv: np.ndarray, hh: np.ndarray, nh: np.ndarray, ff: np.ndarray,
                     nf: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The host items and the deferred items of each plan, given the flat (expert, tokens) items
    of the ``n`` plans (``v``/``hh``/``ff`` with per-plan counts ``nv``/``nh``/``nf``): a LayerPlan's
    ``device``/``host`` count every token routed to the expert, deferred slots included (the
    cache serves the union). Deferral is a host technique (KTransformers §4: the CPU's deferred
    experts overlap the next layer's attention): a deferred slot of an expert the device computes
    runs in the device's immediate call (its result is still added at the next MoE layer), and
    only the host's deferred slots leave the immediate call to run once, in the deferred task —
    as :mod:`moelab.hybrid.real` does (its backends skip zero-weight slots). Returns
    ``(hh, nh, ff, nf)``, each plan's items in their order (vectorised: one pass over the arrays)."""
    plans = np.arange(n, dtype=np.int64)
    vkey = np.repeat(plans, nv) * E + v[:, 0]
    fplan = np.repeat(plans, nf)
    fkey = fplan * E + ff[:, 0]
    vs = np.sort(vkey)  # (np.isin hashes both arrays: several times slower here than a sorted lookup)
    at = np.minimum(np.searchsorted(vs, fkey), max(len(vs) - 1, 0))
    keep = ~(vs[at] == fkey) if len(vs) else np.ones(len(fkey), dtype=bool)  # deferred slots of device
    # experts stay in the device's call
    ff, fplan, fkey = ff[keep], fplan[keep], fkey[keep]
    hplan = np.repeat(plans, nh)
    hkey = hplan * E + hh[:, 0]
    order = np.argsort(fkey, kind="stable")
    fs, fcount = fkey[order], ff[order, 1]
    pos = np.minimum(np.searchsorted(fs, hkey), max(len(fs) - 1, 0))
    found = (fs[pos] == hkey) if len(fs) else np.zeros(len(hkey), dtype=bool)
    left = hh[:, 1] - np.where(found, fcount[pos] if len(fs) else 0, 0)
    stay = left > 0  # a host expert whose every slot is deferred leaves the immediate call
    hh = np.column_stack([hh[stay, 0], left[stay]]) if len(hh) else hh
    return hh, np.bincount(hplan[stay], minlength=n), ff, np.bincount(fplan, minlength=n)


def _list_columns(plans: Sequence[Any], num_experts: int) -> dict:
    """The encoder's columns (:func:`moelab.simulate.records.plan_columns`) read from the plans' lists."""
    n = len(plans)
    E = num_experts
    get = attrgetter("forward", "step", "layer", "tokens", "phase", "device", "host", "deferred", "transfers", "hits")
    cols_p = list(zip(*map(get, plans), strict=True)) if n else [()] * 10
    devs, hosts, dfrs, trs, hits = cols_p[5:10]
    phits = [getattr(p, "prefetch_hits", None) or () for p in plans]
    nv = np.fromiter(map(len, devs), dtype=np.int64, count=n)
    v = _flat_pairs(devs)
    flat_tr = list(chain.from_iterable(trs))
    if flat_tr:
        cols = list(zip(*map(attrgetter("layer", "expert", "bytes", "priority"), flat_tr), strict=True))
        x = np.column_stack([np.fromiter(cols[0], np.int64), np.fromiter(cols[1], np.int64),
                             np.fromiter(cols[2], np.int64), np.fromiter(map(XKIND.__getitem__, cols[3]), np.int64)])
    else:
        x = np.zeros((0, 4), np.int64)
    plans_idx = np.arange(n, dtype=np.int64)
    keys = np.repeat(plans_idx, nv) * E + v[:, 0]
    fate = np.full(len(v), 2, dtype=np.int64)
    for code, lists in ((0, hits), (1, phits)):
        counts = np.fromiter(map(len, lists), dtype=np.int64, count=n)
        if counts.sum():
            k = np.repeat(plans_idx, counts) * E + np.fromiter(chain.from_iterable(lists), np.int64, int(counts.sum()))
            if len(k) and (k.min() < 0 or k.max() >= n * E):
                raise MoelabError(f"a plan's hits name an expert outside 0..{E - 1}; give the shape of the model "
                                  "the trace was recorded on.")
            mark = np.zeros(n * E, dtype=bool)
            mark[k] = True
            fate[mark[keys]] = code
    return {
        "forward": np.fromiter(cols_p[0], dtype=np.int64, count=n), "step": np.fromiter(cols_p[1], np.int64, n),
        "layer": np.fromiter(cols_p[2], np.int64, n), "tokens": np.fromiter(cols_p[3], np.int64, n),
        "prefill": np.fromiter(map("prefill".__eq__, cols_p[4]), dtype=bool, count=n),
        "nv": nv, "v": np.column_stack([v, fate]), "nh": np.fromiter(map(len, hosts), np.int64, n),
        "h": _flat_pairs(hosts), "nf": np.fromiter(map(len, dfrs), np.int64, n), "f": _flat_pairs(dfrs),
        "nx": np.fromiter(map(len, trs), dtype=np.int64, count=n), "x": x,
    }


def encode(plans: Sequence[Any], num_experts: int, num_moe_layers: int, *, has_shared: bool) -> Encoded:
    """Flatten plans (LayerPlan-like objects) in order; checks experts and layers against the shape.

    The compiled planner's plans are read from their packed records
    (:func:`moelab.simulate.records.plan_columns`: numpy over one concatenated array), any other
    plans from their lists; both give the same arrays."""
    from moelab.simulate.records import plan_columns

    n = len(plans)
    E = num_experts
    c = plan_columns(plans) or _list_columns(plans, E)
    fwd, enc_layer, v, hh, ff, x = c["forward"], c["layer"], c["v"], c["h"], c["f"], c["x"]
    nh, nf = c["nh"], c["nf"]
    if n:
        if enc_layer.min() < 0 or enc_layer.max() >= num_moe_layers:
            raise MoelabError(f"a plan names MoE layer {int(enc_layer.max())} but the model shape has "
                              f"{num_moe_layers} MoE layers; simulate with the shape of the model the plans are from.")
        if (np.diff(fwd) < 0).any():
            raise MoelabError("plans must come in forward order (one forward's layers after another).")
    for name, arr, col in (("device", v, 0), ("host", hh, 0), ("deferred", ff, 0), ("transfer", x, 1)):
        if len(arr) and (arr[:, col].min() < 0 or arr[:, col].max() >= E):
            bad = int(arr[:, col].max()) if arr[:, col].max() >= E else int(arr[:, col].min())
            raise MoelabError(f"a plan's {name} expert {bad} does not exist: the model shape has {E} experts per "
                              "layer; give the shape of the model the trace was recorded on.")
    if len(x) and (x[:, 0].min() < 0 or x[:, 0].max() >= num_moe_layers):
        raise MoelabError(f"a transfer names MoE layer {int(x[:, 0].max())}; the model shape has {num_moe_layers}.")
    if len(ff):
        hh, nh, ff, nf = _immediate_items(n, E, v, c["nv"], hh, nh, ff, nf)
    last = np.ones(n, dtype=bool)
    if n > 1:
        last[:-1] = fwd[1:] != fwd[:-1]
    return Encoded(
        forward=fwd, step=c["step"], layer=enc_layer, tokens=c["tokens"], prefill=c["prefill"], nx=c["nx"],
        nv=c["nv"], nh=nh, nf=nf, ns=1 if has_shared else 0, last=last, x=x, v=v, h=hh, f=ff,
    )


def chunk_copies(enc: Encoded, chunks: int) -> Encoded:
    """``enc`` with each low-priority copy (prefetch, insert) split into ``chunks`` copies of equal
    bytes (the last one takes the remainder), in place of the whole one and in order — ProMoE's
    chunked transfers (§5: per projection), so a demand copy waits for at most the chunk on the
    link (a started copy is never pre-empted: :mod:`moelab.simulate.engine`). The chunks keep the
    copy's priority and plan; on one copy engine they run one after another, and a device expert
    waits for the last chunk of its latest copy (:func:`_copy_before`). Demand copies stay whole."""
    if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or chunks < 1:
        raise MoelabError(f"copy_chunks={chunks!r}: expected an integer ≥ 1 (1: whole copies; 3: ProMoE's "
                          "per-projection chunks).")
    if chunks == 1 or not len(enc.x):
        return enc
    reps = np.where(enc.x[:, 3] != XKIND["demand"], int(chunks), 1)  # pieces per copy
    x = np.repeat(enc.x, reps, axis=0)
    n = np.repeat(reps, reps)  # each piece's copy's number of pieces
    k = np.arange(len(x)) - np.repeat(np.cumsum(reps) - reps, reps)  # the piece's number within its copy
    part = x[:, 2] // n
    x[:, 2] = np.where(k == n - 1, x[:, 2] - part * (n - 1), part)  # the last piece takes the remainder
    owner = np.repeat(np.arange(enc.n_plans, dtype=np.int64), enc.nx)
    nx = np.bincount(owner, weights=reps, minlength=enc.n_plans).astype(np.int64)
    return dataclasses.replace(enc, x=x, nx=nx)


# ---------------------------------------------------------------------- layout of the task list
@dataclass
class Layout:
    """Where each plan's tasks are: ``D`` (dense), ``X0``.. (transfers), ``S0`` (shared), ``V0``
    (device), ``H0`` (host), ``F0`` (deferred), ``W`` (wait); ``T`` (tail) after a forward's last plan."""

    D: np.ndarray
    X0: np.ndarray
    S0: np.ndarray
    V0: np.ndarray
    H0: np.ndarray
    F0: np.ndarray
    W: np.ndarray
    T: np.ndarray
    n: int


def layout(enc: Encoded) -> Layout:
    size = 2 + enc.nx + enc.ns + enc.nv + enc.nh + enc.nf + enc.last.astype(np.int64)
    base = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.int64) if enc.n_plans else np.zeros(0, np.int64)
    X0 = base + 1
    S0 = X0 + enc.nx
    V0 = S0 + enc.ns
    H0 = V0 + enc.nv
    F0 = H0 + enc.nh
    W = F0 + enc.nf
    T = np.where(enc.last, W + 1, -1)
    return Layout(base, X0, S0, V0, H0, F0, W, T, int(size.sum()))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` for each (start, length)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offs = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(np.asarray(starts, dtype=np.int64) - offs, lengths) + np.arange(total, dtype=np.int64)


# ---------------------------------------------------------------------- costs of every task
def _task_costs(enc: Encoded, lay: Layout, costs: CostModel, context: int):
    """Per-task arrays: resource, priority, fixed, bytes, cap, pool, category, and per-item extras.

    Size: long: one table of task costs by kind (dense, router, experts on either side, copies), in the order
    of the cost model's definition.
    """
    hw = costs.profile
    n = lay.n
    N = hw.numa_nodes
    shared_mem = hw.device_shares_host_memory
    res = np.zeros(n, np.int32)
    prio = np.zeros(n, np.int32)
    fixed = np.zeros(n, np.float64)
    nbytes = np.zeros(n, np.float64)
    cap = np.ones(n, np.float64)
    pool = np.full(n, -1, np.int32)
    cat = np.zeros(n, np.int8)
    P = enc.n_plans

    # ---- context per forward, attention per plan
    fwd_ids, first = np.unique(enc.forward, return_index=True)
    ctx_of = {}
    c = int(context)
    for f, i in zip(fwd_ids.tolist(), first.tolist(), strict=True):
        t = int(enc.tokens[i])
        if enc.prefill[i]:
            c += t
            ctx_of[f] = (c, t, True)
        else:
            c += 1
            ctx_of[f] = (c, max(t, 1), False)
    att = np.array([costs.attention(cc, b, pre)[:2] for cc, b, pre in ctx_of.values()], dtype=np.float64)
    of_fwd = np.repeat(np.arange(len(fwd_ids)), np.diff(np.append(first, P)))  # plans come in forward order
    a_bytes = att[of_fwd, 0] if P else np.zeros(0)
    a_flops = att[of_fwd, 1] if P else np.zeros(0)

    # decoder layers between the previous planned MoE layer (of the same forward) and this one
    moe = np.asarray(costs.moe_layers, dtype=np.int64)
    is_dense = np.ones(costs.num_layers + 1, dtype=np.int64)
    is_dense[moe] = 0
    dense_before = np.concatenate([[0], np.cumsum(is_dense[:-1])])  # dense decoder layers in [0, i)
    d_here = moe[enc.layer] if P else np.zeros(0, np.int64)
    first_of_fwd = np.ones(P, dtype=bool)
    if P > 1:
        first_of_fwd[1:] = enc.forward[1:] != enc.forward[:-1]
    d_prev = np.where(first_of_fwd, -1, np.concatenate([[-1], d_here[:-1]])) if P else d_here
    n_attn = d_here - d_prev
    n_dmlp = dense_before[d_here] - dense_before[d_prev + 1]
    toks = np.maximum(enc.tokens, 1).astype(np.float64)
    dense_b = n_attn * a_bytes + n_dmlp * costs.dense_mlp_bytes + costs.router_bytes
    dense_f = n_attn * a_flops + n_dmlp * costs.dense_mlp_flops_per_token * toks + costs.router_flops_per_token * toks
    D = lay.D
    res[D], cat[D] = RES_CONTROL, CAT_D
    fixed[D] = n_attn * hw.gpu_kernels_per_attention * hw.gpu_launch_us + hw.sync_us
    nbytes[D] = dense_b
    cap[D] = costs.dense_cap(dense_b, dense_f)
    if shared_mem:
        pool[D] = 0

    # ---- tail after each forward's last plan
    lastp = np.flatnonzero(enc.last)
    T = lay.T[lastp]
    n_tail = costs.num_layers - 1 - d_here[lastp]
    nd_tail = dense_before[costs.num_layers] - dense_before[d_here[lastp] + 1]
    tail_b = n_tail * a_bytes[lastp] + nd_tail * costs.dense_mlp_bytes + costs.lm_head_bytes
    tail_f = (n_tail * a_flops[lastp] + nd_tail * costs.dense_mlp_flops_per_token * toks[lastp]
              + costs.lm_head_flops_per_token * toks[lastp])
    res[T], cat[T] = RES_CONTROL, CAT_T
    fixed[T] = (n_tail * hw.gpu_kernels_per_attention + 2) * hw.gpu_launch_us + hw.sync_us
    nbytes[T] = tail_b
    cap[T] = costs.dense_cap(tail_b, tail_f)
    if shared_mem:
        pool[T] = 0

    # ---- waits
    W = lay.W
    res[W], cat[W] = RES_CONTROL, CAT_W
    fixed[W] = np.where((enc.nv + enc.ns) > 0, hw.sync_us, 0.0)

    # ---- transfers
    X = _ranges(lay.X0, enc.nx)
    res[X], cat[X] = RES_COPY, CAT_X
    prio[X] = np.array([PRIO[k] for k in XNAMES], dtype=np.int32)[enc.x[:, 3]]
    fixed[X] = hw.link.latency_us
    nbytes[X] = enc.x[:, 2]
    cap[X] = costs.link_cap
    pool[X] = enc.x[:, 1] % N

    # ---- shared experts
    if enc.ns:
        S = lay.S0
        res[S], cat[S] = RES_DEVICE, CAT_S
        fixed[S] = costs.device_expert_fixed_us
        nbytes[S] = costs.shared_bytes
        cap[S] = costs.device_cap(np.full(P, costs.shared_bytes), costs.shared_flops_per_token * toks)
        if shared_mem:
            pool[S] = 0

    # ---- device experts
    V = _ranges(lay.V0, enc.nv)
    res[V], cat[V] = RES_DEVICE, CAT_V
    fixed[V] = costs.device_expert_fixed_us
    nbytes[V] = costs.expert_bytes
    cap[V] = costs.device_cap(np.full(len(V), costs.expert_bytes), costs.expert_flops_per_token * enc.v[:, 1])
    if shared_mem:
        pool[V] = enc.v[:, 0] % N
    # one experts call per layer on the device: its fixed cost is paid by the layer's first device task
    first_dev = np.where(enc.ns > 0, lay.S0, lay.V0)[(enc.nv + enc.ns) > 0]
    fixed[first_dev] += costs.device_call_us

    # ---- host and deferred experts
    for cat_id, starts, counts, items in ((CAT_H, lay.H0, enc.nh, enc.h), (CAT_F, lay.F0, enc.nf, enc.f)):
        idx = _ranges(starts, counts)
        node = items[:, 0] % N if len(items) else np.zeros(0, np.int64)
        res[idx], cat[idx] = 3 + node, cat_id
        fixed[idx] = costs.host_expert_fixed_us
        # one experts call per layer and host lane: its fixed cost is paid by the first task of each lane
        if len(idx):
            owner = np.repeat(np.arange(len(counts)), counts)
            key = owner * N + node
            first = np.ones(len(idx), dtype=bool)
            first[1:] = key[1:] != key[:-1]
            if N > 1:  # items of one plan are not sorted by node: mark the first of each (plan, node),
                first[:] = False  # node by node (items come in plan order)
                for k in range(N):
                    on = np.flatnonzero(node == k)
                    head = np.ones(len(on), dtype=bool)
                    head[1:] = owner[on[1:]] != owner[on[:-1]]
                    first[on[head]] = True
            fixed[idx[first]] += costs.host_call_us
        nbytes[idx] = costs.expert_bytes
        cap[idx] = costs.host_cap(np.full(len(idx), costs.expert_bytes), costs.expert_flops_per_token * items[:, 1])
        pool[idx] = node
    fixed[D] += costs.control_layer_us  # moelab's executor's own cost per MoE layer (0 on a hardware profile)
    servers = np.array([1, 1, hw.copy_engines] + [1] * N, dtype=np.int32)
    pool_bw = np.full(N, hw.numa_node_bandwidth_gbs * 1e3)
    if shared_mem:
        # a CPU-only machine: every lane (control, device stand-in, copies, host) is a CPU thread whose
        # work (Python dispatch, torch ops and native kernels over all their threads) wants every core, and
        # the lanes time-share the cores. Each task's work becomes its time alone × cpu_cores core-µs,
        # run at up to cpu_cores (all of them when alone) from one pool of cpu_cores shared max-min fair:
        # two busy lanes take twice as long each (memory bandwidth, saturated by one kernel here, goes
        # with the cores)
        work = cat != CAT_W
        with np.errstate(divide="ignore", invalid="ignore"):
            alone = fixed + np.where(nbytes > 0, nbytes / np.where(cap > 0, cap, 1.0), 0.0)
        c = float(hw.cpu_cores)
        nbytes = nbytes.copy()
        nbytes[work] = alone[work] * c
        cap[work] = c
        fixed[work] = 0.0
        pool[work] = 0
        pool_bw = np.full(N, c)
    return res, prio, fixed, nbytes, cap, pool, cat, servers, pool_bw


# ---------------------------------------------------------------------- dependencies
def _copy_before(enc: Encoded, lay: Layout, E: int) -> np.ndarray:
    """For each device expert, the latest copy of its (layer, expert) issued before it (its task
    index), or -1: one sort of the copies and device experts by (key, task index), then a running
    maximum of the copies' positions."""
    X = _ranges(lay.X0, enc.nx)
    V = _ranges(lay.V0, enc.nv)
    if not (len(V) and len(X)):
        return np.full(len(V), -1, dtype=np.int64)
    kx = enc.x[:, 0] * E + enc.x[:, 1]
    kv = np.repeat(enc.layer, enc.nv) * E + enc.v[:, 0]
    big = lay.n + 1
    if (max(int(kx.max()), int(kv.max())) + 1) * big < 1 << 61:  # one int64 sort of key·big + task
        val = np.sort(np.concatenate([kx * big + X, kv * big + V]))
        key, ids = np.divmod(val, big)
        isx = np.zeros(big, dtype=bool)
        isx[X] = True
        isx = isx[ids]
    else:  # pragma: no cover - more than 2^61 / (tasks) keys
        keys, ids = np.concatenate([kx, kv]), np.concatenate([X, V])
        order = np.lexsort((ids, keys))
        key, ids, val = keys[order], ids[order], keys[order] * big + ids[order]
        isx = np.concatenate([np.ones(len(X), bool), np.zeros(len(V), bool)])[order]
    run = np.maximum.accumulate(np.where(isx, val, -1))
    sel = ~isx
    k_s, run_s = key[sel], run[sel]
    copy = np.where(run_s >= k_s * big, run_s - k_s * big, -1)
    by_task = np.empty(big, dtype=np.int64)
    by_task[ids[sel]] = copy
    return by_task[V]  # back in device-expert order


def _deps_vectorized(enc: Encoded, lay: Layout, E: int) -> tuple[np.ndarray, np.ndarray]:
    """The dependencies as CSR, written straight in task order: each task's are at most three
    ranges of task indices (no sort of the edges).

    * dense work ``D``: the control task just before it (the previous plan's wait, or tail);
    * transfers, shared, host and deferred experts: their plan's ``D``; a device expert also the
      latest copy of it issued before it (:func:`_copy_before`);
    * the wait ``W``: ``D``, the plan's shared, device and host experts (contiguous) and the
      previous plan's deferred experts when it is of the same forward;
    * the tail ``T``: the forward's last ``W`` and that plan's deferred experts.
    """
    P, n = enc.n_plans, lay.n
    sizes = np.diff(np.append(lay.D, n)) if P else np.zeros(0, np.int64)
    plan_of = np.repeat(np.arange(P, dtype=np.int64), sizes)
    s1 = lay.D[plan_of]  # every task's first range: one task, its plan's dense work ...
    l1 = np.ones(n, dtype=np.int64)
    s1[lay.D] = lay.D - 1  # ... but the control chain's
    if P:
        l1[lay.D[0]] = 0
    lastp = np.flatnonzero(enc.last)
    T = lay.T[lastp]
    s1[T] = lay.W[lastp]
    s2 = np.zeros(n, dtype=np.int64)
    l2 = np.zeros(n, dtype=np.int64)
    V = _ranges(lay.V0, enc.nv)
    copy = _copy_before(enc, lay, E)
    s2[V], l2[V] = copy, copy >= 0
    s2[lay.W], l2[lay.W] = lay.S0, enc.ns + enc.nv + enc.nh
    s2[T], l2[T] = lay.F0[lastp], enc.nf[lastp]
    s3 = np.zeros(n, dtype=np.int64)
    l3 = np.zeros(n, dtype=np.int64)
    if P > 1:
        same = np.flatnonzero(enc.forward[1:] == enc.forward[:-1])
        s3[lay.W[same + 1]], l3[lay.W[same + 1]] = lay.F0[same], enc.nf[same]
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(l1 + l2 + l3, out=ptr[1:])
    idx = np.empty(int(ptr[-1]), dtype=np.int64)
    one = np.flatnonzero(l1)  # every task but the first has its first range of one task: scattered,
    idx[ptr[one]] = s1[one]  # the few longer ranges expanded
    for s, ln, at in ((s2, l2, ptr[:-1] + l1), (s3, l3, ptr[:-1] + l1 + l2)):
        some = np.flatnonzero(ln)
        s, ln = s[some], ln[some]
        vals = _ranges(s, ln)
        idx[vals + np.repeat(at[some] - s, ln)] = vals
    return ptr, idx


def _deps_reference(enc: Encoded, lay: Layout, E: int) -> tuple[np.ndarray, np.ndarray]:
    """The dependencies by a plain walk over the plans (the definition of :func:`_deps_vectorized`)."""
    deps: list[list[int]] = [[] for _ in range(lay.n)]
    last_copy: dict[tuple[int, int], int] = {}
    prev_ctrl = -1
    prev_f: list[int] = []
    xi = vi = hi = fi = 0
    for i in range(enc.n_plans):
        D = int(lay.D[i])
        if prev_ctrl >= 0:
            deps[D].append(prev_ctrl)
        t = D + 1
        for _ in range(int(enc.nx[i])):
            deps[t].append(D)
            last_copy[(int(enc.x[xi, 0]), int(enc.x[xi, 1]))] = t
            t += 1
            xi += 1
        waited = []
        for _ in range(enc.ns):
            deps[t].append(D)
            waited.append(t)
            t += 1
        for _ in range(int(enc.nv[i])):
            deps[t].append(D)
            c = last_copy.get((int(enc.layer[i]), int(enc.v[vi, 0])))
            if c is not None:
                deps[t].append(c)
            waited.append(t)
            t += 1
            vi += 1
        for _ in range(int(enc.nh[i])):
            deps[t].append(D)
            waited.append(t)
            t += 1
            hi += 1
        mine_f = []
        for _ in range(int(enc.nf[i])):
            deps[t].append(D)
            mine_f.append(t)
            t += 1
            fi += 1
        W = t
        assert lay.W[i] == W
        deps[W] = [D, *waited, *prev_f]
        prev_ctrl, prev_f = W, mine_f
        if enc.last[i]:
            T = W + 1
            deps[T] = [W, *mine_f]
            prev_ctrl, prev_f = T, []
    ptr = np.cumsum([0] + [len(d) for d in deps]).astype(np.int64)
    idx = np.array([x for d in deps for x in sorted(d)], dtype=np.int64)
    return ptr, idx


def _task_bytes(enc: Encoded, lay: Layout, costs: CostModel, context: int) -> np.ndarray:
    """The bytes each task reads (as :func:`_task_costs` computes them on a profile whose work is bytes)."""
    hw = costs.profile.with_changes(device_shares_host_memory=False)
    return _task_costs(enc, lay, dataclasses.replace(costs, profile=hw), context)[3]


def build_graph(enc: Encoded, costs: CostModel, *, context: int = 0, reference: bool = False) -> tuple[Graph, Layout, Any]:
    """The task graph of encoded plans (numpy; ``reference=True``: the plain-loop dependencies)."""
    lay = layout(enc)
    res, prio, fixed, nbytes, cap, pool, cat, servers, pool_bw = _task_costs(enc, lay, costs, context)
    event_bytes = _task_bytes(enc, lay, costs, context) if costs.profile.device_shares_host_memory else None
    ptr, idx = (_deps_reference if reference else _deps_vectorized)(enc, lay, costs.num_experts)
    g = Graph(res, prio, fixed, nbytes, cap, pool, ptr, idx, servers, pool_bw)
    g.event_bytes = event_bytes  # the bytes each task reads, when its work is in core-µs (see _task_costs)
    return g, lay, cat


def build_graph_reference(enc: Encoded, costs: CostModel, *, context: int = 0):
    return build_graph(enc, costs, context=context, reference=True)


# ---------------------------------------------------------------------- events
def lane_names(hw: HardwareProfile) -> list[str]:
    """Names of the engine's resources' servers, as event lanes (one list per resource, flattened
    by :func:`_lane_of`)."""
    copies = ["copy"] if hw.copy_engines == 1 else [f"copy{i}" for i in range(hw.copy_engines)]
    hosts = ["host"] if hw.numa_nodes == 1 else [f"host{i}" for i in range(hw.numa_nodes)]
    return ["control", "device", *copies, *hosts]


KINDS = ("dense", "expert-device", "expert-host", "expert-deferred", "transfer-demand", "transfer-insert",
         "transfer-prefetch", "wait")
CAUSES = ("attention+router", "shared-experts", "tail+lm-head", "hit", "prefetch-hit", "miss-fetch", "miss-host",
          "deferred", "demand", "insert", "prefetch", "copy", "device", "host", "")


@dataclass
class SimResult:
    """A simulated run: its events (the real executor's columns) and what produced them."""

    events: Any
    """pandas DataFrame with :data:`moelab.hybrid.events.COLUMNS` (categorical strings)."""
    schedule: Schedule
    graph: Graph
    profile: HardwareProfile
    forwards: Any
    """pandas DataFrame: one row per forward (phase, tokens, start, end µs)."""

    def summary(self) -> dict:
        return summarize_sim(self.events, self.forwards)

    def table(self):
        """The events as a pyarrow Table with the Parquet schema of :class:`moelab.hybrid.events.EventLog`."""
        import pyarrow as pa

        from moelab.hybrid.events import EventLog

        schema = EventLog("x").table().schema
        df = self.events.copy()
        for c in ("run", "lane", "kind", "cause"):
            df[c] = df[c].astype(str)
        return pa.Table.from_pandas(df[list(COLUMNS)], schema=schema, preserve_index=False)


def _events(enc: Encoded, lay: Layout, cat: np.ndarray, g: Graph, s: Schedule, hw: HardwareProfile, run: str):
    import pandas as pd

    lanes = lane_names(hw)
    # lane code of every task: control 0, device 1, copy servers, host nodes
    # columns in their final dtypes from the start (codes in int8/int16: fewer pages to touch and no casts)
    code = np.int8 if len(lanes) < 128 else np.int16
    lane_base = np.array([0, 1, 2] + [2 + hw.copy_engines + k for k in range(hw.numa_nodes)], dtype=code)
    lane = lane_base[g.resource]
    copies = g.resource == RES_COPY
    lane[copies] += s.server[copies].astype(code)
    n = g.n
    P = enc.n_plans
    sizes = np.diff(np.append(lay.D, n)) if P else np.zeros(0, np.int64)
    plan_of = np.repeat(np.arange(P), sizes) if P else np.zeros(n, np.int64)
    step = enc.forward.astype(np.int32)[plan_of] if P else np.zeros(n, np.int32)
    layer = enc.layer.astype(np.int32)[plan_of] if P else np.zeros(n, np.int32)
    kind = np.zeros(n, np.int8)
    cause = np.full(n, CAUSES.index(""), np.int8)
    expert = np.full(n, -1, np.int32)
    tokens = np.zeros(n, np.int32)
    eb = getattr(g, "event_bytes", None)
    nbytes = (g.nbytes if eb is None else eb).astype(np.int64)
    t0, t1 = s.start.copy(), s.end.copy()

    D, T, W = lay.D, lay.T[enc.last], lay.W
    cause[D] = CAUSES.index("attention+router")
    layer[T], cause[T] = -1, CAUSES.index("tail+lm-head")
    X = _ranges(lay.X0, enc.nx)
    kind[X] = KINDS.index("transfer-demand") + enc.x[:, 3]
    cause[X] = CAUSES.index("demand") + enc.x[:, 3]
    layer[X], expert[X] = enc.x[:, 0], enc.x[:, 1]
    if enc.ns:
        cause[lay.S0] = CAUSES.index("shared-experts")
        tokens[lay.S0] = enc.tokens
    V = _ranges(lay.V0, enc.nv)
    kind[V] = KINDS.index("expert-device")
    cause[V] = CAUSES.index("hit") + enc.v[:, 2]
    expert[V], tokens[V] = enc.v[:, 0], enc.v[:, 1]
    for starts, counts, items, k, c in ((lay.H0, enc.nh, enc.h, "expert-host", "miss-host"),
                                        (lay.F0, enc.nf, enc.f, "expert-deferred", "deferred")):
        idx = _ranges(starts, counts)
        kind[idx], cause[idx] = KINDS.index(k), CAUSES.index(c)
        expert[idx], tokens[idx] = items[:, 0], items[:, 1]
    nbytes[D] = 0
    nbytes[T] = 0
    # waits: from the end of the layer's dense work to the wait's end; cause = the last dependency
    kind[W] = KINDS.index("wait")
    nbytes[W] = 0
    t0[W] = s.end[D]
    cr = s.crit[W]
    ccat = cat[cr]
    cause[W] = np.select(
        [ccat == CAT_F, ccat == CAT_H, (ccat == CAT_V) & (cat[np.maximum(s.crit[cr], 0)] == CAT_X) & (s.crit[cr] >= 0),
         (ccat == CAT_V) | (ccat == CAT_S)],
        [CAUSES.index("deferred"), CAUSES.index("host"), CAUSES.index("copy"), CAUSES.index("device")],
        CAUSES.index(""),
    )
    keep = np.ones(n, bool)
    keep[W] = t1[W] > t0[W]
    cols = {"step": step, "layer": layer, "lane": lane, "kind": kind, "expert": expert, "tokens": tokens,
            "bytes": nbytes, "t_start_us": t0, "t_end_us": t1, "cause": cause}
    cols = {k: v[keep] for k, v in cols.items()}
    # extra waits: the tail held up by deferred experts; the device lane idle before a copied expert
    extra = []
    tl = T
    Wl = lay.W[enc.last]
    late = s.start[tl] > s.end[Wl]
    if late.any():
        extra.append((step[tl][late], np.full(late.sum(), -1), np.zeros(late.sum(), np.int64),
                      s.end[Wl][late], s.start[tl][late], CAUSES.index("deferred")))
    if len(V):
        dev_tasks = np.flatnonzero(g.resource == RES_DEVICE)
        order = dev_tasks[np.argsort(s.start[dev_tasks], kind="stable")]
        prev_end = np.concatenate([[0.0], s.end[order][:-1]])
        ready_at = np.maximum(prev_end, s.end[lay.D[plan_of[order]]])
        c = s.crit[order]
        by_copy = (c >= 0) & (cat[np.maximum(c, 0)] == CAT_X) & (s.start[order] > ready_at)
        if by_copy.any():
            o = order[by_copy]
            extra.append((step[o], layer[o], np.ones(len(o), np.int64), ready_at[by_copy], s.start[o],
                          CAUSES.index("copy")))
    for st, ly, ln, a, b, c in extra:
        m = len(st)
        for k, v in (("step", st), ("layer", ly), ("lane", ln), ("kind", np.full(m, KINDS.index("wait"))),
                     ("expert", np.full(m, -1)), ("tokens", np.zeros(m, np.int64)), ("bytes", np.zeros(m, np.int64)),
                     ("t_start_us", a), ("t_end_us", b), ("cause", np.full(m, c))):
            cols[k] = np.concatenate([cols[k], np.asarray(v).astype(cols[k].dtype, copy=False)])
    m = len(cols["step"])
    df = pd.DataFrame({
        "run": pd.Categorical.from_codes(np.zeros(m, np.int8), [run]),
        "step": cols["step"], "layer": cols["layer"],
        "lane": pd.Categorical.from_codes(cols["lane"], lanes),
        "kind": pd.Categorical.from_codes(cols["kind"], list(KINDS)),
        "expert": cols["expert"], "tokens": cols["tokens"], "bytes": cols["bytes"], "t_start_us": cols["t_start_us"], "t_end_us": cols["t_end_us"],
        "cause": pd.Categorical.from_codes(cols["cause"], list(CAUSES)),
    })
    return df  # in task order (each layer's dense, transfers, experts, wait), extra waits last


def _forwards(enc: Encoded, lay: Layout, s: Schedule):
    import pandas as pd

    if not enc.n_plans:
        return pd.DataFrame(columns=["forward", "phase", "tokens", "start_us", "end_us"])
    first = np.ones(enc.n_plans, bool)
    first[1:] = enc.forward[1:] != enc.forward[:-1]
    return pd.DataFrame({
        "forward": enc.forward[first], "phase": np.where(enc.prefill[first], "prefill", "decode"),
        "tokens": enc.tokens[first], "start_us": s.start[lay.D[first]], "end_us": s.end[lay.T[enc.last]],
    })


# ---------------------------------------------------------------------- summary
def _measure(intervals: list[tuple[np.ndarray, np.ndarray]], need: int) -> float:
    """Length of time covered by at least one interval of each of ``need`` interval sets."""
    pts, delta = [], []
    for k, (a, b) in enumerate(intervals):
        pts += [a, b]
        onehot = np.zeros((1, len(intervals)), np.int64)
        onehot[0, k] = 1
        delta += [np.repeat(onehot, len(a), 0), -np.repeat(onehot, len(b), 0)]
    if not pts:
        return 0.0
    x = np.concatenate(pts)
    d = np.concatenate(delta)
    o = np.argsort(x, kind="stable")
    x, d = x[o], d[o]
    cnt = np.cumsum(d, axis=0)
    covered = (cnt > 0).sum(axis=1) >= need
    seg = np.diff(x)
    return float(seg[covered[:-1]].sum())


def summarize_sim(df, forwards=None) -> dict:
    """tokens/s, decode step time, lane busy %, overlap %, stall time by cause (µs), from events.

    Wall time, busy % and overlap follow the one rule of :func:`moelab.events.summarize` (the real
    executor's and :class:`moelab.timeline.Timeline`'s), so real and simulated runs compare line by line.
    """

    if len(df) == 0:
        return {"wall_us": 0.0, "busy_pct": {}, "overlap_pct": 0.0, "stall_us": {}}
    out: dict[str, Any] = summarize(df)
    wall = out["wall_us"]
    groups = df["lane"].astype(str).map(lane_group)
    # KTransformers Fig. 10's "GPU busy" and "CPU busy": the device side (device lane and the control
    # thread's dense work, which a GPU box runs on the GPU) and the host lanes, as shares of the wall time
    out["device_side_busy_pct"] = 100.0 * length(busy_spans(df[groups.isin(["device", "control"])])) / wall
    out["host_side_busy_pct"] = 100.0 * length(busy_spans(df[groups == "host"])) / wall
    waits = df[(df["kind"] == "wait") & (df["lane"] == "control")]
    st = (waits["t_end_us"] - waits["t_start_us"]).groupby(waits["cause"].astype(str)).sum()
    out["stall_us"] = {str(k): float(v) for k, v in st.items() if v > 0}
    if forwards is not None and len(forwards):
        dec = forwards[forwards["phase"] == "decode"]
        if len(dec):
            step_us = (dec["end_us"] - dec["start_us"]).to_numpy()
            out["decode_step_us"] = float(step_us.mean())
            out["decode_tokens_per_s"] = float(dec["tokens"].sum() / (step_us.sum() / 1e6))
        pre = forwards[forwards["phase"] == "prefill"]
        if len(pre):
            out["prefill_us"] = float((pre["end_us"] - pre["start_us"]).sum())
    return out


# ---------------------------------------------------------------------- entry point
def simulate_plans(plans: Sequence[Any], shape: Any, profile: HardwareProfile | str | CostModel, *, context: int = 0,
                   engine: str | None = None, run: str = "simulated", reference_graph: bool = False,
                   copy_chunks: int = 1) -> SimResult:
    """Simulate ``plans`` (LayerPlans, one forward after another) of a model of ``shape`` on
    ``profile``; see the module docstring. ``engine``: ``fast``, ``reference`` or None (fast if it
    builds here). ``copy_chunks``: low-priority copies in that many chunks (:func:`chunk_copies`;
    ``HybridConfig.prefetch.chunks``); each chunk is one transfer event with its share of the bytes."""
    import gc

    costs = cost_model(shape, profile)
    if context < 0:
        raise MoelabError(f"context must be ≥ 0 tokens, got {context}.")
    was_enabled = gc.isenabled()
    gc.disable()  # walking ~10^5 plan objects allocates no cycles; the collector's passes cost ~30 %
    try:
        enc = encode(plans, costs.num_experts, costs.num_moe_layers, has_shared=costs.shared_bytes > 0)
        enc = chunk_copies(enc, copy_chunks)
        g, lay, cat = build_graph(enc, costs, context=context, reference=reference_graph)
        s = simulate(g, engine)
        events = _events(enc, lay, cat, g, s, costs.profile, run)
    finally:
        if was_enabled:
            gc.enable()
    return SimResult(events, s, g, costs.profile, _forwards(enc, lay, s))


__all__ = ["SimResult", "build_graph", "build_graph_reference", "chunk_copies", "encode", "lane_names", "simulate_plans",
           "summarize_sim"]
