"""Trace exports of timelines: Chrome trace JSON and Perfetto protobuf.

* :func:`to_chrome` — the Trace Event Format (opens in https://ui.perfetto.dev and
  ``chrome://tracing``): one process per timeline, one thread per lane (``"M"`` metadata events
  name and order them), a complete event (``"X"``) per event with its step, layer, expert, tokens,
  bytes, cause and fate as ``args``, a flow (``"s"`` → ``"f"``) from each copy to the device compute
  it feeds, and counters (``"C"``) for bytes in flight and the cache occupancy change.
* :func:`to_perfetto` — the same as a Perfetto ``Trace`` protobuf written with the ``perfetto``
  package's :class:`~perfetto.trace_builder.proto_builder.TraceProtoBuilder` (track descriptors
  for processes, lanes and counters; slice begin/end track events with debug annotations and flow
  ids; counter track events). The package's TraceProcessor is not used (it downloads a binary).

Timestamps are µs (Chrome) or ns (Perfetto) from each timeline's first event.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from moelab._output import write_file_atomic
from moelab.errors import MoelabError
from moelab.timeline.core import Timeline

#: what a Chrome trace file must hold, as a JSON schema (checked by the tests on parsed output)
CHROME_SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "traceEvents": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["ph", "pid"],
                "properties": {
                    "ph": {"enum": ["X", "M", "s", "f", "C"]},
                    "name": {"type": "string"},
                    "cat": {"type": "string"},
                    "ts": {"type": "number", "minimum": 0},
                    "dur": {"type": "number", "minimum": 0},
                    "pid": {"type": "integer"},
                    "tid": {"type": "integer"},
                    "id": {"type": "integer"},
                    "bp": {"const": "e"},
                    "args": {"type": "object"},
                },
                "allOf": [
                    {"if": {"properties": {"ph": {"const": "X"}}},
                     "then": {"required": ["name", "ts", "dur", "tid", "args"]}},
                    {"if": {"properties": {"ph": {"const": "M"}}},
                     "then": {"required": ["name", "args"],
                              "properties": {"name": {"enum": ["process_name", "thread_name", "process_sort_index",
                                                               "thread_sort_index"]}}}},
                    {"if": {"properties": {"ph": {"enum": ["s", "f"]}}},
                     "then": {"required": ["name", "ts", "tid", "id", "cat"]}},
                    {"if": {"properties": {"ph": {"const": "C"}}}, "then": {"required": ["name", "ts", "args"]}},
                ],
            },
        },
    },
}


def _as_list(timelines) -> list[Timeline]:
    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not tls:
        raise MoelabError("an export needs at least one Timeline.")
    return tls


def _write_atomic(path: str | Path, data: bytes | list[bytes]) -> str:
    return str(write_file_atomic(path, data if isinstance(data, bytes) else b"".join(data)))


def _threads(tl: Timeline) -> tuple[list[str], np.ndarray]:
    """Thread (track) names and each event's thread: its lane, or ``lane #2``.. for events that
    partially overlap earlier ones on the lane (thread slices must nest; serial lanes get one
    thread each). An event inside another one nests; a later overlapping one moves on."""
    ev = tl.events
    lanes = tl.lanes
    lane_code = ev["lane"].map({lane: k for k, lane in enumerate(lanes)}).to_numpy(dtype=np.int64)
    start, end = ev["t_start_us"].to_numpy(), ev["t_end_us"].to_numpy()
    sub = np.zeros(len(ev), dtype=np.int64)
    for k in range(len(lanes)):
        idx = np.flatnonzero(lane_code == k)  # time-sorted (Timeline sorts by start, then end)
        if idx.size < 2 or (start[idx[1:]] >= np.maximum.accumulate(end[idx])[:-1]).all():
            continue
        stacks: list[list[float]] = []  # per sub-thread: the ends of its open slices
        for i in idx.tolist():
            for j, st in enumerate(stacks):
                while st and st[-1] <= start[i]:
                    st.pop()
                if not st or end[i] <= st[-1]:  # free, or nests inside the innermost open slice
                    st.append(end[i])
                    sub[i] = j
                    break
            else:
                stacks.append([end[i]])
                sub[i] = len(stacks) - 1
    pairs = sorted(set(zip(lane_code.tolist(), sub.tolist(), strict=True)))
    names = [lanes[a] if b == 0 else f"{lanes[a]} #{b + 1}" for a, b in pairs]
    index = {p: n for n, p in enumerate(pairs)}
    code = np.fromiter((index[p] for p in zip(lane_code.tolist(), sub.tolist(), strict=True)), dtype=np.int64,
                       count=len(ev))
    return names, code


def _names(tl: Timeline) -> np.ndarray:
    """Slice names: ``kind``, then `` LN`` for the MoE layer and `` eN`` for single-expert work."""
    return np.asarray(_name_text(tl.events, slice(None)).to_pylist(), dtype=object)


def _name_text(ev: pd.DataFrame, sl: slice) -> pa.Array:
    """The slice names of rows ``sl`` as Arrow strings (without quotes; kinds are JSON-escaped)."""
    empty = pa.scalar("", pa.string())
    parts = [_dict_text(ev["kind"].iloc[sl], lambda c: json.dumps(str(c))[1:-1])]
    for col, prefix in (("layer", " L"), ("expert", " e")):
        v = pa.array(ev[col].to_numpy()[sl])
        txt = pc.binary_join_element_wise(pa.scalar(prefix, pa.string()), pc.cast(v, pa.string()), empty)
        parts.append(pc.if_else(pc.greater_equal(v, 0), txt, empty))
    return pc.binary_join_element_wise(*parts, empty)


def _dict_text(col: pd.Series, encode) -> pa.Array:
    """A categorical column as Arrow strings, ``encode`` applied once per category."""
    table = pa.array([encode(c) for c in col.cat.categories], pa.string())
    return pc.cast(pa.DictionaryArray.from_arrays(pa.array(col.cat.codes.to_numpy(), pa.int32()), table),
                   pa.string())


CHUNK = 500_000  # rows formatted at a time (Arrow string arrays hold < 2 GiB each)


def _text(values) -> pa.Array:
    """Numbers as JSON number text (floats rounded to 3 decimals, i.e. ns resolution in µs)."""
    arr = pa.array(values)
    if pa.types.is_floating(arr.type):
        arr = pc.round(arr, 3)
    return pc.cast(arr, pa.string())


def _rows(pieces: list, n: int) -> bytes:
    """Concatenate, row by row, string arrays and literal strings; every row ends with ``,\n``."""
    if n == 0:
        return b""
    parts = [p if isinstance(p, pa.Array) else pa.scalar(p, pa.string()) for p in [*pieces, ",\n"]]
    joined = pc.binary_join_element_wise(*parts, pa.scalar("", pa.string()))
    offsets = np.frombuffer(joined.buffers()[1], dtype=np.int32)[joined.offset: joined.offset + n + 1]
    return joined.buffers()[2].to_pybytes()[offsets[0]: offsets[-1]]


def to_chrome(timelines: Timeline | Sequence[Timeline], path: str | Path | None = None, *,
              labels: Sequence[str] | None = None) -> str:
    """Chrome trace JSON of one or several timelines; written atomically to ``path`` (returns the
    path) or returned as a string when ``path`` is None."""
    from moelab.timeline.figure import counter_series

    tls = _as_list(timelines)
    labels = list(labels) if labels is not None else [t.name for t in tls]
    body: list[bytes] = []
    meta: list[str] = []
    flow_id = 0
    for pid, (tl, label) in enumerate(zip(tls, labels, strict=True), start=1):
        ev = tl.events
        t0 = tl.t0
        threads, code = _threads(tl)
        tid_of = {name: k for k, name in enumerate(threads, start=1)}
        meta.append(json.dumps({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}}))
        meta.append(json.dumps({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}}))
        for lane, tid in tid_of.items():
            meta.append(json.dumps({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": lane}}))
            meta.append(json.dumps({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                                    "args": {"sort_index": tid}}))
        if not len(ev):
            continue
        tid = code + 1
        ts = ev["t_start_us"].to_numpy() - t0
        dur = ev["t_end_us"].to_numpy() - ev["t_start_us"].to_numpy()
        fates = pd.Series(pd.Categorical(tl.fates().to_numpy()))
        cols = {c: ev[c].to_numpy() for c in ("step", "layer", "expert", "tokens", "bytes")}
        head = '{"ph":"X","pid":' + str(pid) + ',"tid":'
        for a in range(0, len(ev), CHUNK):
            sl = slice(a, a + CHUNK)
            body.append(_rows([
                head, _text(tid[sl]), ',"name":"', _name_text(ev, sl), '","cat":',
                _dict_text(ev["kind"].iloc[sl], json.dumps), ',"ts":', _text(ts[sl]), ',"dur":', _text(dur[sl]),
                ',"args":{"step":', _text(cols["step"][sl]), ',"layer":', _text(cols["layer"][sl]),
                ',"expert":', _text(cols["expert"][sl]), ',"tokens":', _text(cols["tokens"][sl]),
                ',"bytes":', _text(cols["bytes"][sl]), ',"cause":', _dict_text(ev["cause"].iloc[sl], json.dumps),
                ',"fate":', _dict_text(fates.iloc[sl], json.dumps), "}}"], len(ts[sl])))
        f = tl.feeds()
        if len(f):
            tr, cp = f["tr"].to_numpy(), f["cp"].to_numpy()
            ids = np.arange(flow_id + 1, flow_id + 1 + tr.size)
            flow_id += tr.size
            for ph, rows in (("s", tr), ("f", cp)):
                bp = ',"bp":"e"' if ph == "f" else ""
                body.append(_rows([f'{{"ph":"{ph}"{bp},"pid":{pid},"tid":', _text(tid[rows]),
                                   ',"name":"copy→compute","cat":"flow","id":', _text(ids), ',"ts":',
                                   _text(ts[rows]), "}"], rows.size))
        for name, (x, y) in counter_series(tl).items():
            body.append(_rows(['{"ph":"C","pid":' + str(pid) + ',"name":' + json.dumps(name) + ',"ts":',
                               _text(x - t0), ',"args":{"MB":', _text(y / 1e6), "}}"], x.size))
    chunks = [b'{"displayTimeUnit":"ms","traceEvents":[\n', *body, ",\n".join(meta).encode(), b"\n]}\n"]
    if path is None:
        return b"".join(chunks).decode()
    return _write_atomic(path, chunks)


def to_perfetto(timelines: Timeline | Sequence[Timeline], path: str | Path | None = None, *,
                labels: Sequence[str] | None = None) -> str | bytes:
    """A Perfetto ``Trace`` protobuf of one or several timelines (``perfetto.trace_builder``);
    written atomically to ``path`` (returns the path) or returned as bytes when ``path`` is None.

    Size: long: the Perfetto packets of each timeline, track by track (lanes, counters, flows), in the order
    the trace format nests them.
    """
    try:
        from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
        from perfetto.trace_builder.proto_builder import TraceProtoBuilder
    except ImportError:
        raise MoelabError("the Perfetto export needs the `perfetto` package; pip install perfetto "
                          "(or export --format chrome, which Perfetto's UI opens too).") from None
    from moelab.timeline.figure import counter_series

    tls = _as_list(timelines)
    labels = list(labels) if labels is not None else [t.name for t in tls]
    builder = TraceProtoBuilder()
    seq = 1
    BEGIN, END, COUNTER = pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END, pb.TrackEvent.TYPE_COUNTER
    INSTANT = pb.TrackEvent.TYPE_INSTANT
    uuid = 0
    flow = 0
    for pid, (tl, label) in enumerate(zip(tls, labels, strict=True), start=1):
        uuid += 1
        proc = uuid
        p = builder.add_packet()
        p.track_descriptor.uuid = proc
        p.track_descriptor.process.pid = pid
        p.track_descriptor.process.process_name = label
        track = []
        threads, code = _threads(tl)
        for tid, lane in enumerate(threads, start=1):
            uuid += 1
            track.append(uuid)
            p = builder.add_packet()
            p.track_descriptor.uuid = uuid
            p.track_descriptor.parent_uuid = proc
            p.track_descriptor.thread.pid = pid
            p.track_descriptor.thread.tid = pid * 1000 + tid
            p.track_descriptor.thread.thread_name = lane
        ev = tl.events
        if not len(ev):
            continue
        t0 = tl.t0
        f = tl.feeds()
        out_flow: dict[int, int] = {}
        in_flow: dict[int, int] = {}
        for t, c in zip(f["tr"].tolist(), f["cp"].tolist(), strict=True):
            flow += 1
            out_flow[t] = flow
            in_flow[c] = flow
        names = _names(tl).tolist()
        kinds = ev["kind"].to_numpy().astype(object).tolist()
        causes = ev["cause"].to_numpy().astype(object).tolist()
        fates = tl.fates().tolist()
        tracks = np.asarray(track, dtype=np.int64)[code].tolist()
        s_ns = np.rint((ev["t_start_us"].to_numpy() - t0) * 1e3).astype(np.int64)
        e_ns = np.rint((ev["t_end_us"].to_numpy() - t0) * 1e3).astype(np.int64)
        start, end = s_ns.tolist(), e_ns.tolist()
        ints = {c: ev[c].tolist() for c in ("step", "layer", "expert", "tokens", "bytes")}
        # packets in an order in which every track's slices nest: by time; at one time, ends before
        # begins, the inner slice's end first and the outer slice's begin first; an event of no
        # duration is an instant
        n = len(ev)
        instant = s_ns == e_ns
        is_end = np.r_[np.zeros(n, dtype=np.int64), np.ones(n, dtype=np.int64)]
        ts = np.r_[s_ns, e_ns]
        tie = np.r_[-e_ns, -s_ns]
        which = np.r_[np.arange(n), np.arange(n)]
        keep = np.r_[np.ones(n, dtype=bool), ~instant]
        order = np.lexsort((tie[keep], 1 - is_end[keep], ts[keep]))
        add = builder.trace.packet.add
        for k, i in zip(is_end[keep][order].tolist(), which[keep][order].tolist(), strict=True):
            if k:
                p = add(timestamp=end[i], trusted_packet_sequence_id=seq)
                p.track_event.type = END
                p.track_event.track_uuid = tracks[i]
                continue
            p = add(timestamp=start[i], trusted_packet_sequence_id=seq)
            te = p.track_event
            te.type = INSTANT if start[i] == end[i] else BEGIN
            te.track_uuid = tracks[i]
            te.name = names[i]
            te.categories.append(kinds[i])
            da = te.debug_annotations
            da.add(name="step", int_value=ints["step"][i])
            da.add(name="layer", int_value=ints["layer"][i])
            da.add(name="expert", int_value=ints["expert"][i])
            da.add(name="tokens", int_value=ints["tokens"][i])
            da.add(name="bytes", int_value=ints["bytes"][i])
            da.add(name="cause", string_value=causes[i])
            da.add(name="fate", string_value=fates[i])
            if i in out_flow:
                te.flow_ids.append(out_flow[i])
            if i in in_flow:
                te.terminating_flow_ids.append(in_flow[i])
        for name, (x, y) in counter_series(tl).items():
            uuid += 1
            p = builder.add_packet()
            p.track_descriptor.uuid = uuid
            p.track_descriptor.parent_uuid = proc
            p.track_descriptor.name = f"{name} (MB)"
            p.track_descriptor.counter.SetInParent()
            for ts, v in zip(np.rint((x - t0) * 1e3).astype(np.int64).tolist(), (y / 1e6).tolist(), strict=True):
                p = builder.add_packet()
                p.timestamp = ts
                p.trusted_packet_sequence_id = seq
                p.track_event.type = COUNTER
                p.track_event.track_uuid = uuid
                p.track_event.double_counter_value = v
    data = builder.serialize()
    if path is None:
        return data
    return _write_atomic(path, data)
