"""Figures of an attribution (plotly): where a routing change hurt, and whether KL predicts accuracy.

* :func:`token_layer_heatmap` — one sequence: KL per token above, a heat map of a per-layer
  quantity (token × MoE layer) below, the tokens' text on the x axis;
* :func:`kl_by_changed_weight` — the distribution of KL by the router weight the policy
  changed for that token (summed over layers), in quantile bins;
* :func:`accuracy_vs_kl` — across sweep cells (or any labelled points): accuracy lost
  against mean KL, with the rank correlation in the title.

Every function raises :class:`~moelab.errors.MoelabError` on empty input instead of drawing
an empty figure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moelab.errors import MoelabError

LAYER_VALUES = ("resid_delta", "moe_delta", "moved_norm", "changed_weight", "changed_slots")


def _token_text(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    if tokenizer is None:
        return [str(i) for i in ids]
    out = []
    for i in ids:
        t = tokenizer.decode([int(i)])
        out.append(repr(t)[1:-1] if t.strip() == "" or "\n" in t else t)
    return out


def token_layer_heatmap(att: Any, seq: int = 0, *, value: str = "resid_delta", tokenizer: Any = None,
                        title: str | None = None):
    """KL per token (top) and ``value`` per token and MoE layer (bottom) for sequence ``seq``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if value not in LAYER_VALUES:
        raise MoelabError(f"value {value!r}: expected one of {', '.join(LAYER_VALUES)}.")
    t = att.tokens[att.tokens["seq"] == seq].sort_values("index")
    if t.empty:
        raise MoelabError(f"sequence {seq} has no compared tokens (sequences: {sorted(att.tokens['seq'].unique())}).")
    if att.layers is None or len(att.layers) == 0:
        raise MoelabError("this attribution has no per-layer table (compare(..., layers=False)).")
    lyr = att.layers[att.layers["seq"] == seq]
    grid = lyr.pivot(index="layer", columns="index", values=value).sort_index()
    text = _token_text(tokenizer, t["token_id"].tolist())
    x = list(range(len(t)))
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.3, 0.7], vertical_spacing=0.04)
    fig.add_trace(go.Bar(x=x, y=t["kl"], name="KL(baseline ‖ policy)",
                         marker_color=np.where(t["top1_agree"], "#4c78a8", "#e45756"),
                         hovertext=[f"{s!r}: KL {k:.3g}, rank {r}" for s, k, r in zip(text, t["kl"], t["rank"])],
                         hoverinfo="text"), row=1, col=1)
    fig.add_trace(go.Heatmap(z=grid.to_numpy(), x=x, y=[f"L{i}" for i in grid.index], colorscale="Viridis",
                             colorbar={"title": value, "len": 0.65, "y": 0.33},
                             hovertemplate="token %{x}, %{y}: %{z:.3g}<extra></extra>"), row=2, col=1)
    fig.update_xaxes(tickmode="array", tickvals=x, ticktext=text, tickangle=-60, title_text="continuation token",
                     row=2, col=1)
    fig.update_xaxes(title_text="per token", title_font_size=10, row=1, col=1)
    fig.update_yaxes(title_text="KL", row=1, col=1)
    fig.update_yaxes(title_text="MoE layer", row=2, col=1)
    fig.update_layout(title=title or f"{att.meta['policy']}: where sequence {seq} diverges (red bars: top-1 changed)",
                      showlegend=False, height=520, margin={"t": 70})
    return fig


def kl_by_changed_weight(att: Any, *, bins: int = 5, title: str | None = None):
    """Box plots of per-token KL by the router weight the policy changed for the token (summed
    over MoE layers), in ``bins`` quantile bins."""
    import pandas as pd
    import plotly.graph_objects as go

    if att.layers is None or len(att.layers) == 0 or len(att.tokens) == 0:
        raise MoelabError("kl_by_changed_weight needs compared tokens and the per-layer table.")
    w = att.layers.groupby(["seq", "index"])["changed_weight"].sum().rename("weight").reset_index()
    d = att.tokens.merge(w, on=["seq", "index"])
    acted = d[d["weight"] > 0]
    if acted.empty:
        raise MoelabError(f"{att.meta['policy']} changed no router weight on the compared tokens.")
    q = pd.qcut(acted["weight"], q=min(bins, acted["weight"].nunique()), duplicates="drop")
    fig = go.Figure()
    for interval, part in acted.groupby(q, observed=True):
        fig.add_trace(go.Box(y=part["kl"], name=f"{interval.left:.2f}–{interval.right:.2f}", boxmean=True))
    fig.update_layout(title=title or f"{att.meta['policy']}: KL by changed router weight per token",
                      xaxis_title="router weight deferred/skipped (sum over MoE layers)",
                      yaxis_title="KL(baseline ‖ policy)", yaxis_type="log", showlegend=False)
    return fig


def accuracy_vs_kl(points: Sequence[dict[str, Any]], *, title: str | None = None):
    """Accuracy lost (baseline score − score) against mean KL; ``points``: dicts with ``label``,
    ``mean_kl``, ``accuracy`` and ``baseline_accuracy`` (e.g. a sweep's cells)."""
    import plotly.graph_objects as go
    from scipy.stats import spearmanr

    pts = [p for p in points if p.get("mean_kl") is not None and p.get("accuracy") is not None]
    if not pts:
        raise MoelabError("accuracy_vs_kl needs points with mean_kl and accuracy (none given).")
    x = np.array([p["mean_kl"] for p in pts], dtype=float)
    y = np.array([p["baseline_accuracy"] - p["accuracy"] for p in pts], dtype=float)
    rho = spearmanr(x, y).statistic if len(pts) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0 else float("nan")
    fig = go.Figure(go.Scatter(x=x, y=y, mode="markers+text", text=[p["label"] for p in pts],
                               textposition="top center", marker={"size": 10}))
    fig.update_layout(title=title or f"Does KL predict accuracy loss? (Spearman ρ = {rho:.2f}, n = {len(pts)})",
                      xaxis_title="mean KL(baseline ‖ policy) per token", yaxis_title="accuracy lost vs baseline")
    return fig
