"""Baselines: ``frequency`` (static popularity per layer), ``oracle`` (perfect, for bounds) and
``repeat`` (the previous step's experts: temporal locality, training-free).

``oracle`` and ``repeat`` read the recorded routing itself (:attr:`Predictor.reads_routing`), so
they need no fitting to drive a prefetch: the cache simulator and the offline planner propose,
after MoE layer ``l`` of a forward, the experts MoE layer ``l + d`` needs in the same forward
(oracle) or needed in the previous step of the same sequence (repeat), in access order
(:func:`moelab.caches.prefetch.proposals`, :func:`moelab.hybrid.offline.plan_routing`). Fitted, they
also give per-token predictions over a trace (``predict_trace``) for the accuracy metrics.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, TraceData
from moelab.predictors.registry import register_predictor


def layer_frequencies(data: TraceData, tokens: np.ndarray | None = None) -> np.ndarray:
    """(L, E) float32 share of tokens that selected each expert, per MoE layer."""
    tr = data.trace
    L, E = tr.num_moe_layers, tr.num_experts
    layer = tr.column("moe_layer").astype(np.int64)
    experts = data.experts
    rows = np.arange(len(layer)) if tokens is None else data.index.rows[tokens].reshape(-1)
    rows = rows[rows >= 0]
    counts = np.zeros((L, E), dtype=np.float64)
    ids = experts[rows]
    lay = np.broadcast_to(layer[rows][:, None], ids.shape)
    ok = ids >= 0
    np.add.at(counts, (lay[ok], ids[ok]), 1.0)
    totals = np.maximum(np.bincount(layer[rows], minlength=L), 1)[:, None]
    return (counts / totals).astype(np.float32)


@register_predictor("frequency")
class FrequencyPredictor(Predictor):
    """Predicts each layer's most popular experts, whatever the token (static placement).

    Learned state: ``frequency_`` (L, E), the share of the training sequences' tokens
    selecting each expert (``val_fraction`` of the sequences held out).
    """

    timing = "static"

    def __init__(self, distance: int = 1, val_fraction: float = 0.1, seed: int = 0) -> None:
        self.distance = distance
        self.val_fraction = val_fraction
        self.seed = seed

    def _fit(self, data: TraceData, model: Any) -> None:
        self.frequency_ = layer_frequencies(data, data.index.tokens_of(self.train_sequences_))

    def _scores(self, layer, hidden, token_ids, n):
        return np.broadcast_to(self.frequency_[layer + self.distance], (n, self.frequency_.shape[1])).copy()

    def _state(self):
        return {"frequency": self.frequency_}, {}

    def _load_state(self, tensors, extra, model):
        want = (self.num_moe_layers_, max(self.num_experts_))
        if tensors["frequency"].shape != want:
            raise MoelabError(f"'frequency' has shape {tensors['frequency'].shape}, expected {want}.")
        self.frequency_ = tensors["frequency"]


class _RoutingReader(Predictor):
    """A kind that reads the recorded routing instead of predicting from inputs (offline only,
    nothing to learn); :attr:`~moelab.predictors.base.Predictor.reads_routing` says which forward."""

    online = False

    def __init__(self, distance: int = 1) -> None:
        self.distance = distance

    def _fit(self, data: TraceData, model: Any) -> None:
        pass


@register_predictor("oracle")
class OraclePredictor(_RoutingReader):
    """The recorded future: ranks the experts layer ``l + d`` actually chose first (by
    weight), then the rest by their recorded router score. Offline only; an upper bound
    (accuracy 1 at m = top-k, and a fetch rate limited only by timing). As a prefetch source
    it proposes what layer ``l + d`` of the same forward needs (``reads_routing = "same"``)."""

    reads_routing = "same"

    def _scores_offline(self, data: TraceData, layer: int, tokens: np.ndarray) -> np.ndarray:
        target = layer + self.distance
        rows = data.index.rows[tokens, target]
        E = max(self.num_experts_)
        scores = np.zeros((len(rows), E), dtype=np.float32)
        if data.scores is not None:
            scores[:] = data.scores[rows, :E]  # in [0, 1] for softmax and sigmoid routers
            scores = np.clip(scores, 0.0, 1.0)
        actual = data.experts[rows]
        K = actual.shape[1]
        r, c = np.nonzero(actual >= 0)
        scores[r, actual[r, c]] = 2.0 + (K - c)  # chosen experts first, in weight order
        return scores


@register_predictor("repeat")
class RepeatPredictor(_RoutingReader):
    """Temporal locality: predicts for a token of step ``s`` the experts MoE layer ``l + d``
    chose at step ``s - 1`` of the same sequence, the most chosen first (by the number of
    that step's tokens choosing each, then by their best rank, then the lower id), the rest
    by their recorded router score at that step. No learned state; offline only (it reads the
    recorded previous step). As a prefetch source it proposes what layer ``l + d`` needed at the
    previous step of the same sequence (``reads_routing = "previous"``); a prompt (step 0) has
    no previous step and gets no proposal."""

    reads_routing = "previous"

    def _scores_offline(self, data: TraceData, layer: int, tokens: np.ndarray) -> np.ndarray:
        target = layer + self.distance
        idx = data.index
        E = max(self.num_experts_)
        scores = np.zeros((len(tokens), E), dtype=np.float32)
        if len(tokens) == 0:
            return scores
        # every token of each (seq, step) recorded at the target layer: the previous step's votes
        at = np.flatnonzero(idx.rows[:, target] >= 0)
        step_of = {}
        for t in at.tolist():
            step_of.setdefault((int(idx.seq[t]), int(idx.step[t])), []).append(t)
        K = data.experts.shape[1]
        cache: dict[tuple[int, int], np.ndarray] = {}
        for i, t in enumerate(tokens.tolist()):
            key = (int(idx.seq[t]), int(idx.step[t]) - 1)
            if key[1] < 0 or key not in step_of:
                continue
            if key not in cache:
                rows = idx.rows[step_of[key], target]
                chosen = data.experts[rows]
                count = np.zeros(E, dtype=np.float64)
                best = np.full(E, K, dtype=np.float64)  # K: never chosen
                for c in range(K):
                    ok = chosen[:, c] >= 0
                    np.add.at(count, chosen[ok, c], 1.0)
                    np.minimum.at(best, chosen[ok, c], float(c))
                # lexicographic: votes, then best rank, then the router's mean score (in [0, 1))
                v = count * (K + 2) + (K - best)
                if data.scores is not None:
                    v += 0.999 * np.clip(data.scores[rows, :E], 0.0, 1.0).mean(axis=0)
                cache[key] = v.astype(np.float32)
            scores[i] = cache[key]
        return scores
