"""The executors' event log (:class:`EventLog`): one thread-safe list of events with one clock.

The event schema (``COLUMNS``: run, step, layer, lane, kind, expert, tokens, bytes, t_start_us,
t_end_us, cause) and the summary rule (:func:`summarize`: lane busy %, overlap) live in
:mod:`moelab.events` (numpy only) and are re-exported here.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from moelab.events import COLUMNS, LANE_GROUPS, busy_spans, lane_group, length, summarize, union

__all__ = ["COLUMNS", "LANE_GROUPS", "Event", "EventLog", "busy_spans", "lane_group", "length", "summarize", "union"]


class Event(NamedTuple):
    """One event of the schema (:data:`COLUMNS`), read by attribute. A named tuple rather than a
    dataclass: :meth:`EventLog.add` makes it with ``tuple.__new__`` (a C call), where a dataclass's
    ``__init__`` is a Python frame, and the control thread records several events per MoE layer."""

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

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        with self._lock:
            evs = list(self.events)
        lanes = sorted({e.lane for e in evs})
        span = (max(e.t_end_us for e in evs) - min(e.t_start_us for e in evs)) / 1e3 if evs else 0.0
        return (f"EventLog(run {self.run!r}: {len(evs)} events over {span:.1f} ms on lanes "
                f"{', '.join(lanes) or '-'}; .table() for the Arrow table, moelab.Timeline(log) to read it)")

    def add(self, step: int, layer: int, lane: str, kind: str, t_start_us: float, t_end_us: float, *,
            expert: int = -1, tokens: int = 0, nbytes: int = 0, cause: str = "") -> None:
        """Size: one parameter per column of the event schema (moelab.events.COLUMNS).
        """
        ev = _new(Event, (self.run, step, layer, lane, kind, expert, tokens, nbytes, t_start_us, t_end_us, cause))
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


def control_span(log: EventLog, marks: dict[int, float], step: int, layer: int, kind: str, cause: str) -> float:
    """Record the control thread's work since its last mark for ``step`` as one event (``dense``
    attention/router, ``plan`` the planner and policies, ``dispatch`` handing work to lanes and
    merging their results), so no time of the control thread goes without a cause; returns now."""
    t = (time.perf_counter_ns() - log.t0) / 1e3  # log.now_us() inline: a call less, several per MoE layer
    start = marks.get(step, t)
    if t > start:  # log.add inline too (runs between a forward's layers, where each call costs µs)
        ev = _new(Event, (log.run, step, layer, "control", kind, -1, 0, 0, start, t, cause))
        with log._lock:
            log.events.append(ev)
    marks[step] = t
    return t


_new = tuple.__new__  # Event's fields in order, without NamedTuple's Python-level __new__
