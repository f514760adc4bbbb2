"""The interactive timeline figure (plotly): one row per lane, bars coloured by fate or kind.

Bars are drawn as WebGL line segments (``Scattergl``, NaN-separated: one trace per colour, not one
shape per event) with an invisible marker at each bar's middle that carries the hover (step,
layer, expert, tokens, bytes, cause, start, duration). Flows (thin lines) join a copy to the
device compute it feeds (:meth:`~moelab.timeline.Timeline.feeds`); a second row holds the
counters: bytes in flight on the copy lanes and, where the events record evictions, the change
of the device cache's occupancy (bytes copied in minus bytes evicted).

Level of detail: at most ``detail_budget`` events are drawn one by one (the first steps of the
selection, or all of it when it is small enough); the next steps are drawn as one bar per (lane,
step, layer) — the span of that layer's work on the lane, coloured by what took most of its
time — up to ``aggregate_budget`` bars, and the rest as one bar per (lane, step). The title says
which steps are drawn at which level; pick steps (``steps=``, or the panel in
:mod:`moelab.timeline.widgets`) to see other steps' single experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from moelab.errors import MoelabError
from moelab.timeline.core import FATES, Timeline, lane_order

#: colour per category: an expert's fate, or an event's kind for other work
COLORS: dict[str, str] = {
    "hit": "#2ca02c", "prefetch-hit": "#98df8a", "miss-host": "#1f77b4", "miss-fetch": "#d62728",
    "deferred": "#9467bd", "expert-device": "#2ca02c", "expert-host": "#1f77b4", "expert-deferred": "#9467bd",
    "dense": "#7f7f7f", "plan": "#c49c94", "dispatch": "#dbdb8d", "wait": "#e0e0e0", "transfer-demand": "#ff7f0e", "transfer-prefetch": "#ffbb78",
    "transfer-insert": "#bcbd22", "evict": "#8c564b", "other": "#17becf",
}
ORDER = [*FATES, "expert-device", "expert-host", "expert-deferred", "dense", "plan", "dispatch", "transfer-demand",
         "transfer-prefetch", "transfer-insert", "evict", "wait"]
MAX_FLOWS = 20_000
MAX_COUNTER_POINTS = 20_000


def categories(tl: Timeline, color_by: str = "fate") -> np.ndarray:
    """The colour category of each event: its fate (expert compute) or kind (``color_by='fate'``),
    or its kind (``color_by='kind'``)."""
    if color_by not in ("fate", "kind"):
        raise MoelabError(f"color_by={color_by!r}: expected 'fate' or 'kind'.")
    kind = tl.events["kind"].to_numpy().astype(object)
    if color_by == "kind":
        return kind
    fate = tl.fates().to_numpy()
    return np.where(fate != "", fate, kind)


def timeline_figure(timelines: Timeline | Sequence[Timeline], *, labels: Sequence[str] | None = None,
                    steps=None, layers=None, color_by: str = "fate", detail_budget: int = 40_000,
                    aggregate_budget: int = 30_000, flows: bool = True, counters: bool = True,
                    critical_path: int | None = None, title: str | None = None,
                    origins: Sequence[float] | None = None, rows: Sequence[tuple[int, str]] | None = None) -> Any:
    """A plotly figure of one or several timelines on one time axis (ms from each one's start).

    Several timelines (a real and a simulated run, configurations A and B) are overlaid: each lane
    gets one row per timeline, labelled ``label · lane``. ``steps``/``layers`` select events
    (lists or inclusive ``(lo, hi)`` ranges); ``critical_path=STEP`` draws that step's critical path
    (:meth:`~moelab.timeline.Timeline.critical_path`) as a black chain over its events.
    ``origins`` (µs, one per timeline; default each one's first event) and ``rows`` (``(timeline
    index, lane)`` pairs) pin the axes, so that a redrawn part of a figure lines up with it
    (``counters="always"`` keeps the counter row even where the part has no copies).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from plotly.subplots import make_subplots

    tls = [timelines] if isinstance(timelines, Timeline) else list(timelines)
    if not tls:
        raise MoelabError("timeline_figure needs at least one Timeline.")
    labels = list(labels) if labels is not None else [t.name for t in tls]
    if len(set(labels)) < len(labels):
        labels = [f"{n} ({i})" for i, n in enumerate(labels)]
    tls = [t.select(steps=steps, layers=layers) if steps is not None or layers is not None else t for t in tls]
    if rows is None:
        lanes = lane_order({lane for t in tls for lane in t.lanes})
        rows = [(i, lane) for lane in lanes for i, t in enumerate(tls) if lane in t.lanes]
    rows = [(int(i), str(lane)) for i, lane in rows]
    row_of = {r: k for k, r in enumerate(rows)}
    row_names = [f"{labels[i]} · {lane}" if len(tls) > 1 else lane for i, lane in rows]
    width = float(max(2, min(16, 360 / max(len(rows), 1))))

    has_counters = counters == "always" or (counters and any(t.events["kind"].str.startswith("transfer").any()
                                                             for t in tls))
    fig = make_subplots(rows=2 if has_counters else 1, cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        row_heights=[0.78, 0.22] if has_counters else [1.0])
    per_cat: dict[str, list[dict[str, np.ndarray]]] = {}
    notes = []
    share = max(detail_budget // len(tls), 1)
    for i, t in enumerate(tls):
        if not len(t):
            continue
        ev = t.events
        t0 = t.t0 if origins is None else float(origins[i])
        cat = categories(t, color_by)
        codes, names = pd.factorize(cat)
        detail_steps, layer_steps = _levels(ev, share, max(aggregate_budget // len(tls), 1))
        step = ev["step"].to_numpy()
        in_detail = np.isin(step, detail_steps)
        in_layer = np.isin(step, layer_steps)
        missing = [lane for lane in t.lanes if (i, lane) not in row_of]
        if missing:
            raise MoelabError(f"rows= has no row for lane(s) {missing} of timeline {i}; include them or leave rows unset.")
        lane_row = ev["lane"].map({lane: row_of[(i, lane)] for lane in t.lanes}).to_numpy(dtype=np.float64)
        idx = np.flatnonzero(in_detail)
        for c in pd.unique(cat[idx]):
            m = idx[cat[idx] == c]
            per_cat.setdefault(str(c), []).append(_detail_bars(ev, m, lane_row, t0, labels[i]))
        for level, mask in (("layer", in_layer), ("step", ~in_detail & ~in_layer)):
            if mask.any():
                for c, bars in _aggregate(ev, mask, codes, names, lane_row, t0, labels[i],
                                          by_layer=level == "layer").items():
                    per_cat.setdefault(c, []).append(bars)
        notes.append(_note(labels[i] if len(tls) > 1 else "", detail_steps, layer_steps, t.steps))
        if flows:
            _add_flows(fig, t, in_detail, lane_row, t0, showlegend=i == 0)
        if has_counters:
            _add_counters(fig, t, t0, labels[i] if len(tls) > 1 else "")
        if critical_path is not None and critical_path in t.steps:
            _add_critical_path(fig, t, critical_path, lane_row, t0, labels[i] if len(tls) > 1 else "")
    for c in sorted(per_cat, key=lambda c: ORDER.index(c) if c in ORDER else len(ORDER)):
        _add_bars(fig, c, per_cat[c], width)
    fig.update_yaxes(tickvals=list(range(len(rows))), ticktext=row_names, autorange="reversed",
                     range=[len(rows) - 0.5, -0.5], row=1, col=1, showgrid=False, zeroline=False)
    fig.update_xaxes(title_text="time (ms from the start of the selection)", row=2 if has_counters else 1, col=1)
    if has_counters:
        fig.update_yaxes(title_text="MB", row=2, col=1)
    head = title or "Timeline" + (" — " + " vs ".join(labels) if len(tls) > 1 else f" — {labels[0]}")
    fig.update_layout(
        title={"text": f"{head}<br><sup>{'; '.join(n for n in notes if n)}</sup>"},
        height=int(220 + 26 * len(rows) + (170 if has_counters else 0)),
        hovermode="closest", legend={"title": {"text": "fate / kind" if color_by == "fate" else "kind"}},
        margin={"l": 120, "r": 20, "t": 80, "b": 50},
    )
    return fig


def _levels(ev: pd.DataFrame, detail_budget: int, aggregate_budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps drawn event by event, and steps drawn per (lane, layer): the first steps that fit."""
    steps, counts = np.unique(ev["step"].to_numpy(), return_counts=True)
    n_detail = int(np.searchsorted(np.cumsum(counts), detail_budget, side="right"))
    if n_detail == 0 and len(steps) == 1:
        n_detail = 1  # one step over the budget: still drawn event by event
    rest = steps[n_detail:]
    if rest.size == 0:
        return steps, rest
    g = ev[ev["step"].isin(rest)].groupby(["step", "lane", "layer"]).size().groupby(level=0).size()
    n_layer = int(np.searchsorted(np.cumsum(g.reindex(rest, fill_value=0).to_numpy()), aggregate_budget, side="right"))
    return steps[:n_detail], rest[:n_layer]


def _note(label: str, detail: np.ndarray, layer: np.ndarray, steps: list[int]) -> str:
    def rng(a) -> str:
        return f"{a[0]}" if len(a) == 1 else f"{a[0]}–{a[-1]}"

    parts = []
    if len(detail):
        parts.append(f"steps {rng(detail)}: single events")
    if len(layer):
        parts.append(f"steps {rng(layer)}: per layer")
    rest = [s for s in steps if s not in set(detail.tolist()) | set(layer.tolist())]
    if rest:
        parts.append(f"steps {rng(rest)}: per step")
    return (f"{label}: " if label else "") + ", ".join(parts)


def _detail_bars(ev: pd.DataFrame, m: np.ndarray, lane_row: np.ndarray, t0: float, label: str) -> dict:
    s = (ev["t_start_us"].to_numpy()[m] - t0) / 1e3
    e = (ev["t_end_us"].to_numpy()[m] - t0) / 1e3
    custom = np.column_stack([ev[c].to_numpy()[m].astype(np.float64) for c in
                              ("step", "layer", "expert", "tokens", "bytes")] + [(e - s) * 1e3])
    return {"s": s, "e": e, "y": lane_row[m], "custom": custom, "cause": ev["cause"].to_numpy()[m],
            "label": label, "level": "event"}


def _aggregate(ev: pd.DataFrame, mask: np.ndarray, codes: np.ndarray, names, lane_row: np.ndarray, t0: float, label: str,
               *, by_layer: bool) -> dict[str, dict]:
    """One bar per (lane, step[, layer]): its span, coloured by the category with the most time."""
    sub = pd.DataFrame({"row": lane_row[mask], "step": ev["step"].to_numpy()[mask],
                        "layer": ev["layer"].to_numpy()[mask] if by_layer else 0,
                        "cat": codes[mask], "s": ev["t_start_us"].to_numpy()[mask], "e": ev["t_end_us"].to_numpy()[mask]})
    sub["d"] = sub["e"] - sub["s"]
    keys = ["row", "step", "layer"]
    g = sub.groupby(keys, sort=False)
    span = g.agg(s=("s", "min"), e=("e", "max"), n=("s", "size"), busy=("d", "sum"))
    top = sub.groupby([*keys, "cat"], sort=False)["d"].sum().reset_index()
    top = top.sort_values("d", ascending=False).drop_duplicates(keys).set_index(keys)["cat"]
    span = span.join(top).reset_index()
    out = {}
    for c, part in span.groupby("cat", sort=False):
        s = (part["s"].to_numpy() - t0) / 1e3
        e = (part["e"].to_numpy() - t0) / 1e3
        custom = np.column_stack([part["step"].to_numpy(), part["layer"].to_numpy() if by_layer else
                                  np.full(len(part), -1), part["n"].to_numpy(), part["busy"].to_numpy(),
                                  (e - s) * 1e3]).astype(np.float64)
        out[str(names[c])] = {"s": s, "e": e, "y": part["row"].to_numpy(np.float64), "custom": custom, "label": label,
                       "level": "layer" if by_layer else "step"}
    return out


def _segments(s: np.ndarray, e: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    e = np.maximum(e, s + 1e-4)  # an instant stays visible as a sliver
    x = np.column_stack([s, e, np.full(s.size, np.nan)]).ravel()
    yy = np.column_stack([y, y, np.full(y.size, np.nan)]).ravel()
    return x.astype(np.float32), yy.astype(np.float32)


_HOVER = {
    "event": "%{meta}<br>step %{customdata[0]}, layer %{customdata[1]}, expert %{customdata[2]}<br>"
             "tokens %{customdata[3]}, bytes %{customdata[4]:,}<br>cause: CAUSE<br>"
             "start %{x:.3f} ms, %{customdata[5]:.1f} µs<extra>CAT</extra>",
    "layer": "%{meta}<br>step %{customdata[0]}, layer %{customdata[1]} (aggregate)<br>%{customdata[2]} events, "
             "busy %{customdata[3]:.1f} µs of %{customdata[4]:.1f} µs<extra>CAT (most time)</extra>",
    "step": "%{meta}<br>step %{customdata[0]} (aggregate of all layers)<br>%{customdata[2]} events, "
            "busy %{customdata[3]:.1f} µs of %{customdata[4]:.1f} µs<extra>CAT (most time)</extra>",
}


def _add_bars(fig, cat: str, parts: list[dict], width: float) -> None:
    import plotly.graph_objects as go

    color = COLORS.get(cat, COLORS["other"])
    xs, ys = zip(*(_segments(p["s"], p["e"], p["y"]) for p in parts), strict=True)
    fig.add_trace(go.Scattergl(x=np.concatenate(xs), y=np.concatenate(ys), mode="lines", name=cat,
                               legendgroup=cat, line={"color": color, "width": width}, hoverinfo="skip",
                               opacity=0.5 if cat == "wait" else 1.0), row=1, col=1)
    # hover: an invisible marker in the middle of each bar, one trace per (level, label, cause)
    for p in parts:
        n = len(p["s"])
        groups = [(p["cause"] == c, c) for c in pd.unique(p["cause"])] if p["level"] == "event" else \
            [(np.ones(n, dtype=bool), "")]
        for m, cause in groups:
            def sel(a, m=m):
                return a[m]

            mid = (sel(p["s"]) + sel(p["e"])) / 2
            fig.add_trace(go.Scattergl(
                x=mid.astype(np.float32), y=sel(p["y"]).astype(np.float32), mode="markers", legendgroup=cat,
                showlegend=False, name=cat, meta=f"{p['label']}", customdata=sel(p["custom"]).astype(np.float32),
                marker={"color": color, "size": width, "opacity": 0},
                hovertemplate=_HOVER[p["level"]].replace("CAUSE", str(cause) or "—").replace("CAT", cat)),
                row=1, col=1)


def _add_flows(fig, t: Timeline, in_detail: np.ndarray, lane_row: np.ndarray, t0: float, showlegend: bool) -> None:
    import plotly.graph_objects as go

    f = t.feeds()
    if not len(f):
        return
    tr, cp = f["tr"].to_numpy(), f["cp"].to_numpy()
    keep = in_detail[tr] & in_detail[cp]
    tr, cp = tr[keep][:MAX_FLOWS], cp[keep][:MAX_FLOWS]
    if not tr.size:
        return
    x0 = (t.events["t_end_us"].to_numpy()[tr] - t0) / 1e3
    x1 = (t.events["t_start_us"].to_numpy()[cp] - t0) / 1e3
    alpha = 0.5 if x0.size <= 2_000 else 0.15  # thousands of flows: faint, the bars stay readable
    x = np.column_stack([x0, x1, np.full(x0.size, np.nan)]).ravel().astype(np.float32)
    y = np.column_stack([lane_row[tr], lane_row[cp], np.full(x0.size, np.nan)]).ravel().astype(np.float32)
    fig.add_trace(go.Scattergl(x=x, y=y, mode="lines+markers", name="copy → compute", legendgroup="flow",
                               showlegend=showlegend, hoverinfo="skip",
                               line={"color": f"rgba(60,60,60,{alpha})", "width": 1},
                               marker={"size": 4, "color": f"rgba(60,60,60,{alpha})"}), row=1, col=1)


def _add_critical_path(fig, t: Timeline, step: int, lane_row: np.ndarray, t0: float, label: str) -> None:
    import plotly.graph_objects as go

    cp = t.critical_path(step)
    pos = cp.events.index.to_numpy()
    s = (cp.events["t_start_us"].to_numpy() - t0) / 1e3
    e = (cp.events["t_end_us"].to_numpy() - t0) / 1e3
    y = lane_row[pos]
    # along each event, then from its end to the next one's start (the dependency)
    x = np.column_stack([s, e]).ravel()
    yy = np.column_stack([y, y]).ravel()
    name = f"critical path, step {step}" + (f" ({label})" if label else "")
    fig.add_trace(go.Scattergl(x=x.astype(np.float32), y=yy.astype(np.float32), mode="lines", name=name,
                               line={"color": "black", "width": 2},
                               hovertemplate=f"{name}: {cp.length_us:.1f} µs of a {cp.wall_us:.1f} µs step"
                                             "<extra></extra>"), row=1, col=1)


def counter_series(t: Timeline) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``bytes in flight`` (copies running) and, when the events record evictions, ``cache
    occupancy Δ`` (bytes copied in minus bytes evicted since the start): (t_us, value) step series."""
    ev = t.events
    is_tr = ev["kind"].str.startswith("transfer").to_numpy()
    b = ev["bytes"].to_numpy()[is_tr].astype(np.float64)
    times = np.concatenate([ev["t_start_us"].to_numpy()[is_tr], ev["t_end_us"].to_numpy()[is_tr]])
    delta = np.concatenate([b, -b])
    order = np.argsort(times, kind="stable")
    out = {"bytes in flight": (times[order], np.cumsum(delta[order]))}
    is_ev = (ev["kind"] == "evict").to_numpy()
    if is_ev.any():
        times = np.concatenate([ev["t_end_us"].to_numpy()[is_tr], ev["t_start_us"].to_numpy()[is_ev]])
        delta = np.concatenate([b, -ev["bytes"].to_numpy()[is_ev].astype(np.float64)])
        order = np.argsort(times, kind="stable")
        out["cache occupancy Δ"] = (times[order], np.cumsum(delta[order]))
    return out


def _decimate(x: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``n`` points: the maximum of each of ``n`` equal time bins (peaks stay visible)."""
    if x.size <= n:
        return x, y
    edges = np.linspace(x[0], x[-1], n + 1)
    b = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, n - 1)
    ymax = np.full(n, -np.inf)
    np.maximum.at(ymax, b, y)
    keep = np.isfinite(ymax)
    return edges[:-1][keep], ymax[keep]


def _add_counters(fig, t: Timeline, t0: float, label: str) -> None:
    import plotly.graph_objects as go

    for name, (x, y) in counter_series(t).items():
        x, y = _decimate(x, y, MAX_COUNTER_POINTS)
        fig.add_trace(go.Scattergl(x=((x - t0) / 1e3).astype(np.float32), y=(y / 1e6).astype(np.float32),
                                   mode="lines", line={"shape": "hv", "width": 1.5},
                                   name=f"{label} · {name}" if label else name,
                                   hovertemplate="%{x:.3f} ms: %{y:.2f} MB<extra>" + name + "</extra>"),
                      row=2, col=1)


def write_html(fig, path, *, open_browser: bool = False) -> str:
    """A self-contained (offline) HTML file of ``fig``, written atomically; returns its path."""
    import os
    import tempfile
    from pathlib import Path

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fig.write_html(tmp, include_plotlyjs=True, full_html=True, config={"scrollZoom": True})
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # mkstemp makes 0600; an output file gets the normal permissions
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if open_browser and can_open_browser():
        import webbrowser

        webbrowser.open(p.resolve().as_uri())
    return str(p)


def can_open_browser() -> bool:
    """Whether a graphical browser can be opened here (a terminal browser would block the CLI)."""
    import os
    import sys

    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
