"""Routing figures over a :class:`~moelab.trace.RoutingTrace`.

* :func:`expert_load_heatmap` — how often each expert is selected, per MoE layer;
* :func:`token_assignments` — which experts each token of a sequence used, per layer;
* :func:`layer_affinity` / :func:`adjacent_layer_overlap` — how predictable layer l+1's
  experts are from layer l's (co-activation and a per-pair coverage score);
* :func:`temporal_locality` — how many of a token's experts the previous token used.
"""

from __future__ import annotations

import numpy as np

from moelab.errors import MoelabError
from moelab.static_view import StaticView, controls_caption
from moelab.trace import RoutingTrace


def _go():
    import plotly.graph_objects as go

    return go


def expert_load_heatmap(trace: RoutingTrace, *, phase: str | None = None, normalize: bool = True):
    """Heatmap: MoE layer × expert, share of the layer's selections (or raw counts)."""
    go = _go()
    load = trace.expert_load(phase=phase).astype(float)
    if normalize:
        totals = load.sum(axis=1, keepdims=True)
        load = np.divide(load, totals, out=np.zeros_like(load), where=totals > 0)
    fig = go.Figure(
        go.Heatmap(
            z=load,
            x=list(range(load.shape[1])),
            y=[f"L{layer}" for layer in trace.moe_layers],
            colorscale="Viridis",
            colorbar={"title": "share" if normalize else "tokens"},
            hovertemplate="layer %{y}<br>expert %{x}<br>%{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Expert load per MoE layer ({phase or 'all tokens'})",
        xaxis_title="expert",
        yaxis_title="MoE layer",
        yaxis_autorange="reversed",
    )
    return fig


def _sequence_rows(trace: RoutingTrace, seq: int) -> np.ndarray:
    rows = np.flatnonzero(trace.column("seq") == seq)
    if rows.size == 0:
        raise MoelabError(f"trace has no sequence {seq}; sequences are 0..{trace.meta['num_sequences'] - 1}.")
    return rows


def token_assignments(trace: RoutingTrace, *, seq: int = 0, layer: int = 0, tokenizer=None, max_tokens: int = 128):
    """Heatmap for one sequence and MoE layer: token (x) × expert (y), router weight as colour."""
    go = _go()
    rows = _sequence_rows(trace, seq)
    rows = rows[trace.column("moe_layer")[rows] == layer]
    order = np.argsort(trace.column("pos")[rows], kind="stable")
    rows = rows[order][:max_tokens]
    experts, weights = trace.experts_array()[rows], trace.weights_array()[rows]
    grid = np.full((trace.num_experts, len(rows)), np.nan)
    for t, (ids, ws) in enumerate(zip(experts, weights)):
        valid = ids >= 0
        grid[ids[valid], t] = ws[valid]
    token_ids = trace.column("token_id")[rows]
    labels = [
        f"{p}:{tokenizer.decode([int(t)]) if tokenizer is not None and t >= 0 else int(t)}"
        for p, t in zip(trace.column("pos")[rows], token_ids)
    ]
    phases = trace.column("phase")[rows]
    fig = go.Figure(
        go.Heatmap(
            z=grid,
            x=list(range(len(rows))),
            y=list(range(trace.num_experts)),
            colorscale="Blues",
            colorbar={"title": "weight"},
            customdata=np.array([[f"{lab} ({ph})" for lab, ph in zip(labels, phases)]] * trace.num_experts),
            hovertemplate="token %{customdata}<br>expert %{y}<br>weight %{z:.3f}<extra></extra>",
        )
    )
    fig.update_layout(
        title=f"Token → expert assignments, sequence {seq}, MoE layer {layer} (decoder layer {trace.moe_layers[layer]})",
        xaxis={"title": "token", "tickmode": "array", "tickvals": list(range(len(rows))), "ticktext": labels},
        yaxis_title="expert",
    )
    return fig


def layer_affinity(trace: RoutingTrace, layer: int = 0) -> np.ndarray:
    """(E, E') matrix P(expert j selected at MoE layer l+1 | expert i selected at layer l), per token."""
    if not 0 <= layer < trace.num_moe_layers - 1:
        raise MoelabError(f"layer must be in 0..{trace.num_moe_layers - 2} (it is paired with layer+1), got {layer}.")
    a, b = _aligned(trace, layer, layer + 1)
    E = trace.num_experts
    counts = np.zeros((E, E))
    for k1 in range(a.shape[1]):
        for k2 in range(b.shape[1]):
            valid = (a[:, k1] >= 0) & (b[:, k2] >= 0)
            np.add.at(counts, (a[valid, k1], b[valid, k2]), 1)
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def _aligned(trace: RoutingTrace, l1: int, l2: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ids of the same tokens at MoE layers l1 and l2 (rows matched on seq, step, pos)."""
    layer = trace.column("moe_layer")
    keys = np.stack([trace.column("seq"), trace.column("step").astype(np.int64), trace.column("pos").astype(np.int64)], 1)
    r1, r2 = np.flatnonzero(layer == l1), np.flatnonzero(layer == l2)
    k1 = {tuple(k): i for i, k in zip(r1, keys[r1])}
    pairs = [(k1[tuple(k)], j) for j, k in zip(r2, keys[r2]) if tuple(k) in k1]
    if not pairs:
        return np.zeros((0, trace.top_k), np.int32), np.zeros((0, trace.top_k), np.int32)
    i1, i2 = np.array(pairs).T
    experts = trace.experts_array()
    return experts[i1], experts[i2]


def adjacent_layer_overlap(trace: RoutingTrace) -> list[float]:
    """Per adjacent pair (l, l+1): the share of layer l+1's experts that are among the K
    most likely successors (by :func:`layer_affinity`) of the token's layer-l experts.

    1.0 means layer l's routing fully determines layer l+1's; K/E is what chance gives.
    Evaluated in-sample: an upper bound on what a table predictor could reach.
    """
    out = []
    for layer in range(trace.num_moe_layers - 1):
        aff = layer_affinity(trace, layer)
        a, b = _aligned(trace, layer, layer + 1)
        if len(a) == 0:
            out.append(float("nan"))
            continue
        k = b.shape[1]
        score = np.zeros((len(a), aff.shape[1]))
        for col in range(a.shape[1]):
            score += aff[np.clip(a[:, col], 0, None)] * (a[:, col : col + 1] >= 0)
        top = np.argsort(-score, axis=1, kind="stable")[:, :k]
        hits = (top[:, :, None] == b[:, None, :]).any(axis=1).sum()
        out.append(float(hits / (b >= 0).sum()))
    return out


def temporal_locality(trace: RoutingTrace) -> list[float]:
    """Per MoE layer: mean share of a decode token's experts also used by the previous token."""
    out = []
    seq, step, layer = trace.column("seq"), trace.column("step"), trace.column("moe_layer")
    experts = trace.experts_array()
    decode = trace.column("phase") == "decode"
    for ml in range(trace.num_moe_layers):
        rows = np.flatnonzero((layer == ml) & decode)
        rows = rows[np.lexsort((step[rows], seq[rows]))]
        if len(rows) < 2:
            out.append(float("nan"))
            continue
        prev, cur = rows[:-1], rows[1:]
        same = (seq[prev] == seq[cur]) & (step[cur] == step[prev] + 1)
        if not same.any():
            out.append(float("nan"))
            continue
        a, b = experts[prev[same]], experts[cur[same]]
        shared = (b[:, :, None] == a[:, None, :]).any(axis=2) & (b >= 0)
        out.append(float(shared.sum() / (b >= 0).sum()))
    return out


def affinity_figure(trace: RoutingTrace, layer: int = 0):
    """Heatmap of :func:`layer_affinity` for MoE layers (layer, layer+1)."""
    go = _go()
    aff = layer_affinity(trace, layer)
    fig = go.Figure(go.Heatmap(z=aff, colorscale="Magma", colorbar={"title": "P(j | i)"}))
    fig.update_layout(
        title=f"Adjacent-layer routing: P(expert at MoE layer {layer + 1} | expert at layer {layer})",
        xaxis_title=f"expert at MoE layer {layer + 1}",
        yaxis_title=f"expert at MoE layer {layer}",
        yaxis_autorange="reversed",
    )
    return fig


def overlap_figure(trace: RoutingTrace):
    """Bars: adjacent-layer overlap and temporal locality per layer, with the chance level."""
    go = _go()
    overlap = adjacent_layer_overlap(trace)
    locality = temporal_locality(trace)
    fig = go.Figure()
    fig.add_bar(x=[f"L{a}→L{b}" for a, b in zip(trace.moe_layers, trace.moe_layers[1:])], y=overlap,
                name="adjacent-layer overlap")
    fig.add_bar(x=[f"L{a}" for a in trace.moe_layers], y=locality, name="temporal locality (decode)")
    chance = trace.top_k / trace.num_experts
    fig.add_hline(y=chance, line_dash="dot", annotation_text=f"chance K/E = {chance:.2f}")
    fig.update_layout(title="Routing overlap between adjacent layers and consecutive tokens",
                      yaxis_title="share of experts", yaxis_range=[0, 1], barmode="group")
    return fig


def routing_explorer(trace: RoutingTrace, tokenizer=None):
    """An ipywidgets panel: choose MoE layer and sequence; shows assignments and affinity.
    Displayed (with a static view for HTML exports, :mod:`moelab.static_view`) and returned."""
    import ipywidgets as widgets
    from IPython.display import display

    layer = widgets.Dropdown(
        options=[(f"MoE layer {i} (decoder {d})", i) for i, d in enumerate(trace.moe_layers)],
        value=0,
        description="layer",
    )
    seq = widgets.BoundedIntText(value=0, min=0, max=max(trace.meta["num_sequences"] - 1, 0), description="sequence")
    out = widgets.Output()

    def draw() -> None:
        token_assignments(trace, seq=seq.value, layer=layer.value, tokenizer=tokenizer).show()
        if layer.value < trace.num_moe_layers - 1:
            affinity_figure(trace, layer.value).show()

    def redraw(*_):
        out.clear_output(wait=True)
        with out:
            draw()

    layer.observe(redraw, names="value")
    seq.observe(redraw, names="value")
    redraw()
    view = StaticView(widgets.VBox([widgets.HBox([layer, seq]), out]), draw,
                      caption=lambda: controls_caption({"layer": layer.value, "sequence": seq.value}))
    display(view)
    return view
