"""Report section: expert-cache hit rate against capacity, with the Belady bound.

Replays the demo trace's decode accesses through the cache policies at several capacities
(:func:`moelab.caches.simulation.sweep`) and draws :func:`moelab.caches.viz.hit_rate_curves`.
"""

from __future__ import annotations

from moelab.caches.viz import hit_rate_curves, layer_heatmap
from moelab.report import ReportContext, Section, html_table, register_section

POLICIES = ("lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass")
CAPACITIES = (0.125, 0.25, 0.375, 0.5, 0.75)


def caches_section(ctx: ReportContext) -> Section:
    from moelab.caches.simulation import sweep

    result = sweep(ctx.trace, policies=POLICIES, capacities=CAPACITIES, progress=False)
    df = result.to_frame()
    df = df[df.scope == "layer"]
    near = float(df.capacity_fraction.iloc[(df.capacity_fraction - 0.25).abs().argmin()])
    at = df[(df.capacity_fraction - near).abs() < 1e-9].sort_values("hit_rate", ascending=False)
    rows = [{"policy": r.policy, f"hit rate at {near:.1%}": float(r.hit_rate)} for r in at.itertuples()]
    intro = (
        "<p>The demo trace's decode steps replayed through each policy, one cache per MoE layer "
        "(capacity = fraction of a layer's experts kept resident). "
        "<code>moelab cache simulate --trace DIR --capacity 0.125,0.25,0.375,0.5,0.75</code></p>"
        + html_table(rows)
    )
    return Section(html=intro, figures=[
        hit_rate_curves(result, title="Expert-cache hit rate vs capacity (per-layer caches; Belady dashed)"),
        layer_heatmap(result, capacity_fraction=near),
    ])


register_section(
    "caches", caches_section, order=100, title="Expert caches: hit rate vs capacity",
    read="Each solid line is an online policy and the dashed Belady lines are the offline optimum on the same "
         "accesses: the vertical gap is what a better policy or a predictor could still win at that capacity.",
)
