"""Prefetching into expert caches: the proposal protocol, built-in prefetchers, proposals.

After a step's MoE layer ``l`` is served, a *prefetcher* proposes the experts MoE layer
``l + d`` of the same step will need (``d`` = prediction distance). The cache inserts them
as low-priority *speculative* entries within a transfer budget (per MoE layer by default, or per
step: ``PrefetchConfig.budget_scope``); when layer ``l + d``
runs, its exact needs are served with high priority and evict unused prefetches first
(ProMoE's early preemption). Proposals beyond the last MoE layer are not made.

Where proposals come from:

* a fitted expert predictor (:class:`moelab.predictors.Predictor`, the one predictor
  protocol — :mod:`moelab.predictors.protocol`): wrap it with
  ``moelab.predictors.as_prefetcher(predictor, trace)``, which predicts over the trace and
  unions each step's tokens with :func:`moelab.predictors.protocol.union_predictions`
  (the CLI's ``--prefetch DIRECTORY`` does this);
* a registered prefetcher (:data:`PREFETCHERS`: ``oracle``, ``repeat``; add your own with
  :func:`register_prefetcher`), which reads the access stream itself;
* any object with ``propose(context) -> experts`` (:class:`Prefetcher`); it may return one
  ranked list, or (T, m) per-token predictions (padding rows ``-1``), which are unioned
  with ``union_predictions``. ``model_name`` / ``num_experts`` attributes, when present,
  are checked against the trace. ``propose_stream(stream, distance)`` makes every proposal
  at once (the built-ins do). Objects written for the old protocol, ``predict(context)``,
  still work (with a DeprecationWarning): ``predict`` is the expert predictors' method.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from moelab.caches.stream import AccessStream
from moelab.errors import MoelabError
from moelab.registry import Registry

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PredictContext:
    """What a predictor sees when asked, after MoE layer ``layer`` of one step, about ``target_layer``."""

    stream: AccessStream
    """The access stream being replayed (gives ``num_experts``, ``top_k`` and the past)."""
    group: int
    """Index of the (seq, step, layer) group just served."""
    seq: int
    """Sequence id."""
    step: int
    """Step (0 = prefill, n = n-th decode step)."""
    layer: int
    """MoE-layer ordinal just served (``l``)."""
    target_layer: int
    """MoE-layer ordinal to predict (``l + d``)."""
    experts: np.ndarray
    """Experts layer ``l`` used in this step, in access order."""
    scores: np.ndarray | None
    """(tokens, E) router scores of layer ``l`` in this step, or None if not recorded."""


@runtime_checkable
class Prefetcher(Protocol):
    """What the cache's prefetch path calls: ``propose(context)`` returns expert ids of
    ``context.target_layer``, most confident first (or (T, m) per-token predictions, unioned
    in order by :func:`moelab.predictors.protocol.union_predictions`). Optional:
    ``model_name: str``, ``num_experts: list[int]`` (checked against the trace), and
    ``propose_stream(stream, distance) -> (ptr, experts)`` for a vectorised offline path.
    """

    def propose(self, context: PredictContext) -> Sequence[int] | np.ndarray: ...


#: Former name of :class:`Prefetcher` (its method was ``predict(context)``, renamed
#: ``propose`` so that ``predict`` means one thing: the expert predictors' method).
ExpertPredictor = Prefetcher


class OraclePrefetcher:
    """Reads the future from the trace: proposes exactly the experts layer ``l + d`` will use."""

    name = "oracle"

    def propose(self, context: PredictContext) -> Sequence[int]:
        tgt = _target_groups(context.stream, context.target_layer - context.layer, same_pass=True)
        g = tgt[context.group]
        return [] if g < 0 else context.stream.group_experts(g).tolist()

    def propose_stream(self, stream: AccessStream, distance: int) -> tuple[np.ndarray, np.ndarray]:
        return _gather(stream, _target_groups(stream, distance, same_pass=True))


class RepeatPrefetcher:
    """Proposes the experts layer ``l + d`` used at the previous step of the same sequence.

    A training-free baseline that bets on temporal locality.
    """

    name = "repeat"

    def propose(self, context: PredictContext) -> Sequence[int]:
        tgt = _target_groups(context.stream, context.target_layer - context.layer, same_pass=False)
        g = tgt[context.group]
        return [] if g < 0 else context.stream.group_experts(g).tolist()

    def propose_stream(self, stream: AccessStream, distance: int) -> tuple[np.ndarray, np.ndarray]:
        return _gather(stream, _target_groups(stream, distance, same_pass=False))


#: Prefetchers by name (``--prefetch NAME`` on the CLI): factories called with no arguments.
PREFETCHERS: Registry[Callable[[], Any]] = Registry("prefetch predictor", check=callable)
PREFETCHERS.register("oracle", OraclePrefetcher)
PREFETCHERS.register("repeat", RepeatPrefetcher)


def register_prefetcher(name: str, factory: Callable[[], Any], *, overwrite: bool = False) -> None:
    """Make a prefetcher available by name (``--prefetch NAME`` on the CLI); a repeated
    name raises unless ``overwrite=True``."""
    PREFETCHERS.register(name, factory, overwrite=overwrite)


def available_prefetchers() -> list[str]:
    return sorted(PREFETCHERS.names())


class _LegacyPredict:
    """An object of the old protocol (``predict(context)``) seen through ``propose``."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj
        for attr in ("model_name", "num_experts", "name"):
            if hasattr(obj, attr):
                setattr(self, attr, getattr(obj, attr))

    def propose(self, context: PredictContext):
        return self.obj.predict(context)


def get_prefetcher(predictor: str | Any) -> Any:
    """A prefetcher from a registered name, or the object itself (see the module docstring)."""
    if isinstance(predictor, str):
        return PREFETCHERS.get(predictor)()
    if callable(getattr(predictor, "predict_trace", None)) and callable(getattr(predictor, "source_layers", None)):
        raise MoelabError(
            f"{type(predictor).__name__} is an expert predictor: it predicts from router inputs and token ids, "
            "which the cache's access stream does not hold; pass moelab.predictors.as_prefetcher(predictor, "
            "trace) (the trace it should predict over) as the prefetch predictor."
        )
    if callable(getattr(predictor, "propose", None)) or callable(getattr(predictor, "propose_stream", None)):
        return predictor
    if callable(getattr(predictor, "predict", None)):
        warnings.warn(
            f"{type(predictor).__name__}.predict(context) is the old prefetch protocol; rename it to "
            "propose(context) (see moelab.caches.prefetch.Prefetcher).", DeprecationWarning, stacklevel=3,
        )
        return _LegacyPredict(predictor)
    raise MoelabError(
        f"{type(predictor).__name__} is not a prefetcher: it needs propose(context) -> expert ids "
        "(see moelab.caches.prefetch.Prefetcher), or wrap a fitted predictor with moelab.predictors.as_prefetcher."
    )


def check_compatible(predictor: Any, stream: AccessStream) -> None:
    """Refuse a predictor built for another model (by name or by expert counts)."""
    who = type(predictor.obj if isinstance(predictor, _LegacyPredict) else predictor).__name__
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

    from moelab.predictors.protocol import union_predictions

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
