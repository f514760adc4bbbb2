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
                 (by the cost model); then, while the host would finish first, it steals
                 the device's lightest cached experts (a hit computed on the host) while
                 that makes the layer finish earlier.
``min-cost``     Fiddler's idea: the split of the misses (and of the hits, which the host
                 may compute too) that minimises the **later** of the two lanes (the
                 makespan), exactly for up to 12 experts, greedily (``greedy-hss``) beyond. Fiddler's published code minimises the *sum* of the lanes' costs;
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
    steal: ClassVar[bool] = False
    """True if the placement may put hits on the host: the planner then asks it even when a layer
    has no misses."""

    def place(self, hits: list[tuple[int, int]], misses: list[tuple[int, int]],
              cost: CostModel | None) -> dict[int, str]:  # pragma: no cover - abstract
        """``hits``/``misses``: (expert, tokens) pairs; returns expert → ``host`` | ``fetch`` for
        every miss, and optionally ``host`` for a hit the host computes instead of the device
        (a hit not named runs on the device)."""
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
    steal = True
    """The host takes cached experts when it would otherwise idle (HybriMoE §IV-B)."""

    def __init__(self) -> None:
        self._cost: CostModel | None = None

    def _costs(self, cost: CostModel):
        # per-token-count costs, kept while the same cost model is passed (one per planner)
        if cost is not self._cost:
            self._cost = cost
            self._memo = (_Memo(cost.device_us), _Memo(cost.host_us), cost.fetch_us())
        return self._memo

    def place(self, hits, misses, cost):
        # incremental form of HybriMoE's rules: start with the hits on the device and every miss on
        # its host lane; (1) PCIe: take uncached experts heaviest first and fetch one while that
        # lowers max(device finish, host finish) (CostModel.lanes_us); (2) steal: while the host
        # finishes first, give it the device's lightest cached expert (the device runs its hits
        # heaviest first, so the lightest is the last it would start) while that lowers the max
        dcost, hcost, fetch_us = self._costs(cost)
        tokens = max(max((n for _, n in misses), default=1), max((n for _, n in hits), default=1))
        paid = bool(hits) or cost.shared_bytes > 0
        sync = cost.profile.sync_us  # after both lanes, once the device has work (CostModel.lanes_us)
        dev = cost.device_call_us + cost.shared_us(tokens) + sum([dcost[n] for _, n in hits]) if paid else 0.0
        H = cost.host_lanes
        call_h = cost.host_call_us
        work, count, read = [0.0] * H, [0] * H, [0.0] * H
        for e, n in misses:
            work[e % H] += hcost[n]
            count[e % H] += 1
            read[e % H] += cost.expert_bytes  # a host expert, or the copy of a fetched one, reads its node
        node = cost.node_cap if not cost.profile.device_shares_host_memory else float("inf")

        def host_end() -> float:
            return max([max(w + call_h, r / node) if c else 0.0 for w, c, r in zip(work, count, read)])

        best = max(dev, host_end()) + (sync if paid else 0.0)
        link = 0.0
        out: dict[int, str] = {e: HOST for e, _ in misses}
        fetched: list[tuple[int, int]] = []
        for e, n in sorted(misses, key=lambda p: (-p[1], p[0])):
            nl = link + fetch_us
            nd = max(dev, nl) + dcost[n] + (0.0 if paid else cost.device_call_us)
            lane = e % H
            work[lane] -= hcost[n]
            count[lane] -= 1
            t = max(nd, host_end()) + sync
            if t < best:
                link, dev, best, paid = nl, nd, t, True
                out[e] = FETCH
                fetched.append((e, n))
            else:
                work[lane] += hcost[n]
                count[lane] += 1
        if self.steal and hits:
            # the device's finish without a stolen hit: its fetched experts still wait for their copies
            cached = sorted(hits, key=lambda p: (p[1], p[0]))  # lightest first
            kept = list(hits)
            for e, n in cached:
                if host_end() >= dev:
                    break
                lane = e % H
                work[lane] += hcost[n]
                count[lane] += 1
                read[lane] += cost.expert_bytes
                kept.remove((e, n))
                nd = cost.device_finish_us(kept, fetched, tokens=tokens)
                t = max(nd, host_end()) + (sync if nd else 0.0)
                if t < best:
                    dev, best = nd, t
                    out[e] = HOST
                else:
                    work[lane] -= hcost[n]
                    count[lane] -= 1
                    read[lane] -= cost.expert_bytes
                    kept.append((e, n))
                    break
        return out


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
    """The exact makespan split for up to :attr:`exact_limit` experts (misses and hits together),
    :class:`GreedyHSS` beyond.

    :meth:`place` enumerates every split in a fixed order (misses fetched: by size of the chosen
    set, then ``itertools.combinations`` order of the misses sorted heaviest first; hits stolen:
    the same, inner) and keeps the first split strictly cheaper than the best so far. It evaluates
    :meth:`~moelab.timing.costs.CostModel.lanes_us`'s arithmetic inline, in the same operation
    order (so the same floats and the same decisions as :meth:`place_reference`, which calls the
    cost model for every split), with what does not depend on the split computed once: the
    per-token-count costs, each stolen set's resident-device time, and each fetched set's host
    lanes before stealing. Up to 2^12 splits per layer; about 6× faster than the reference."""

    name = "min-cost"
    needs_cost_model = True
    steal = True
    exact_limit: ClassVar[int] = 12

    def _greedy_place(self, hits, misses, cost):
        if not hasattr(self, "_greedy"):
            self._greedy = GreedyHSS()
        return self._greedy.place(hits, misses, cost)

    @staticmethod
    def _decision(misses, best_set, best_stolen) -> dict[int, str]:
        out = {e: (FETCH if (e, n) in best_set else HOST) for e, n in misses}
        out.update({e: HOST for e, _ in best_stolen})
        return out

    def place_reference(self, hits, misses, cost):
        """The plain search: every split's lanes from the cost model (the definition :meth:`place`
        must equal)."""
        if len(misses) + len(hits) > self.exact_limit:
            return self._greedy_place(hits, misses, cost)
        ordered = sorted(misses, key=lambda p: (-p[1], p[0]))
        tokens = max(max((n for _, n in misses), default=1), max((n for _, n in hits), default=1))
        best, best_set, best_stolen = float("inf"), (), ()
        for r in range(len(ordered) + 1):
            for chosen in itertools.combinations(ordered, r):
                host = [p for p in ordered if p not in chosen]
                for s in range(len(hits) + 1):  # hits the host computes instead of the device
                    for stolen in itertools.combinations(hits, s):
                        kept = [p for p in hits if p not in stolen] if stolen else hits
                        t = max(lanes_us(kept, chosen, host + list(stolen), cost, tokens))
                        if t < best - 1e-9:
                            best, best_set, best_stolen = t, chosen, stolen
        return self._decision(misses, best_set, best_stolen)

    def place(self, hits, misses, cost):
        """:meth:`place_reference`'s decisions, with the cost model's arithmetic inline.

        Size: one search loop; splitting it would pass its dozen precomputed locals around."""
        if len(misses) + len(hits) > self.exact_limit:
            return self._greedy_place(hits, misses, cost)
        ordered = sorted(misses, key=lambda p: (-p[1], p[0]))
        tokens = max(max((n for _, n in misses), default=1), max((n for _, n in hits), default=1))
        H = cost.host_lanes
        call_d, call_h, sync = cost.device_call_us, cost.host_call_us, cost.profile.sync_us
        fetch_us, eb, node_cap = cost.fetch_us(), cost.expert_bytes, cost.node_cap
        capped = not cost.profile.device_shares_host_memory
        dcost = {n: cost.device_us(n) for _, n in (*hits, *misses)}
        hcost = {n: cost.host_us(n) for _, n in (*hits, *misses)}
        # per stolen set, in the reference's order: (stolen, the resident device time, paid)
        steals = []
        for s in range(len(hits) + 1):
            for stolen in itertools.combinations(hits, s):
                kept = [p for p in hits if p not in stolen] if stolen else hits
                if kept or cost.shared_bytes:
                    steals.append((stolen, call_d + cost.shared_us(tokens) + sum(dcost[n] for _, n in kept), True))
                else:
                    steals.append((stolen, 0.0, False))
        best, best_set, best_stolen = float("inf"), (), ()
        for r in range(len(ordered) + 1):
            for chosen in itertools.combinations(ordered, r):
                host_lanes = [0.0] * H
                n_host = 0
                for p in ordered:
                    if p not in chosen:
                        lane = p[0] % H
                        host_lanes[lane] += (call_h if host_lanes[lane] == 0.0 else 0.0) + hcost[p[1]]
                        n_host += 1
                read0 = None
                if chosen and capped:
                    read0 = [0.0] * H
                    for p in ordered:
                        if p not in chosen:
                            read0[p[0] % H] += eb
                for stolen, dev, paid in steals:
                    link = 0.0
                    for _, n in chosen:
                        link += fetch_us
                        dev = max(dev, link) + dcost[n] + (0.0 if paid else call_d)
                        paid = True
                    lanes = host_lanes
                    if stolen:
                        lanes = host_lanes.copy()
                        for e, n in stolen:
                            lane = e % H
                            lanes[lane] += (call_h if lanes[lane] == 0.0 else 0.0) + hcost[n]
                    if read0 is not None and (n_host or stolen):
                        read = read0.copy()
                        for e, _ in stolen:
                            read[e % H] += eb
                        for e, _ in chosen:
                            read[e % H] += eb
                        lanes = [max(t, r_ / node_cap) if t else t for t, r_ in zip(lanes, read)]
                    host_end = max(lanes)
                    t = max(dev + sync, host_end + sync) if dev else max(dev, host_end)
                    if t < best - 1e-9:
                        best, best_set, best_stolen = t, chosen, stolen
        return self._decision(misses, best_set, best_stolen)


def get_placement(name: str) -> Placement:
    """A new placement policy by registered name (did-you-mean error if unknown)."""
    if not isinstance(name, str):
        raise MoelabError(f"placement must be a registered name, got {name!r}.")
    return PLACEMENTS.get(name)()
