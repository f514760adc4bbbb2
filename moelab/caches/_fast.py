"""The compiled (numba) expert cache: the one compiled implementation of the built-in policies.

Eviction is defined twice in moelab: readably, by the reference classes
(:mod:`moelab.caches.policies`: each policy's ``_priority``, ranked by
:meth:`ExpertCache._rank <moelab.caches.base.ExpertCache._rank>`), and here, compiled, for
every built-in policy at once. This module follows the reference step for step and is tested
against it for exact parity (hit per access, counters, contents, the journal of evictions and
insertions): tests/test_caches_compiled.py drives it one (forward, layer) at a time, the cache
tests compare whole replays through :func:`moelab.caches.simulate`.

**State.** A :class:`Cache` (:func:`new_cache`) is one cache of ``NK`` keys split into ``NP``
partitions (each MoE layer's own slots, or one global pool): a named tuple of its contents,
the policy's per-key state and the eviction order, as numpy arrays a planner can read.
Victims come from indexed binary min-heaps ordered by the reference's rank ``(speculative?,
p1, p2, key)``, one per partition, so every eviction is O(log C) and Belady is O(n log n). MRS
keeps one heap per layer instead (a step rescales all of one layer's priorities: re-heapifying
that layer's heap is O(its cached keys), where fixing them in a pool-wide heap costs
O(m log C); a global pool's victim is then the least of its layers' heap tops, O(L + log C)).

**Code.** Each kernel takes the cache, turns it into a tuple of data pointers
(:func:`_pointers`) and hands that to small helpers, one per step of the reference; those on
every access (``inline="always"``) are inlined by numba into their callers, those of a miss
are calls. Measured against the former single 350-line kernel (its helpers were closures),
replaying the same streams in one process: the same speed (0.8–1.05× its time per policy and
scope), half its compile time (23 s against 48 s, once per machine: the kernels are cached).

**API.** Every kernel below is compiled, callable from Python and from other compiled code,
and changes the cache in place:

* :func:`access` — serve the keys one (forward, MoE layer) needs, in access order, under the
  cache's insertion rule, writing their hit flags: what a planner calls per layer.
* :func:`prefetch` — insert proposed keys as speculative entries, within a budget.
* :func:`access_admit` — :func:`access` inserting only the misses an admission filter lets in.
* :func:`mrs_scores` — MRS's score update from a group's top-p rows (before its :func:`access`).
* :func:`victim` — the key the next insertion into a partition would evict (read-only).
* :func:`load` — initial contents; :func:`replay` — a whole access stream, group by group
  (the cache simulator's kernel, :func:`moelab.caches.simulate`).

Each :func:`access` / :func:`prefetch` lists what it changed in ``cache.journal`` (its first
``cache.clock[LOGGED]`` entries, in order): an inserted key as itself, an evicted one as
``-1 - key``.

Insertion rules (:mod:`moelab.caches.base`): ``always`` visits a group twice, its hits first
and then its misses (each inserted, the victim any cached key); ``protect-step`` visits it
once, in access order, with the group's keys stamped as not evictable. MRS's top-p of every
token row is selected first, in one pass over the router scores in memory order
(:func:`top_p_rows`), so the replay reads a compact (R, P) table in stream order.
Memory: O(num_keys) state, one byte per access for the hit flags, and MRS's (R, P) table.

Shape legend: n accesses, G groups, R token rows, P top-p width, NK keys, NP partitions,
NH heaps, L MoE layers.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

try:  # numba is optional: without it, simulate() falls back to the reference classes.
    from numba import njit, types
    from numba.extending import intrinsic

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
# clock[] slots: the cache's time, the last protection stamp, the journal's length
TIME, STAMP, LOGGED = 0, 1, 2
#: A protection stamp no key carries (keys never stamped hold -1): nothing is protected.
NOTHING = -2


class Policy(NamedTuple):
    """What a compiled cache evicts and admits: the reference class's options (:func:`make_policy`)."""

    code: int
    """The policy (:mod:`moelab.caches._codes`: ``LRU``, ``FIFO``, ``LFU``, ``MRS``, ``STATIC``, ``BELADY``)."""
    insertion: int
    """``INSERTION_CODES``: 0 ``always`` (hits first, then every miss, any victim), 1 ``protect-step``."""
    lfu_reset: bool
    """LFU's ``reset_on_evict``."""
    alpha: float
    """MRS's α."""
    pinned: np.ndarray
    """(NK,) bool: static's pinned keys, the only ones it caches."""
    bypass: bool
    """Belady: a miss used again no sooner than the victim (or never) is not inserted."""
    never: int
    """Belady: futures ≥ ``never`` are "never used again"."""


class Cache(NamedTuple):
    """One compiled expert cache (see the module docstring): build it with :func:`new_cache`.

    The compiled kernels change its arrays in place, reading them through :func:`_pointers`."""

    # the policy (Policy's fields)
    code: int
    insertion: int
    lfu_reset: bool
    alpha: float
    bypass: bool
    never: int
    pinned: np.ndarray
    """(NK,) uint8 static's pinned keys."""
    # partitions and contents
    num_keys: int
    key_part: np.ndarray
    """(NK,) int64 the partition of each key."""
    part_cap: np.ndarray
    """(NP,) int64 slots per partition."""
    key_offset: np.ndarray
    """(L+1,) int64 the first key of each MoE layer."""
    count: np.ndarray
    """(NP,) int64 cached keys per partition."""
    resident: np.ndarray
    """(NK,) uint8 cached now."""
    spec: np.ndarray
    """(NK,) uint8 prefetched and not used by a demand access since."""
    prot: np.ndarray
    """(NK,) int64 each key's last protection stamp (its group's or prefetch batch's)."""
    # the rank (srank, p1, p2, key), smallest evicted first, and the policy's per-key state
    srank: np.ndarray
    """(NK,) int8 0 for an unused prefetch (evicted first), else 1."""
    p1: np.ndarray
    """(NK,) float64 the policy's priority (:func:`_set_priority`)."""
    p2: np.ndarray
    """(NK,) float64 its tie-break."""
    last: np.ndarray
    """(NK,) int64 time of the last use or insertion."""
    ins: np.ndarray
    """(NK,) int64 time of the last insertion."""
    freq: np.ndarray
    """(NK,) int64 demand accesses so far (LFU)."""
    score: np.ndarray
    """(NK,) float64 MRS's S."""
    nxtk: np.ndarray
    """(NK,) int64 Belady: each key's next use."""
    dense: np.ndarray
    """(NK,) float64 scratch of :func:`mrs_scores` (zero between calls)."""
    # the heaps: NH indexed binary min-heaps in one array
    heap_of: np.ndarray
    """(NK,) int64 the heap of each key (its partition; MRS: its layer)."""
    heap_start: np.ndarray
    """(NH,) int64 where each heap begins in :attr:`heap_items`."""
    heap_size: np.ndarray
    """(NH,) int64 keys in each heap."""
    heap_items: np.ndarray
    """(Σ capacities,) int64 the heaps' keys."""
    heap_pos: np.ndarray
    """(NK,) int64 each key's index in its heap, -1 when not cached."""
    part_heap_ptr: np.ndarray
    """(NP+1,) int64 CSR: partition p's heaps are ``part_heaps[part_heap_ptr[p]:part_heap_ptr[p+1]]``."""
    part_heaps: np.ndarray
    """(NH,) int64."""
    tmp: np.ndarray
    """(NK,) int64 scratch: the protected keys a victim search lifts out."""
    # time and results
    clock: np.ndarray
    """(3,) int64: ``TIME``, ``STAMP``, ``LOGGED``."""
    counters: np.ndarray
    """(5,) int64: ``EVICTIONS``, ``TRANSFERS``, ``PREFETCHED``, ``PREFETCH_HITS``, ``WASTED_EVICTED``."""
    journal: np.ndarray
    """(2 NK,) int64: what the last :func:`access` / :func:`prefetch` inserted (``key``) and
    evicted (``-1 - key``), in order: its first ``clock[LOGGED]`` entries."""


if HAVE_NUMBA:

    @intrinsic
    def _pointers(typingctx, cache):
        """``cache`` with each array replaced by a pointer to its data (the same field names).

        What the kernels work on: numba counts references each time an array is read from a
        tuple or a struct (an out-of-line call per read) and copies a tuple of arrays (7 words
        each) into every helper call — 3× (a StructRef) to 30× (a tuple) slower here; pointers
        are plain words. Like numba's
        arrays by default, no bounds checks; unlike them, no negative indices (none is used).
        Valid while ``cache`` is alive: the kernel's own argument."""
        if not isinstance(cache, types.BaseNamedTuple):
            return None
        fields = [types.CPointer(t.dtype) if isinstance(t, types.Array) else t for t in cache.types]
        view = types.NamedTuple(fields, cache.instance_class)

        def codegen(context, builder, sig, args):
            values = []
            for i, t in enumerate(cache.types):
                v = builder.extract_value(args[0], i)
                values.append(context.make_array(t)(context, builder, value=v).data if isinstance(t, types.Array) else v)
            return context.make_tuple(builder, view, values)

        return view(cache), codegen

else:  # pragma: no cover - without numba the kernels run as plain Python on the arrays themselves

    def _pointers(cache):
        return cache


class Stream(NamedTuple):
    """An access stream as :func:`replay` reads it (:class:`moelab.caches.stream.AccessStream`'s columns)."""

    keys: np.ndarray
    """(n,) int32 the key of each access."""
    group_ptr: np.ndarray
    """(G+1,) int64 each group's accesses."""
    group_layer: np.ndarray
    """(G,) int32 each group's MoE layer."""
    group_pass: np.ndarray
    """(G,) int64 each group's pass (forward): a prefetch budget per pass restarts at a new one."""
    future: np.ndarray
    """(n,) int64 Belady's next use of each access (:func:`moelab.caches.stream.belady_future`); empty otherwise."""


class Scores(NamedTuple):
    """MRS's input to :func:`replay` (empty for the other policies)."""

    row_ptr: np.ndarray
    """(G+1,) int64 token rows per group."""
    top_v: np.ndarray
    """(R, P) float32 each token row's top-p scores, rows in group order (:func:`top_p_rows`)."""
    top_e: np.ndarray
    """(R, P) int32 their experts."""
    p_layer: np.ndarray
    """(L,) int64 top-p width per MoE layer."""


class Prefetches(NamedTuple):
    """Prefetch proposals of :func:`replay`: after group g, ``keys[ptr[g]:ptr[g+1]]`` (empty: no prefetch)."""

    ptr: np.ndarray
    """(G+1,) int64."""
    keys: np.ndarray
    """(M,) int64 proposed keys, the target layer's."""
    budget: int
    """Prefetch transfers per pass (or per group, :attr:`per_group`); -1 = unlimited."""
    per_group: bool
    """The budget is per group (forward, MoE layer) instead of per pass."""


# ---------------------------------------------------------------------- building a cache
def make_policy(code: int, num_keys: int, insertion: int = 0, *, lfu_reset: bool = False, alpha: float = 0.5,
                pinned=None, bypass: bool = False, never: int = 0) -> Policy:
    """A :class:`Policy` with the compiled kernels' types (``pinned``: keys, or None)."""
    mask = np.zeros(num_keys, dtype=np.bool_)
    if pinned is not None and len(pinned):
        mask[np.asarray(pinned, dtype=np.int64)] = True
    return Policy(int(code), int(insertion), bool(lfu_reset and code == LFU), float(alpha), mask,
                  bool(bypass and code == BELADY), int(never))


def _heaps(code: int, key_part: np.ndarray, part_cap: np.ndarray, key_offset: np.ndarray) -> dict:
    """The heap fields of an empty cache: one heap per partition (MRS: per layer)."""
    NK, NP, L = len(key_part), len(part_cap), len(key_offset) - 1
    if code == MRS:
        sizes = np.diff(key_offset)
        heap_of = np.repeat(np.arange(L, dtype=np.int64), sizes)
        heap_part = key_part[key_offset[:-1]]
        heap_cap = np.minimum(sizes, part_cap[heap_part])
    else:
        heap_of = key_part.copy()
        heap_part = np.arange(NP, dtype=np.int64)
        heap_cap = part_cap.copy()
    return {
        "heap_of": heap_of,
        "heap_start": np.concatenate([[0], np.cumsum(heap_cap)[:-1]]).astype(np.int64),
        "heap_size": np.zeros(len(heap_cap), dtype=np.int64),
        "heap_items": np.zeros(max(1, int(heap_cap.sum())), dtype=np.int64),
        "heap_pos": np.full(NK, -1, dtype=np.int64),
        "part_heap_ptr": np.concatenate([[0], np.cumsum(np.bincount(heap_part, minlength=NP))]).astype(np.int64),
        "part_heaps": np.argsort(heap_part, kind="stable").astype(np.int64),
        "tmp": np.zeros(NK, dtype=np.int64),
    }


def new_cache(policy: Policy, key_part, part_cap, key_offset, warm=(), future=None) -> Cache:
    """An empty compiled cache, then loaded with ``warm`` (keys, least important first; not
    transfers), as the reference's ``ExpertCache(..., warm=...)``.

    Args:
        policy: :func:`make_policy`.
        key_part: (NK,) the partition of each key (its MoE layer, or 0 for a global pool).
        part_cap: (NP,) slots per partition (:func:`moelab.caches.base.resolve_capacity`).
        key_offset: (L+1,) the first key of each MoE layer.
        warm: initial contents.
        future: Belady: (NK,) each key's first use (:func:`moelab.caches.stream.belady_future`).
    """
    key_part = np.ascontiguousarray(key_part, dtype=np.int64)
    part_cap = np.ascontiguousarray(part_cap, dtype=np.int64)
    key_offset = np.ascontiguousarray(key_offset, dtype=np.int64)
    NK = len(key_part)

    def keys(dtype, value=0, n=NK):
        return np.full(n, value, dtype=dtype)

    cache = Cache(
        code=int(policy.code), insertion=int(policy.insertion), lfu_reset=bool(policy.lfu_reset and policy.code == LFU),
        alpha=float(policy.alpha), bypass=bool(policy.bypass and policy.code == BELADY), never=int(policy.never),
        pinned=np.ascontiguousarray(policy.pinned, dtype=np.uint8), num_keys=NK, key_part=key_part,
        part_cap=part_cap, key_offset=key_offset, count=keys(np.int64, n=len(part_cap)),
        resident=keys(np.uint8), spec=keys(np.uint8), prot=keys(np.int64, -1), srank=keys(np.int8, 1),
        p1=keys(np.float64), p2=keys(np.float64), last=keys(np.int64), ins=keys(np.int64), freq=keys(np.int64),
        score=keys(np.float64), nxtk=keys(np.int64) if future is None else np.array(future, dtype=np.int64),
        dense=keys(np.float64), **_heaps(policy.code, key_part, part_cap, key_offset),
        clock=keys(np.int64, n=3), counters=keys(np.int64, n=5), journal=keys(np.int64, n=2 * NK),
    )
    load(cache, np.asarray(warm, dtype=np.int64))
    return cache


# ---------------------------------------------------------------------- the eviction order
@njit(cache=True, nogil=True, inline="always")
def _before(c, a, b):
    """True if cached key ``a`` is evicted before ``b``: the reference's ``_rank``, smallest first."""
    sr = c.srank
    if sr[a] != sr[b]:
        return sr[a] < sr[b]
    p1 = c.p1
    if p1[a] != p1[b]:
        return p1[a] < p1[b]
    p2 = c.p2
    if p2[a] != p2[b]:
        return p2[a] < p2[b]
    return a < b


@njit(cache=True, nogil=True, inline="always")
def _set_priority(c, k):
    """The reference's ``_priority(k)`` as (p1, p2)."""
    code = c.code
    if code == LRU:
        c.p1[k] = c.last[k]
    elif code == FIFO:
        c.p1[k] = c.ins[k]
    elif code == LFU:
        c.p1[k] = c.freq[k]
        c.p2[k] = c.last[k]
    elif code == MRS:
        c.p1[k] = c.score[k]
        c.p2[k] = c.last[k]
    elif code == BELADY:
        c.p1[k] = -c.nxtk[k]


@njit(cache=True, nogil=True, inline="always")
def _sift_up(c, h, i):
    """Move heap ``h``'s entry at index ``i`` up to its place."""
    items, pos, base = c.heap_items, c.heap_pos, c.heap_start[h]
    k = items[base + i]
    while i > 0:
        parent = (i - 1) >> 1
        pk = items[base + parent]
        if not _before(c, k, pk):
            break
        items[base + i] = pk
        pos[pk] = i
        i = parent
    items[base + i] = k
    pos[k] = i


@njit(cache=True, nogil=True, inline="always")
def _sift_down(c, h, i):
    """Move heap ``h``'s entry at index ``i`` down to its place."""
    items, pos, base, size = c.heap_items, c.heap_pos, c.heap_start[h], c.heap_size[h]
    k = items[base + i]
    while True:
        ch = 2 * i + 1
        if ch >= size:
            break
        if ch + 1 < size and _before(c, items[base + ch + 1], items[base + ch]):
            ch += 1
        ck = items[base + ch]
        if not _before(c, ck, k):
            break
        items[base + i] = ck
        pos[ck] = i
        i = ch
    items[base + i] = k
    pos[k] = i


@njit(cache=True, nogil=True, inline="always")
def _push(c, k):
    """Add cached key ``k`` to its heap."""
    h = c.heap_of[k]
    i = c.heap_size[h]
    c.heap_items[c.heap_start[h] + i] = k
    c.heap_size[h] = i + 1
    _sift_up(c, h, i)


@njit(cache=True, nogil=True)
def _remove(c, k):
    """Take key ``k`` out of its heap."""
    h = c.heap_of[k]
    i = c.heap_pos[k]
    last_i = c.heap_size[h] - 1
    c.heap_size[h] = last_i
    c.heap_pos[k] = -1
    if i != last_i:
        lk = c.heap_items[c.heap_start[h] + last_i]
        c.heap_items[c.heap_start[h] + i] = lk
        c.heap_pos[lk] = i
        _sift_up(c, h, i)
        _sift_down(c, h, c.heap_pos[lk])


@njit(cache=True, nogil=True, inline="always")
def _reorder(c, k):
    """Set cached key ``k``'s priority and restore the heap order (adding ``k`` if new)."""
    _set_priority(c, k)
    if c.heap_pos[k] < 0:
        _push(c, k)
    else:
        h = c.heap_of[k]
        _sift_up(c, h, c.heap_pos[k])
        _sift_down(c, h, c.heap_pos[k])


@njit(cache=True, nogil=True)
def _victim(c, part, stamp):
    """:func:`victim` on the pointer view ``c``: protected heap tops are lifted out, the least
    of the heaps' remaining tops taken, the lifted keys pushed back."""
    nt = 0
    v = -1
    for j in range(c.part_heap_ptr[part], c.part_heap_ptr[part + 1]):
        h = c.part_heaps[j]
        while c.heap_size[h] > 0:
            top = c.heap_items[c.heap_start[h]]
            if c.prot[top] != stamp:
                if v < 0 or _before(c, top, v):
                    v = top
                break
            c.tmp[nt] = top
            nt += 1
            _remove(c, top)
    for j in range(nt):
        _push(c, c.tmp[j])
    return v


# ---------------------------------------------------------------------- mechanics
@njit(cache=True, nogil=True, inline="always")
def _tick(c):
    """The cache's clock, advanced by one."""
    t = c.clock[TIME] + 1
    c.clock[TIME] = t
    return t


@njit(cache=True, nogil=True, inline="always")
def _log(c, entry):
    """Append ``entry`` to the journal."""
    n = c.clock[LOGGED]
    if n < 2 * c.num_keys:
        c.journal[n] = entry
        c.clock[LOGGED] = n + 1


@njit(cache=True, nogil=True)
def _evict(c, v):
    """Drop cached key ``v``; an unused prefetch counts as wasted."""
    _remove(c, v)
    c.resident[v] = 0
    c.count[c.key_part[v]] -= 1
    c.counters[EVICTIONS] += 1
    if c.spec[v]:
        c.spec[v] = 0
        c.srank[v] = 1
        c.counters[WASTED_EVICTED] += 1
    if c.lfu_reset:
        c.freq[v] = 0
    _log(c, -1 - v)


@njit(cache=True, nogil=True, inline="always")
def _admits(c, k, demand):
    """Whether key ``k`` may be inserted at all (the reference's ``_admit`` / ``_admit_prefetch``)."""
    if c.code == STATIC:
        return demand and c.pinned[k] != 0
    if c.code == BELADY and c.bypass:
        return c.nxtk[k] < c.never
    return True


@njit(cache=True, nogil=True)
def _make_room(c, k, stamp):
    """Evict the victim if ``k``'s partition is full; False if ``k`` must bypass (the reference's
    ``_make_room`` with ``_replace``)."""
    part = c.key_part[k]
    if c.count[part] < c.part_cap[part]:
        return True
    v = _victim(c, part, stamp)
    if v < 0 or (c.code == BELADY and c.bypass and c.nxtk[k] >= c.nxtk[v]):
        return False
    _evict(c, v)
    return True


@njit(cache=True, nogil=True, inline="always")
def _store(c, k, t):
    """Insert key ``k`` at time ``t`` (a transfer); its priority is set by the caller."""
    c.resident[k] = 1
    c.count[c.key_part[k]] += 1
    c.ins[k] = t
    c.counters[TRANSFERS] += 1
    _log(c, k)


@njit(cache=True, nogil=True, inline="always")
def _serve(c, k, future, stamp, allow):
    """One demand access of key ``k`` (``future``: its next use, Belady); victims not stamped
    ``stamp``; a miss is inserted only where ``allow`` (the caller's admission: a miss the hybrid
    planner runs on the host is counted but not copied in). Returns 1 on a hit."""
    t = _tick(c)
    if c.code == BELADY:
        c.nxtk[k] = future
    hit = c.resident[k]
    if hit != 0:
        if c.spec[k]:
            c.spec[k] = 0
            c.srank[k] = 1
            c.counters[PREFETCH_HITS] += 1
    elif allow and _admits(c, k, True) and _make_room(c, k, stamp):
        _store(c, k, t)
    c.last[k] = t
    c.freq[k] += 1
    if c.resident[k] != 0:
        _reorder(c, k)
    return np.uint8(hit)


@njit(cache=True, nogil=True, inline="always")
def _begin_batch(c, keys):
    """A fresh protection stamp, given to ``keys``; the journal emptied."""
    stamp = c.clock[STAMP] + 1
    c.clock[STAMP] = stamp
    for k in keys:
        c.prot[k] = stamp
    c.clock[LOGGED] = 0
    return stamp


# ---------------------------------------------------------------------- what the API runs
@njit(cache=True, nogil=True)
def _load(c, keys):
    """:func:`load` on the pointer view ``c``."""
    for k in keys:
        part = c.key_part[k]
        if c.count[part] < c.part_cap[part]:
            t = _tick(c)
            c.resident[k] = 1
            c.count[part] += 1
            c.ins[k] = t
            c.last[k] = t
            _reorder(c, k)


@njit(cache=True, nogil=True)
def _access(c, keys, future, hit, admit):
    """:func:`access` on the pointer view ``c`` (``admit``: :func:`access_admit`'s, or empty)."""
    stamp = _begin_batch(c, keys)
    belady = c.code == BELADY
    admit_all = admit.shape[0] == 0  # every miss may be inserted
    n = keys.shape[0]
    nhit = 0
    if c.insertion == 0:
        for i in range(n):  # the hits first, in access order
            hit[i] = c.resident[keys[i]]
            if hit[i] != 0:
                nhit += _serve(c, keys[i], future[i] if belady else 0, NOTHING, True)
        for i in range(n):  # then every miss
            if hit[i] == 0:
                _serve(c, keys[i], future[i] if belady else 0, NOTHING, admit_all or admit[i] != 0)
        return nhit
    vstamp = NOTHING if belady else stamp
    for i in range(n):
        hit[i] = _serve(c, keys[i], future[i] if belady else 0, vstamp, admit_all or admit[i] != 0)
        nhit += hit[i]
    return nhit


@njit(cache=True, nogil=True)
def _prefetch(c, keys, budget):
    """:func:`prefetch` on the pointer view ``c``."""
    stamp = _begin_batch(c, keys)
    moved = 0
    for k in keys:
        if c.resident[k] != 0:
            continue
        if moved == budget:
            break
        if not _admits(c, k, False) or not _make_room(c, k, stamp):
            continue
        t = _tick(c)
        _store(c, k, t)
        c.last[k] = t
        c.spec[k] = 1
        if c.code != BELADY:  # Belady's rank ignores speculation
            c.srank[k] = 0
        c.counters[PREFETCHED] += 1
        moved += 1
        _reorder(c, k)
    return moved


@njit(cache=True, nogil=True)
def _mrs_scores(c, layer, p, top_v, top_e):
    """:func:`mrs_scores` on the pointer view ``c``: the scores, then the layer's heap reordered."""
    lo = c.key_offset[layer]
    hi = c.key_offset[layer + 1]
    alpha = c.alpha
    dense, score = c.dense, c.score
    for r in range(top_v.shape[0]):
        for j in range(p):
            dense[lo + top_e[r, j]] = np.float64(top_v[r, j])
        for k in range(lo, hi):
            score[k] = alpha * dense[k] + (1.0 - alpha) * score[k]
            dense[k] = 0.0
    # every cached key of this layer changed priority: rebuild the layer's heap, O(m)
    for k in range(lo, hi):
        if c.heap_pos[k] >= 0:
            c.p1[k] = score[k]
    for j in range(c.heap_size[layer] // 2 - 1, -1, -1):
        _sift_down(c, layer, j)


# ---------------------------------------------------------------------- the API
@njit(cache=True, nogil=True)
def load(cache, keys):
    """Load ``keys`` in order while their partition has room (initial contents: not transfers)."""
    _load(_pointers(cache), keys)


@njit(cache=True, nogil=True)
def victim(cache, part, stamp=NOTHING):
    """The cached key of partition ``part`` the next insertion evicts: the least by
    ``(speculative?, p1, p2, key)`` whose protection stamp is not ``stamp`` (default: any);
    -1 if none. The cache is unchanged."""
    return _victim(_pointers(cache), part, stamp)


@njit(cache=True, nogil=True)
def access(cache, keys, future, hit):
    """Serve the distinct ``keys`` (int) one (forward, MoE layer) needs, in access order;
    ``hit[i]`` (uint8) becomes 1 where ``keys[i]`` was cached. Returns the number of hits.

    ``future``: Belady's next use of each access (other policies ignore it: may be empty).
    MRS: update the layer's scores with :func:`mrs_scores` first. Under ``always`` the hits
    are served first, then every miss (the victim any cached key); under ``protect-step``
    one pass in order, a miss evicting none of ``keys`` (Belady: nothing protected).
    ``cache.journal`` then lists what was inserted and evicted."""
    return _access(_pointers(cache), keys, future, hit, np.zeros(0, dtype=np.uint8))


@njit(cache=True, nogil=True)
def access_admit(cache, keys, future, hit, admit):
    """:func:`access` with an admission filter: a miss of ``keys[i]`` is inserted only where
    ``admit[i]`` is nonzero (the reference's ``ExpertCache.access(..., admit=)``: the hybrid
    planner admits the misses its placement fetches); a miss not admitted is still counted and
    seen by the policy (its use time, LFU's count). An empty ``admit`` admits every miss."""
    return _access(_pointers(cache), keys, future, hit, admit)


@njit(cache=True, nogil=True)
def prefetch(cache, keys, budget):
    """Insert the proposed ``keys`` (one target layer's, most confident first) that are not
    cached as speculative entries, at most ``budget`` of them (-1: no limit); a proposal
    never evicts another of the same batch. Returns how many moved (the reference's
    ``ExpertCache.prefetch``; static admits none). ``cache.journal`` lists the changes."""
    return _prefetch(_pointers(cache), keys, budget)


@njit(cache=True, nogil=True)
def mrs_scores(cache, layer, p, top_v, top_e):
    """MRS: ``S ← α·TopP(s) + (1 − α)·S`` for each of a (forward, layer)'s token rows
    (``top_v``/``top_e``: (rows, ≥ p) their top-``p`` scores and experts, :func:`top_p_rows`)."""
    _mrs_scores(_pointers(cache), layer, p, top_v, top_e)


@njit(cache=True, nogil=True)
def replay(cache, stream, scores, prefetches, hit):
    """Replay ``stream`` group by group through ``cache``: MRS's score update, the group's
    :func:`access` (its hit flags into ``hit``, (n,) uint8), then the prefetch proposals made
    after it, within the budget. Counters, contents and unused prefetches stay on ``cache``."""
    c = _pointers(cache)
    pf = prefetches
    cur_pass = -1
    left = pf.budget
    every = np.zeros(0, dtype=np.uint8)
    for g in range(stream.group_layer.shape[0]):
        if pf.per_group or stream.group_pass[g] != cur_pass:
            cur_pass = stream.group_pass[g]
            left = pf.budget
        layer = stream.group_layer[g]
        if c.code == MRS:
            r0, r1 = scores.row_ptr[g], scores.row_ptr[g + 1]
            _mrs_scores(c, layer, scores.p_layer[layer], scores.top_v[r0:r1], scores.top_e[r0:r1])
        a, b = stream.group_ptr[g], stream.group_ptr[g + 1]
        _access(c, stream.keys[a:b], stream.future[a:b], hit[a:b], every)
        if pf.ptr[g + 1] > pf.ptr[g]:
            moved = _prefetch(c, pf.keys[pf.ptr[g] : pf.ptr[g + 1]], left)
            if left > 0:
                left -= moved


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

