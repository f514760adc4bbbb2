"""A discrete-event engine for task graphs on lanes that share memory bandwidth.

The simulator (:mod:`moelab.simulate.executor`) turns plans into a :class:`Graph`; this
module runs it. A graph is plain arrays, one entry per task:

* ``resource`` — the lane the task runs on; a resource has ``servers[r]`` identical
  servers (the copy engines are one resource with one server per engine); a task holds
  one server from start to end;
* ``priority`` — among the tasks ready on a resource, the lowest ``(priority, task
  index)`` starts first (a demand copy, priority 0, overtakes queued prefetches,
  priority 1); a started task is never pre-empted;
* ``deps`` (CSR: ``dep_ptr``, ``dep_idx``) — a task is ready when all its dependencies
  have ended;
* a task's work is a **fixed phase** of ``fixed_us`` (launch, dispatch, latency) and then a
  **bandwidth phase** of ``nbytes`` bytes read at up to ``cap`` bytes/µs (the task's own
  roofline rate: ``min(bandwidth × efficiency, bytes / compute time)``);
* ``pool`` — the memory the bandwidth phase reads: ``-1`` for private memory (the phase
  lasts ``nbytes / cap``), else a shared pool of ``pool_bw[p]`` bytes/µs (a NUMA node's
  DRAM) that all tasks in their bandwidth phase on it share.

**Sharing a pool (processor sharing, max-min fair).** While ``n`` tasks read one pool of
bandwidth ``B``, task ``i`` gets rate ``r_i`` by water-filling: visit the tasks by
ascending cap; each gets ``min(cap_i, remaining / tasks left)`` and the remaining
bandwidth shrinks by that. Two readers with caps ≥ B/2 get B/2 each (a read of ``b``
bytes that would take ``b / B`` alone takes twice as long while the other one runs); a
copy capped at the link's 32 GB/s beside a CPU kernel on a 220 GB/s node gets 32 and the
kernel 188. Rates change only when a task enters or leaves a pool, so between two events
every rate is constant and the next event is the earliest of the fixed phases' ends and
``now + remaining_i / r_i``.

**One step** of the engine (both implementations, in this order): start ready tasks
(resources in index order; each takes its lowest ``(priority, index)`` ready task on its
lowest free server) → recompute pool rates → advance to the next event time → end every
fixed phase due (a task with a bandwidth phase enters its pool, others end) and every
bandwidth phase read to within ``1e-9`` of its bytes → release successors, in ascending
task order (so ``crit[j]``, the dependency that released ``j`` last, is well defined).

Two implementations: :func:`simulate_reference` (plain Python, the definition) and a C
engine (:mod:`moelab.simulate._native`, the same steps over arrays, built on first use with
the system C compiler and cached); :func:`simulate` picks the fast one when it builds and
falls back to the reference with a warning when it does not. ``tests/test_simulate_engine.py``
checks they agree over random graphs.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
from dataclasses import dataclass

import numpy as np

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

#: A bandwidth phase has ended when less than this share of its bytes is left (rounding).
REL_TOL = 1e-9
ENGINE_ENV = "MOELAB_SIMULATE_ENGINE"


@dataclass
class Graph:
    """A task graph (see the module docstring); every array has one entry per task."""

    resource: np.ndarray
    priority: np.ndarray
    fixed_us: np.ndarray
    nbytes: np.ndarray
    cap: np.ndarray
    """Bytes per µs of the bandwidth phase when the task reads alone (= GB/s × 1e3)."""
    pool: np.ndarray
    dep_ptr: np.ndarray
    dep_idx: np.ndarray
    servers: np.ndarray
    """Servers per resource."""
    pool_bw: np.ndarray
    """Bytes per µs of each shared pool."""

    def __post_init__(self) -> None:
        self.resource = np.ascontiguousarray(self.resource, dtype=np.int32)
        self.priority = np.ascontiguousarray(self.priority, dtype=np.int32)
        self.fixed_us = np.ascontiguousarray(self.fixed_us, dtype=np.float64)
        self.nbytes = np.ascontiguousarray(self.nbytes, dtype=np.float64)
        self.cap = np.ascontiguousarray(self.cap, dtype=np.float64)
        self.pool = np.ascontiguousarray(self.pool, dtype=np.int32)
        self.dep_ptr = np.ascontiguousarray(self.dep_ptr, dtype=np.int64)
        self.dep_idx = np.ascontiguousarray(self.dep_idx, dtype=np.int64)
        self.servers = np.ascontiguousarray(self.servers, dtype=np.int32)
        self.pool_bw = np.ascontiguousarray(self.pool_bw, dtype=np.float64)

    @property
    def n(self) -> int:
        return len(self.resource)

    def validate(self) -> None:
        """Shapes and ranges; a bad graph is a bug in its builder, said in one line."""
        n = self.n
        for name in ("priority", "fixed_us", "nbytes", "cap", "pool"):
            if len(getattr(self, name)) != n:
                raise MoelabError(f"graph: {name} has {len(getattr(self, name))} entries for {n} tasks.")
        if len(self.dep_ptr) != n + 1 or self.dep_ptr[0] != 0 or self.dep_ptr[-1] != len(self.dep_idx):
            raise MoelabError("graph: dep_ptr must have n + 1 entries from 0 to len(dep_idx).")
        if n and (self.resource.min() < 0 or self.resource.max() >= len(self.servers)):
            raise MoelabError("graph: a task names a resource that does not exist.")
        if (self.servers < 1).any():
            raise MoelabError("graph: every resource needs ≥ 1 server.")
        if n and self.pool.max() >= len(self.pool_bw):
            raise MoelabError("graph: a task names a pool that does not exist.")
        if (self.pool_bw <= 0).any():
            raise MoelabError(f"graph: pool bandwidths must be > 0, got {self.pool_bw.tolist()}.")
        if n and (self.priority.min() < 0 or self.priority.max() >= 1 << 20):
            raise MoelabError("graph: priorities must be in [0, 2^20).")
        if n and n >= 1 << 40:
            raise MoelabError("graph: at most 2^40 tasks.")
        if (self.fixed_us < 0).any() or (self.nbytes < 0).any():
            raise MoelabError("graph: fixed times and bytes must be ≥ 0.")
        if ((self.nbytes > 0) & ~(self.cap > 0)).any():
            raise MoelabError("graph: a task that reads bytes needs a rate cap > 0.")
        if len(self.dep_idx) and (self.dep_idx.min() < 0 or self.dep_idx.max() >= n):
            raise MoelabError("graph: a dependency names a task that does not exist.")


@dataclass
class Schedule:
    """When each task ran: ``start``/``end`` µs, the ``server`` it held, and ``crit``, the
    dependency whose end released it (``-1``: none)."""

    start: np.ndarray
    end: np.ndarray
    server: np.ndarray
    crit: np.ndarray
    events: int = 0
    """Engine events processed (task starts, phase changes and ends)."""


def water_fill(caps: list[float], bandwidth: float) -> list[float]:
    """Max-min fair rates of readers with ``caps`` sharing ``bandwidth`` (ascending caps first;
    ties in the order given)."""
    order = sorted(range(len(caps)), key=lambda i: caps[i])
    rates = [0.0] * len(caps)
    left, k = bandwidth, len(caps)
    for i in order:
        share = left / k
        r = caps[i] if caps[i] < share else share
        rates[i] = r
        left -= r
        k -= 1
    return rates


def simulate_reference(g: Graph) -> Schedule:
    """The engine in plain Python (the definition; see the module docstring)."""
    g.validate()
    n, R = g.n, len(g.servers)
    res, prio = g.resource.tolist(), g.priority.tolist()
    fixed, nbytes, cap, pool = g.fixed_us.tolist(), g.nbytes.tolist(), g.cap.tolist(), g.pool.tolist()
    ptr, idx = g.dep_ptr.tolist(), g.dep_idx.tolist()
    succ: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for j in range(n):
        for k in range(ptr[j], ptr[j + 1]):
            succ[idx[k]].append(j)
            indeg[j] += 1
    ready: list[list[tuple[int, int]]] = [[] for _ in range(R)]
    free = [list(range(int(s))) for s in g.servers]
    timers: list[tuple[float, int]] = []
    final = [False] * n  # the running timer of task i ends the task (no bandwidth phase after it)
    active: list[dict[int, float]] = [{} for _ in range(len(g.pool_bw))]  # pool -> task -> bytes left
    rates: list[dict[int, float]] = [{} for _ in range(len(g.pool_bw))]
    start, end = [math.nan] * n, [math.nan] * n
    server, crit = [-1] * n, [-1] * n
    for j in range(n):
        if indeg[j] == 0:
            heapq.heappush(ready[res[j]], (prio[j], j))
    now, done, events = 0.0, 0, 0
    while True:
        for r in range(R):
            while ready[r] and free[r]:
                _, i = heapq.heappop(ready[r])
                server[i] = heapq.heappop(free[r])
                start[i] = now
                events += 1
                if pool[i] < 0 or nbytes[i] == 0:
                    final[i] = True
                    heapq.heappush(timers, (now + (fixed[i] + (nbytes[i] / cap[i] if nbytes[i] > 0 else 0.0)), i))
                else:
                    heapq.heappush(timers, (now + fixed[i], i))
        for p, act in enumerate(active):
            tasks = sorted(act)  # task order, then water-filling by ascending cap (stable)
            rs = water_fill([cap[i] for i in tasks], float(g.pool_bw[p]))
            rates[p] = dict(zip(tasks, rs, strict=True))
        t = timers[0][0] if timers else math.inf
        for p, act in enumerate(active):
            for i, left in act.items():
                t = min(t, now + left / rates[p][i])
        if t == math.inf:
            break
        dt = t - now
        for p, act in enumerate(active):
            for i in act:
                act[i] -= rates[p][i] * dt
        now = t
        ending: list[int] = []
        while timers and timers[0][0] <= now:
            _, i = heapq.heappop(timers)
            events += 1
            if final[i]:
                ending.append(i)
            else:
                active[pool[i]][i] = nbytes[i]
        for act in active:
            for i in [i for i, left in act.items() if left <= REL_TOL * nbytes[i]]:
                del act[i]
                ending.append(i)
        for i in sorted(ending):
            end[i] = now
            done += 1
            events += 1
            heapq.heappush(free[res[i]], server[i])
            for j in succ[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    crit[j] = i
                    heapq.heappush(ready[res[j]], (prio[j], j))
    if done != n:
        raise MoelabError(f"graph: {n - done} of {n} tasks never ran (a dependency cycle); this is a bug "
                          "in the graph's builder.")
    return Schedule(np.array(start), np.array(end), np.array(server, dtype=np.int32),
                    np.array(crit, dtype=np.int64), events)


def simulate(g: Graph, engine: str | None = None) -> Schedule:
    """Run ``g`` on the fast engine (``engine="fast"``), the reference (``"reference"``), or
    the fast one if it builds here (default; ``$MOELAB_SIMULATE_ENGINE`` overrides)."""
    engine = engine or os.environ.get(ENGINE_ENV) or "auto"
    if engine not in ("auto", "fast", "reference"):
        raise MoelabError(f"simulator engine {engine!r}: expected auto, fast or reference.")
    if engine == "reference":
        return simulate_reference(g)
    from moelab.simulate import _native

    if engine == "fast" or _native.available():
        return _native.simulate_fast(g)
    return simulate_reference(g)


__all__ = ["ENGINE_ENV", "Graph", "REL_TOL", "Schedule", "simulate", "simulate_reference", "water_fill"]
