"""The one predictor protocol: inputs on any device, padding masked out, several tokens' predictions unioned in one place.

Every expert predictor is a :class:`moelab.predictors.base.Predictor`. The same object
serves three callers:

* **online** (a forward pass, e.g. the forward-context attach): ``predictor.predict(layer,
  hidden=h, token_ids=ids, valid=mask, m=m)`` with what the model has when MoE layer
  ``layer`` routes. ``h`` (T, H), ``ids`` (T,) and ``mask`` (T,) may be numpy arrays or
  torch tensors on any device (CUDA included): they go through :func:`to_numpy` /
  :func:`to_cpu_tensor` (``.detach().cpu()`` before numpy). The result is (T, m) int64
  expert ids of MoE layer ``layer + distance``, best first; rows of padding tokens
  (``valid`` False) are ``-1`` and are not computed. ``predictor.predict_union(...)`` takes
  the same arguments and returns the ordered union (below) for the whole forward — what a
  prefetcher transfers.
* **offline** (a recorded trace): ``predictor.predict_trace(trace, layer)`` does the same
  for every recorded token (traces hold no padding).
* **the cache simulator**: ``moelab.predictors.as_prefetcher(predictor, trace)`` turns the
  offline predictions into per-(sequence, step, layer) proposals for
  ``moelab.caches.PrefetchConfig``; a group with several tokens (a prompt) is unioned
  with :func:`union_predictions`.

Prefetch sources. The cache simulator and the offline planner (and through it the what-if
grids) take one kind of prefetch source, resolved by ``moelab.caches.prefetch.get_prefetcher``:
a predictor kind that reads the recorded routing (``"oracle"``, ``"repeat"``: by name or as an
instance, unfitted; :attr:`~moelab.predictors.base.Predictor.reads_routing`), a fitted predictor
(through :func:`moelab.predictors.as_prefetcher` for a cache's access stream, which holds no
router inputs; directly in the planner and a running model, which ask ``predict_union`` with
the forward's router inputs), or any object following :class:`Prefetcher`: ``propose(context)``
with one :class:`PredictContext`, the same type in the cache simulator and the planner.

:func:`union_predictions` is the one place that merges several tokens' predictions and
orders them (see its docstring for the order and why).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from moelab.errors import MoelabError


def to_cpu_tensor(x: Any):
    """``x`` (a torch tensor on any device, a numpy array, a list) as a detached CPU torch tensor."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    return torch.as_tensor(np.asarray(x))


def to_numpy(x: Any, dtype: Any = None) -> np.ndarray:
    """``x`` as a numpy array: torch tensors (any device, any dtype, bf16 included) are
    ``.detach().cpu()``-ed first; ``dtype`` casts (no copy when it already matches)."""
    if type(x).__module__.startswith("torch"):
        import torch

        if isinstance(x, torch.Tensor):
            t = x.detach().cpu()
            if t.dtype in (torch.bfloat16, torch.float16) or (dtype is not None and np.dtype(dtype).kind == "f"
                                                               and t.dtype.is_floating_point):
                t = t.float()
            x = t.numpy()
    arr = np.asarray(x)
    return arr if dtype is None else arr.astype(dtype, copy=False)


def valid_mask(valid: Any, n: int) -> np.ndarray | None:
    """``valid`` as an (n,) bool numpy mask (None stays None: every token is valid)."""
    if valid is None:
        return None
    mask = to_numpy(valid)
    if mask.dtype != np.bool_:
        if mask.dtype.kind not in "iu" or not np.isin(mask, (0, 1)).all():
            raise MoelabError(f"valid must be a bool mask (True = a real token, False = padding), got dtype {mask.dtype}.")
        mask = mask.astype(bool)
    mask = mask.reshape(-1)
    if len(mask) != n:
        raise MoelabError(f"valid has {len(mask)} entries but there are {n} tokens; give one flag per token.")
    return mask


def union_predictions(predicted: Any, valid: Any = None, scores: Any = None, *, limit: int | None = None) -> np.ndarray:
    """The experts predicted for any valid token, in the order a prefetcher should fetch them.

    Args:
        predicted: (T, m) expert ids, each row best first (``Predictor.predict``); a 1-D
            array is one token. Entries ``< 0`` mean "no prediction" and are skipped; an id
            repeated within a row counts once for that token, at its best rank.
        valid: (T,) bool, False for padding tokens (their rows are ignored); None = all.
        scores: optional (T, m) non-negative weights of each prediction (a predictor's
            confidence); when given, an expert's support is the sum of its weights instead
            of the number of tokens predicting it.
        limit: keep at most this many experts.

    Order: (1) support, descending — the number of tokens that predicted the expert: an
    expert needed by more tokens of the forward is likelier to be needed at all, and a miss
    on it stalls more of the batch; (2) best rank any token gave it, ascending — a token's
    top-1 guess is likelier than its top-k; (3) lower expert id, so the order is
    deterministic. For one token this is the predictor's own ranking.

    Returns: (n,) int64 expert ids, no duplicates.
    """
    pred = to_numpy(predicted)
    if pred.ndim == 1:
        pred = pred[None, :]
    if pred.ndim != 2:
        raise MoelabError(f"predicted must be (tokens, m) expert ids, got shape {pred.shape}.")
    if pred.size and pred.dtype.kind not in "iu":
        raise MoelabError(f"predicted must hold integer expert ids, got dtype {pred.dtype}.")
    pred = pred.astype(np.int64, copy=False)
    T, m = pred.shape
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 0):
        raise MoelabError(f"limit must be an integer ≥ 0, got {limit!r}.")
    if T == 1 and valid is None and scores is None:  # one token (a decode step): its own ranking, each id
        # once at its best rank — the rule below in a few Python steps (the per-layer path of a live run)
        out = np.fromiter(dict.fromkeys(e for e in pred[0].tolist() if e >= 0), dtype=np.int64)
        return out if limit is None else out[:limit]
    rows = np.repeat(np.arange(T), m)
    ranks = np.tile(np.arange(m), T)
    ids = pred.reshape(-1)
    keep = ids >= 0
    mask = valid_mask(valid, T)
    if mask is not None:
        keep &= mask[rows]
    weight = None
    if scores is not None:
        w = to_numpy(scores, np.float64)
        if w.ndim == 1:
            w = w[None, :]
        if w.shape != pred.shape:
            raise MoelabError(f"scores must have the shape of predicted {pred.shape}, got {w.shape}.")
        if not np.all(np.isfinite(w[keep.reshape(T, m)])) or (w[keep.reshape(T, m)] < 0).any():
            raise MoelabError("scores must be finite and ≥ 0 (a weight per prediction).")
        weight = w.reshape(-1)[keep]
    rows, ranks, ids = rows[keep], ranks[keep], ids[keep]
    if ids.size == 0:
        out = np.zeros(0, dtype=np.int64)
        return out
    # one vote per (token, expert): keep the best rank of an id repeated within a row
    order = np.lexsort((ranks, ids, rows))
    rows, ranks, ids = rows[order], ranks[order], ids[order]
    if weight is not None:
        weight = weight[order]
    first = np.ones(len(ids), dtype=bool)
    first[1:] = (rows[1:] != rows[:-1]) | (ids[1:] != ids[:-1])
    rows, ranks, ids = rows[first], ranks[first], ids[first]
    if weight is not None:
        weight = weight[first]
    uniq, inv = np.unique(ids, return_inverse=True)
    support = np.bincount(inv, weights=weight, minlength=len(uniq)).astype(np.float64)
    best = np.full(len(uniq), np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(best, inv, ranks)
    out = uniq[np.lexsort((uniq, best, -support))]
    if limit is not None:
        out = out[:limit]
    return out.astype(np.int64, copy=False)


@dataclass(frozen=True)
class PredictContext:
    """What a prefetch source sees when asked, after MoE layer ``layer`` of one forward (a
    step), about ``target_layer``: the same type in the cache simulator and the offline planner."""

    stream: Any
    """The cache simulator's access stream (``num_experts``, ``top_k`` and the past), or None
    in the offline planner."""
    group: int
    """Index of the (seq, step, layer) group just served in ``stream``; in the planner, the
    forward's index in the routing source times the MoE layers plus ``layer``."""
    seq: int
    """Sequence id (-1 in the planner: a forward may hold several sequences)."""
    step: int
    """Step (0 = prefill, n = n-th decode step)."""
    layer: int
    """MoE-layer ordinal just served (``l``)."""
    target_layer: int
    """MoE-layer ordinal to predict (``l + d``)."""
    experts: np.ndarray
    """Experts layer ``l`` used in this step, in access order."""
    scores: np.ndarray | None
    """Router scores of layer ``l`` in this step, or None if not recorded."""
    routing: Any = None
    """The planner's :class:`moelab.routing.ForwardRouting` of this forward (its router inputs
    and token ids, when recorded); None in the cache simulator."""


@runtime_checkable
class Prefetcher(Protocol):
    """A prefetch source written by hand: ``propose(context)`` returns expert ids of
    ``context.target_layer``, most confident first, or (T, m) per-token predictions (padding
    rows ``-1``), unioned in order by :func:`union_predictions`. Optional: ``model_name: str``,
    ``num_experts: list[int]`` (checked against the trace), and ``propose_stream(stream,
    distance) -> (ptr, keys)`` for a vectorised path over a cache's whole access stream."""

    def propose(self, context: PredictContext) -> Sequence[int] | np.ndarray: ...


__all__ = ["PredictContext", "Prefetcher", "to_cpu_tensor", "to_numpy", "union_predictions", "valid_mask"]
