"""Drive an expert cache from a running model: one access per forward pass and MoE layer.

A runtime calls :func:`access_forward` at every MoE layer of every forward with the router's
output for the batch's tokens. The experts accessed are the union over the valid tokens,
ordered by descending largest router weight (ties: lower expert id): the rule of
:func:`moelab.caches.stream.ordered_union`, which the offline per-forward replay
(``replay="forward"``) applies to a recorded trace, so that replaying a trace and driving the
cache online give the same hits at any batch size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from moelab.caches.base import ExpertCache
from moelab.caches.stream import ordered_union
from moelab.errors import MoelabError


def _host(x: Any, dtype: Any) -> np.ndarray:
    """A tensor (any device, any float dtype) or array as a NumPy array of ``dtype``."""
    if hasattr(x, "detach"):  # torch.Tensor: bfloat16 has no NumPy dtype, so cast on device first
        import torch

        x = x.detach().to(device="cpu", dtype=torch.float32 if np.dtype(dtype).kind == "f" else torch.int64)
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


def forward_experts(experts: Any, weights: Any, valid: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """The experts a forward accesses at one MoE layer, in access order, and the valid rows.

    ``experts``/``weights`` are (T, K) (``-1`` = no expert), ``valid`` (T,) bool or None (all
    tokens real). Returns ``(expert ids (m,), indices of the valid rows)``.
    """
    ex = _host(experts, np.int64)
    if ex.ndim == 1:
        ex = ex[None, :]
    w = _host(weights, np.float32).reshape(ex.shape)
    rows = np.arange(len(ex)) if valid is None else np.flatnonzero(_host(valid, bool).reshape(-1))
    if valid is not None and len(_host(valid, bool).reshape(-1)) != len(ex):
        raise MoelabError(f"valid must have one entry per token ({len(ex)}), got {len(_host(valid, bool).reshape(-1))}.")
    ex, w = ex[rows], w[rows]
    if ex.size <= _SMALL:  # ordered_union's rule in plain Python (numpy's per-call cost dominates)
        return np.array(union_small(ex.tolist(), w.tolist()), dtype=np.int64), rows
    _, union = ordered_union(np.zeros(len(ex), dtype=np.int64), ex, w, 1)
    return union, rows


#: Selections up to which :func:`forward_experts` orders in plain Python.
_SMALL = 64


def union_small(experts: list[list[int]], weights: list[list[float]]) -> list[int]:
    """:func:`moelab.caches.stream.ordered_union`'s rule for one group, on Python lists.

    One token: its experts in router order (``-1`` skipped). Several: each expert once, by
    descending largest weight, ties by lower id. For the few values of a decode step this
    is several times faster than the numpy path (tests check they agree).
    """
    if len(experts) == 1:
        return [e for e in experts[0] if e >= 0]
    best: dict[int, float] = {}
    for row, wrow in zip(experts, weights, strict=True):
        for e, x in zip(row, wrow, strict=True):
            if e >= 0 and (e not in best or x > best[e]):
                best[e] = x
    return sorted(best, key=lambda e: (-best[e], e))


def access_forward(
    cache: ExpertCache,
    moe_layer: int,
    experts: Any,
    weights: Any,
    valid: Any = None,
    scores: Any = None,
) -> list[bool]:
    """Serve one forward's MoE layer from ``cache``; returns hit/miss per accessed expert.

    Args:
        cache: an online cache (:func:`moelab.caches.make_cache`).
        moe_layer: the MoE layer's ordinal (0..L-1), not its decoder-layer index.
        experts: (T, K) selected expert ids of the batch's tokens (tensor on any device or
            array; ``-1`` = no expert).
        weights: (T, K) their router weights (orders the union).
        valid: (T,) bool, False for padding tokens; None: every token is real.
        scores: (T, E) router score vectors, for score-aware policies (``mrs``); only the
            valid rows are used, in token order.
    """
    union, rows = forward_experts(experts, weights, valid)
    sc = None
    if scores is not None:
        sc = _host(scores, np.float32)
        sc = sc.reshape(-1, sc.shape[-1])[rows]
    if len(union) == 0:
        return []
    return cache.access(moe_layer, union.tolist(), sc)


@contextmanager
def attach_cache(model: Any, cache: ExpertCache, *, include_prefill: bool = False) -> Iterator[ExpertCache]:
    """Drive ``cache`` from ``model``'s forwards inside the ``with`` block.

    A handler at the ``router`` point of the model's forward hooks (:mod:`moelab.forward`,
    level ``CACHE``) calls :func:`access_forward` once per forward and MoE layer with the
    router's output and the forward's valid-token mask — decode forwards only unless
    ``include_prefill`` (the default of offline replay), so a trace recorded during the same
    forwards replays (``replay="forward"``) to the same hits. Removed on exit.

    >>> with attach_cache(model, make_cache("lru", [8] * 4, 0.25)) as cache:
    ...     model.generate(**inputs, max_new_tokens=16)
    >>> cache.hit_rate
    """
    from moelab.adapters import make_routing
    from moelab.forward import Order, forward_hooks

    wants_scores = bool(getattr(cache, "needs_scores", False))

    def on_router(ctx, layer, call) -> None:
        if not include_prefill and ctx.phase != "decode":
            return
        if wants_scores:
            r = make_routing(call.logits, call.weights, call.experts, layer.spec.scoring)
            experts, weights, scores = r.experts, r.weights, r.scores
        else:
            experts, weights, scores = call.experts, call.weights, None
        experts = experts.reshape(-1, experts.shape[-1])
        access_forward(cache, layer.index, experts, weights.reshape(experts.shape),
                       ctx.valid_or_ones(experts.shape[0], experts.device), scores)

    handle = forward_hooks(model).add("router", on_router, order=Order.CACHE, name="online expert cache")
    try:
        yield cache
    finally:
        handle.remove()


__all__ = ["access_forward", "attach_cache", "forward_experts", "union_small"]
