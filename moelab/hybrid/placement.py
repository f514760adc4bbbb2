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

A cost model (:class:`CostModel`) turns (expert, tokens) into microseconds per lane and
per copy; ``greedy-hss`` and ``min-cost`` need one (``HybridConfig.hardware``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from moelab.errors import MoelabError
from moelab.registry import Registry
from moelab.timing import Link

HOST, FETCH = "host", "fetch"


@dataclass(frozen=True)
class CostModel:
    """Roofline costs of one routed expert on each lane (times in µs, bandwidths in GB/s)."""

    expert_bytes: int
    """Bytes of one expert's weights."""
    flops_per_token: float
    """FLOPs of one token through one expert (2 × 3 × hidden × intermediate for a gated MLP)."""
    device_bandwidth_gbs: float
    device_tflops: float
    host_bandwidth_gbs: float
    host_tflops: float
    link_bandwidth_gbs: float
    link_latency_us: float
    launch_us: float = 5.0
    """Fixed cost of one device kernel launch (assumed)."""

    def device_us(self, tokens: int) -> float:
        return self.launch_us + max(self.expert_bytes / (self.device_bandwidth_gbs * 1e3),
                                    tokens * self.flops_per_token / (self.device_tflops * 1e6))

    def host_us(self, tokens: int) -> float:
        return max(self.expert_bytes / (self.host_bandwidth_gbs * 1e3),
                   tokens * self.flops_per_token / (self.host_tflops * 1e6))

    def fetch_us(self) -> float:
        """One expert over the host→device link (:class:`moelab.timing.Link`, the one link model)."""

        return Link(self.link_bandwidth_gbs, self.link_latency_us).transfer_us(self.expert_bytes)

    @classmethod
    def from_profile(cls, profile, expert_bytes: int, flops_per_token: float) -> CostModel:
        """From a hardware profile; peak FLOP rates the profile does not state are assumed
        (device 100 TFLOP/s, host 1 TFLOP/s: a bf16 GPU and a many-core AVX-512 server)."""
        return cls(
            expert_bytes=int(expert_bytes),
            flops_per_token=float(flops_per_token),
            device_bandwidth_gbs=float(profile.gpu_memory_bandwidth_gbs),
            device_tflops=float(getattr(profile, "gpu_peak_tflops", 100.0)),
            host_bandwidth_gbs=float(profile.cpu_memory_bandwidth_gbs),
            host_tflops=float(getattr(profile, "cpu_peak_tflops", 1.0)),
            link_bandwidth_gbs=float(profile.link_bandwidth_gbs),
            link_latency_us=float(profile.link_latency_us),
        )


def lanes_us(hits: Sequence[tuple[int, int]], fetch: Sequence[tuple[int, int]],
             host: Sequence[tuple[int, int]], cost: CostModel) -> tuple[float, float]:
    """(device finish, host finish) of one layer: the device runs hits, then each fetched
    expert once its copy (FIFO on the link) and the device are both free."""
    dev = sum(cost.device_us(n) for _, n in hits)
    link = 0.0
    for _, n in fetch:
        link += cost.fetch_us()
        dev = max(dev, link) + cost.device_us(n)
    return dev, sum(cost.host_us(n) for _, n in host)


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
        # incremental form of: start with every miss on the host; take uncached experts heaviest
        # first and fetch one while that lowers max(device finish, host finish) (lanes_us)
        dcost, hcost, fetch_us = self._costs(cost)
        dev = sum([dcost[n] for _, n in hits])
        host = sum([hcost[n] for _, n in misses])
        link = 0.0
        best = max(dev, host)
        fetched: set[int] = set()
        for e, n in sorted(misses, key=lambda p: (-p[1], p[0])):
            nl = link + fetch_us
            nd = max(dev, nl) + dcost[n]
            nh = host - hcost[n]
            if max(nd, nh) < best:
                link, dev, host, best = nl, nd, nh, max(nd, nh)
                fetched.add(e)
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
        best, best_set = float("inf"), ()
        for r in range(len(ordered) + 1):
            for chosen in itertools.combinations(ordered, r):
                host = [p for p in ordered if p not in chosen]
                t = max(lanes_us(hits, chosen, host, cost))
                if t < best - 1e-9:
                    best, best_set = t, chosen
        return {e: (FETCH if (e, n) in best_set else HOST) for e, n in misses}


def get_placement(name: str) -> Placement:
    """A new placement policy by registered name (did-you-mean error if unknown)."""
    if not isinstance(name, str):
        raise MoelabError(f"placement must be a registered name, got {name!r}.")
    return PLACEMENTS.get(name)()
