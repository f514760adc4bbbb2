"""The event schema every executor of the hybrid runtime writes, and the rules computed from it.

The events are the timeline of a hybrid run, as one open Parquet table (``events.parquet``).

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
                         the control thread), ``plan`` (the planner and routing policies
                         of a layer, control thread), ``dispatch`` (the control thread
                         submitting work to lanes and merging results), ``expert-device``, ``expert-host``,
                         ``expert-deferred``, ``transfer-demand``, ``transfer-prefetch``,
                         ``transfer-insert``, ``wait`` (the control thread waiting for lanes)
``expert``     int32     expert id, or -1 for a fused call over several experts
``tokens``     int32     (token, expert) pairs computed (0 for copies and dense work)
``bytes``      int64     bytes moved (copies) or weight bytes read (expert compute)
``t_start_us`` float64   start, µs since the run began (``time.perf_counter_ns``)
``t_end_us``   float64   end, µs since the run began
``cause``      string    why: for expert compute the expert's fate (``hit``, ``prefetch-hit``,
                         ``miss-host``, ``miss-fetch``, ``deferred``; older runs: ``hit+fetch``,
                         ``miss``), else ``demand``, ``prefetch``, ``insert``, ``copy`` …
=============  ========  ====================================================================

Lanes are named by prefix (``copy0``/``copy1`` for several copy engines, ``host0``.. for NUMA
nodes: any name starting with ``device``, ``host``, ``copy`` or ``control`` keeps its meaning).
Summaries (lane busy %, overlap, tokens/s) are computed from this table alone: :func:`summarize`
here, and the rest (stalls, critical path, comparisons) in :mod:`moelab.timeline`. This module
needs numpy only (no torch), so that reading a timeline stays light; the executors' event log is
:mod:`moelab.hybrid.events`.
"""

from __future__ import annotations

import numpy as np

COLUMNS = ("run", "step", "layer", "lane", "kind", "expert", "tokens", "bytes", "t_start_us", "t_end_us", "cause")


#: Lane names keep their meaning by prefix: ``copy0``/``copy1`` are copy engines, ``host0``.. NUMA nodes.
LANE_GROUPS = ("device", "host", "copy", "control")


def lane_group(lane: str) -> str:
    """``device``, ``host``, ``copy`` or ``control`` for a lane named with that prefix, else the name."""
    for g in LANE_GROUPS:
        if lane.startswith(g):
            return g
    return lane


def union(starts, ends):
    """The union of intervals ``[starts[i], ends[i])`` as sorted disjoint ``(starts, ends)`` arrays."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.size == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.r_[first[1:] - 1, s.size - 1]
    return s[first], reach[last]


def length(iv) -> float:
    """Total length of disjoint intervals ``(starts, ends)``."""
    return float((iv[1] - iv[0]).sum())


def busy_spans(df, lanes=None):
    """Busy intervals (a union) of the rows of ``df`` on ``lanes`` (all lanes if None), waits excluded.

    A lane is *busy* while it runs work; a ``wait`` event (a lane blocked on another) is idle time.
    """
    rows = df[df["kind"] != "wait"]
    if lanes is not None:
        rows = rows[rows["lane"].isin(list(lanes))]
    return union(rows["t_start_us"].to_numpy(), rows["t_end_us"].to_numpy())


def summarize(df) -> dict:
    """Lane busy %, host/device overlap % and wall time from an events DataFrame (pandas).

    * ``wall_us``: first start to last end over all events;
    * ``busy_pct[lane]``: the union of the lane's events other than ``wait`` over the wall time;
    * ``overlap_pct``: the share of the host side's busy time (lanes ``host*``) during which the
      device side (lanes ``device*``, or the control thread's work other than waits) was busy too.

    :class:`moelab.timeline.Timeline` reports these same figures (it calls this function).
    """
    if len(df) == 0:
        return {"wall_us": 0.0, "busy_pct": {}, "overlap_pct": 0.0}
    t0, t1 = float(df["t_start_us"].min()), float(df["t_end_us"].max())
    wall = max(t1 - t0, 1e-9)
    busy = {str(lane): 100.0 * length(busy_spans(g)) / wall for lane, g in df.groupby("lane", sort=True)}
    groups = df["lane"].map(lane_group)
    host = busy_spans(df[groups == "host"])
    dev = busy_spans(df[(groups == "device") | (groups == "control")])
    host_busy = length(host)
    both = host_busy + length(dev) - length(union(np.concatenate([host[0], dev[0]]),
                                                  np.concatenate([host[1], dev[1]])))
    return {
        "wall_us": wall,
        "busy_pct": busy,
        "overlap_pct": 100.0 * both / host_busy if host_busy else 0.0,
    }


#: What every tokens/s moelab prints means (run summaries, timelines, reports, notebooks).
RATE_BASIS = "decode tokens / decode wall (prefill and set-up excluded)"


def decode_rate(df, forwards) -> dict:
    """The one tokens/s of a run: tokens generated by decode forwards over those forwards' wall time.

    ``forwards``: one mapping per forward with ``step`` (the events' step), ``phase``, ``tokens``
    (tokens it generated) and ``wall_us`` (its own measured wall). A decode forward's wall is the
    span of its events where the run has events for it (so simulated runs are timed by their
    simulation), else its measured wall. Returns ``tokens_per_s`` (None without decode forwards),
    ``decode_tokens``, ``decode_wall_s``, ``decode_forwards`` and ``tokens_per_s_basis``.
    """
    dec = [f for f in forwards if f.get("phase") == "decode"]
    out = {"tokens_per_s": None, "decode_tokens": 0, "decode_wall_s": 0.0, "decode_forwards": len(dec),
           "tokens_per_s_basis": RATE_BASIS}
    if not dec:
        out["tokens_per_s_basis"] = RATE_BASIS + "; this run has no decode forwards"
        return out
    spans = {}
    if df is not None and len(df):
        g = df.groupby("step")
        spans = (g["t_end_us"].max() - g["t_start_us"].min()).to_dict()
    wall = sum(float(spans.get(f["step"], f.get("wall_us") or 0.0)) for f in dec)
    tokens = int(sum(int(f.get("tokens") or 0) for f in dec))
    out.update(decode_tokens=tokens, decode_wall_s=wall / 1e6, tokens_per_s=tokens / (wall / 1e6) if wall > 0 else None)
    return out
