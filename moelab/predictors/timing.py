"""The prefetch timing model behind GoodPred (fetch rate), and batch-1 latency measurement.

**Model** (decode, one token per forward, batch 1). Time 0 is when MoE layer 0 routes;
MoE layer j routes — and needs its experts on the device — at ``R_j = j × T`` with
``T = HardwareProfile.decode_layer_time_us``. The forward pass starts at ``-a × T``
(``a = attention_fraction``: the attention before the first MoE block).

* A **layer-wise** predictor (skip, learned, oracle) predicting MoE layer ``l + d`` from
  layer l's router input is ready at ``R_l + latency``: its lead time is ``d × T − latency``.
* An **iteration-wise** predictor (token) predicts from the token id at the start of the
  forward, one layer after another: the prediction for the i-th target layer is ready at
  ``−a × T + (i + 1) × latency``.
* A **static** predictor (frequency) is ready at ``−a × T``.
* As soon as a prediction is ready, its m = top-k experts are queued for transfer, best
  first, on **one FIFO host→device link** — the one link model of
  :class:`moelab.timing.Link`: each transfer takes ``link_latency_us + expert_bytes /
  link_bandwidth`` and starts when both the link is free and its prediction is ready.
* The queue order of one forward's experts is that of
  :func:`moelab.predictors.protocol.union_predictions`; GoodPred scores batch-1 decode
  (one token per forward), where it is the token's own ranking.
* A predicted expert is **fetched in time** if its transfer completes by ``R_target``.
  FetchRate (ProMoE's, the default) = in-time predicted experts / predicted experts and
  GoodPred = Accuracy × FetchRate; with ``fetch_basis="correct"``, FetchRate = in-time
  correct predictions / correct predictions and GoodPred = in-time correct predictions /
  actual experts (:mod:`moelab.predictors.metrics`).

**Assumptions** (all favour neither predictor kind): no expert cache — every predicted
expert is transferred (a cache only helps, and is studied with ``moelab.caches``); the
link is idle at the start of each forward; wrong predictions occupy the link like right
ones; on-demand fetches of mispredicted experts are not modelled (they would compete for
the link); the predictor runs on the CPU concurrently with the GPU and does not slow the
layer; layer time does not depend on the prediction. Because issue times do not depend
on the data, whether rank r of target layer j arrives in time is one boolean per
``(j, r)``: :func:`in_time_schedule`. Prefill (many tokens per forward, shared experts)
is not modelled: GoodPred is reported for decode tokens only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from moelab.measure import from_samples, machine_load
from moelab.timing import EPS_US, HardwareProfile, fifo_schedule, get_profile


@dataclass(frozen=True)
class TransferModel:
    """The inputs of the GoodPred timing model."""

    profile: HardwareProfile
    """Link bandwidth/latency, layer time and attention fraction."""
    expert_bytes: int
    """Bytes moved per expert transfer."""
    latency_us: float
    """Predictor latency per layer per token (batch 1)."""

    @property
    def transfer_us(self) -> float:
        return self.profile.transfer_time_us(self.expert_bytes)

    def to_dict(self) -> dict:
        return {
            "profile": self.profile.name,
            "link_bandwidth_gbs": self.profile.link_bandwidth_gbs,
            "link_latency_us": self.profile.link_latency_us,
            "decode_layer_time_us": self.profile.decode_layer_time_us,
            "attention_fraction": self.profile.attention_fraction,
            "expert_bytes": int(self.expert_bytes),
            "transfer_us": self.transfer_us,
            "predictor_latency_us": self.latency_us,
        }


def in_time_schedule(timing: str, distance: int, top_k: list[int], model: TransferModel) -> np.ndarray:
    """(L, K) bool: whether rank r of the prediction for MoE layer j completes its transfer in time.

    Rows of layers without a prediction (j < distance for layer-wise predictors) are False.
    """
    L, K = len(top_k), max(top_k)
    T = model.profile.decode_layer_time_us
    start = -model.profile.attention_fraction * T
    lat = max(float(model.latency_us), 0.0)
    targets = list(range(distance, L)) if timing == "layer" else list(range(L))
    ready: list[float] = []
    slots: list[tuple[int, int]] = []
    for i, j in enumerate(targets):
        if timing == "layer":
            t = (j - distance) * T + lat
        elif timing == "iteration":
            t = start + (i + 1) * lat
        else:  # static
            t = start
        for r in range(top_k[j]):
            ready.append(t)
            slots.append((j, r))
    out = np.zeros((L, K), dtype=bool)
    if not slots:
        return out
    _, end = fifo_schedule(model.profile.link, ready, model.expert_bytes, free_at_us=start)
    for (j, r), e in zip(slots, end.tolist()):
        out[j, r] = e <= j * T + EPS_US
    return out


def measure_latency(predictor, data, *, calls: int = 200, warmup: int = 20):
    """Wall times of ``calls`` online ``predict`` calls for one token at one layer (batch 1), after
    ``warmup`` untimed ones, as a :class:`moelab.measure.Measurement` (median, spread, load).

    Inputs are real rows of ``data`` (router input of the first source layer as recorded,
    and the token id); input conversion is included, as it is part of the online path.
    None for offline-only predictors (oracle) and where no token pair exists.
    """

    if not predictor.online or calls < 1:
        return None
    layer = predictor.source_layers()[0]
    tokens = data.index.pairs(layer, layer + predictor.distance)[:64]
    if len(tokens) == 0:
        return None
    rows = data.index.rows[tokens, layer]
    hidden = data.hidden[rows] if predictor.needs_hidden else None
    ids = data.index.token_id[tokens]
    before = machine_load()
    samples = []
    for i in range(warmup + calls):
        j = i % len(tokens)
        h = hidden[j : j + 1] if hidden is not None else None
        t0 = time.perf_counter_ns()
        predictor.predict(layer, hidden=h, token_ids=ids[j : j + 1])
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 1e9)
    return from_samples(samples, warmup=warmup, load_before=before)


def measure_latency_us(predictor, data, *, calls: int = 200, warmup: int = 20) -> float:
    """Median wall time (µs) of one online ``predict`` call (:func:`measure_latency`); NaN for
    offline-only predictors."""
    m = measure_latency(predictor, data, calls=calls, warmup=warmup)
    return float("nan") if m is None else m.median * 1e6


def transfer_model(hardware: str | HardwareProfile | None, expert_bytes: int, latency_us: float,
                   layer_time_us: float | None = None, link_bandwidth_gbs: float | None = None) -> TransferModel:
    """A :class:`TransferModel` from a profile name and optional overrides."""
    profile = get_profile(hardware)
    changes = {}
    if layer_time_us is not None:
        changes["decode_layer_time_us"] = float(layer_time_us)
    if link_bandwidth_gbs is not None:
        # the rate copies reach, as given: the profile's link efficiency does not apply to it
        changes["link_bandwidth_gbs"] = float(link_bandwidth_gbs)
        changes["link_efficiency"] = 1.0
    if changes:
        profile = profile.with_changes(**changes)
    return TransferModel(profile=profile, expert_bytes=int(expert_bytes), latency_us=float(latency_us))
