"""Placement policies: where each cache miss of a MoE layer runs — on the host, or fetched to the device.

Registered by name in :data:`PLACEMENTS`:

============== =========================================================================
``host-misses``  KTransformers: the device runs what it holds (a static or cached set);
                 every miss is computed on the host.
``fetch-misses`` mixtral-offloading, ProMoE: every miss is copied to the device, then
                 computed there.
``greedy-hss``   HybriMoE §IV-B: the device runs cached experts heaviest first, the host
                 runs uncached experts lightest first; the heaviest uncached experts are
                 fetched, one at a time, while that makes the later lane finish earlier
                 (by the cost model). Not modelled: the host stealing cached experts
                 when idle.
``min-cost``     Fiddler's idea: the split of the misses that minimises the **later** of
                 the two lanes (the makespan), exactly for up to 12 misses, greedily
                 beyond. Fiddler's published code minimises the *sum* of the lanes' costs;
                 we minimise the makespan because the lanes run concurrently.
============== =========================================================================

The one cost model (:class:`moelab.timing.costs.CostModel`, built from the model's shape and
``HybridConfig.hardware``) turns (expert, tokens) into microseconds per lane and per copy — the
same numbers the simulator charges; ``greedy-hss`` and ``min-cost`` need one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import ClassVar

from moelab.errors import MoelabError
from moelab.registry import Registry
from moelab.timing.costs import CostModel

HOST, FETCH = "host", "fetch"


def lanes_us(hits: Sequence[tuple[int, int]], fetch: Sequence[tuple[int, int]],
             host: Sequence[tuple[int, int]], cost: CostModel, tokens: int = 1) -> tuple[float, float]:
    """(device finish, host finish) of one layer by the one cost model
    (:meth:`moelab.timing.costs.CostModel.lanes_us`): the device runs its shared experts and hits,
    then each fetched expert once its copy (FIFO on the link) and the device are both free; each
    host lane (NUMA node) runs its experts."""
    return cost.lanes_us(hits, fetch, host, tokens=tokens)


class Placement:
    """Base class: decide, for each miss, ``"host"`` or ``"fetch"``."""

    name: ClassVar[str] = ""
    needs_cost_model: ClassVar[bool] = False

    def place(self, hits: list[tuple[int, int]], misses: list[tuple[int, int]],
              cost: CostModel | None) -> dict[int, str]:  # pragma: no cover - abstract
        """``hits``/``misses``: (expert, tokens) pairs; returns expert → ``host`` | ``fetch``."""
        raise NotImplementedError


PLACEMENTS: Registry[type[Placement]] = Registry("placement policy", base=Placement)


@PLACEMENTS.register("host-misses")
class HostMisses(Placement):
    name = "host-misses"

    def place(self, hits, misses, cost):
        return {e: HOST for e, _ in misses}


@PLACEMENTS.register("fetch-misses")
class FetchMisses(Placement):
    name = "fetch-misses"

    def place(self, hits, misses, cost):
        return {e: FETCH for e, _ in misses}


@PLACEMENTS.register("greedy-hss")
class GreedyHSS(Placement):
    name = "greedy-hss"
    needs_cost_model = True

    def __init__(self) -> None:
        self._cost: CostModel | None = None

    def _costs(self, cost: CostModel):
        # per-token-count costs, kept while the same cost model is passed (one per planner)
        if cost is not self._cost:
            self._cost = cost
            self._memo = (_Memo(cost.device_us), _Memo(cost.host_us), cost.fetch_us())
        return self._memo

    def place(self, hits, misses, cost):
        # incremental form of: start with every miss on its host lane; take uncached experts heaviest
        # first and fetch one while that lowers max(device finish, host finish) (CostModel.lanes_us)
        dcost, hcost, fetch_us = self._costs(cost)
        tokens = max(max(n for _, n in misses), max((n for _, n in hits), default=1))
        paid = bool(hits) or cost.shared_bytes > 0
        dev = cost.device_call_us + cost.shared_us(tokens) + sum([dcost[n] for _, n in hits]) if paid else 0.0
        H = cost.host_lanes
        call_h = cost.host_call_us
        work, count = [0.0] * H, [0] * H
        for e, n in misses:
            work[e % H] += hcost[n]
            count[e % H] += 1
        best = max(dev, *[w + call_h if c else 0.0 for w, c in zip(work, count)])
        link = 0.0
        fetched: set[int] = set()
        for e, n in sorted(misses, key=lambda p: (-p[1], p[0])):
            nl = link + fetch_us
            nd = max(dev, nl) + dcost[n] + (0.0 if paid else cost.device_call_us)
            lane = e % H
            work[lane] -= hcost[n]
            count[lane] -= 1
            t = max(nd, *[w + call_h if c else 0.0 for w, c in zip(work, count)])
            if t < best:
                link, dev, best, paid = nl, nd, t, True
                fetched.add(e)
            else:
                work[lane] += hcost[n]
                count[lane] += 1
        return {e: (FETCH if e in fetched else HOST) for e, _ in misses}


class _Memo(dict):
    """``fn(n)`` per token count ``n``, computed once (``memo[n]``; a plain dict lookup after)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def __missing__(self, n: int) -> float:
        v = self[n] = self.fn(n)
        return v


@PLACEMENTS.register("min-cost")
class MinCost(Placement):
    name = "min-cost"
    needs_cost_model = True
    exact_limit: ClassVar[int] = 12

    def place(self, hits, misses, cost):
        if len(misses) > self.exact_limit:
            if not hasattr(self, "_greedy"):
                self._greedy = GreedyHSS()
            return self._greedy.place(hits, misses, cost)
        ordered = sorted(misses, key=lambda p: (-p[1], p[0]))
        tokens = max(max(n for _, n in misses), max((n for _, n in hits), default=1))
        best, best_set = float("inf"), ()
        for r in range(len(ordered) + 1):
            for chosen in itertools.combinations(ordered, r):
                host = [p for p in ordered if p not in chosen]
                t = max(lanes_us(hits, chosen, host, cost, tokens))
                if t < best - 1e-9:
                    best, best_set = t, chosen
        return {e: (FETCH if (e, n) in best_set else HOST) for e, n in misses}


def get_placement(name: str) -> Placement:
    """A new placement policy by registered name (did-you-mean error if unknown)."""
    if not isinstance(name, str):
        raise MoelabError(f"placement must be a registered name, got {name!r}.")
    return PLACEMENTS.get(name)()
