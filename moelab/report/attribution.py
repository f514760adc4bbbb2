"""Report section: where deferral changes the model's predictions, token by token and layer by layer.

Teacher-forced comparison (:func:`moelab.attribution.compare`) of deferral with the unmodified
demo model on the baseline's own greedy generations of a few ``arith`` prompts.
"""

from __future__ import annotations

import html

from moelab.report import ReportContext, Section, register_section
from moelab.tasks import generate, prompt_and_target


def attribution_section(ctx: ReportContext) -> Section:
    import plotly.graph_objects as go

    from moelab.adapters import moe_layers
    from moelab.attribution import compare, sequences
    from moelab.attribution.figures import kl_by_changed_weight, token_layer_heatmap

    layers = moe_layers(ctx.model)
    d = max(1, min(layer.top_k for layer in layers) // 2)
    n, new = (4, 16) if ctx.quick else (12, 32)
    prompts = [prompt_and_target("arith", doc)[0] for doc in generate("arith", "test")[:n]]
    seqs = sequences(ctx.model, prompts, tokenizer=ctx.tokenizer, max_new_tokens=new)
    policy = {"policy": "deferral", "deferred": d, "min_immediate": 0}
    att = compare(ctx.model, policy, seqs=seqs, tokenizer=ctx.tokenizer)
    per_layer = []
    for i in range(len(layers) - 1):
        one = compare(ctx.model, {**policy, "deferred": {i: d}}, seqs=seqs, tokenizer=ctx.tokenizer,
                      layers=False, free_running=False)
        per_layer.append(one.mean_kl)
    bar = go.Figure(go.Bar(x=list(range(len(per_layer))), y=per_layer))
    bar.update_layout(title=f"Deferring {d} experts in one MoE layer only: mean KL per token",
                      xaxis_title="MoE layer that defers", yaxis_title="mean KL(baseline ‖ policy)", yaxis_type="log")
    s = att.summary()
    worst = int(att.tokens.groupby("seq")["kl"].sum().idxmax())
    intro = (
        f"<p>arith, first {n} test prompts, the baseline's greedy generation of up to {new} tokens read by both "
        f"models (teacher forcing); {d} experts per token deferred in every MoE layer but the last, decode steps "
        f"only. {s['tokens']} tokens: mean KL {s['mean_kl']:.3g}, top-1 agreement {s['top1_agreement']:.3f}, "
        f"{s['diverged_sequences']} of {s['sequences']} free-running generations diverge. "
        f"<code>{html.escape('moelab.attribution.compare(model, ' + repr(policy) + ', prompts, tokenizer=tok)')}"
        "</code></p>"
    )
    return Section(html=intro, figures=[token_layer_heatmap(att, worst, tokenizer=ctx.tokenizer),
                                        kl_by_changed_weight(att), bar])


register_section(
    "attribution", attribution_section, order=87, title="Attribution: where deferral changes predictions",
    read="The first figure follows the most affected prompt: bars are the KL per generated token (red: the top "
         "token changed), the heat map how far each MoE layer's residual stream has drifted. The second shows "
         "whether tokens that lost more router weight diverge more; the third, which single layer tolerates "
         "deferral best (lowest bar).",
)
