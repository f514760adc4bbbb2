"""The events every executor emits: the timeline of a hybrid run, as one open Parquet table.

One row per unit of work on a lane:

=============  ========  ====================================================================
column         type      meaning
=============  ========  ====================================================================
``run``        string    run id (one per :class:`~moelab.hybrid.HybridRun` application)
``step``       int32     forward ordinal within the run (0 = the first forward)
``layer``      int32     MoE layer ordinal (-1 for work outside MoE layers)
``lane``       string    ``device`` (GPU compute, or the CPU worker standing in for it),
                         ``host`` (CPU experts), ``copy`` (host→device copies),
                         ``control`` (the thread running the model's Python code)
``kind``       string    ``dense`` (attention, norms and router between two MoE layers, on
                         the control thread), ``expert-device``, ``expert-host``,
                         ``expert-deferred``, ``transfer-demand``, ``transfer-prefetch``,
                         ``transfer-insert``, ``wait`` (the control thread waiting for lanes)
``expert``     int32     expert id, or -1 for a fused call over several experts
``tokens``     int32     (token, expert) pairs computed (0 for copies and dense work)
``bytes``      int64     bytes moved (copies) or weight bytes read (expert compute)
``t_start_us`` float64   start, µs since the run began (``time.perf_counter_ns``)
``t_end_us``   float64   end, µs since the run began
``cause``      string    why: ``hit``, ``miss``, ``demand``, ``prefetch``, ``insert``,
                         ``deferred`` …
=============  ========  ====================================================================

Summaries (lane busy %, overlap, tokens/s) are computed from this table alone.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

COLUMNS = ("run", "step", "layer", "lane", "kind", "expert", "tokens", "bytes", "t_start_us", "t_end_us", "cause")


@dataclass
class Event:
    run: str
    step: int
    layer: int
    lane: str
    kind: str
    expert: int
    tokens: int
    bytes: int
    t_start_us: float
    t_end_us: float
    cause: str = ""


class EventLog:
    """A thread-safe list of events with one clock."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.t0 = time.perf_counter_ns()
        self.events: list[Event] = []
        self._lock = threading.Lock()

    def now_us(self) -> float:
        return (time.perf_counter_ns() - self.t0) / 1e3

    def add(self, step: int, layer: int, lane: str, kind: str, t_start_us: float, t_end_us: float, *,
            expert: int = -1, tokens: int = 0, nbytes: int = 0, cause: str = "") -> None:
        ev = Event(self.run, step, layer, lane, kind, expert, tokens, nbytes, t_start_us, t_end_us, cause)
        with self._lock:
            self.events.append(ev)

    def table(self):
        """The events as a pyarrow Table (the Parquet schema)."""
        import pyarrow as pa

        with self._lock:
            evs = list(self.events)
        schema = pa.schema([
            ("run", pa.string()), ("step", pa.int32()), ("layer", pa.int32()), ("lane", pa.string()),
            ("kind", pa.string()), ("expert", pa.int32()), ("tokens", pa.int32()), ("bytes", pa.int64()),
            ("t_start_us", pa.float64()), ("t_end_us", pa.float64()), ("cause", pa.string()),
        ])
        cols = {c: [getattr(e, c) for e in evs] for c in COLUMNS}
        return pa.table(cols, schema=schema)


def summarize(df) -> dict:
    """Lane busy %, overlap and wall time from an events DataFrame (pandas).

    ``overlap_pct``: the share of the host lane's busy time during which the device side
    (device lane or the control thread's dense work) was busy too.
    """
    if len(df) == 0:
        return {"wall_us": 0.0, "busy_pct": {}, "overlap_pct": 0.0}
    t0, t1 = float(df["t_start_us"].min()), float(df["t_end_us"].max())
    wall = max(t1 - t0, 1e-9)
    busy = {}
    for lane, g in df.groupby("lane"):
        iv = _merge(list(zip(g["t_start_us"], g["t_end_us"], strict=True)))
        busy[lane] = 100.0 * sum(b - a for a, b in iv) / wall

    def spans(rows) -> list[tuple[float, float]]:
        return _merge(list(zip(rows["t_start_us"], rows["t_end_us"], strict=True)))

    host = spans(df[df["lane"].astype(str).str.startswith("host")])  # host, or host0.. per NUMA node
    # the device side: device-lane compute and the control thread's dense work (not its waits)
    dev = spans(df[(df["lane"] == "device") | ((df["lane"] == "control") & (df["kind"] != "wait"))])
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in host for c, d in dev)
    host_busy = sum(b - a for a, b in host)
    return {
        "wall_us": wall,
        "busy_pct": busy,
        "overlap_pct": 100.0 * overlap / host_busy if host_busy else 0.0,
    }


def _merge(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
