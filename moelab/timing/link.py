"""The one link model: a transfer costs ``latency + bytes / bandwidth`` on a FIFO queue.

A :class:`Link` (host→device copy engine, PCIe or NVLink-C2C) serves transfers one at a
time in the order they were requested: a transfer starts when the link is free **and**
its request time has come, and ends ``transfer_us(nbytes)`` later. Everything in moelab
that needs copy times uses it:

* GoodPred's in-time schedule (:func:`moelab.predictors.timing.in_time_schedule`) queues
  each prediction's experts on one FIFO link and checks they arrive before their layer;
* cache prefetch budgets (:meth:`moelab.caches.simulation.PrefetchConfig.from_link`,
  ``from_profile``) count the transfers that fit in one step: the FIFO schedule of
  back-to-back transfers all requested at the step's start (:meth:`Link.transfers_within`).

Units: GB/s (10^9 bytes per second), bytes, microseconds.

>>> link = Link(bandwidth_gbs=25.0, latency_us=10.0)
>>> link.transfer_us(1_000_000)                 # 10 + 1e6 / 25e3
50.0
>>> fifo_schedule(link, ready_us=[0, 0, 200], nbytes=1_000_000)
(array([  0.,  50., 200.]), array([ 50., 100., 250.]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from moelab.errors import MoelabError

if TYPE_CHECKING:  # numpy is imported when a schedule is computed: the CLI's --help stays light
    import numpy as np

#: Slack (µs) when comparing an arrival with a deadline: float sums of transfer times that
#: land exactly on a deadline count as in time.
EPS_US = 1e-9


@dataclass(frozen=True)
class Link:
    """A host→device link: ``bandwidth_gbs`` GB/s, ``latency_us`` fixed cost per transfer."""

    bandwidth_gbs: float
    latency_us: float = 0.0

    def __post_init__(self) -> None:
        bw, lat = self.bandwidth_gbs, self.latency_us
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0 or math.isinf(bw):
            raise MoelabError(f"link bandwidth_gbs must be a finite number > 0 (GB/s), got {bw!r}.")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not lat >= 0 or math.isinf(lat):
            raise MoelabError(f"link latency_us must be a finite number ≥ 0 (µs), got {lat!r}.")

    def transfer_us(self, nbytes: float) -> float:
        """Time of one transfer of ``nbytes``: latency + bytes / bandwidth."""
        if not nbytes >= 0:
            raise MoelabError(f"a transfer moves ≥ 0 bytes, got {nbytes!r}.")
        return self.latency_us + nbytes / (self.bandwidth_gbs * 1e3)

    def transfers_within(self, window_us: float, nbytes: float) -> int:
        """How many back-to-back transfers of ``nbytes``, all requested at time 0, end by
        ``window_us`` on this FIFO link (the n-th ends at ``n × transfer_us``)."""
        if not window_us >= 0:
            raise MoelabError(f"the time window must be ≥ 0 µs, got {window_us!r}.")
        xfer = self.transfer_us(nbytes)
        if xfer <= 0:
            raise MoelabError("a zero-time transfer (0 bytes on a link without latency) fits without bound; "
                              "give expert_bytes ≥ 1.")
        return int(math.floor(window_us / xfer * (1 + 1e-12) + EPS_US))

    def queue(self, free_at_us: float = -math.inf) -> LinkQueue:
        """A stateful FIFO queue on this link, free from ``free_at_us`` on."""
        return LinkQueue(self, free_at_us)


class LinkQueue:
    """A FIFO queue on a :class:`Link`, for callers that issue transfers one by one.

    ``request(ready_us, nbytes)`` returns ``(start, end)``: the transfer starts at
    ``max(link free, ready_us)`` and the link is busy until ``end``. Requests must be made
    in FIFO order (the order the copy engine sees them), not necessarily by ready time.
    """

    def __init__(self, link: Link, free_at_us: float = -math.inf) -> None:
        self.link = link
        self.free_at_us = float(free_at_us)

    def request(self, ready_us: float, nbytes: float) -> tuple[float, float]:
        start = max(self.free_at_us, float(ready_us))
        end = start + self.link.transfer_us(nbytes)
        self.free_at_us = end
        return start, end


def fifo_schedule(
    link: Link, ready_us: Sequence[float] | np.ndarray, nbytes: float | Sequence[float] | np.ndarray,
    *, free_at_us: float = -math.inf,
) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) µs of transfers queued in the given order on one FIFO ``link``.

    ``ready_us[i]`` is when transfer i is requested; ``nbytes`` is one size for all or one
    per transfer; the link is free from ``free_at_us`` on.
    """
    import numpy as np

    ready = np.asarray(ready_us, dtype=np.float64).reshape(-1)
    sizes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), ready.shape)
    start = np.empty_like(ready)
    end = np.empty_like(ready)
    q = LinkQueue(link, free_at_us)
    for i in range(len(ready)):
        start[i], end[i] = q.request(ready[i], sizes[i])
    return start, end


__all__ = ["EPS_US", "Link", "LinkQueue", "fifo_schedule"]
