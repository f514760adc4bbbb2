"""Plotly figures of predictor reports (plotly is imported lazily).

Accuracy and GoodPred are drawn with error bars of ± one standard error clustered by sequence
(``accuracy_stderr`` / ``goodpred_stderr`` of :mod:`moelab.predictors.metrics`; no bar where a
group holds a single sequence and the error cannot be estimated), and the hover text gives n
(the (token, layer) pairs scored and the sequences they come from).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moelab.timing import DEFAULT_PROFILE


def accuracy_per_layer(df, phase: str = "decode", distance: int = 1):
    """Grouped bars: accuracy per target layer, one bar per predictor (ProMoE Fig. 8 shape)."""
    import plotly.express as px

    d = df[(df.phase == phase) & (df.distance == distance)]
    fig = px.bar(d, x="target_layer", y="accuracy", color="kind", barmode="group",
                 error_y=_err(d, "accuracy"), hover_data=_n(d),
                 title=f"Prediction accuracy per layer ({phase}, d = {distance}; {_n_label(d)})",
                 labels={"target_layer": "MoE layer", "accuracy": "accuracy (|pred ∩ actual| / top-k)"})
    fig.update_yaxes(range=[0, 1])
    return fig


def accuracy_vs_distance(df_overall, phase: str = "decode"):
    """Lines: overall accuracy against the prediction distance d, one line per predictor."""
    import plotly.express as px

    d = df_overall[df_overall.phase == phase].sort_values("distance")
    fig = px.line(d, x="distance", y="accuracy", color="kind", markers=True,
                  error_y=_err(d, "accuracy"), hover_data=_n(d),
                  title=f"Accuracy vs prediction distance ({phase}; {_n_label(d)})")
    fig.update_xaxes(dtick=1)
    fig.update_yaxes(range=[0, 1])
    return fig


def goodpred_vs_bandwidth(reports: dict, bandwidths: Sequence[float], *, expert_bytes: int,
                          hardware: str = DEFAULT_PROFILE, **kwargs: Any):
    """Lines: decode GoodPred against link bandwidth (GB/s) for each (kind, distance)."""
    import pandas as pd
    import plotly.express as px

    from moelab.predictors.metrics import goodpred

    rows = []
    for (kind, d), (p, rep) in reports.items():
        for bw in bandwidths:
            g = goodpred(rep, p, hardware=hardware, expert_bytes=expert_bytes, link_bandwidth_gbs=bw, **kwargs)
            rows.append({"kind": kind, "distance": d, "bandwidth_gbs": bw, **g})
    df = pd.DataFrame(rows)
    fig = px.line(df, x="bandwidth_gbs", y="goodpred", color="kind", line_dash="distance", markers=True, log_x=True,
                  error_y=_err(df, "goodpred"), hover_data=_n(df),
                  title=f"GoodPred vs link bandwidth ({expert_bytes / 1e6:.1f} MB experts, {hardware} timing; "
                        f"{_n_label(df)})",
                  labels={"bandwidth_gbs": "host→device link (GB/s)"})
    fig.update_yaxes(range=[0, 1])
    return fig, df


def _err(df, metric: str) -> str | None:
    col = f"{metric}_stderr"
    return col if col in df.columns else None


def _n(df) -> list[str]:
    return [c for c in ("pairs", "sequences") if c in df.columns]


def _n_label(df) -> str:
    """``± 1 clustered stderr, n = 96–1,024 pairs from 3 sequences``."""
    if "pairs" not in df.columns or df.empty:
        return "± 1 stderr"
    lo, hi = int(df.pairs.min()), int(df.pairs.max())
    pairs = f"{lo:,}" if lo == hi else f"{lo:,}–{hi:,}"
    seqs = ""
    if "sequences" in df.columns:
        slo, shi = int(df.sequences.min()), int(df.sequences.max())
        seqs = f" from {slo if slo == shi else f'{slo}–{shi}'} sequences"
    return f"error bars ± 1 stderr clustered by sequence; n = {pairs} pairs{seqs}"


def recall_curve(report, phase: str = "decode", layer: int | None = None):
    """recall@m and precision@m against m for one report (one source layer or overall)."""
    import pandas as pd
    import plotly.express as px

    if layer is None:
        o = report.overall[phase]
    else:
        o = next(r for r in report.per_layer if r["phase"] == phase and r["source_layer"] == layer)
    df = pd.DataFrame([{"m": m, "recall": o[f"recall@{m}"], "precision": o[f"precision@{m}"]}
                       for m in report.m_values])
    title = f"{report.kind} d={report.distance}: recall/precision@m ({phase}, " + \
        ("all layers" if layer is None else f"source layer {layer}") + ")"
    return px.line(df, x="m", y=["recall", "precision"], markers=True, title=title)
