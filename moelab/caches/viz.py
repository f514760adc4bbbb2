"""Plotly figures and an ipywidgets panel over cache results (plotly imported lazily)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moelab.caches.results import CacheSweep
from moelab.static_view import StaticView, controls_caption


def hit_rate_curves(sweep: CacheSweep, scope: str = "layer", title: str | None = None):
    """Hit rate vs capacity, one line per policy (and prefetch setting), Belady dashed on top.

    HybriMoE Fig. 9 style; the gap between a policy and Belady is what a better policy could win.
    """
    import plotly.graph_objects as go

    df = sweep.to_frame()
    df = df[df.scope == scope].sort_values("capacity_fraction")
    fig = go.Figure()
    for (policy, pf), d in df.groupby(["policy", "prefetch"], sort=False):
        name = policy if pf == "none" else f"{policy} + {pf}"
        dash = "dash" if _is_bound(policy) else ("dot" if pf != "none" else "solid")
        fig.add_trace(
            go.Scatter(x=d.capacity_fraction, y=d.hit_rate, name=name, mode="lines+markers", line=dict(dash=dash))
        )
    fig.update_layout(
        title=title or f"Expert-cache hit rate vs capacity ({scope} scope)",
        xaxis=dict(title="capacity (fraction of experts)", tickformat=".0%"),
        yaxis=dict(title="hit rate", tickformat=".0%", range=[0, 1]),
        legend_title="policy",
    )
    return fig


def _is_bound(policy: str) -> bool:
    """Offline bounds (policies that read the future) are drawn dashed."""
    from moelab.caches.base import get_policy

    try:
        return get_policy(policy).needs_future
    except Exception:  # a result of a policy no longer registered: draw it solid
        return False


def layer_heatmap(sweep: CacheSweep, capacity_fraction: float | None = None, scope: str = "layer",
                  prefetch: str = "none"):
    """Per-MoE-layer hit rate: policies × layers at one capacity (default: the smallest)."""
    import plotly.graph_objects as go

    df = sweep.layer_frame()
    df = df[(df.scope == scope) & (df.prefetch == prefetch)]
    if capacity_fraction is None:
        capacity_fraction = float(df.capacity_fraction.min())
    d = df[(df.capacity_fraction - capacity_fraction).abs() < 1e-9]
    z = d.pivot(index="policy", columns="layer", values="hit_rate")
    fig = go.Figure(go.Heatmap(z=z.values, x=list(z.columns), y=list(z.index), colorscale="Viridis",
                               zmin=0, zmax=1, colorbar=dict(title="hit rate", tickformat=".0%")))
    fig.update_layout(title=f"Hit rate per MoE layer at {capacity_fraction:.1%} capacity ({scope} scope)",
                      xaxis_title="MoE layer", yaxis_title="policy")
    return fig


def cache_panel(source: Any, policies: Sequence[str] = ("lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass"),
                capacities: Sequence[float] = (0.125, 0.25, 0.5, 0.75)):
    """An ipywidgets panel: choose policy, capacity and scope; shows per-layer hit rates (with a
    static view for HTML exports, :mod:`moelab.static_view`)."""
    import ipywidgets as w
    import plotly.graph_objects as go

    from moelab.caches.simulation import load_stream, simulate

    stream = load_stream(source, scores=True)
    policy = w.Dropdown(options=list(policies), value=policies[0], description="policy")
    capacity = w.SelectionSlider(options=[(f"{c:.1%}", c) for c in capacities], value=capacities[1]
                                 if len(capacities) > 1 else capacities[0], description="capacity")
    scope = w.ToggleButtons(options=["layer", "global"], description="scope")
    out = w.Output()

    def draw() -> None:
        r = simulate(stream, policy.value, capacity.value, scope.value)
        fig = go.Figure(go.Bar(x=list(range(len(r.layer_hits))), y=r.layer_hit_rate))
        fig.update_layout(title=f"{r.policy}, {capacity.value:.1%} ({scope.value}): hit rate {r.hit_rate:.1%}, "
                                f"{r.misses} misses, {r.bytes_moved} bytes moved",
                          xaxis_title="MoE layer", yaxis=dict(title="hit rate", tickformat=".0%", range=[0, 1]))
        fig.show()

    def redraw(*_: Any) -> None:
        out.clear_output(wait=True)
        with out:
            draw()

    for c in (policy, capacity, scope):
        c.observe(redraw, names="value")
    redraw()
    return StaticView(w.VBox([w.HBox([policy, capacity, scope]), out]), draw,
                      caption=lambda: controls_caption({"policy": policy.value, "capacity": capacity.value,
                                                        "scope": scope.value}))
