"""Honest predictor metrics: accuracy, recall@m, precision@m, GoodPred — per layer, per phase.

Definitions, per (token, target MoE layer) pair, with ``P_m`` the first m predicted
experts and ``A`` the experts the layer actually chose (``|A|`` = top-k):

* ``accuracy = |P_K ∩ A| / |A|`` with K = top-k (ProMoE's accuracy);
* ``recall@m = |P_m ∩ A| / |A|``, ``precision@m = |P_m ∩ A| / m``;
* ``fetch_rate`` and ``goodpred``, decode only, under one of two bases (``fetch_basis``):

  - ``"predicted"`` (the default; ProMoE's prose, docs/techniques.md §3): the fetch rate is the
    share of the *predicted* experts ``P_K`` whose transfer completes before the layer routes
    (timing model: :mod:`moelab.predictors.timing`), and per pair
    ``goodpred = accuracy × |{e ∈ P_K : in time}| / |P_K|``, averaged over pairs (within one
    target layer the fetch rate is one number, so there GoodPred = Accuracy × FetchRate exactly);
  - ``"correct"`` (moelab before 2026-11-26): the fetch rate is the share of the *correct*
    predictions ``P_K ∩ A`` that arrive in time, and ``goodpred = |{e ∈ P_K ∩ A : in time}| / |A|``.

  The two agree whenever every predicted rank is in time or none is; they differ when only the
  first ranks make it (the ``"correct"`` basis then credits a predictor whose right answers sit
  in the early ranks).

Every figure is the mean over the (token, layer) pairs of a group: per target layer and
over all layers, for ``prefill``, ``decode`` and ``all`` tokens. Each group also carries its
sample size and uncertainty: ``pairs`` (n, the (token, layer) pairs scored), ``sequences``
(the sequences they come from), and ``accuracy_stderr`` / ``goodpred_stderr``, the standard
error of the mean clustered by sequence (:func:`moelab.stats.clustered_stderr`, the
cluster-robust estimator Miller 2024 recommends for evals with correlated items: tokens of
one sequence, and the layers of one token, are not independent predictions).
``accuracy_stderr_iid`` is the naive ``sqrt(s²/n)`` that treats every pair as independent;
it is a lower bound, reported for comparison only. :meth:`PredictionReport.write_dump`
writes each pair's predicted and actual ids (and in-time flags) to Parquet so anyone can
recompute them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moelab._output import reserve_output
from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, as_trace_data
from moelab.predictors.timing import in_time_schedule, measure_latency, transfer_model
from moelab.stats import clustered_stderr, iid_stderr
from moelab.timing import DEFAULT_PROFILE, HardwareProfile, expert_bytes_of

log = logging.getLogger(__name__)

PHASES = ("prefill", "decode", "all")
FETCH_BASES = ("predicted", "correct")  # the fetch rate's denominator (module docstring); the first is the default


def check_fetch_basis(basis: str) -> str:
    if basis not in FETCH_BASES:
        raise MoelabError(f"fetch_basis={basis!r} is not one of {FETCH_BASES}: 'predicted' is ProMoE's "
                          "definition (share of predicted experts fetched in time, the default), 'correct' the "
                          "share of correct predictions fetched in time.")
    return basis


def _fetch_and_good(hits: np.ndarray, in_time: np.ndarray, valid: np.ndarray, n_actual: np.ndarray,
                    basis: str) -> tuple[float, np.ndarray]:
    """``(fetch rate, per-pair goodpred)`` of decode pairs: ``hits``/``in_time``/``valid`` are
    (n, K) — prediction correct, transfer in time, a prediction made at that rank."""
    denom = np.maximum(n_actual, 1)
    if basis == "correct":
        good = (hits & in_time).sum(1)
        correct = hits.sum()
        return (float(good.sum() / correct) if correct else float("nan")), good / denom
    timely = (in_time & valid).sum(1)
    made = valid.sum(1)
    share = timely / np.maximum(made, 1)
    fetch = float(timely.sum() / made.sum()) if made.sum() else float("nan")
    return fetch, (hits.sum(1) / denom) * share


@dataclass
class PredictionReport:
    """What :func:`evaluate` measured. ``per_layer`` rows and ``overall`` per phase."""

    kind: str
    distance: int
    params: dict[str, Any]
    model_name: str
    trace_id: str
    split: str
    top_k: int
    m_values: list[int]
    latency_us: float
    transfer: dict[str, Any]
    per_layer: list[dict[str, Any]]
    overall: dict[str, dict[str, Any]]
    rows: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    fetch_basis: str = "predicted"
    latency: dict[str, Any] = field(default_factory=dict)
    """How ``latency_us`` was measured (calls, spread, load, busy reason); empty when given."""

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in ("kind", "distance", "params", "model_name", "trace_id", "split",
                                            "top_k", "m_values", "latency_us", "latency", "transfer", "fetch_basis", "overall",
                                            "per_layer")}
        return _clean(d)

    def to_frame(self):
        """``per_layer`` as a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.per_layer)

    def accuracy(self, phase: str = "decode") -> float:
        return self.overall[phase]["accuracy"]

    def accuracy_text(self, phase: str = "decode") -> str:
        """``0.712±0.031 (n=4,096 pairs, 24 seqs)``: accuracy ± its sequence-clustered stderr."""
        o = self.overall[phase]
        return _score_text(o["accuracy"], o["accuracy_stderr"], o["pairs"], o["sequences"])

    def dump_table(self):
        """A ``pyarrow.Table``: one row per (token, target layer) with predicted and actual ids."""
        import pyarrow as pa

        r = self.rows
        n = len(r["seq"])

        def lists(mat, typ, valid=None):
            width = mat.shape[1] if mat.ndim == 2 else 0
            flat = mat.reshape(-1)
            if valid is None:
                offsets = np.arange(0, n * width + 1, width, dtype=np.int32)
                return pa.ListArray.from_arrays(offsets, pa.array(flat, typ))
            lens = valid.sum(1)
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            return pa.ListArray.from_arrays(offsets, pa.array(mat[valid], typ))

        return pa.table({
            "seq": pa.array(r["seq"], pa.int64()),
            "step": pa.array(r["step"], pa.int32()),
            "pos": pa.array(r["pos"], pa.int32()),
            "phase": pa.array(r["phase"].astype(str), pa.string()),
            "token_id": pa.array(r["token_id"], pa.int64()),
            "source_layer": pa.array(r["source"], pa.int32()),
            "target_layer": pa.array(r["target"], pa.int32()),
            "distance": pa.array(np.full(n, self.distance), pa.int32()),
            "predicted": lists(r["predicted"], pa.int32()),
            "actual": lists(r["actual"], pa.int32(), valid=r["actual"] >= 0),
            "in_time": lists(r["in_time"], pa.bool_()),
        })

    def write_dump(self, path: str | Path) -> Path:
        """Write :meth:`dump_table` as Parquet (atomically). Columns: seq, step, pos, phase,
        token_id, source_layer, target_layer, distance, predicted (ranked, length max(m)),
        actual (top-k by weight), in_time (per predicted rank: transfer done before the
        target layer routes under the report's timing model; decode rows only)."""
        import pyarrow.parquet as pq

        with reserve_output(path, overwrite=True, what="dump", kind="file") as res:
            pq.write_table(self.dump_table(), res.staging)
            return res.commit()


def _score_text(p: float, se: float, pairs: int, sequences: int) -> str:
    if p != p:
        return f"n/a (n={pairs} pairs)"
    se_text = "n/a" if se != se else f"{se:.3f}"
    return f"{p:.3f}±{se_text} (n={pairs:,} pairs, {sequences} seqs)"


def _clean(obj):
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _aggregate(match: np.ndarray, n_actual: np.ndarray, in_time: np.ndarray, decode: np.ndarray,
               K: int, m_values: list[int], seq: np.ndarray, valid: np.ndarray,
               fetch_basis: str = "predicted") -> dict[str, Any]:
    """Size: the per-pair arrays of one evaluation (matches, counts, timing, phase, sequence, validity) and its
    settings; the arrays are built once by evaluate and shared by every metric here.
    """
    n = len(n_actual)
    nan = float("nan")
    out: dict[str, Any] = {"pairs": int(n), "sequences": int(len(np.unique(seq)))}
    if n == 0:
        out.update({"accuracy": nan, "accuracy_stderr": nan, "accuracy_stderr_iid": nan,
                    "fetch_rate": nan, "goodpred": nan, "goodpred_stderr": nan})
        for m in m_values:
            out[f"recall@{m}"] = out[f"precision@{m}"] = nan
        return out
    denom = np.maximum(n_actual, 1)
    hits_k = match[:, :K].sum(1)
    acc = hits_k / denom
    out["accuracy"] = float(np.mean(acc))
    out["accuracy_stderr"] = clustered_stderr(acc, seq)
    out["accuracy_stderr_iid"] = iid_stderr(acc)
    for m in m_values:
        hits = match[:, :m].sum(1)
        out[f"recall@{m}"] = float(np.mean(hits / denom))
        out[f"precision@{m}"] = float(np.mean(hits / m))
    if decode.any():
        fetch, good = _fetch_and_good(match[decode, :K], in_time[decode, :K], valid[decode, :K], n_actual[decode],
                                      fetch_basis)
        out["fetch_rate"] = fetch
        out["goodpred"] = float(np.mean(good))
        out["goodpred_stderr"] = clustered_stderr(good, seq[decode])
    else:
        out["fetch_rate"] = out["goodpred"] = out["goodpred_stderr"] = nan
    return out


def goodpred(report: PredictionReport, predictor: Predictor, *, hardware: str | HardwareProfile = DEFAULT_PROFILE,
             expert_bytes: int, layer_time_us: float | None = None, link_bandwidth_gbs: float | None = None,
             latency_us: float | None = None, fetch_basis: str | None = None) -> dict[str, float]:
    """Decode fetch rate and GoodPred of ``report``'s predictions under another transfer model,
    without predicting again (only the timing changes). ``fetch_basis`` defaults to the report's."""
    basis = check_fetch_basis(report.fetch_basis if fetch_basis is None else fetch_basis)
    lat = report.latency_us if latency_us is None else latency_us
    lat = 0.0 if not math.isfinite(lat) else lat
    tm = transfer_model(hardware, expert_bytes, lat, layer_time_us, link_bandwidth_gbs)
    schedule = in_time_schedule(predictor.timing, predictor.distance, predictor.top_k_, tm)
    r = report.rows
    K = report.top_k
    decode = r["phase"] == "decode"
    pred, actual = r["predicted"][decode, :K], r["actual"][decode]
    hits = (pred[:, :, None] == actual[:, None, :]).any(2) & (pred >= 0)
    in_time = schedule[r["target"][decode]][:, :K]
    n_actual = np.maximum((actual >= 0).sum(1), 1)
    fetch, good = _fetch_and_good(hits, in_time, pred >= 0, n_actual, basis)
    seq = r["seq"][decode]
    nan = float("nan")
    return {"goodpred": float(np.mean(good)) if len(good) else nan,
            "goodpred_stderr": clustered_stderr(good, seq),
            "fetch_rate": fetch, "fetch_basis": basis,
            "accuracy": float(np.mean(hits.sum(1) / n_actual)) if len(good) else nan,
            "accuracy_stderr": clustered_stderr(hits.sum(1) / n_actual, seq),
            "pairs": int(len(good)), "sequences": int(len(np.unique(seq)))}


def evaluate(
    predictor: Predictor,
    trace,
    *,
    sequences: np.ndarray | None = None,
    m_values: list[int] | None = None,
    hardware: str | HardwareProfile = DEFAULT_PROFILE,
    expert_bytes: int | None = None,
    layer_time_us: float | None = None,
    link_bandwidth_gbs: float | None = None,
    latency_us: float | None = None,
    model: Any = None,
    fetch_basis: str = "predicted",
) -> PredictionReport:
    """Score a fitted predictor on a trace (of the same model).

    Tokens: ``sequences`` if given; else, when ``trace`` is the trace the predictor was
    fitted on and it holds out validation sequences (``val_sequences_``), only those; else
    every sequence. ``expert_bytes`` defaults to the model's own expert size (recorded in the
    trace, else from the model, loaded by name if ``model`` is not given); ``latency_us`` defaults to the measured batch-1
    latency (:func:`~moelab.predictors.timing.measure_latency_us`). ``fetch_basis``: the fetch
    rate's denominator (module docstring; ``"predicted"`` is ProMoE's).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build. Long
    because the metrics of one source layer share their intermediate arrays (predictions, matches, lead
    times), computed once, top to bottom.
    """
    check_fetch_basis(fetch_basis)
    data = as_trace_data(trace)
    tr = data.trace
    predictor.check_model(tr.model_fingerprint, tr.meta["model"].get("name"))
    idx = data.index
    if sequences is not None:
        split = "given sequences"
        chosen = np.asarray(sequences, dtype=np.int64)
    elif tr.trace_id == predictor.trace_id_ and getattr(predictor, "val_sequences_", None) is not None:
        split = "held-out validation sequences of the fitting trace"
        chosen = predictor.val_sequences_
    else:
        split = "all sequences" + (" (the fitting trace)" if tr.trace_id == predictor.trace_id_ else "")
        chosen = None
    tokens = idx.tokens_of(chosen)
    if len(tokens) == 0:
        raise MoelabError(f"no tokens to evaluate on in trace {str(tr.path)!r} ({split}).")
    K = max(predictor.top_k_)
    E = min(predictor.num_experts_)
    m_values = sorted({m for m in (m_values or [1, 2, 4, 8, K]) if 1 <= m <= E} | {K})
    M = max(m_values)

    latency: dict[str, Any] = {}
    if latency_us is None:
        m = measure_latency(predictor, data)
        latency_us = float("nan") if m is None else m.median * 1e6
        if m is not None:
            latency = {"calls": len(m.samples), "spread": m.spread, "load": m.load_after.get("load1"),
                       "busy": m.reason}
    timing_latency = 0.0 if not math.isfinite(latency_us) else latency_us
    if expert_bytes is None and tr.meta["model"].get("expert_bytes"):
        expert_bytes = int(max(tr.meta["model"]["expert_bytes"]))  # recorded: no need to load the model
    if expert_bytes is None:
        from moelab.predictors.skip import resolve_model

        try:
            model = resolve_model(tr.meta["model"]["name"], tr.model_fingerprint, model)
        except MoelabError as exc:
            raise MoelabError(f"{exc} Or give the transfer size directly: expert_bytes= (CLI: --expert-bytes).") from None
        expert_bytes = expert_bytes_of(model)
    tm = transfer_model(hardware, expert_bytes, timing_latency, layer_time_us, link_bandwidth_gbs)
    schedule = in_time_schedule(predictor.timing, predictor.distance, predictor.top_k_, tm)  # (L, K)

    parts: dict[str, list[np.ndarray]] = {k: [] for k in (
        "tok", "source", "target", "predicted", "actual", "in_time")}
    for layer in predictor.source_layers():
        target = layer + predictor.distance
        tok, pred = predictor.predict_trace(data, layer, tokens=tokens, m=M)
        actual = data.experts[idx.rows[tok, target]][:, :K]
        in_time = np.zeros((len(tok), M), dtype=bool)
        kk = min(K, M)
        in_time[:, :kk] = schedule[target, :kk]
        in_time &= (idx.phase[tok] == "decode")[:, None]
        parts["tok"].append(tok)
        parts["source"].append(np.full(len(tok), layer, np.int32))
        parts["target"].append(np.full(len(tok), target, np.int32))
        parts["predicted"].append(pred)
        parts["actual"].append(actual)
        parts["in_time"].append(in_time)
    cat = {k: np.concatenate(v) for k, v in parts.items()}
    tok = cat["tok"]
    rows = {
        "seq": idx.seq[tok], "step": idx.step[tok], "pos": idx.pos[tok], "phase": idx.phase[tok],
        "token_id": idx.token_id[tok], "source": cat["source"], "target": cat["target"],
        "predicted": cat["predicted"], "actual": cat["actual"], "in_time": cat["in_time"],
    }
    pred, actual = cat["predicted"], cat["actual"]
    valid = pred >= 0  # (n, M): a prediction made at that rank
    match = (pred[:, :, None] == actual[:, None, :]).any(2) & valid  # (n, M)
    n_actual = (actual >= 0).sum(1)
    phase = rows["phase"]
    decode = phase == "decode"

    per_layer, overall = [], {}
    for ph in PHASES:
        sel = np.ones(len(tok), bool) if ph == "all" else phase == ph
        overall[ph] = _aggregate(match[sel], n_actual[sel], cat["in_time"][sel], decode[sel], K, m_values,
                                 rows["seq"][sel], valid[sel], fetch_basis)
        for layer in predictor.source_layers():
            s = sel & (cat["source"] == layer)
            row = {"phase": ph, "source_layer": layer, "target_layer": layer + predictor.distance}
            row.update(_aggregate(match[s], n_actual[s], cat["in_time"][s], decode[s], K, m_values,
                                  rows["seq"][s], valid[s], fetch_basis))
            per_layer.append(row)
    return PredictionReport(
        kind=predictor.kind,
        distance=int(predictor.distance),
        params=predictor.get_params(),
        model_name=predictor.model_name_,
        trace_id=tr.trace_id,
        split=split,
        top_k=K,
        m_values=m_values,
        latency_us=float(latency_us),
        transfer={**tm.to_dict(), "timing": predictor.timing, "in_time": schedule.tolist()},
        per_layer=per_layer,
        overall=overall,
        rows=rows,
        fetch_basis=fetch_basis,
        latency=latency,
    )
