"""Report section: a simulated what-if on a real model shape (``moelab.simulate``).

DeepSeek-V3 (BF16) on the ``ktransformers-a100`` profile (the machine of KTransformers'
paper), decode at batch 1, context 1024:

* a small what-if grid, device cache capacity × deferred experts, through
  :func:`moelab.simulate.whatif.whatif` (the offline planner's plans simulated), each cell
  beside its oracle bound (Belady's MIN and the oracle prefetch at the same capacity and
  deferral);
* the signature plot: one MoE layer without and with 2, 3 and 4 deferred experts
  (:func:`moelab.timeline.signature.simulated_fig10`, set up as the simulator's validation
  cases of KTransformers Fig. 10).

The routing is synthetic, with statistics fitted from the demo's own trace of its model (so the
section records nothing more); every number is simulated when the report is built. Without
``moelab.simulate`` the section is drawn as "not available in this build".
"""

from __future__ import annotations

import html
import importlib

from moelab.report import ReportContext, Section, SectionUnavailable, html_table, register_section
from moelab.timing.profile import get_profile
from moelab.timing.shapes import get_shape

SHAPE = "deepseek-v3"
PROFILE = "ktransformers-a100"
CONTEXT = 1024
GRID = {"capacity": [1, 4], "deferral": [0, 2, 3]}
"""Routed experts per layer on the GPU (1: about what an A100-40GB holds beside DeepSeek-V3's BF16
attention and shared experts; 4: a what-if beyond it) × deferred experts per token."""


def simulate_section(ctx: ReportContext) -> Section:
    try:
        importlib.import_module("moelab.simulate")
    except ImportError as exc:
        raise SectionUnavailable(
            f"the simulator (moelab.simulate) is not part of this build ({exc}); this section shows its "
            "what-if grid on a real model shape once it is."
        ) from exc
    from moelab.simulate.whatif import load_routing, whatif
    from moelab.timeline.signature import (
        fig10_figure,
        fig10_table,
        simulated_fig10,
        simulated_setup,
    )

    if ctx.trace is None:
        raise SectionUnavailable("the synthetic routing's statistics are fitted from the demo's trace; none here.")
    steps, warmup = (2, 2) if ctx.quick else (4, 4)
    shape = get_shape(SHAPE)
    routing = load_routing(shape, synthetic=True, fit_from=ctx.trace, steps=warmup + steps, batch=1)
    # the grid is a what-if beyond the A100's 40 GB on purpose: simulated anyway, its memory said below
    df = whatif(shape, PROFILE, routing=routing, steps=steps, warmup=warmup, context=CONTEXT, grid=GRID,
                check_memory=False)
    over = [f"{r['capacity']} GPU experts/layer need {r['gpu_need_gb']:.1f} GB" for _, r in df.iterrows()
            if r["fits"] is not None and not r["fits"]]
    memory = (f" Memory (<code>moelab.timing.memory</code>): {html.escape('; '.join(dict.fromkeys(over)))} of the "
              f"GPU's {get_profile(PROFILE).gpu_memory_gb:g} GB, so these cells are what-ifs beyond this machine."
              if over else "")
    panels = simulated_fig10(routing=routing)
    rows = [{"GPU experts / layer": r["capacity"], "deferred": int(r["deferral"]), "tokens/s": r["tokens_per_s"],
             "oracle tokens/s": r["oracle_tokens_per_s"], "step ms": r["step_ms"],
             "stall copy s": r["stall_copy_s"], "stall host s": r["stall_host_s"],
             "oracle": r["oracle_variant"]} for _, r in df.iterrows()]
    sig = fig10_table(panels)
    sig_rows = [{"deferred": int(r["deferred"]), "layer µs": r["layer_us"], "change %": r["change_pct"],
                 **{k.removeprefix("busy_").removesuffix("_pct") + " busy %": v for k, v in r.items()
                    if k.startswith("busy_")}} for _, r in sig.iterrows()]
    body = (
        f"<p>{html.escape(shape.name)} (BF16, {shape.num_moe_layers} MoE layers of {shape.num_experts} experts, "
        f"top-{shape.top_k}) on the <code>{PROFILE}</code> hardware profile, decode at batch 1, context "
        f"{CONTEXT}: {len(df)} cells of <code>moelab.simulate.whatif</code> ({steps} measured decode steps after "
        f"{warmup} warm-up; {df.attrs['wall_s']:.1f} s), placement <code>host-misses</code>, LRU cache. Routing: "
        f"{html.escape(routing.source.split(';')[0])}, statistics fitted from the demo's trace of "
        f"{html.escape(ctx.model_name)} and rescaled to the shape.{memory}</p>"
        + html_table(rows, floatfmt="{:.3g}")
        + f"<p>The signature plot: {html.escape(simulated_setup())}, with this section's routing.</p>"
        + html_table(sig_rows, floatfmt="{:.1f}")
    )
    return Section(html=body, figures=[_grid_figure(df), fig10_figure(panels, subtitle=simulated_setup())])


def _grid_figure(df):
    """Tokens/s per cell (bars) with the oracle bound (diamonds), grouped by capacity."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for cap, part in df.groupby("capacity", sort=True):
        x = [f"{int(d)} deferred" for d in part["deferral"]]
        fig.add_trace(go.Bar(x=x, y=part["tokens_per_s"], name=f"{cap:g} GPU experts/layer (LRU)",
                             offsetgroup=str(cap), hovertemplate="%{x}: %{y:.2f} tokens/s<extra>%{fullData.name}</extra>"))
        fig.add_trace(go.Scatter(x=x, y=part["oracle_tokens_per_s"], mode="markers", name=f"{cap:g}: oracle bound",
                                 marker={"symbol": "diamond", "size": 11, "line": {"width": 1, "color": "black"}},
                                 customdata=part["oracle_variant"],
                                 hovertemplate="%{x}: oracle %{y:.2f} tokens/s (%{customdata})<extra></extra>"))
    fig.update_layout(
        title=f"What-if: {df.attrs['shape']} decode on {df.attrs['hardware']} — GPU expert capacity × deferral",
        xaxis_title="deferred experts per token", yaxis_title="simulated decode tokens/s", barmode="group",
        scattermode="group", height=420,
    )
    return fig


register_section(
    "simulate", simulate_section, order=130, title="Simulated what-if on a real model shape",
    read="Predicted decode tokens/s of DeepSeek-V3 on KTransformers' A100 machine for each GPU expert capacity "
         "and deferral setting (bars), beside the oracle bound (diamonds: what a perfect cache and prefetch would "
         "reach at the same setting); below, one MoE layer without and with 2, 3, 4 deferred experts (KTransformers "
         "Fig. 10 redrawn from simulated events): read the host row's busy % and the layer time in each panel's title.",
)
