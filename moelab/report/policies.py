"""Report section: accuracy under expert deferral versus expert skipping (KTransformers Fig. 13).

Scores the demo model with :func:`moelab.evals.compare.compare_policies` on a few ``arith``
documents, unmodified and with ``n`` experts per token deferred or skipped.
"""

from __future__ import annotations

from moelab.report import ReportContext, Section, register_section


def counts_for(top_k: int, quick: bool) -> list[int]:
    """Experts affected per token: about half and three quarters of top-k (quick: half only)."""
    half = max(1, top_k // 2)
    return [half] if quick else sorted({half, max(1, (3 * top_k) // 4)})


def policies_section(ctx: ReportContext) -> Section:
    from moelab.adapters import moe_layers
    from moelab.evals.compare import compare_policies

    top_k = min(layer.top_k for layer in moe_layers(ctx.model))
    counts = counts_for(top_k, ctx.quick)
    limit = 2 if ctx.quick else 10
    cmp = compare_policies(
        ctx.model, ctx.tokenizer, ["arith"], deferred=[0, *counts], skipped=[0, *counts], limit=limit,
        model_name=ctx.model_name, batch_size=16,
    )
    intro = (
        f"<p>arith, first {limit} test documents, greedy; n experts per token (top-k = {top_k}) are "
        "<i>deferred</i> (computed one layer late, their output merged into the next layer's) or "
        "<i>skipped</i> (dropped), in the decode phase. "
        f"<code>moelab compare-policies --tasks arith --deferred 0,{','.join(map(str, counts))} "
        f"--skipped 0,{','.join(map(str, counts))} --limit {limit}</code></p>"
        f"<pre>{_escape(cmp.table())}</pre>"
    )
    return Section(html=intro, figures=[cmp.line_figure()])


def _escape(text: str) -> str:
    import html

    return html.escape(text)


register_section(
    "policies", policies_section, order=85, title="Deferral vs skipping: accuracy",
    read="Each line is accuracy against the experts affected per token: deferral keeps every expert's "
         "contribution (one layer late) and should stay near the n = 0 score while skipping drops it; "
         "overlapping error bars mean the sample cannot tell them apart.",
)
