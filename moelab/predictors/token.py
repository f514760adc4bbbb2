"""Token-based prediction (iteration-wise, MoE-Infinity/Lina-style tables).

Offline, count for each input token id which experts each MoE layer chose; online,
predict the most frequent ones for every layer at once from the token id alone — the
largest lead time, at the price of ignoring context.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, TraceData
from moelab.predictors.baselines import layer_frequencies
from moelab.predictors.registry import register_predictor


@register_predictor("token")
class TokenPredictor(Predictor):
    """Token id → per-layer expert frequency table.

    Score of expert e at layer t for token v: ``count[v, t, e] + smoothing × freq[t, e]``,
    so unseen tokens (and ties) fall back to the layer's popularity. Learned state:
    ``token_ids_`` (U,) sorted seen ids, ``counts_`` (U, L, E), ``frequency_`` (L, E).
    Fitted on the training sequences only (``val_fraction`` of them held out, by sequence).
    """

    timing = "iteration"

    def __init__(self, distance: int = 1, smoothing: float = 1.0, val_fraction: float = 0.1, seed: int = 0) -> None:
        self.distance = distance
        self.smoothing = smoothing
        self.val_fraction = val_fraction
        self.seed = seed

    def _validate_params(self) -> None:
        super()._validate_params()
        if not self.smoothing >= 0:
            raise MoelabError(f"TokenPredictor: smoothing must be ≥ 0, got {self.smoothing!r}.")

    def _fit(self, data: TraceData, model: Any) -> None:
        idx = data.index
        tokens = idx.tokens_of(self.train_sequences_)
        L, E = data.trace.num_moe_layers, data.trace.num_experts
        ids, inverse = np.unique(idx.token_id[tokens], return_inverse=True)
        counts = np.zeros((len(ids), L, E), dtype=np.float32)
        for layer in range(L):
            rows = idx.rows[tokens, layer]
            ok = rows >= 0
            chosen = data.experts[rows[ok]]
            u = np.broadcast_to(inverse[ok][:, None], chosen.shape)
            valid = chosen >= 0
            np.add.at(counts[:, layer, :], (u[valid], chosen[valid]), 1.0)
        self.token_ids_ = ids.astype(np.int64)
        self.counts_ = counts
        self.frequency_ = layer_frequencies(data, tokens)

    def _scores(self, layer, hidden, token_ids, n):
        if token_ids is None:
            raise MoelabError("the 'token' predictor needs token_ids= (the input token ids).")
        target = layer + self.distance
        base = self.smoothing * self.frequency_[target]
        scores = np.broadcast_to(base, (n, base.shape[0])).copy()
        pos = np.searchsorted(self.token_ids_, token_ids)
        pos = np.minimum(pos, max(len(self.token_ids_) - 1, 0))
        seen = (len(self.token_ids_) > 0) & (self.token_ids_[pos] == token_ids) if len(self.token_ids_) else np.zeros(n, bool)
        scores[seen] += self.counts_[pos[seen], target]
        return scores

    def _state(self):
        return (
            {"token_ids": self.token_ids_, "counts": self.counts_, "frequency": self.frequency_},
            {},
        )

    def _load_state(self, tensors, extra, model):
        self.token_ids_ = tensors["token_ids"]
        self.counts_ = tensors["counts"]
        self.frequency_ = tensors["frequency"]
