"""The planner's per-layer hot path, compiled (numba): one MoE layer's plan on preallocated arrays.

:class:`moelab.hybrid.planner.Planner` is the reference and the offline driver; where its
configuration is supported (below) and numba is present it hands each layer to this module,
which makes the same decisions in one compiled call:

slot states (edited first by Expert Deferral where the run hands its deferral to the planner:
:meth:`moelab.hybrid.planner.Planner.defer_with`, :func:`_defer`; the policy's own edit,
:func:`moelab.policies.deferral.defer_rows`, is the reference) → the experts the layer needs in access order (the rule of
:func:`moelab.caches.online.union_small`: one token's in router order, several tokens' each once
by descending largest weight, ties lower id) → hits and misses against the compiled cache →
placement (``host-misses``, ``fetch-misses``, ``greedy-hss`` on the one cost model's numbers,
tabulated per token count) → the cache's access with admission (``placement`` or ``all``) →
the prefetch proposal within the budget (``select: order``). The cache is the one compiled
implementation, :mod:`moelab.caches._fast` (its state is a :class:`moelab.caches._fast.Cache`,
its kernels :func:`~moelab.caches._fast.access_admit`, :func:`~moelab.caches._fast.prefetch`,
:func:`~moelab.caches._fast.mrs_scores` and :func:`~moelab.caches._fast.top_p_rows` are called,
not copied). :class:`CompiledCache` gives that state the read API of
:class:`moelab.caches.base.ExpertCache` (counters, contents, eviction order) for the code that
reads ``run.cache``.

**Supported** (:func:`unsupported` names the first reason otherwise, and the planner uses the
reference): a cache (capacity > 0) of a built-in policy with a compiled kernel (``lru``,
``lfu``, ``fifo``, ``mrs`` with its paper defaults, ``static``), its class's fast path on
(``ExpertCache.fast``), placement ``host-misses``, ``fetch-misses`` or ``greedy-hss``, prefetch
``select: order`` or ``impact`` (HybriMoE's impact-driven choice, on the same cost model).
``MOELAB_PLANNER=reference|compiled`` forces a path (``compiled`` raises where it is not
supported); :attr:`Planner.path` says which one runs.

**Speed.** What crosses the Python → numba boundary costs more than most of a decode step's
plan, and several times more between a forward's layers (cold caches) than in a loop. numba
unboxes a named tuple of arrays field by field on every call (≈ 6 µs for a cache); a structref
of the state crosses as one pointer, but its type is looked up in Python (2.2 µs a call in a
loop, 15–20 µs between layers); a returned array is boxed into a new Python object (2.4 µs /
12 µs). So the state — the cache, the static tables, the outputs — crosses as one int64 array,
its *handle* (:func:`handle`: each array's address and shape, each setting's value), from
which the kernel rebuilds the named tuples as views (:func:`_views`, no reference counting:
the planner holds the arrays); the settings (placement, admission, prefetch choice) are in
it, and the plan's record is written into a preallocated buffer the caller copies. In a loop
over a decode's recorded calls (MRS, greedy-hss, prefetch) the call took 19.8 µs with the
structref and 14.1 µs with the handle; in the model 80–103 → 53–73 µs (2026-11-28, development
VM). Everything is cached on disk (``cache=True``), the entry point (:func:`run`) included, so a
process that finds the cache compiles nothing (a jitclass could not be cached: every process
paid seconds of compilation).

**Float parity.** ``greedy-hss`` is the reference's arithmetic in the reference's order (sums
left to right, the same subtractions and re-additions on its lane totals), on the cost model's
per-token-count values computed by the cost model itself, so its decisions are bit-identical.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any, NamedTuple

import numpy as np

from moelab.caches import _fast
from moelab.caches._fast import HAVE_NUMBA, njit
from moelab.caches.policies import nan_scores_message
from moelab.errors import MoelabError

log = logging.getLogger(__name__)

#: Placement codes of the kernel.
PLACE_CODES = {"host-misses": 0, "fetch-misses": 1, "greedy-hss": 2}
#: ``where`` codes of the kernel's output: a device hit, a fetched miss, a host miss, a stolen hit.
DEVICE, FETCHED, HOSTED, STOLEN = 0, 1, 2, 3
#: The environment variable that forces a path: ``reference`` or ``compiled`` (default: automatic).
ENV = "MOELAB_PLANNER"

#: The weights' dtypes the kernel reads as they are (uint16: bfloat16 bit patterns).
_WEIGHT_DTYPES = (np.dtype(np.float32), np.dtype(np.uint16))
#: ``state`` modes of :func:`run`: no slot states; states read; states edited in place by Expert
#: Deferral first (:func:`_defer`, the run's own policy handed to the planner), then read.
NO_STATE, READ_STATE, DEFER = 0, 1, 2

# cnt[] slots of the kernel's output
N_NEEDED, N_DEFERRED, SKIPPED, N_EVICTED, N_PF_IN, N_PF_OUT, MOVED, ERROR = range(8)
# ... and (not in the record) the widths of the layer's compacted immediate and deferred routing
# (:func:`_compact`: -1 every slot is in that state, 0 none is, else the most slots a token has there)
M_NOW, M_LATE = 8, 9
# error codes
OK, BAD_SCORES, BAD_EXPERT, BAD_PROPOSAL = 0, 1, 2, 3


class Static(NamedTuple):
    """What the kernel reads besides the cache and one layer's routing (built once per planner)."""

    mrs_p: np.ndarray
    """(L,) int64 MRS's top-p width per MoE layer (0: not MRS)."""
    costs: np.ndarray
    """(10,) float64 the cost model's scalars: device call µs, host call µs, fetch µs, sync µs,
    expert bytes, node bandwidth (inf when the device shares host memory), 1 if shared experts
    exist, host lanes, the prefetch lead time µs (distance × decode layer time), 1 if the device
    shares host memory."""
    top_k: np.ndarray
    """(L,) int64 experts per token per MoE layer (impact-driven prefetch's token guess)."""
    dcost: np.ndarray
    """(N,) float64 ``cost.device_us(n)`` per token count n (index n)."""
    hcost: np.ndarray
    """(N,) float64 ``cost.host_us(n)``."""
    shared: np.ndarray
    """(N,) float64 ``cost.shared_us(n)``."""
    layer_hm: np.ndarray
    """(L, 2) int64 demand hits and misses per MoE layer (the reference cache's counters)."""
    place: int
    """The placement's code (:data:`PLACE_CODES`)."""
    admit_all: bool
    """Admission ``all``: every miss is copied in (else only the misses the placement fetches)."""
    impact: bool
    """Prefetch ``select: impact`` (HybriMoE's impact-driven choice) instead of ``order``."""
    defer_d: np.ndarray
    """(L,) int64 Expert Deferral's D per MoE layer, where the planner applies it (:data:`DEFER`)."""
    defer_min: int
    """Its ``min_immediate``."""
    defer_union: bool
    """Its ``batch_rule`` is ``union``."""


class Out(NamedTuple):
    """The kernel's outputs, preallocated (sizes: the largest layer's experts ``E``, ``T·K`` slots)."""

    needed: np.ndarray
    """(E,) the experts the layer needs, in access order."""
    tokens: np.ndarray
    """(E,) tokens per needed expert."""
    hit: np.ndarray
    """(E,) uint8 cached before the access."""
    where: np.ndarray
    """(E,) int64 ``DEVICE`` / ``FETCHED`` / ``HOSTED`` / ``STOLEN``."""
    spec: np.ndarray
    """(E,) uint8 an unused prefetch before the access."""
    inserted_host: np.ndarray
    """(E,) uint8 a host miss copied in afterwards (admission ``all``)."""
    deferred: np.ndarray
    """(T·K, 2) int64 sorted (expert, deferred slots)."""
    evicted: np.ndarray
    """(NK,) keys the access evicted (sorted)."""
    pf_in: np.ndarray
    """(NK,) keys the prefetch inserted, in order."""
    pf_out: np.ndarray
    """(NK,) keys the prefetch evicted (sorted)."""
    cnt: np.ndarray
    """(10,) int64 the counts (``N_NEEDED`` …), an error code, the compacted routing's widths."""
    scratch: np.ndarray
    """(E + 1,) float64 per-expert scratch (largest weight; zero between calls)."""
    seen: np.ndarray
    """(E + 1,) int64 per-expert scratch (position + 1 in ``needed``; zero between calls)."""
    keys: np.ndarray
    """(E,) int64 scratch: the needed experts' cache keys."""
    admit: np.ndarray
    """(E,) uint8 scratch: the access's admission filter."""
    flags: np.ndarray
    """(E,) uint8 scratch: the access's hit flags."""
    top_v: np.ndarray
    """(N, E) float32 scratch: MRS's top-p scores of each token row (N: the tables' token counts)."""
    top_e: np.ndarray
    """(N, E) int32 scratch: their experts."""
    rows: np.ndarray
    """(N,) int64 ``0 .. N-1``: token row r reads scores row r."""
    group: np.ndarray
    """(1,) int32 scratch: the layer of the one group :func:`~moelab.caches._fast.top_p_rows` sees."""
    row_ptr: np.ndarray
    """(2,) int64 scratch: that group's rows."""
    pk: np.ndarray
    """(NK,) int64 scratch: the prefetch proposal's cache keys."""
    rec: np.ndarray
    """(8 + 6 E + 2 T·K + 3 NK,) int64: the last plan's record (:func:`pack`)."""
    split_ids: np.ndarray
    """(L, 2, T·K) int64 per MoE layer, the immediate [0] and deferred [1] slots' expert ids
    compacted (:func:`_compact`; row-major (T, width)); a layer's stay valid until its next plan."""
    split_w32: np.ndarray
    """(L, 2, T·K) float32 their weights (float32 weights)."""
    split_w16: np.ndarray
    """(L, 2, T·K) uint16 their weights (bfloat16 bit patterns)."""


# ---------------------------------------------------------------------- the kernel
def _weight(w, t, j):
    """Slot ``(t, j)``'s router weight as a float: ``w`` holds float32 values, or (uint16) the bit
    patterns of bfloat16 ones: a bf16 tensor's own memory, read with no conversion on the hot path."""
    x = w[t, j]
    if w.dtype == np.uint16:
        return float(np.array([np.uint32(x) << np.uint32(16)], dtype=np.uint32).view(np.float32)[0])
    return float(x)


if HAVE_NUMBA:
    from llvmlite import ir as _ir
    from numba import typeof as _typeof
    from numba.core import types as _types
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload
    from numba.np.arrayobj import populate_array as _populate_array

    @_intrinsic
    def _bf16_value(typingctx, bits):
        """The float64 of bfloat16 bit pattern ``bits`` (exact: the bits are a float32's top half)."""
        if not (isinstance(bits, _types.Integer) and bits.bitwidth == 16):
            return None

        def codegen(context, builder, sig, args):
            i32 = _ir.IntType(32)
            v = builder.shl(builder.zext(args[0], i32), _ir.Constant(i32, 16))
            return builder.fpext(builder.bitcast(v, _ir.FloatType()), _ir.DoubleType())

        return _types.float64(bits), codegen

    @_overload(_weight)
    def _weight_compiled(w, t, j):
        if isinstance(w.dtype, _types.Integer):
            return lambda w, t, j: _bf16_value(w[t, j])
        return lambda w, t, j: np.float64(w[t, j])


@njit(cache=True, nogil=True)
def _ranks_after(a, ja, b, jb):
    """Whether slot ``ja`` (weight ``a``) ranks after slot ``jb`` (weight ``b``) in
    :meth:`moelab.forward.plan.SlotPlan.rank`'s order: descending weight, NaN first, ties in slot order."""
    if a != a:
        return b != b and ja > jb
    if b != b:
        return True
    return a < b or (a == b and ja > jb)


@njit(cache=True, nogil=True)
def _defer(ids, w, st, d, min_immediate, union, mark):
    """Expert Deferral's edit of the slot states, in place (:class:`moelab.policies.ExpertDeferral`,
    whose ``_plan`` is the reference): per token, the ``min(d, n - min_immediate)`` lowest-ranked of
    its ``n`` immediate slots become deferred; under the ``union`` rule a deferred slot whose expert
    is immediate for any token runs immediately again (every row is a real token here: the caller
    hands padded batches to the reference). ``mark``: per-expert scratch, zero before and after."""
    T, K = st.shape
    for t in range(T):
        n = 0
        for j in range(K):
            n += st[t, j] == 0
        for _ in range(min(d, n - min_immediate)):  # the lowest-ranked immediate slot, each time
            low = -1
            for j in range(K):
                if st[t, j] == 0 and (low < 0 or _ranks_after(_weight(w, t, j), j, _weight(w, t, low), low)):
                    low = j
            st[t, low] = 1
    if not union:
        return
    negative = False  # an id below 0 counts as an expert of its own, as in the reference's set
    for t in range(T):
        for j in range(K):
            if st[t, j] == 0:
                e = ids[t, j]
                if e < 0:
                    negative = True
                else:
                    mark[e] = 1
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if st[t, j] == 1 and (negative if e < 0 else mark[e] != 0):
                st[t, j] = 0
    for t in range(T):
        for j in range(K):
            if ids[t, j] >= 0:
                mark[ids[t, j]] = 0


def _split_weights(out, w):
    """The compacted-weights buffer of ``w``'s dtype (float32, or uint16 bfloat16 bit patterns)."""
    return out.split_w16 if w.dtype == np.uint16 else out.split_w32


if HAVE_NUMBA:

    @_overload(_split_weights)
    def _split_weights_compiled(out, w):
        if isinstance(w.dtype, _types.Integer):
            return lambda out, w: out.split_w16
        return lambda out, w: out.split_w32


@njit(cache=True, nogil=True)
def _compact(ids, w, st, which, cids, cw):
    """The slots in state ``which`` of every token packed to the left in router order into the flat
    ``cids`` / ``cw`` (row-major, (T, max(m, 1))), a token with fewer padded with its first packed
    slot's expert (its first slot's, when it has none) at weight 0: the seam's compaction
    (:func:`moelab.forward.plan.compact_rows`, the reference). Returns ``m``, the most such slots a
    token has, or -1 when every slot is in that state (nothing written: the call's own routing)."""
    T, K = st.shape
    m = 0
    every = True
    for t in range(T):
        c = 0
        for j in range(K):
            if st[t, j] == which:
                c += 1
        m = max(m, c)
        every = every and c == K
    if every:
        return -1
    width = max(m, 1)
    for t in range(T):
        pos = 0
        first = ids[t, 0]
        for j in range(K):
            if st[t, j] == which:
                if pos == 0:
                    first = ids[t, j]
                cids[t * width + pos] = ids[t, j]
                cw[t * width + pos] = w[t, j]
                pos += 1
        for q in range(pos, width):
            cids[t * width + q] = first
            cw[t * width + q] = 0
    return m


@njit(cache=True, nogil=True)
def _union(ids, w, st, mode, out):
    """Slot states and the union (:func:`moelab.hybrid.planner.slots_and_union`); returns n."""
    T, K = ids.shape
    needed, tokens, seen, best, dfr, cnt = out.needed, out.tokens, out.seen, out.scratch, out.deferred, out.cnt
    n = 0
    nd = 0
    skipped = 0
    if T == 1:
        for j in range(K):
            e = ids[0, j]
            s = st[0, j] if mode else 0
            if s == 2:
                skipped += 1
                continue
            if s == 1:
                dfr[nd, 0] = e
                dfr[nd, 1] = 1
                nd += 1
            if e >= 0:
                needed[n] = e
                tokens[n] = 1
                n += 1
        # sorted (expert, 1) pairs: insertion sort of the few deferred slots
        for i in range(1, nd):
            x = dfr[i, 0]
            j = i - 1
            while j >= 0 and dfr[j, 0] > x:
                dfr[j + 1, 0] = dfr[j, 0]
                j -= 1
            dfr[j + 1, 0] = x
    else:
        for t in range(T):
            for j in range(K):
                e = ids[t, j]
                s = st[t, j] if mode else 0
                if s == 2:
                    skipped += 1
                    continue
                if s == 1:  # counted per expert id (-1 included, as the reference's dict)
                    found = -1
                    for q in range(nd):
                        if dfr[q, 0] == e:
                            found = q
                            break
                    if found < 0:
                        dfr[nd, 0] = e
                        dfr[nd, 1] = 1
                        nd += 1
                    else:
                        dfr[found, 1] += 1
                if e < 0:
                    continue
                x = _weight(w, t, j)
                p = seen[e]
                if p == 0:
                    needed[n] = e
                    tokens[n] = 1
                    best[e] = x
                    n += 1
                    seen[e] = n
                else:
                    tokens[p - 1] += 1
                    if x > best[e]:
                        best[e] = x
        # each once, by descending largest weight, ties lower id: insertion sort (few experts)
        for i in range(1, n):
            e, c = needed[i], tokens[i]
            j = i - 1
            while j >= 0 and (best[needed[j]] < best[e] or (best[needed[j]] == best[e] and needed[j] > e)):
                needed[j + 1] = needed[j]
                tokens[j + 1] = tokens[j]
                j -= 1
            needed[j + 1] = e
            tokens[j + 1] = c
        for i in range(n):
            seen[needed[i]] = 0
            best[needed[i]] = 0.0
        for i in range(1, nd):  # sorted by expert
            a, b = dfr[i, 0], dfr[i, 1]
            j = i - 1
            while j >= 0 and dfr[j, 0] > a:
                dfr[j + 1, 0] = dfr[j, 0]
                dfr[j + 1, 1] = dfr[j, 1]
                j -= 1
            dfr[j + 1, 0] = a
            dfr[j + 1, 1] = b
    cnt[N_DEFERRED] = nd
    cnt[SKIPPED] = skipped
    return n


@njit(cache=True, nogil=True)
def _host_end(work, count, read, call_h, node):
    m = 0.0
    for i in range(work.shape[0]):
        v = max(work[i] + call_h, read[i] / node) if count[i] else 0.0
        m = max(m, v)
    return m


@njit(cache=True, nogil=True)
def _greedy(n, needed, tokens, hit, where, s):
    """:class:`moelab.hybrid.placement.GreedyHSS`'s ``place`` (see its comments), in its arithmetic order.

    Size: the reference's two phases (fetch the heaviest misses, then steal the lightest hits)
    share its lane totals, which each phase changes and restores in the reference's order; kept
    as one function so that order reads against the reference line by line."""
    cp = s.costs
    dcall, call_h, fetch_us, sync, ebytes, node = cp[0], cp[1], cp[2], cp[3], cp[4], cp[5]
    has_shared = cp[6] != 0.0
    H = int(cp[7])
    dcost, hcost = s.dcost, s.hcost
    nm = 0
    nh = 0
    tok = 1
    for i in range(n):
        tok = max(tok, tokens[i])
        if hit[i]:
            nh += 1
        else:
            nm += 1
    paid = nh > 0 or has_shared
    dev = 0.0
    if paid:
        sm = 0.0
        for i in range(n):
            if hit[i]:
                sm += dcost[tokens[i]]
        dev = dcall + s.shared[tok] + sm
    work = np.zeros(H)
    count = np.zeros(H, dtype=np.int64)
    read = np.zeros(H)
    for i in range(n):
        if not hit[i]:
            lane = needed[i] % H
            work[lane] += hcost[tokens[i]]
            count[lane] += 1
            read[lane] += ebytes
    best = max(dev, _host_end(work, count, read, call_h, node)) + (sync if paid else 0.0)
    link = 0.0
    # the misses heaviest first, ties lower id
    order = np.empty(nm, dtype=np.int64)
    m = 0
    for i in range(n):
        if not hit[i]:
            j = m - 1
            while j >= 0 and (tokens[order[j]] < tokens[i] or (tokens[order[j]] == tokens[i]
                                                               and needed[order[j]] > needed[i])):
                order[j + 1] = order[j]
                j -= 1
            order[j + 1] = i
            m += 1
    fetched = np.empty(nm, dtype=np.int64)
    nf = 0
    for q in range(nm):
        i = order[q]
        nt = tokens[i]
        nl = link + fetch_us
        nd = max(dev, nl) + dcost[nt] + (0.0 if paid else dcall)
        lane = needed[i] % H
        work[lane] -= hcost[nt]
        count[lane] -= 1
        t = max(nd, _host_end(work, count, read, call_h, node)) + sync
        if t < best:
            link, dev, best, paid = nl, nd, t, True
            where[i] = FETCHED
            fetched[nf] = i
            nf += 1
        else:
            work[lane] += hcost[nt]
            count[lane] += 1
    if nh == 0:
        return
    # steal: the hits lightest first, ties lower id
    light = np.empty(nh, dtype=np.int64)
    m = 0
    for i in range(n):
        if hit[i]:
            j = m - 1
            while j >= 0 and (tokens[light[j]] > tokens[i] or (tokens[light[j]] == tokens[i]
                                                               and needed[light[j]] > needed[i])):
                light[j + 1] = light[j]
                j -= 1
            light[j + 1] = i
            m += 1
    for q in range(nh):
        i = light[q]
        if _host_end(work, count, read, call_h, node) >= dev:
            break
        nt = tokens[i]
        lane = needed[i] % H
        work[lane] += hcost[nt]
        count[lane] += 1
        read[lane] += ebytes
        where[i] = STOLEN  # tentatively: the device's finish without it (CostModel.device_finish_us)
        kept = 0
        sm = 0.0
        for z in range(n):
            if hit[z] and where[z] != STOLEN:
                kept += 1
                sm += dcost[tokens[z]]
        nd = 0.0
        p2 = False
        if kept > 0 or has_shared:
            nd = dcall + s.shared[tok] + sm
            p2 = True
        lk = 0.0
        for f in range(nf):
            lk += fetch_us
            nd = max(nd, lk) + dcost[tokens[fetched[f]]] + (0.0 if p2 else dcall)
            p2 = True
        t = max(nd, _host_end(work, count, read, call_h, node)) + (sync if nd != 0.0 else 0.0)
        if t < best:
            dev, best = nd, t
        else:
            where[i] = DEVICE
            work[lane] -= hcost[nt]
            count[lane] -= 1
            read[lane] -= ebytes
            break


@njit(cache=True, nogil=True)
def _span(s, place, h, m, n, tokens):
    """The reference's ``_impactful.span``: the layer's time (the later lane, by
    :meth:`moelab.timing.costs.CostModel.lanes_us`) with hits ``h`` and misses ``m`` (expert
    ids, ``n`` tokens each), placed by ``place``."""
    cp = s.costs
    dcall, call_h, fetch_us, sync, ebytes, node = cp[0], cp[1], cp[2], cp[3], cp[4], cp[5]
    has_shared = cp[6] != 0.0
    H = int(cp[7])
    shares = cp[9] != 0.0
    nh, nm = h.shape[0], m.shape[0]
    N = nh + nm
    needed = np.empty(N, dtype=np.int64)
    tok = np.full(N, n, dtype=np.int64)
    hit = np.zeros(N, dtype=np.uint8)
    where = np.zeros(N, dtype=np.int64)
    for i in range(nh):
        needed[i] = h[i]
        hit[i] = 1
    for i in range(nm):
        needed[nh + i] = m[i]
        where[nh + i] = FETCHED if place == 1 else HOSTED
    if place == 2 and N > 0:
        _greedy(N, needed, tok, hit, where, s)
    # device finish: its call, shared experts, the kept hits, then each fetched miss (m order)
    dev = 0.0
    paid = False
    kept = 0
    sm = 0.0
    for i in range(nh):
        if where[i] != STOLEN:
            kept += 1
            sm += s.dcost[n]
    if kept > 0 or has_shared:
        dev = dcall + s.shared[tokens] + sm
        paid = True
    link = 0.0
    nf = 0
    for i in range(nh, N):
        if where[i] == FETCHED:
            link += fetch_us
            dev = max(dev, link) + s.dcost[n] + (0.0 if paid else dcall)
            paid = True
            nf += 1
    lanes = np.zeros(H)
    nhost = 0
    for i in range(N):  # the stolen hits (h order), then the host misses (m order)
        if where[i] == STOLEN or where[i] == HOSTED:
            lane = needed[i] % H
            lanes[lane] += (call_h if lanes[lane] == 0.0 else 0.0) + s.hcost[n]
            nhost += 1
    if nf > 0 and nhost > 0 and not shares:
        read = np.zeros(H)
        for i in range(N):
            if where[i] == STOLEN or where[i] == HOSTED:
                read[needed[i] % H] += ebytes
        for i in range(N):
            if where[i] == FETCHED:
                read[needed[i] % H] += ebytes
        for j in range(H):
            if lanes[j] != 0.0:
                lanes[j] = max(lanes[j], read[j] / node)
    host_end = lanes[0]
    for j in range(1, H):
        host_end = max(host_end, lanes[j])
    if dev != 0.0:
        return max(dev + sync, host_end + sync)
    return max(dev, host_end)


@njit(cache=True, nogil=True)
def _impactful(cache, s, place, target, T, n_demand, pf):
    """The reference's ``Planner._impactful``: of the proposal's experts not cached, the ones
    whose residence shortens MoE layer ``target``'s planned schedule most, one at a time, while
    one does and its copy lands within the lead time."""
    cp = s.costs
    fetch_us, lead = cp[2], cp[8]
    off = cache.key_offset[target]
    E = cache.key_offset[target + 1] - off
    k = s.top_k[target]
    n = 1 if T <= 1 else max(1, -(-T * k // E))
    prop = np.empty(pf.shape[0], dtype=np.int64)
    np_ = 0
    for q in range(pf.shape[0]):
        dup = False
        for z in range(np_):
            if prop[z] == pf[q]:
                dup = True
                break
        if not dup:
            prop[np_] = pf[q]
            np_ += 1
    h = np.empty(np_, dtype=np.int64)
    left = np.empty(np_, dtype=np.int64)
    nh = 0
    nl = 0
    for q in range(np_):
        if cache.resident[off + prop[q]]:
            h[nh] = prop[q]
            nh += 1
        else:
            left[nl] = prop[q]
            nl += 1
    chosen = np.empty(nl, dtype=np.int64)
    nc = 0
    if nl == 0:
        return chosen[:0]
    link = fetch_us * n_demand
    tokens = max(n, T)
    best = _span(s, place, h[:nh], left[:nl], n, tokens)
    rest = np.empty(nl, dtype=np.int64)
    while nl > 0 and link + fetch_us <= lead:
        pick = -1
        best_t = best
        for q in range(nl):
            e = left[q]
            h[nh] = e
            r = 0
            for z in range(nl):
                if left[z] != e:
                    rest[r] = left[z]
                    r += 1
            t = _span(s, place, h[: nh + 1], rest[:r], n, tokens)
            if t < best_t - 1e-9:
                pick, best_t = q, t
        if pick < 0:
            break
        best = best_t
        e = left[pick]
        chosen[nc] = e
        nc += 1
        h[nh] = e
        nh += 1
        for z in range(pick, nl - 1):
            left[z] = left[z + 1]
        nl -= 1
        link += fetch_us
    return chosen[:nc].copy()


@njit(cache=True, nogil=True)
def plan(cache, s, out, layer, ids, w, st, mode, scores, place, admit_all, pf, pf_target, budget, impact):
    """One MoE layer's plan (see the module docstring); results in ``out``, its counts in
    ``out.cnt`` (``cnt[ERROR]`` nonzero: nothing was changed, the wrapper raises).

    Size: the per-layer hot path, compiled: one layer's routing and settings as plain arguments
    (a parameter object per call costs a boxing at the boundary), the steps in the planner's
    order in one body."""
    cnt = out.cnt
    for i in range(cnt.shape[0]):
        cnt[i] = 0
    off = cache.key_offset[layer]
    E = cache.key_offset[layer + 1] - off
    T, K = ids.shape
    for t in range(T):  # checked before anything changes
        for j in range(K):
            if ids[t, j] >= E:
                cnt[ERROR] = BAD_EXPERT
                return
    for q in range(pf.shape[0]):
        if pf_target >= 0 and not 0 <= pf[q] < cache.key_offset[pf_target + 1] - cache.key_offset[pf_target]:
            cnt[ERROR] = BAD_PROPOSAL
            return
    p = s.mrs_p[layer]
    if p > 0:  # the top-p tables in preallocated scratch (p <= E: every entry read is written first)
        R = scores.shape[0]
        top_v, top_e = out.top_v[:R, :p], out.top_e[:R, :p]
        out.group[0] = layer
        out.row_ptr[1] = R
        if _fast.top_p_rows(out.group, out.row_ptr, out.rows[:R], scores, s.mrs_p, cache.key_offset, top_v,
                            top_e) >= 0:
            cnt[ERROR] = BAD_SCORES
            return
    if mode == DEFER and s.defer_d[layer] > 0:
        _defer(ids, w, st, s.defer_d[layer], s.defer_min, s.defer_union, out.seen)
    n = _union(ids, w, st, mode, out)
    cnt[N_NEEDED] = n
    if mode != NO_STATE and w.shape[0] == T and w.shape[1] == K and out.split_ids.shape[2] >= T * K:
        cw = _split_weights(out, w)
        cnt[M_NOW] = _compact(ids, w, st, 0, out.split_ids[layer, 0], cw[layer, 0])
        cnt[M_LATE] = _compact(ids, w, st, 1, out.split_ids[layer, 1], cw[layer, 1])
    else:
        cnt[M_NOW] = cnt[M_LATE] = -2  # not compacted
    needed, hit, where, spec = out.needed, out.hit, out.where, out.spec
    keys = out.keys[:n]  # preallocated scratch: no allocation on the per-layer path
    nhit = 0
    for i in range(n):
        k = off + needed[i]
        keys[i] = k
        hit[i] = cache.resident[k]
        spec[i] = cache.spec[k]
        out.inserted_host[i] = 0
        nhit += hit[i]
        where[i] = DEVICE if hit[i] else (FETCHED if place == 1 else HOSTED)
    if place == 2 and n > 0:
        _greedy(n, needed, out.tokens, hit, where, s)
    if p > 0:
        _fast.mrs_scores(cache, layer, p, top_v, top_e)
    admit = out.admit[:n]
    for i in range(n):
        admit[i] = 1 if admit_all or where[i] == FETCHED else 0
    flags = out.flags[:n]  # the same as ``hit``: nothing changed since
    _fast.access_admit(cache, keys, keys[:0], flags, admit)
    s.layer_hm[layer, 0] += nhit
    s.layer_hm[layer, 1] += n - nhit
    # evictions: evicted and not inserted by this access, sorted
    nj = cache.clock[_fast.LOGGED]
    ne = 0
    for q in range(nj):
        j = cache.journal[q]
        if j < 0:
            k = -1 - j
            again = False
            for z in range(nj):
                if cache.journal[z] == k:
                    again = True
                    break
            if not again:
                out.evicted[ne] = k
                ne += 1
    out.evicted[:ne].sort()
    cnt[N_EVICTED] = ne
    if admit_all:
        for i in range(n):
            if where[i] == HOSTED and cache.resident[keys[i]]:
                out.inserted_host[i] = 1
    if pf_target >= 0:
        po = cache.key_offset[pf_target]
        if impact:
            nd = 0
            for i in range(n):
                nd += where[i] == FETCHED
            chosen = _impactful(cache, s, place, pf_target, T, nd, pf)
            m = chosen.shape[0]
            pk = out.pk[:m] if m <= out.pk.shape[0] else np.empty(m, dtype=np.int64)
            for q in range(m):
                pk[q] = po + chosen[q]
        else:
            m = pf.shape[0]  # a proposal may repeat experts: longer than the scratch, it gets its own
            pk = out.pk[:m] if m <= out.pk.shape[0] else np.empty(m, dtype=np.int64)
            for q in range(m):
                pk[q] = po + pf[q]
        moved = _fast.prefetch(cache, pk, budget)
        cnt[MOVED] = moved
        if moved:
            nj = cache.clock[_fast.LOGGED]
            ni = 0
            no = 0
            for q in range(nj):
                j = cache.journal[q]
                if j >= 0:
                    out.pf_in[ni] = j
                    ni += 1
                else:
                    out.pf_out[no] = -1 - j
                    no += 1
            out.pf_out[:no].sort()
            cnt[N_PF_IN] = ni
            cnt[N_PF_OUT] = no


def unsupported(planner: Any) -> str | None:
    """Why ``planner``'s configuration cannot run compiled (None: it can)."""
    if not HAVE_NUMBA:
        return "numba is not installed"
    cache = planner.cache
    if cache is None:
        return "no device cache (capacity 0)"
    cls = type(cache)
    if cls.__dict__.get("kernel") is None:
        return f"cache policy {cls.__name__} has no compiled kernel"
    if not getattr(cache, "fast", True):
        return "the cache's fast path is off (ExpertCache.fast = False or a policy variant)"
    if cls.needs_future:
        return f"cache policy {cache.name!r} reads the future (offline only)"
    if planner.placement.name not in PLACE_CODES or type(planner.placement).__name__ not in (
            "HostMisses", "FetchMisses", "GreedyHSS"):
        return f"placement {planner.placement.name!r} plans in Python"
    return None


def _ints2(x: Any) -> np.ndarray:
    """Per-token integer rows (ids or slot states) as a 2-D int64 array."""
    a = np.asarray(x, dtype=np.int64)
    if a.ndim != 2:
        a = a.reshape(len(a), -1) if a.size else np.zeros((0, 1), dtype=np.int64)
    return a


@njit(cache=True, nogil=True)
def pack(out):
    """One plan's outputs as one int64 record in ``out.rec`` (a :class:`LazyPlan` keeps it as a
    list of ints); returns its length: the 8 counts (``cnt``), then needed, tokens, hit,
    where, spec, inserted_host (n each), the deferred pairs (2 per pair), the access's evictions,
    the prefetch's insertions and evictions (an error: the counts only)."""
    cnt = out.cnt
    n, nd, ne, ni, no = cnt[N_NEEDED], cnt[N_DEFERRED], cnt[N_EVICTED], cnt[N_PF_IN], cnt[N_PF_OUT]
    rec = out.rec
    rec[:8] = cnt[:8]
    if cnt[ERROR]:
        return 8
    o = 8
    for i in range(n):
        rec[o + i] = out.needed[i]
        rec[o + n + i] = out.tokens[i]
        rec[o + 2 * n + i] = out.hit[i]
        rec[o + 3 * n + i] = out.where[i]
        rec[o + 4 * n + i] = out.spec[i]
        rec[o + 5 * n + i] = out.inserted_host[i]
    o += 6 * n
    for i in range(nd):
        rec[o + 2 * i] = out.deferred[i, 0]
        rec[o + 2 * i + 1] = out.deferred[i, 1]
    o += 2 * nd
    rec[o : o + ne] = out.evicted[:ne]
    o += ne
    rec[o : o + ni] = out.pf_in[:ni]
    o += ni
    rec[o : o + no] = out.pf_out[:no]
    return o + no


def _out(E: int, NK: int, N: int, slots: int, L: int = 1) -> Out:
    """Zeroed outputs and scratch for ``L`` MoE layers of up to ``E`` experts, ``NK`` cache keys,
    ``N - 1`` tokens and ``slots`` (token, expert) slots."""
    z = np.zeros
    return Out(z(E, np.int64), z(E, np.int64), z(E, np.uint8), z(E, np.int64), z(E, np.uint8), z(E, np.uint8),
               z((slots, 2), np.int64), z(NK, np.int64), z(NK, np.int64), z(NK, np.int64), z(10, np.int64),
               z(E + 1, np.float64), z(E + 1, np.int64), z(E, np.int64), z(E, np.uint8), z(E, np.uint8),
               z((N, E), np.float32), z((N, E), np.int32), np.arange(N, dtype=np.int64), z(1, np.int32),
               z(2, np.int64), z(NK, np.int64), z(8 + 6 * E + 2 * slots + 3 * NK, np.int64),
               z((L, 2, slots), np.int64), z((L, 2, slots), np.float32), z((L, 2, slots), np.uint16))


def handle(*parts: tuple) -> np.ndarray:
    """The int64 handle of the named tuples ``parts`` (the cache, the static tables, the outputs),
    what :func:`run` reads them from: per field in order, an array's data address then its
    shape, an integer's or a flag's value, a float's bits. The arrays must be C-contiguous and
    outlive every call given the handle (the :class:`CompiledPlanner` holds them)."""
    words: list[int] = []
    for nt, want in zip(parts, _view_types(), strict=True):
        for name, v, t in zip(nt._fields, nt, want.types, strict=True):
            if _typeof(v) != t:  # the kernel reads the words as the types it was compiled for
                raise MoelabError(f"compiled planner state {type(nt).__name__}.{name}: {_typeof(v)}, expected {t}"
                                  + (" (C-contiguous)" if isinstance(v, np.ndarray) else "") + ".")
            if isinstance(v, np.ndarray):
                words += [v.ctypes.data, *v.shape]
            elif isinstance(v, float):
                words.append(int(np.float64(v).view(np.int64)))
            else:
                words.append(int(v))
    return np.array(words, dtype=np.int64)


if HAVE_NUMBA:

    @functools.cache
    def _view_types() -> tuple:
        """The numba types of the cache, static tables and outputs :func:`run` works on (those of a
        tiny planner's: the field types do not depend on the sizes); worked out on first use, not at
        import (building the tiny cache calls a compiled function)."""
        z = np.zeros(1, np.int64)
        cache = _fast.new_cache(_fast.make_policy(_fast.LRU, 1), z, np.ones(1, np.int64), np.array([0, 1]))
        static = Static(np.zeros(1, np.int64), np.zeros(10), z, np.zeros(2), np.zeros(2), np.zeros(2),
                        np.zeros((1, 2), np.int64), 0, False, False, z, 0, False)
        return _typeof(cache), _typeof(static), _typeof(_out(1, 1, 1, 2))


    @_intrinsic
    def _views(typingctx, h):
        """``(cache, static tables, outputs)`` read from the handle ``h`` (:func:`handle`): each
        array a view of the memory its address names (no reference counting: the planner keeps the
        arrays), each scalar its word. What replaces passing the three named tuples — unboxed field
        by field (≈ 6 µs a call) — or a struct of them, whose Python-level type lookup and unboxing
        cost 2 µs a call in a loop and 15-20 µs between a forward's layers."""
        if not (isinstance(h, _types.Array) and h.dtype == _types.int64 and h.ndim == 1):
            return None
        views = _view_types()
        ret = _types.Tuple(views)

        def codegen(context, builder, sig, args):
            base = context.make_array(sig.args[0])(context, builder, value=args[0]).data
            i64 = _ir.IntType(64)
            pos = [0]

            def word():
                v = builder.load(builder.gep(base, [_ir.Constant(i64, pos[0])]))
                pos[0] += 1
                return v

            tuples = []
            for nt in views:
                values = []
                for t in nt.types:
                    if isinstance(t, _types.Array):
                        addr = word()
                        shape = [word() for _ in range(t.ndim)]
                        ary = context.make_array(t)(context, builder)
                        size = context.get_abi_sizeof(context.get_data_type(t.dtype))
                        strides, step = [], _ir.Constant(i64, size)
                        for d in reversed(shape):  # C order
                            strides.insert(0, step)
                            step = builder.mul(step, d)
                        _populate_array(ary, data=builder.inttoptr(addr, ary.data.type), shape=shape,
                                        strides=strides, itemsize=_ir.Constant(i64, size), meminfo=None)
                        values.append(ary._getvalue())
                    elif t == _types.boolean:
                        values.append(builder.icmp_unsigned("!=", word(), _ir.Constant(i64, 0)))
                    elif isinstance(t, _types.Float):
                        values.append(builder.bitcast(word(), context.get_value_type(t)))
                    elif isinstance(t, _types.Integer):
                        values.append(context.cast(builder, word(), _types.int64, t))
                    else:  # pragma: no cover - the named tuples hold arrays and scalars only
                        raise TypeError(f"compiled planner state: no handle word for {t}")
                tuples.append(context.make_tuple(builder, nt, values))
            return context.make_tuple(builder, ret, tuples)

        return ret(h), codegen

    @njit(cache=True, nogil=True)
    def run(h, layer, ids, w, st, mode, scores, pf, pf_target, budget):
        """:func:`plan` on the planner's state read from its handle ``h`` (:func:`handle`; its
        settings there too: each argument costs microseconds at the boundary between a forward's
        layers), then :func:`pack`; returns the record's length in ``out.rec``, the error code, the
        skipped slots and the prefetched experts (what the caller reads at once, as ints).

        Size: :func:`plan`'s per-call arguments."""
        cache, s, out = _views(h)
        plan(cache, s, out, layer, ids, w, st, mode, scores, s.place, s.admit_all, pf, pf_target,
             budget, s.impact)
        cnt = out.cnt
        return pack(out), cnt[ERROR], cnt[SKIPPED], cnt[MOVED], cnt[M_NOW], cnt[M_LATE]


# ---------------------------------------------------------------------- the Python side
def _cost_tables(cost: Any, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``device_us``, ``host_us``, ``shared_us`` per token count 0..n-1 (the cost model's own values)."""
    if cost is None:
        z = np.zeros(n)
        return z, z.copy(), z.copy()
    idx = range(n)
    return (np.array([cost.device_us(max(i, 1)) for i in idx], dtype=np.float64),
            np.array([cost.host_us(max(i, 1)) for i in idx], dtype=np.float64),
            np.array([cost.shared_us(max(i, 1)) for i in idx], dtype=np.float64))


def _fast_cache(cache: Any) -> _fast.Cache:
    """The compiled cache holding what the reference ``cache`` holds now (a fresh one: its warm set)."""
    cls = type(cache)
    NK = int(cache.key_offset_[-1])
    key_layer = np.repeat(np.arange(len(cache.num_experts), dtype=np.int64), cache.num_experts)
    key_part = key_layer if cache.scope == "layer" else np.zeros(NK, dtype=np.int64)
    pinned = sorted(getattr(cache, "pinned_", ()) or ())
    policy = _fast.make_policy(cls.__dict__["kernel"], NK, _fast.INSERTION_CODES[cache.insertion],
                               lfu_reset=bool(getattr(cache, "reset_on_evict", False)),
                               alpha=float(getattr(cache, "alpha", 0.5)), pinned=pinned)
    return _fast.new_cache(policy, key_part, np.asarray(cache.slots_, dtype=np.int64),
                           np.asarray(cache.key_offset_, dtype=np.int64), cache.warm or ())


class CompiledCache:
    """The read API of :class:`moelab.caches.base.ExpertCache` over a compiled cache's state
    (what ``run.cache`` is when the planner runs compiled): counters, contents, residency,
    the eviction order. Changed only by the compiled planner."""

    def __init__(self, reference: Any, state: _fast.Cache, layer_hm: np.ndarray) -> None:
        self.reference = reference
        """The reference cache the state was built from (its settings; its own state stays as built)."""
        self.state = state
        self._hm = layer_hm
        for name in ("name", "num_experts", "capacity", "scope", "expert_bytes", "warm", "insertion", "slots_",
                     "key_offset_", "needs_scores", "needs_future", "bypasses", "fast"):
            setattr(self, name, getattr(reference, name))
        self._key_layer = [ly for ly, e in enumerate(self.num_experts) for _ in range(e)]

    hits = property(lambda self: int(self._hm[:, 0].sum()))
    misses = property(lambda self: int(self._hm[:, 1].sum()))
    layer_hits = property(lambda self: self._hm[:, 0].tolist())
    layer_misses = property(lambda self: self._hm[:, 1].tolist())
    evictions = property(lambda self: int(self.state.counters[_fast.EVICTIONS]))
    transfers = property(lambda self: int(self.state.counters[_fast.TRANSFERS]))
    prefetched = property(lambda self: int(self.state.counters[_fast.PREFETCHED]))
    prefetch_hits = property(lambda self: int(self.state.counters[_fast.PREFETCH_HITS]))
    accesses = property(lambda self: self.hits + self.misses)
    hit_rate = property(lambda self: self.hits / self.accesses if self.accesses else float("nan"))
    bytes_moved = property(lambda self: self.transfers * self.expert_bytes)

    @property
    def wasted_prefetches(self) -> int:
        return int(self.state.counters[_fast.WASTED_EVICTED]) + len(self.speculative)

    @property
    def speculative(self) -> set[int]:
        return set(np.flatnonzero(self.state.spec).tolist())

    def is_resident(self, key: int) -> bool:
        return bool(self.state.resident[key])

    def resident_keys(self) -> np.ndarray:
        return self.state.resident.astype(bool)

    def key(self, layer: int, expert: int) -> int:
        return self.reference.key(layer, expert)

    def layer_expert(self, key: int) -> tuple[int, int]:
        layer = self._key_layer[key]
        return layer, int(key - self.key_offset_[layer])

    def contents(self, layer: int | None = None):
        if layer is None:
            return {ly: self.contents(ly) for ly in range(len(self.num_experts))}
        self.reference._check_layer(layer)
        lo, hi = self.key_offset_[layer], self.key_offset_[layer + 1]
        return (np.flatnonzero(self.state.resident[lo:hi])).tolist()

    def partition_keys(self, layer: int) -> set[int]:
        res = self.state.resident
        if self.scope == "layer":
            lo, hi = self.key_offset_[layer], self.key_offset_[layer + 1]
            return set((np.flatnonzero(res[lo:hi]) + lo).tolist())
        return set(np.flatnonzero(res).tolist())

    def eviction_order(self) -> list[int]:
        """The cached keys, the next victim first: the compiled rank ``(speculative?, p1, p2, key)``."""
        c = self.state
        keys = np.flatnonzero(c.resident)
        return sorted(keys.tolist(), key=lambda k: (int(c.srank[k]), float(c.p1[k]), float(c.p2[k]), k))

    def __repr__(self) -> str:
        return f"CompiledCache({self.name}, {self.capacity}, {self.scope}; {self.hits} hits, {self.misses} misses)"


#: :attr:`CompiledPlanner._native` before :meth:`CompiledPlanner.entry` resolved it.
_UNRESOLVED = object()

LazyPlan: Any = None
"""The lazy plan class (built on first use: :mod:`moelab.hybrid.planner` imports this module)."""
_LAZY = frozenset({"device", "host", "deferred", "accessed", "hits", "misses", "transfers", "evictions",
                   "prefetch_hits"})


def _lazy_plan_class():
    from dataclasses import fields

    from moelab.hybrid.planner import LayerPlan

    names = [f.name for f in fields(LayerPlan)]

    class LazyPlan(LayerPlan):
        """A :class:`~moelab.hybrid.planner.LayerPlan` of the compiled path whose lists are built
        from its packed record the first time one is read (a running model's functional executor
        reads none). Equal to the reference's plan field by field; copies and pickles as a plain
        ``LayerPlan``."""

        def __init__(self, forward, step, phase, layer, tokens, skipped, rec, target, dec) -> None:
            """Size: the plan's scalar fields, its record, and what decodes it (one per layer plan)."""
            d = self.__dict__
            d["forward"], d["step"], d["phase"], d["layer"], d["tokens"], d["skipped"] = (
                forward, step, phase, layer, tokens, skipped)
            d["_rec"], d["_target"], d["_dec"] = rec, target, dec

        def __getattr__(self, name):
            d = self.__dict__
            if name in _LAZY and "_rec" in d:
                d["_dec"].fill(self)
                return d[name]
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

        def __eq__(self, other):
            if not isinstance(other, LayerPlan):
                return NotImplemented
            return all(getattr(self, k) == getattr(other, k) for k in names)

        __hash__ = None

        def plain(self) -> LayerPlan:
            """This plan as a plain :class:`~moelab.hybrid.planner.LayerPlan`."""
            return LayerPlan(*(getattr(self, k) for k in names))

        def __reduce__(self):
            return (LayerPlan, tuple(getattr(self, k) for k in names))

    LazyPlan.__qualname__ = LazyPlan.__name__ = "LayerPlan"
    return LazyPlan


class CompiledPlanner:
    """The compiled per-layer path of one :class:`moelab.hybrid.planner.Planner` (see the module docstring)."""

    def __init__(self, planner: Any) -> None:
        from moelab.hybrid.planner import LayerPlan, Transfer

        self._LayerPlan, self._Transfer = LayerPlan, Transfer
        global LazyPlan
        if LazyPlan is None:
            LazyPlan = _lazy_plan_class()
        self.planner = planner
        ref = planner.cache
        self.state = _fast_cache(ref)
        L = planner.num_layers
        mrs_p = np.zeros(L, dtype=np.int64)
        if type(ref).__dict__["kernel"] == _fast.MRS:
            mrs_p[:] = [int(p) for p in ref.p_]
        cost = planner.cost
        self._cost = cost
        costs = np.zeros(10)
        costs[7] = 1.0
        if cost is not None:
            shares = bool(cost.profile.device_shares_host_memory)
            node = cost.node_cap if not shares else float("inf")
            costs[:] = [cost.device_call_us, cost.host_call_us, cost.fetch_us(), cost.profile.sync_us,
                        cost.expert_bytes, node, 1.0 if cost.shared_bytes > 0 else 0.0, cost.host_lanes,
                        planner.lead_us, 1.0 if shares else 0.0]
        self.impact = bool(planner.impact)
        self._costs, self._mrs_p = costs, mrs_p
        self.layer_hm = np.zeros((L, 2), dtype=np.int64)
        self.view = CompiledCache(ref, self.state, self.layer_hm)
        self.place = PLACE_CODES[planner.placement.name]
        self.admit_all = bool(planner.admit_all)
        self.is_mrs = bool(mrs_p.any())
        self._emax = max(planner.num_experts)
        self._nk = int(ref.key_offset_[-1])
        self._key_pair = [self.view.layer_expert(k) for k in range(self._nk)]
        self._offsets = [int(o) for o in ref.key_offset_]
        self._f1 = np.zeros((1, 1), dtype=np.float32)
        self._i1 = np.zeros((1, 1), dtype=np.int64)
        self._pf0 = np.zeros(0, dtype=np.int64)
        self._defer = (np.zeros(L, dtype=np.int64), 0, False)  # (D per layer, min_immediate, union)
        self._splits: dict[tuple, tuple] = {}  # torch views of the compacted routing buffers
        self.widths = (-2, -2)
        """The last plan's compacted immediate and deferred widths (:func:`_compact`; -2: none made)."""
        self._ntab = 0
        self._slots = 0
        self._grow(64, 64)
        self._native: Any = _UNRESOLVED
        """The native per-layer entry (:mod:`moelab.hybrid._entry`; :meth:`entry`), or None."""

    def entry(self) -> Any | None:
        """The native per-layer entry :meth:`plan_tensors` calls, or None (it then returns None):
        resolved on first use, so a planner that never plans a running model's tensors (offline
        planning, a replay) loads no extension."""
        if self._native is _UNRESOLVED:
            from moelab.hybrid._entry import native_entry

            self._native = native_entry()
        return self._native

    def defer_with(self, deferred: list[int], min_immediate: int, union: bool) -> None:
        """:meth:`moelab.hybrid.planner.Planner.defer_with`: the deferral settings into the handle."""
        self._defer = (np.asarray(deferred, dtype=np.int64), int(min_immediate), bool(union))
        self.static = self.static._replace(defer_d=self._defer[0], defer_min=self._defer[1],
                                           defer_union=self._defer[2])
        self._set_handle()

    def _set_handle(self) -> None:
        self._h = handle(self.state, self.static, self.out)
        self._h_addr = int(self._h.ctypes.data)  # what the native entry is given

    def _grow(self, tokens: int, slots: int) -> None:
        """(Re)build the static tables for ``tokens`` real tokens and the outputs for ``slots`` slots."""
        more_tokens = tokens >= self._ntab
        if more_tokens:
            self._ntab = max(2 * self._ntab, tokens + 1)
            d, h, sh = _cost_tables(self._cost, self._ntab)
            self.static = Static(self._mrs_p, self._costs, np.asarray(self.planner.top_k, dtype=np.int64), d, h, sh,
                                 self.layer_hm, self.place, self.admit_all, self.impact, *self._defer)
        if slots > self._slots or more_tokens:
            self._slots = max(2 * self._slots, slots)
            self.out = _out(self._emax, self._nk, self._ntab, self._slots, self.planner.num_layers)
            self._splits.clear()  # views of the previous buffers
        self._set_handle()

    def plan_layer(self, forward: int, step: int, phase: str, layer: int, ids: Any, weights: Any,
                   state: Any = None, scores: Any = None, prefetch: Any = None, defer: bool = False):
        """:meth:`moelab.hybrid.planner.Planner.plan_layer`, compiled: the same arguments, as lists or
        arrays (integer ids and states of any width, as the model's tensors hold them, and float32
        or bfloat16-bits (uint16) weights: the kernel is compiled per dtype, so nothing is converted
        on the hot path). With ``defer``, ``state`` must be such an array: the deferral edits it.

        Size: the reference's signature (positional on the per-layer hot path)."""
        p = self.planner
        if type(ids) is not np.ndarray or ids.ndim != 2 or ids.dtype.kind not in "iu":
            ids = _ints2(ids)
        T, K = ids.shape
        w = self._f1
        if T > 1 or defer:
            w = weights if type(weights) is np.ndarray and weights.dtype in _WEIGHT_DTYPES else \
                np.asarray(weights, dtype=np.float32)
            w = w.reshape(T, K)
        mode = NO_STATE if state is None else DEFER if defer else READ_STATE
        if mode == NO_STATE:
            st = self._i1
        elif type(state) is np.ndarray and state.ndim == 2 and state.dtype.kind in "iu":
            st = state
        elif defer:
            raise MoelabError("plan_layer(defer=True) edits the slot states in place: pass them as a 2-D integer "
                              f"array (got {type(state).__name__}).")
        else:
            st = _ints2(state).reshape(T, K)
        sc = self._f1
        if self.is_mrs:
            if scores is None:
                raise MoelabError(f"policy {self.view.name!r} needs the router scores of each step.")
            sc = scores
            if type(sc) is not np.ndarray or sc.dtype != np.float32 or sc.ndim != 2:
                sc = np.asarray(sc, dtype=np.float32)
                sc = sc.reshape(-1, sc.shape[-1])
        R = max(T, sc.shape[0])  # the MRS scratch holds a row per scores row
        if self._ntab <= R or self._slots < T * K:
            self._grow(R, T * K)
        target = layer + p.distance
        pf, pf_target, budget = self._pf0, -1, -1
        if prefetch is not None and target < p.num_layers:
            pf, pf_target = prefetch, target
            if type(pf) is not np.ndarray or pf.ndim != 1 or pf.dtype.kind not in "iu":
                pf = np.asarray(prefetch, dtype=np.int64).reshape(-1)
            budget = self._budget(forward)
        if not 0 <= layer < p.num_layers:
            self.view.reference._check_layer(layer)
        n, err, skipped, moved, m_now, m_late = run(self._h, layer, ids, w, st, mode, sc, pf, pf_target, budget)
        # (compacted from the weights given; a call that gave none, or failed, left no split)
        self.widths = (m_now, m_late) if w is not self._f1 and not err else (-2, -2)
        rec = self.out.rec[:n].tolist()
        if err:
            self._raise(err, layer, ids, pf, pf_target)
        if pf_target >= 0 and p.budget_per_forward and p.budget is not None:
            p._budget_left -= moved
        return LazyPlan(forward, step, phase, layer, T, skipped, rec, pf_target, self)

    def _budget(self, forward: int) -> int:
        """The prefetch budget this call may spend (-1: unbounded); a per-forward budget starts
        afresh on a new forward (the caller takes what the kernel moved off it)."""
        p = self.planner
        b = p.budget
        if p.budget_per_forward and b is not None:
            if p._budget_forward != forward:
                p._budget_forward, p._budget_left = forward, b
            b = p._budget_left
        return -1 if b is None else int(b)

    def plan_tensors(self, forward: int, step: int, phase: str, layer: int, ids: Any, weights: Any,
                     state: Any = None, scores: Any = None, prefetch: Any = None, defer: bool = False):
        """:meth:`plan_layer` for the hybrid runtime's CPU tensors, through the native entry
        (:mod:`moelab.hybrid._entry`) where it takes them as they are: ``ids`` (T, K) int64,
        ``weights`` float32 or bfloat16 (or None where :meth:`plan_layer` needs none), ``state``
        int8, ``scores`` float32 (tensors or numpy arrays), ``prefetch`` an int64 array; all
        C-contiguous. None for anything else, for plans larger than the buffers, and where the entry
        is unavailable, with nothing changed but a per-forward prefetch budget's start on a new
        forward, which :meth:`plan_layer` makes alike: the caller then plans through
        :meth:`plan_layer` (which converts, grows and raises).

        Size: the reference's signature (positional on the per-layer hot path)."""
        native = self._native
        if native is _UNRESOLVED:
            native = self.entry()
        p = self.planner
        if native is None or (self.is_mrs and scores is None):
            return None
        target = layer + p.distance
        pf_target = budget = -1
        if prefetch is not None and target < p.num_layers:
            pf_target, budget = target, self._budget(forward)
        else:
            prefetch = None
        r = native(self._h_addr, self._h.shape[0], self._ntab, self._slots, p.num_layers, layer,
                   NO_STATE if state is None else DEFER if defer else READ_STATE, pf_target, budget, ids, weights,
                   state, scores if self.is_mrs else None, prefetch)
        if r is None:  # not as the entry takes them: the caller's dispatcher path
            return None
        rec, err, skipped, moved, m_now, m_late, T = r
        # (the entry read the weights given for several tokens or a deferral, as plan_layer does)
        self.widths = (m_now, m_late) if (T > 1 or defer) and not err else (-2, -2)
        if err:
            self._raise(err, layer, ids, prefetch, pf_target)
        if pf_target >= 0 and p.budget_per_forward and p.budget is not None:
            p._budget_left -= moved
        return LazyPlan(forward, step, phase, layer, T, skipped, rec, pf_target, self)

    def split(self, layer: int, experts: Any, weights: Any, bf16: bool) -> tuple | None:
        """The seam's ``(immediate, deferred)`` routing of the last plan (MoE layer ``layer``, whose
        ``experts`` (T, K) int64 and ``weights`` (float32, or bfloat16: ``bf16``) the plan read) from the
        kernel's compacted buffers, as torch views kept per shape: what
        :func:`moelab.forward.points._split_plan` computes (``tests/test_planner_compiled.py``).
        The deferred part is None when no slot is deferred. None when the kernel made none or every
        slot is immediate."""
        m_now, m_late = self.widths
        if m_now < 0:  # none made, or every slot immediate: the seam runs the call's own routing
            return None
        T = experts.shape[0]
        key = (layer, T, m_now, m_late, bf16)
        got = self._splits.get(key)
        if got is None:
            if len(self._splits) >= 1024:
                self._splits.clear()
            got = self._splits[key] = (self._split_part(layer, 0, T, m_now, bf16),
                                       self._split_part(layer, 1, T, m_late, bf16))
        now, late = got
        return (now or (experts, weights)), ((late or (experts, weights)) if m_late else None)

    def _split_part(self, layer: int, which: int, T: int, m: int, bf16: bool) -> tuple | None:
        import torch

        if m < 0:
            return None
        n = T * max(m, 1)
        ids = torch.from_numpy(self.out.split_ids[layer, which, :n]).view(T, -1)
        w = torch.from_numpy((self.out.split_w16 if bf16 else self.out.split_w32)[layer, which, :n]).view(T, -1)
        return ids, (w.view(torch.bfloat16) if bf16 else w)

    def fill(self, lp: LazyPlan) -> None:
        """Decode ``lp``'s record into the :class:`~moelab.hybrid.planner.LayerPlan` fields (once)."""
        r = lp._rec
        n, nd, ne, ni, no = r[N_NEEDED], r[N_DEFERRED], r[N_EVICTED], r[N_PF_IN], r[N_PF_OUT]
        layer, target = lp.layer, lp._target
        o = 8
        needed = r[o : o + n]
        tokens, hit, where = r[o + n : o + 2 * n], r[o + 2 * n : o + 3 * n], r[o + 3 * n : o + 4 * n]
        spec, ins = r[o + 4 * n : o + 5 * n], r[o + 5 * n : o + 6 * n]
        o += 6 * n
        d = lp.__dict__
        d["accessed"] = needed
        dfr = r[o : o + 2 * nd]
        d["deferred"] = list(zip(dfr[::2], dfr[1::2]))
        o += 2 * nd
        # one pass, no comprehension (each is a function call before Python 3.12, and this runs per
        # MoE layer on the control thread): the lists in the order the reference builds them
        Tr = self._Transfer
        nbytes = self.planner.expert_bytes[layer]
        hits, misses, pf_hits, transfers = [], [], [], []
        by_where: tuple[list, list, list, list] = ([], [], [], [])  # DEVICE, FETCHED, HOSTED, STOLEN
        for e, c, h, x, sp, i in zip(needed, tokens, hit, where, spec, ins):
            if h:
                hits.append(e)
                if sp:
                    pf_hits.append(e)
            else:
                misses.append(e)
            by_where[x].append((e, c))
            if x == FETCHED or i:
                transfers.append(Tr(layer, e, nbytes, "demand" if x == FETCHED else "insert"))
        d["hits"], d["misses"], d["prefetch_hits"] = hits, misses, pf_hits
        d["device"] = by_where[DEVICE] + by_where[FETCHED]
        d["host"] = by_where[HOSTED] + by_where[STOLEN]
        pair = self._key_pair.__getitem__
        d["evictions"] = evictions = list(map(pair, r[o : o + ne]))
        o += ne
        if r[MOVED]:
            off, nb = self._offsets[target], self.planner.expert_bytes[target]
            for k in r[o : o + ni]:
                transfers.append(Tr(target, k - off, nb, "prefetch"))
            evictions += map(pair, r[o + ni : o + ni + no])
        d["transfers"] = transfers
        del d["_rec"], d["_dec"]

    def _raise(self, code: int, layer: int, ids: np.ndarray, pf: np.ndarray, target: int) -> None:
        ref = self.view.reference
        if code == BAD_SCORES:
            raise MoelabError(nan_scores_message(None, layer))
        if code == BAD_EXPERT:
            for e in ids.reshape(-1).tolist():
                ref.key(layer, e) if e >= 0 else None
        if code == BAD_PROPOSAL:
            for e in pf.tolist():
                ref.key(target, e)
        raise MoelabError(f"MoE layer {layer}: routing out of range for the compiled planner.")  # pragma: no cover


#: Executors whose runs the compiled path is chosen for under ``planner: auto``.
AUTO_EXECUTORS = ("real", "cuda")


def choose(planner: Any) -> CompiledPlanner | None:
    """The compiled path of ``planner``, or None (the reference): :data:`ENV` if set, else
    ``planner.config.planner`` (``auto``: compiled for the real and CUDA executors where the
    configuration allows it; :class:`~moelab.hybrid.config.HybridConfig`)."""
    forced = os.environ.get(ENV, "").strip().lower()
    if forced not in ("", "auto", "reference", "compiled"):
        raise MoelabError(f"{ENV}={forced!r}: expected reference, compiled or auto (or unset).")
    config = getattr(planner, "config", None)
    mode = forced or getattr(config, "planner", "auto")
    source = f"{ENV}={forced}" if forced else f"planner: {mode}"
    if mode == "reference":
        planner.path_reason = source
        return None
    why = unsupported(planner)
    if mode == "auto":
        executor = getattr(config, "executor", "functional")
        if why is None and executor not in AUTO_EXECUTORS:
            why = (f"planner: auto plans the {executor} executor and offline planning with the reference (a "
                   "process's first compiled plan loads numba: 1–2 s, a minute with a cold cache); set planner: compiled to use it")
        if why is not None:
            planner.path_reason = why
            return None
    elif why is not None:
        raise MoelabError(f"{source}, but this configuration cannot run compiled: {why}; use planner: auto or "
                          "reference.")
    return CompiledPlanner(planner)


__all__ = ["ENV", "CompiledCache", "CompiledPlanner", "choose", "plan", "unsupported"]
