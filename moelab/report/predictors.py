"""Report section: expert-predictor accuracy by prediction distance.

Records a training and a held-out trace (with hidden states) of the demo model on the
synthetic tasks' train and test splits, fits each predictor kind at each distance
(:func:`moelab.predictors.compare`) and draws accuracy against distance and per layer.
"""

from __future__ import annotations

from moelab.predictors import plots
from moelab.report import ReportContext, Section, html_table, register_section
from moelab.tasks import generate, prompt_and_target

KINDS = ("frequency", "token", "skip", "learned")


def _prompts(split: str, n: int) -> list[str]:
    out = [prompt_and_target("arith", ex)[0] for ex in generate("arith", split, n=n // 2)]
    return out + [prompt_and_target("pycode", ex)[0] for ex in generate("pycode", split, n=n - n // 2)]


def predictors_section(ctx: ReportContext) -> Section:
    from moelab.predictors import compare, frame
    from moelab.trace.run import trace_prompts

    n_train, n_test, new = (12, 6, 6) if ctx.quick else (32, 12, 12)
    traces = {}
    for split, n in (("train", n_train), ("test", n_test)):
        traces[split] = trace_prompts(
            ctx.model, ctx.tokenizer, _prompts(split, n), ctx.workdir / f"predictors-{split}",
            max_new_tokens=new, batch_size=8, progress=False, hidden_states=True, hidden_dtype="float32",
            model_name=ctx.model_name,
        )
    layers = traces["train"].num_moe_layers
    distances = [d for d in (1, 2, 3) if d < layers][: 2 if ctx.quick else 3]
    if not distances:
        from moelab.report import SectionUnavailable

        raise SectionUnavailable(f"{ctx.model_name} has {layers} MoE layer(s): nothing to predict across layers")
    reports = compare(traces["train"], traces["test"], kinds=KINDS, distances=distances, model=ctx.model,
                      params={"learned": {"max_epochs": 2 if ctx.quick else 6, "progress": False}})
    overall = frame(reports, per_layer=False)
    per_layer = frame(reports)
    dec = overall[overall.phase == "decode"].sort_values(["distance", "kind"])
    rows = [{"predictor": r.kind, "distance": int(r.distance), "accuracy": float(r.accuracy),
             "± stderr": float(r.accuracy_stderr), "pairs": int(r.pairs), "latency µs": float(r.latency_us)}
            for r in dec.itertuples()]
    intro = (
        f"<p>Fitted on {n_train} train-split prompts (arith and pycode, {new} new tokens each), scored on "
        f"{n_test} held-out test-split prompts; accuracy = |predicted ∩ actual| / top-k for the experts "
        "of MoE layer l + d, predicted at layer l. "
        "<code>moelab predict eval --trace TEST --predictor learned --fit-trace TRAIN --distance 1</code></p>"
        + html_table(rows)
    )
    return Section(html=intro, figures=[plots.accuracy_vs_distance(overall, phase="decode"),
                                        plots.accuracy_per_layer(per_layer, phase="decode", distance=distances[0])])


register_section(
    "predictors", predictors_section, order=90, title="Expert predictors: accuracy by distance",
    read="How well each predictor names the experts a later layer will use: higher is better, and the drop "
         "from d = 1 to larger d is the price of predicting early enough to hide a transfer; frequency is "
         "the no-information baseline.",
)
