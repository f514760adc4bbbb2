"""Report section: a hybrid CPU/GPU run on the real executor, drawn as a timeline.

Generates a few tokens of the demo model under ``moelab.hybrid(model, cfg)`` with
``executor: real`` (device, host and copy lanes running concurrently, measured
timestamps) and draws its events, one row per lane, with the run's summary (busy % per
lane, host/device overlap, tokens/s) computed from the events alone.

The drawing is one function, :func:`timeline_figure`, over the events table (the shared
schema of :mod:`moelab.hybrid.events`): ``moelab.timeline`` replaces it when merged.
"""

from __future__ import annotations

import html

from moelab.report import ReportContext, Section, html_table, register_section

#: The demo's hybrid configuration: a quarter of each layer's experts resident (LRU), misses placed by
#: the greedy HybriMoE-style rule on a PCIe 4 cost model, two experts per token deferred.
CONFIG = {
    "cache": {"capacity": 0.25, "policy": "lru"},
    "placement": "greedy-hss",
    "hardware": "pcie4-x16",
    "routing": {"deferred": 2, "min_immediate": 1},
    "executor": "real",
    "host_backend": "moelab",
}
LANES = ("control", "device", "copy", "host")
MAX_EVENTS = 4000
"""The figure draws the first forwards whose events fit in this many bars."""


def hybrid_section(ctx: ReportContext) -> Section:
    import moelab
    from moelab.adapters import moe_layers
    from moelab.prompts import task_prompts

    cfg = dict(CONFIG)
    try:
        from moelab.kernels.build import load_extension

        load_extension()
    except Exception:  # noqa: BLE001 - no compiler: the host lane runs the reference experts
        cfg["host_backend"] = "reference"
    top_k = min(layer.top_k for layer in moe_layers(ctx.model))
    cfg["routing"] = {"deferred": min(2, top_k - 1), "min_immediate": 1} if top_k >= 2 else {"deferred": 0}
    n_prompts, new = (2, 4) if ctx.quick else (4, 8)
    tok = ctx.tokenizer
    enc = tok(task_prompts("arith", n_prompts), return_tensors="pt", padding=True, padding_side="left")
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with moelab.hybrid(ctx.model, cfg) as run:
        out = ctx.model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=pad)
    events = run.events_table()
    summary = run.summary()
    generated = int((out.shape[1] - enc["input_ids"].shape[1]) * out.shape[0])
    wall_s = summary["wall_us"] / 1e6
    rows = [{"lane": lane, "busy %": float(summary["busy_pct"].get(lane, 0.0)),
             "events": int((events["lane"] == lane).sum())} for lane in LANES if lane in set(events["lane"])]
    kinds = events.groupby("kind").size().to_dict()
    intro = (
        f"<p><code>moelab.hybrid(model, {html.escape(repr(cfg))})</code>, greedy generation of {new} tokens "
        f"for {n_prompts} arith prompts: {len(events)} events in {wall_s:.2f} s "
        f"({generated / wall_s:.1f} generated tokens/s), host/device overlap "
        f"{summary['overlap_pct']:.1f} % of the host lane's busy time. On this CPU-only machine the device "
        "lane is a CPU worker standing in for a GPU (it shares the cores), so the timeline shows the plan's "
        "concurrency, not a GPU's speed.</p>"
        + html_table(rows, floatfmt="{:.1f}")
        + "<p>events by kind: " + ", ".join(f"{html.escape(k)} {v}" for k, v in sorted(kinds.items())) + "</p>"
    )
    return Section(html=intro, figures=[timeline_figure(events, f"Hybrid run on the real executor "
                                                                f"({ctx.model_name})")])


def timeline_figure(events, title: str):
    """Lanes as rows, one bar per event coloured by kind (hover: step, layer, expert, tokens, bytes,
    cause). A stand-in for ``moelab.timeline``'s figure, which replaces it when merged."""
    import plotly.graph_objects as go

    ev = events.sort_values("t_start_us")
    steps = sorted(ev["step"].unique())
    keep = []
    for s in steps:  # whole forwards, as many as fit
        if keep and (ev["step"].isin(keep + [s])).sum() > MAX_EVENTS:
            break
        keep.append(s)
    ev = ev[ev["step"].isin(keep)]
    fig = go.Figure()
    for kind, g in ev.groupby("kind", sort=True):
        fig.add_trace(go.Bar(
            y=g["lane"], x=(g["t_end_us"] - g["t_start_us"]) / 1e3, base=g["t_start_us"] / 1e3, orientation="h",
            name=kind,
            customdata=g[["step", "layer", "expert", "tokens", "bytes", "cause", "t_start_us", "t_end_us"]].to_numpy(),
            hovertemplate="%{y}: " + kind + " from %{customdata[6]:.0f} to %{customdata[7]:.0f} µs<br>"
                          "step %{customdata[0]}, layer %{customdata[1]}, expert %{customdata[2]}, "
                          "tokens %{customdata[3]}, bytes %{customdata[4]}, cause %{customdata[5]}<extra></extra>",
        ))
    shown = f"forwards {keep[0]}–{keep[-1]} of {len(steps)}" if len(keep) < len(steps) else f"{len(steps)} forwards"
    fig.update_layout(
        title=f"{title}: {shown}", barmode="overlay", height=360, legend_title="event kind",
        xaxis_title="time since the run began (ms)",
        yaxis={"title": "lane", "categoryorder": "array", "categoryarray": list(reversed(LANES))},
    )
    return fig


register_section(
    "hybrid", hybrid_section, order=120, title="Hybrid CPU/GPU run: timeline",
    read="One row per lane: gaps on the control row are the model waiting for experts, host bars that overlap "
         "device or control bars are deferred experts hidden behind the next layer's work, and copy bars are "
         "expert weights fetched into the resident pool; the table gives each lane's busy share.",
)
