"""Prefetching into expert caches: prefetch sources resolved in one place, their proposals.

After a step's MoE layer ``l`` is served, a prefetch source proposes the experts MoE layer
``l + d`` of the same step will need (``d`` = prediction distance). The cache inserts them
as low-priority *speculative* entries within a transfer budget (per MoE layer by default, or per
step: ``PrefetchConfig.budget_scope``); when layer ``l + d``
runs, its exact needs are served with high priority and evict unused prefetches first
(ProMoE's early preemption). Proposals beyond the last MoE layer are not made.

Prefetch sources follow the one predictor protocol (:mod:`moelab.predictors.protocol`):

* a predictor kind that reads the recorded routing, by name or as an instance, unfitted:
  ``"oracle"`` (what layer ``l + d`` needs in the same step) and ``"repeat"`` (what it needed
  at the previous step of the same sequence) — :attr:`moelab.predictors.Predictor.reads_routing`;
* a fitted expert predictor, wrapped with ``moelab.predictors.as_prefetcher(predictor,
  trace)``, which predicts over the trace and unions each step's tokens with
  :func:`moelab.predictors.protocol.union_predictions` (the CLI's ``--prefetch DIRECTORY``
  does this);
* any object with ``propose(context) -> experts`` (:class:`Prefetcher`, one
  :class:`PredictContext`); it may return one ranked list, or (T, m) per-token predictions
  (padding rows ``-1``), unioned with ``union_predictions``. ``model_name`` / ``num_experts``
  attributes, when present, are checked against the trace. ``propose_stream(stream,
  distance)`` makes every proposal at once.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from moelab.caches.stream import AccessStream
from moelab.errors import MoelabError, unknown_name
from moelab.predictors.protocol import PredictContext, Prefetcher, union_predictions

logger = logging.getLogger(__name__)


def routing_kinds() -> dict[str, str]:
    """The predictor kinds that read the recorded routing, ``{name: rule}`` (``same`` / ``previous``)."""
    from moelab.predictors import PREDICTORS

    return {n: PREDICTORS.get(n).reads_routing for n in PREDICTORS.names() if PREDICTORS.get(n).reads_routing}


def routing_rule(source: Any) -> str | None:
    """``same`` / ``previous`` when ``source`` is a routing-reading predictor kind (its name, its
    class or an instance), else None."""
    if isinstance(source, str):
        return routing_kinds().get(source)
    return getattr(source, "reads_routing", None) if isinstance(getattr(source, "reads_routing", None), str) else None


class _RoutingProposals:
    """A routing-reading kind's rule over an access stream: the experts of the group of layer
    ``l + d`` in the same pass (``same``) or the previous pass of the same sequence (``previous``)."""

    def __init__(self, name: str, rule: str) -> None:
        self.name, self.rule = name, rule

    def propose(self, context: PredictContext) -> list[int]:
        tgt = _target_groups(context.stream, context.target_layer - context.layer, same_pass=self.rule == "same")
        g = tgt[context.group]
        return [] if g < 0 else context.stream.group_experts(g).tolist()

    def propose_stream(self, stream: AccessStream, distance: int) -> tuple[np.ndarray, np.ndarray]:
        return _gather(stream, _target_groups(stream, distance, same_pass=self.rule == "same"))


def get_prefetcher(source: str | Any) -> Any:
    """The prefetch source ``source`` (see the module docstring) as an object with ``propose``."""
    rule = routing_rule(source)
    if rule is not None:
        name = source if isinstance(source, str) else (getattr(source, "kind", "") or type(source).__name__)
        return _RoutingProposals(name, rule)
    if isinstance(source, str):
        err = unknown_name("prefetch predictor", source, routing_kinds())
        raise MoelabError(f"{err} A predictor that must be fitted drives a prefetch through "
                          "moelab.predictors.as_prefetcher(fitted predictor, trace).")
    if callable(getattr(source, "predict_trace", None)) and callable(getattr(source, "source_layers", None)):
        raise MoelabError(
            f"{type(source).__name__} is an expert predictor: it predicts from router inputs and token ids, "
            "which the cache's access stream does not hold; pass moelab.predictors.as_prefetcher(predictor, "
            "trace) (the trace it should predict over) as the prefetch predictor."
        )
    if callable(getattr(source, "propose", None)) or callable(getattr(source, "propose_stream", None)):
        return source
    raise MoelabError(
        f"{type(source).__name__} is not a prefetch source: it needs propose(context) -> expert ids "
        "(see moelab.predictors.protocol.Prefetcher), or wrap a fitted predictor with moelab.predictors.as_prefetcher."
    )


def check_compatible(predictor: Any, stream: AccessStream) -> None:
    """Refuse a predictor built for another model (by name or by expert counts)."""
    who = type(predictor).__name__
    name = getattr(predictor, "model_name", None)
    if name and stream.model_name and name != stream.model_name:
        raise MoelabError(
            f"predictor {who} was built for model {name!r} but the trace is of "
            f"{stream.model_name!r}; train or load a predictor for {stream.model_name!r}."
        )
    ne = getattr(predictor, "num_experts", None)
    if ne is not None:
        ne = [int(x) for x in np.atleast_1d(ne)]
        mine = stream.num_experts.tolist()
        if ne != mine and not (len(ne) == 1 and all(x == ne[0] for x in mine)):
            raise MoelabError(
                f"predictor {who} expects experts per MoE layer {ne}, the trace has "
                f"{mine}; it was built for a different model."
            )


def proposals(predictor: Any, stream: AccessStream, distance: int) -> tuple[np.ndarray, np.ndarray]:
    """Every proposal of ``predictor`` at ``distance`` as CSR ``(ptr (G+1,), keys)``.

    Group g's proposals (global keys of layer ``layer(g) + distance``, deduplicated, in the
    predictor's order) are ``keys[ptr[g]:ptr[g+1]]``.
    """
    if distance < 1:
        raise MoelabError(f"prefetch distance must be ≥ 1 MoE layer, got {distance}.")
    predictor = get_prefetcher(predictor)
    check_compatible(predictor, stream)
    if callable(getattr(predictor, "propose_stream", None)):
        return predictor.propose_stream(stream, distance)
    from tqdm.auto import tqdm

    G, L = stream.num_groups, stream.num_layers
    ptr = np.zeros(G + 1, dtype=np.int64)
    out: list[int] = []
    for g in tqdm(range(G), desc="predict", disable=G < 20000, leave=False):
        layer = int(stream.group_layer[g])
        tgt = layer + distance
        if tgt < L:
            ctx = PredictContext(
                stream=stream,
                group=g,
                seq=int(stream.group_seq[g]),
                step=int(stream.group_step[g]),
                layer=layer,
                target_layer=tgt,
                experts=stream.group_experts(g),
                scores=stream.group_scores(g),
            )
            E = int(stream.num_experts[tgt])
            got = np.asarray(predictor.propose(ctx))
            if got.ndim == 2:  # per-token predictions: the one union, in its order
                got = union_predictions(got)
            for e in _dedupe(got.reshape(-1).tolist()):
                if not 0 <= e < E:
                    raise MoelabError(f"predictor proposed expert {e} for MoE layer {tgt}, which has {E} experts.")
                out.append(int(stream.key_offset[tgt]) + e)
        ptr[g + 1] = len(out)
    return ptr, np.asarray(out, dtype=np.int64)


def _dedupe(experts: list) -> list[int]:
    seen: set[int] = set()
    out = []
    for e in experts:
        e = int(e)
        if e not in seen:
            seen.add(e)
            out.append(e)
    return out


def _target_groups(stream: AccessStream, distance: int, same_pass: bool) -> np.ndarray:
    """(G,) the group of layer ``l + distance`` in the same pass (or the previous pass of the
    same sequence when ``same_pass`` is False), -1 where there is none."""
    L = stream.num_layers
    code = stream.group_pass * L + stream.group_layer  # ascending: passes in order, layers in order
    want = stream.group_layer.astype(np.int64) + distance
    prev = stream.group_pass - (0 if same_pass else 1)
    tcode = prev * L + want
    idx = np.searchsorted(code, tcode)
    idx_c = np.minimum(idx, len(code) - 1)
    ok = (want < L) & (prev >= 0) & (idx < len(code)) & (code[idx_c] == tcode)
    if not same_pass:
        ok &= stream.group_seq[idx_c] == stream.group_seq
    return np.where(ok, idx_c, -1)


def _gather(stream: AccessStream, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sizes = np.where(target >= 0, stream.group_ptr[target + 1] - stream.group_ptr[target], 0)
    ptr = np.zeros(len(target) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ptr[1:])
    starts = np.repeat(np.where(target >= 0, stream.group_ptr[target], 0), sizes)
    within = np.arange(ptr[-1]) - np.repeat(ptr[:-1], sizes)
    return ptr, stream.keys[starts + within].astype(np.int64)


__all__ = ["PredictContext", "Prefetcher", "check_compatible", "get_prefetcher", "proposals", "routing_kinds",
           "routing_rule"]
