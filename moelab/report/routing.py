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
        figures += [viz.overlap_figure(trace), viz.affinity_figure(trace, 0)]
    return Section(title="Routing", html=intro + html_table(rows), figures=figures)


register_section("routing", routing_section, order=10)
