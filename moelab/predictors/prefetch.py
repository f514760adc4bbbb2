"""Adapter: a fitted :class:`~moelab.predictors.base.Predictor` as a cache prefetcher.

The cache simulator (:mod:`moelab.caches.prefetch`) asks ``propose(context) -> expert ids``
after MoE layer ``l`` of a step, or ``propose_stream(stream, distance)`` for all groups at
once. Its access stream holds no hidden states or token ids, so the adapter precomputes the
predictor's predictions over the trace the stream comes from::

    from moelab.caches import PrefetchConfig, simulate
    pf = as_prefetcher(load_predictor("predictors/moelab-tiny-mixtral/learned-d2"), trace)
    simulate(trace, "lru", 0.5, prefetch=PrefetchConfig(predictor=pf, distance=2))

A group with several tokens (a prompt, or a batch's rows) gets the union of its tokens'
predictions in the order of :func:`moelab.predictors.protocol.union_predictions` (tokens
predicting it, then best rank, then lower id); a one-token group (a decode step at batch 1)
keeps the predictor's own ranking.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.predictors.base import Predictor, as_trace_data
from moelab.predictors.protocol import union_predictions


class PredictorPrefetcher:
    """Satisfies ``moelab.caches.prefetch.Prefetcher`` for one predictor and one trace."""

    def __init__(self, predictor: Predictor, trace, *, m: int | None = None) -> None:
        data = as_trace_data(trace)
        predictor.check_model(data.trace.model_fingerprint, data.trace.meta["model"].get("name"))
        self.predictor = predictor
        self.name = f"{predictor.kind}-d{predictor.distance}"
        self.model_name = data.trace.meta["model"].get("name")
        self.num_experts = list(predictor.num_experts_)
        self.distance = int(predictor.distance)
        idx = data.index
        self._table: dict[tuple[int, int, int], list[int]] = {}
        # per trace row (the source layer's row of each token): its own prediction, so a group of
        # any shape (a batch's rows in per-forward replay) gets exactly its tokens' union
        self._row_pred: dict[int, np.ndarray] = {}
        for layer in predictor.source_layers():
            tok, pred = predictor.predict_trace(data, layer, m=m)
            if len(tok) == 0:
                continue
            for r, row in zip(idx.rows[tok, layer].tolist(), pred, strict=True):
                self._row_pred[r] = row
            seq, step = idx.seq[tok].astype(np.int64), idx.step[tok].astype(np.int64)
            order = np.lexsort((step, seq))
            seq, step, pred = seq[order], step[order], pred[order]
            cut = np.flatnonzero((np.diff(seq) != 0) | (np.diff(step) != 0)) + 1
            for lo, hi in zip(np.r_[0, cut].tolist(), np.r_[cut, len(seq)].tolist()):
                self._table[(int(seq[lo]), int(step[lo]), layer)] = union_predictions(pred[lo:hi]).tolist()

    def lookup(self, seq: int, step: int, layer: int) -> list[int]:
        """Predicted experts of MoE layer ``layer + distance`` after ``layer`` of (seq, step)."""
        return self._table.get((int(seq), int(step), int(layer)), [])

    def propose(self, context: Any) -> Sequence[int]:
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
        rows, row_ptr = getattr(stream, "score_rows", None), getattr(stream, "row_ptr", None)
        for g in range(G):
            layer = int(stream.group_layer[g])
            if layer + distance < L:
                off = int(stream.key_offset[layer + distance])
                if rows is not None and row_ptr is not None:
                    preds = [self._row_pred[r] for r in rows[row_ptr[g]:row_ptr[g + 1]].tolist() if r in self._row_pred]
                    experts = union_predictions(np.stack(preds)).tolist() if preds else []
                else:  # no row map (a stream built without it): the (seq, step) of the group
                    experts = self.lookup(stream.group_seq[g], stream.group_step[g], layer)
                keys.extend(off + e for e in experts)
            ptr[g + 1] = len(keys)
        return ptr, np.asarray(keys, dtype=np.int64)


def as_prefetcher(predictor: Predictor, trace, *, m: int | None = None) -> PredictorPrefetcher:
    """A cache prefetcher (``moelab.caches.prefetch.Prefetcher``) from a fitted predictor."""
    return PredictorPrefetcher(predictor, trace, m=m)
