"""Report section: routing of the demo trace (load, assignments, adjacent-layer overlap)."""

from __future__ import annotations

from moelab.report import ReportContext, Section, html_table, register_section


def routing_section(ctx: ReportContext) -> Section:
    from moelab.viz import routing as viz

    trace = ctx.trace
    s = trace.summary()
    intro = (
        f"<p>{s['tokens']} tokens ({s['prefill_tokens']} prefill, {s['decode_tokens']} decode) in "
        f"{s['sequences']} sequences, {len(s['moe_layers'])} MoE layers (decoder layers {s['moe_layers']}), "
        f"E = {s['num_experts'][0]}, top-k = {s['top_k'][0]}.</p>"
    )
    rows = [
        {"decoder layer": r["layer"], "experts used": r["experts_used"], "max share": r["max_share"],
         "min share": r["min_share"], "cv": r["cv"]}
        for r in s["expert_load"]
    ]
    figures = [viz.expert_load_heatmap(trace), viz.token_assignments(trace, seq=0, layer=0, tokenizer=ctx.tokenizer)]
    if trace.num_moe_layers > 1:
        overlap = viz.overlap_figure(trace).update_xaxes(title="MoE layer pair (overlap) or MoE layer (locality)")
        figures += [overlap, viz.affinity_figure(trace, 0)]
    return Section(title="Routing", html=intro + html_table(rows), figures=figures)


register_section(
    "routing", routing_section, order=10, title="Routing",
    read="Which experts each MoE layer uses (a flat load row is balanced routing), how one prompt's tokens "
         "are routed, and how strongly a layer's choice predicts the next layer's (what prefetching exploits).",
)
