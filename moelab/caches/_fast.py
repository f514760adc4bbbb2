"""Compiled (numba) replay of an access stream for the built-in policies.

One kernel serves every built-in policy. It follows the reference classes in
:mod:`moelab.caches.policies` step for step and is tested against them for exact parity
(hit per access, counters, final contents). Victims come from indexed binary min-heaps
ordered by ``(speculative?, p1, p2, key)``, one per partition, so every eviction is O(log C)
and Belady is O(n log n). MRS keeps one heap per layer instead (O(L + log C) per eviction in a
global pool) and selects every token row's top-p first, in one pass over the router scores in
memory order (:func:`top_p_rows`), so the replay reads a compact (R, P) table in stream order.
Memory: O(num_keys) state, one byte per access for the hit flags, and MRS's (R, P) table.
Insertion rules (:mod:`moelab.caches.base`): ``always`` visits a group twice, its hits first
and then its misses (each inserted, the victim any cached key); ``protect-step`` visits it
once, in access order, with the group's keys stamped as not evictable.

Shape legend: n accesses, G groups, R token rows, P top-p width, NK keys, NP partitions.
"""

from __future__ import annotations

import numpy as np

try:  # numba is optional: without it, simulate() falls back to the reference classes.
    from numba import njit

    HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    HAVE_NUMBA = False

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        def deco(f):
            return f

        return deco if not (len(args) == 1 and callable(args[0])) else args[0]


from moelab.caches._codes import BELADY, FIFO, INSERTION_CODES, LFU, LRU, MRS, STATIC  # noqa: F401

# counters[] slots
EVICTIONS, TRANSFERS, PREFETCHED, PREFETCH_HITS, WASTED_EVICTED = 0, 1, 2, 3, 4


@njit(cache=True, nogil=True)
def top_p_rows(group_layer, row_ptr, score_rows, scores, p_layer, key_offset, top_v, top_e):
    """Fill ``top_v[r, :p]``/``top_e[r, :p]`` with the top-p scores and experts of token row r.

    Top-p of a row's E scores by (score desc, expert id asc), in no particular order; p is the
    row's layer's ``p_layer`` (capped at E). Returns -1, or the first ``scores`` row holding a
    NaN or an infinity (MRS's priorities would turn NaN: 0 · inf, inf − inf). ``scores`` must
    be float32 (the reference's precision). A scores row may serve several token rows.

    Branch-light selection (a sorted insertion mispredicts on nearly every element): split the
    E scores round-robin into G = ceil(p/2) groups of at least two; each group holds two scores
    >= its second largest, so the smallest of those G second-largest values is a lower bound
    on the p-th largest score. The few scores above it are ranked against each other
    (rank = #greater + #equal with a lower id) and those with rank < p are kept. Rows are
    visited in memory order, so the scores are read sequentially.
    """
    N = scores.shape[0]
    W = scores.shape[1] + 1
    inv = np.full(N, -1, dtype=np.int64)
    row_layer = np.zeros(N, dtype=np.int64)
    for g in range(group_layer.shape[0]):
        for r in range(row_ptr[g], row_ptr[g + 1]):
            inv[score_rows[r]] = r  # the last token row of each scores row; the rest copy it below
            row_layer[score_rows[r]] = group_layer[g]
    m1 = np.zeros(W, dtype=np.float32)
    m2 = np.zeros(W, dtype=np.float32)
    cand_v = np.zeros(W, dtype=np.float32)
    cand_e = np.zeros(W, dtype=np.int64)
    sel_v = np.zeros(W, dtype=np.float32)
    sel_e = np.zeros(W, dtype=np.int64)
    for row in range(N):
        r = inv[row]
        if r < 0:
            continue
        layer = row_layer[row]
        E = key_offset[layer + 1] - key_offset[layer]
        p = p_layer[layer]
        bad = False
        for e in range(E):
            x = scores[row, e]
            bad |= x - x != 0  # NaN or ±inf
        if bad:
            return row
        if p >= E:
            for e in range(E):
                top_v[r, e] = scores[row, e]
                top_e[r, e] = e
            continue
        G = (p + 1) // 2  # 2G <= p + 1 <= E: every group has two members
        for j in range(G):
            a = scores[row, j]
            b = scores[row, G + j]
            m1[j] = max(a, b)
            m2[j] = min(a, b)
        for c0 in range(2 * G, E, G):
            for j in range(min(G, E - c0)):
                x = scores[row, c0 + j]
                m2[j] = max(m2[j], min(m1[j], x))
                m1[j] = max(m1[j], x)
        lb = m2[0]
        for j in range(1, G):
            lb = min(lb, m2[j])
        cnt = 0
        for e in range(E):
            v = scores[row, e]
            cand_v[cnt] = v
            cand_e[cnt] = e
            cnt += v >= lb
        o = 0
        for q in range(cnt):  # branch-free compaction of the candidates with rank < p
            v = cand_v[q]
            rank = 0
            for z in range(cnt):
                rank += cand_v[z] > v
            for z in range(q):
                rank += cand_v[z] == v
            sel_v[o] = v
            sel_e[o] = cand_e[q]
            o += rank < p
        for j in range(p):
            top_v[r, j] = sel_v[j]
            top_e[r, j] = sel_e[j]
    for r in range(score_rows.shape[0]):  # token rows sharing a scores row
        r0 = inv[score_rows[r]]
        if r0 != r:
            top_v[r] = top_v[r0]
            top_e[r] = top_e[r0]
    return -1


@njit(cache=True, nogil=True)
def replay(
    policy,  # int: POLICY_CODES
    keys,  # (n,) int32
    group_ptr,  # (G+1,) int64
    group_layer,  # (G,) int32
    group_pass,  # (G,) int64
    key_part,  # (NK,) int64 partition of each key
    part_cap,  # (NP,) int64 slots per partition
    key_offset,  # (L+1,) int64
    warm_keys,  # (W,) int64 initial contents, least important first
    lfu_reset,  # bool
    alpha,  # float64 (mrs)
    row_ptr,  # (G+1,) int64 token rows per group (mrs)
    top_v,  # (R, P) float32 each token row's top-p scores, rows in group order (mrs; top_p_rows)
    top_e,  # (R, P) int32 their experts (mrs)
    p_layer,  # (L,) int64 top-p width per MoE layer (mrs)
    nxt_access,  # (n,) int64 future of each access (belady; stream.belady_future)
    first_future,  # (NK,) int64 future of each key before the stream (belady)
    never,  # int64 futures >= never are "never used again" (belady)
    pinned,  # (NK,) bool (static)
    bypass,  # bool (belady)
    insertion,  # int: INSERTION_CODES (0 always: hits first, then every miss, any victim; 1 protect-step)
    pf_ptr,  # (G+1,) int64 prefetch proposals per group (empty: no prefetch)
    pf_keys,  # (M,) int64 proposed keys, target layer's keys
    budget,  # int64 prefetch transfers per pass (or per group, budget_per_group), -1 = unlimited
    budget_per_group,  # bool: the budget is per group (forward, MoE layer) instead of per pass
    hit,  # (n,) uint8 out
    counters,  # (5,) int64 out
    resident,  # (NK,) bool out (final contents)
    spec,  # (NK,) bool out (unused prefetches at the end)
):
    """Size: one numba-compiled loop over the stream whose state (heaps, stamps, counters) lives in local arrays;
    restructuring it around a jitclass state object was tried and replayed about 10x slower (1.3 M against 16
    M accesses/s for LRU), so it stays one function until a state object as fast exists.
    """
    n = keys.shape[0]
    G = group_layer.shape[0]
    NK = key_part.shape[0]
    NP = part_cap.shape[0]
    L = key_offset.shape[0] - 1
    # Heaps: one per partition, except for MRS, which keeps one per layer even in a global
    # pool (a step rescales all of one layer's priorities: re-heapifying that layer's heap is
    # O(its cached keys), where fixing them in a pool-wide heap costs O(m log C)). A
    # partition's victim is the least of its heaps' least unprotected keys.
    NH = L if policy == MRS else NP
    key_heap = np.zeros(NK, dtype=np.int64)
    heap_cap = np.zeros(NH, dtype=np.int64)
    heap_part = np.zeros(NH, dtype=np.int64)
    if policy == MRS:
        for layer in range(L):
            lo = key_offset[layer]
            key_heap[lo : key_offset[layer + 1]] = layer
            heap_part[layer] = key_part[lo]
            heap_cap[layer] = min(key_offset[layer + 1] - lo, part_cap[key_part[lo]])
    else:
        key_heap[:] = key_part
        heap_cap[:] = part_cap
        heap_part[:] = np.arange(NP)
    part_hptr = np.zeros(NP + 1, dtype=np.int64)  # heaps of each partition, CSR
    for h in range(NH):
        part_hptr[heap_part[h] + 1] += 1
    for p in range(NP):
        part_hptr[p + 1] += part_hptr[p]
    part_heaps = np.zeros(NH, dtype=np.int64)
    fill = part_hptr[:NP].copy()
    for h in range(NH):
        part_heaps[fill[heap_part[h]]] = h
        fill[heap_part[h]] += 1
    hstart = np.zeros(NH, dtype=np.int64)
    for h in range(1, NH):
        hstart[h] = hstart[h - 1] + heap_cap[h - 1]
    heap = np.zeros(max(1, hstart[NH - 1] + heap_cap[NH - 1]), dtype=np.int64)
    hsize = np.zeros(NH, dtype=np.int64)
    count = np.zeros(NP, dtype=np.int64)
    hpos = np.full(NK, -1, dtype=np.int64)
    prot = np.full(NK, -1, dtype=np.int64)
    tmp = np.zeros(NK, dtype=np.int64)
    srank = np.ones(NK, dtype=np.int8)
    p1 = np.zeros(NK, dtype=np.float64)
    p2 = np.zeros(NK, dtype=np.float64)
    last = np.zeros(NK, dtype=np.int64)
    ins = np.zeros(NK, dtype=np.int64)
    freq = np.zeros(NK, dtype=np.int64)
    score = np.zeros(NK, dtype=np.float64)
    dense = np.zeros(NK, dtype=np.float64)
    nxtk = np.full(NK, n, dtype=np.int64)

    # Heap helpers as closures: numba inlines them, so no per-call array refcounting.
    def lt(a, b):  # True if key a is evicted before key b
        if srank[a] != srank[b]:
            return srank[a] < srank[b]
        if p1[a] != p1[b]:
            return p1[a] < p1[b]
        if p2[a] != p2[b]:
            return p2[a] < p2[b]
        return a < b

    def sift_up(base, i):
        k = heap[base + i]
        while i > 0:
            parent = (i - 1) >> 1
            pk = heap[base + parent]
            if lt(k, pk):
                heap[base + i] = pk
                hpos[pk] = i
                i = parent
            else:
                break
        heap[base + i] = k
        hpos[k] = i

    def sift_down(base, size, i):
        k = heap[base + i]
        while True:
            c = 2 * i + 1
            if c >= size:
                break
            if c + 1 < size and lt(heap[base + c + 1], heap[base + c]):
                c += 1
            ck = heap[base + c]
            if lt(ck, k):
                heap[base + i] = ck
                hpos[ck] = i
                i = c
            else:
                break
        heap[base + i] = k
        hpos[k] = i

    def push(k):
        h = key_heap[k]
        i = hsize[h]
        heap[hstart[h] + i] = k
        hsize[h] = i + 1
        sift_up(hstart[h], i)

    def remove(k):
        h = key_heap[k]
        base = hstart[h]
        i = hpos[k]
        last_i = hsize[h] - 1
        hsize[h] = last_i
        hpos[k] = -1
        if i != last_i:
            lk = heap[base + last_i]
            heap[base + i] = lk
            hpos[lk] = i
            sift_up(base, i)
            sift_down(base, last_i, hpos[lk])

    def fix(k):
        h = key_heap[k]
        sift_up(hstart[h], hpos[k])
        sift_down(hstart[h], hsize[h], hpos[k])

    def victim(part, stamp):  # smallest-ranked cached key not protected by stamp; -1 if none
        nt = 0
        v = -1
        for j in range(part_hptr[part], part_hptr[part + 1]):
            h = part_heaps[j]
            while hsize[h] > 0:
                top = heap[hstart[h]]
                if prot[top] == stamp:
                    tmp[nt] = top
                    nt += 1
                    remove(top)
                else:
                    if v < 0 or lt(top, v):
                        v = top
                    break
        for j in range(nt):
            push(tmp[j])
        return v

    def evict(v):  # drop cached key v; an unused prefetch counts as wasted
        remove(v)
        resident[v] = False
        count[key_part[v]] -= 1
        counters[EVICTIONS] += 1
        if spec[v]:
            spec[v] = False
            srank[v] = 1
            counters[WASTED_EVICTED] += 1
        if lfu_reset:
            freq[v] = 0

    def prio(k):
        if policy == LRU:
            p1[k] = last[k]
        elif policy == FIFO:
            p1[k] = ins[k]
        elif policy == LFU:
            p1[k] = freq[k]
            p2[k] = last[k]
        elif policy == MRS:
            p1[k] = score[k]
            p2[k] = last[k]
        elif policy == BELADY:
            p1[k] = -nxtk[k]

    if policy == BELADY:
        nxtk[:] = first_future
    t = 0
    for j in range(warm_keys.shape[0]):
        k = warm_keys[j]
        part = key_part[k]
        if count[part] < part_cap[part]:
            t += 1
            resident[k] = True
            count[part] += 1
            ins[k] = t
            last[k] = t
            prio(k)
            push(k)

    cur_pass = -1
    left = budget
    for g in range(G):
        layer = group_layer[g]
        if budget_per_group or group_pass[g] != cur_pass:
            cur_pass = group_pass[g]
            left = budget
        a = group_ptr[g]
        b = group_ptr[g + 1]
        stamp = 2 * g + 1
        for i in range(a, b):
            prot[keys[i]] = stamp
        if policy == MRS:
            # S <- alpha * TopP(s) + (1 - alpha) * S for every token row (top-p from top_p_rows).
            lo = key_offset[layer]
            hi = key_offset[layer + 1]
            p = p_layer[layer]
            for r in range(row_ptr[g], row_ptr[g + 1]):
                for j in range(p):
                    dense[lo + top_e[r, j]] = np.float64(top_v[r, j])
                for k in range(lo, hi):
                    score[k] = alpha * dense[k] + (1.0 - alpha) * score[k]
                    dense[k] = 0.0
            # Every cached key of this layer changed priority: rebuild the layer's heap, O(m).
            for k in range(lo, hi):
                if hpos[k] >= 0:
                    p1[k] = score[k]
            size = hsize[layer]
            for j in range(size // 2 - 1, -1, -1):
                sift_down(hstart[layer], size, j)

        # "always": two passes, the hits first, then the misses; "protect-step": one, in order.
        npass = 2 if insertion == 0 else 1
        vstamp = -2 if insertion == 0 else stamp  # -2: no key carries it (never-stamped keys hold -1)
        if policy == BELADY:
            # MIN; nothing is protected (see BeladyCache).
            for q in range(a, a + npass * (b - a)):
                i = q if q < b else q - (b - a)
                k = keys[i]
                if npass == 2 and ((q < b and not resident[k]) or (q >= b and hit[i] == 1)):
                    continue
                part = key_part[k]
                t += 1
                last[k] = t
                nxtk[k] = nxt_access[i]
                if resident[k]:
                    hit[i] = 1
                    if spec[k]:
                        spec[k] = False
                        counters[PREFETCH_HITS] += 1
                    prio(k)
                    fix(k)
                    continue
                if bypass and nxtk[k] >= never:
                    continue
                if count[part] >= part_cap[part]:
                    v = victim(part, -2)  # -2: no key carries it (never-stamped keys hold -1)
                    if v < 0 or (bypass and nxtk[k] >= nxtk[v]):
                        continue
                    evict(v)
                resident[k] = True
                count[part] += 1
                ins[k] = t
                counters[TRANSFERS] += 1
                prio(k)
                push(k)

        for q in range(a, a if policy == BELADY else a + npass * (b - a)):  # every other policy
            i = q if q < b else q - (b - a)
            k = keys[i]
            if npass == 2 and ((q < b and not resident[k]) or (q >= b and hit[i] == 1)):
                continue
            part = key_part[k]
            t += 1
            if resident[k]:
                hit[i] = 1
                if spec[k]:
                    spec[k] = False
                    srank[k] = 1
                    counters[PREFETCH_HITS] += 1
            else:
                admit = True
                if policy == STATIC:
                    admit = pinned[k]
                if admit and count[part] >= part_cap[part]:
                    v = victim(part, vstamp)
                    if v < 0:
                        admit = False
                    else:
                        evict(v)
                if admit:
                    resident[k] = True
                    count[part] += 1
                    ins[k] = t
                    counters[TRANSFERS] += 1
            last[k] = t
            freq[k] += 1
            if resident[k]:
                prio(k)
                if hpos[k] >= 0:
                    fix(k)
                else:
                    push(k)

        if policy == STATIC or pf_ptr[g + 1] == pf_ptr[g]:
            continue
        stamp2 = 2 * g + 2
        for j in range(pf_ptr[g], pf_ptr[g + 1]):
            prot[pf_keys[j]] = stamp2
        for j in range(pf_ptr[g], pf_ptr[g + 1]):
            k = pf_keys[j]
            if resident[k]:
                continue
            if left == 0:
                break
            part = key_part[k]
            if policy == BELADY and bypass and nxtk[k] >= never:
                continue
            if count[part] >= part_cap[part]:
                v = victim(part, stamp2)
                if v < 0:
                    continue
                if policy == BELADY and bypass and nxtk[k] >= nxtk[v]:
                    continue
                evict(v)
            t += 1
            resident[k] = True
            count[part] += 1
            ins[k] = t
            last[k] = t
            spec[k] = True
            if policy != BELADY:
                srank[k] = 0
            counters[TRANSFERS] += 1
            counters[PREFETCHED] += 1
            if left > 0:
                left -= 1
            prio(k)
            push(k)
