"""Adapter: a fitted :class:`~moelab.predictors.base.Predictor` as a cache prefetcher.

The cache simulator (:mod:`moelab.caches.prefetch`) asks ``predict(context) -> expert ids``
after MoE layer ``l`` of a step, or ``propose_stream(stream, distance)`` for all groups at
once. Its access stream holds no hidden states or token ids, so the adapter precomputes the
predictor's predictions over the trace the stream comes from::

    from moelab.caches import PrefetchConfig, simulate
    pf = as_prefetcher(load_predictor("predictors/moelab-tiny-mixtral/learned-d2"), trace)
    simulate(trace, "lru", 0.5, prefetch=PrefetchConfig(predictor=pf, distance=2))

A group with several tokens (a prompt) gets the union of its tokens' predictions, ordered
by how many tokens voted for each expert (ties: lower id).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, as_trace_data


class PredictorPrefetcher:
    """Satisfies ``moelab.caches.prefetch.ExpertPredictor`` for one predictor and one trace."""

    def __init__(self, predictor: Predictor, trace, *, m: int | None = None) -> None:
        data = as_trace_data(trace)
        predictor.check_model(data.trace.model_fingerprint, data.trace.meta["model"].get("name"))
        self.predictor = predictor
        self.name = f"{predictor.kind}-d{predictor.distance}"
        self.model_name = data.trace.meta["model"].get("name")
        self.num_experts = list(predictor.num_experts_)
        self.distance = int(predictor.distance)
        idx = data.index
        votes: dict[tuple[int, int, int], Counter] = {}
        for layer in predictor.source_layers():
            tok, pred = predictor.predict_trace(data, layer, m=m)
            for s, st, row in zip(idx.seq[tok].tolist(), idx.step[tok].tolist(), pred.tolist()):
                c = votes.setdefault((s, st, layer), Counter())
                c.update(row)
        self._table = {k: [e for e, _ in sorted(c.items(), key=lambda kv: (-kv[1], kv[0]))] for k, c in votes.items()}

    def lookup(self, seq: int, step: int, layer: int) -> list[int]:
        """Predicted experts of MoE layer ``layer + distance`` after ``layer`` of (seq, step)."""
        return self._table.get((int(seq), int(step), int(layer)), [])

    def predict(self, context: Any) -> Sequence[int]:
        if context.target_layer - context.layer != self.distance:
            raise MoelabError(
                f"predictor {self.name} predicts at distance {self.distance}, the cache asked for "
                f"{context.target_layer - context.layer}; use a predictor fitted with that distance."
            )
        return self.lookup(context.seq, context.step, context.layer)

    def propose_stream(self, stream: Any, distance: int) -> tuple[np.ndarray, np.ndarray]:
        if distance != self.distance:
            raise MoelabError(
                f"predictor {self.name} predicts at distance {self.distance}, the cache asked for {distance}; "
                "use a predictor fitted with that distance."
            )
        G = stream.num_groups
        ptr = np.zeros(G + 1, dtype=np.int64)
        keys: list[int] = []
        L = stream.num_layers
        for g in range(G):
            layer = int(stream.group_layer[g])
            if layer + distance < L:
                off = int(stream.key_offset[layer + distance])
                keys.extend(off + e for e in self.lookup(stream.group_seq[g], stream.group_step[g], layer))
            ptr[g + 1] = len(keys)
        return ptr, np.asarray(keys, dtype=np.int64)


def as_prefetcher(predictor: Predictor, trace, *, m: int | None = None) -> PredictorPrefetcher:
    """A cache prefetcher (``moelab.caches`` ExpertPredictor protocol) from a fitted predictor."""
    return PredictorPrefetcher(predictor, trace, m=m)
