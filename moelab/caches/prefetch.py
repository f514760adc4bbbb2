"""Prefetching into expert caches: the predictor Protocol, built-in prefetchers, proposals.

After a step's MoE layer ``l`` is served, a predictor proposes the experts MoE layer
``l + d`` of the same step will need (``d`` = prediction distance). The cache inserts them
as low-priority *speculative* entries within a per-step transfer budget; when layer ``l + d``
runs, its exact needs are served with high priority and evict unused prefetches first
(ProMoE's early preemption). Proposals beyond the last MoE layer are not made.

Any object with a ``predict(context) -> experts`` method is a predictor (:class:`ExpertPredictor`);
``model_name`` / ``num_experts`` attributes, when present, are checked against the trace.
A predictor may also offer ``propose_stream(stream, distance)`` to make every proposal at
once (the built-ins do).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from moelab.caches.stream import AccessStream
from moelab.errors import MoelabError, unknown_name

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
class ExpertPredictor(Protocol):
    """The minimal predictor interface the caches need.

    ``predict`` returns expert ids of ``context.target_layer``, most confident first
    (typically top-k of them). Optional attributes: ``model_name: str`` and
    ``num_experts: list[int]`` (checked against the trace), and
    ``propose_stream(stream, distance) -> (ptr, experts)`` for a vectorised offline path.
    """

    def predict(self, context: PredictContext) -> Sequence[int]: ...


class OraclePrefetcher:
    """Reads the future from the trace: proposes exactly the experts layer ``l + d`` will use."""

    name = "oracle"

    def predict(self, context: PredictContext) -> Sequence[int]:
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

    def predict(self, context: PredictContext) -> Sequence[int]:
        tgt = _target_groups(context.stream, context.target_layer - context.layer, same_pass=False)
        g = tgt[context.group]
        return [] if g < 0 else context.stream.group_experts(g).tolist()

    def propose_stream(self, stream: AccessStream, distance: int) -> tuple[np.ndarray, np.ndarray]:
        return _gather(stream, _target_groups(stream, distance, same_pass=False))


_PREFETCHERS: dict[str, Callable[[], Any]] = {
    "oracle": OraclePrefetcher,
    "repeat": RepeatPrefetcher,
}


def register_prefetcher(name: str, factory: Callable[[], Any]) -> None:
    """Make a predictor available by name (``--prefetch NAME`` on the CLI)."""
    _PREFETCHERS[name] = factory


def available_prefetchers() -> list[str]:
    return sorted(_PREFETCHERS)


def get_prefetcher(predictor: str | Any) -> Any:
    """A predictor object from a registered name, or the object itself."""
    if isinstance(predictor, str):
        if predictor not in _PREFETCHERS:
            raise unknown_name("prefetch predictor", predictor, _PREFETCHERS)
        return _PREFETCHERS[predictor]()
    if not callable(getattr(predictor, "predict", None)) and not callable(getattr(predictor, "propose_stream", None)):
        raise MoelabError(
            f"{type(predictor).__name__} is not a predictor: it needs predict(context) -> expert ids "
            "(see moelab.caches.prefetch.ExpertPredictor)."
        )
    return predictor


def check_compatible(predictor: Any, stream: AccessStream) -> None:
    """Refuse a predictor built for another model (by name or by expert counts)."""
    name = getattr(predictor, "model_name", None)
    if name and stream.model_name and name != stream.model_name:
        raise MoelabError(
            f"predictor {type(predictor).__name__} was built for model {name!r} but the trace is of "
            f"{stream.model_name!r}; train or load a predictor for {stream.model_name!r}."
        )
    ne = getattr(predictor, "num_experts", None)
    if ne is not None:
        ne = [int(x) for x in np.atleast_1d(ne)]
        mine = stream.num_experts.tolist()
        if ne != mine and not (len(ne) == 1 and all(x == ne[0] for x in mine)):
            raise MoelabError(
                f"predictor {type(predictor).__name__} expects experts per MoE layer {ne}, the trace has "
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
            seen: set[int] = set()
            for e in predictor.predict(ctx):
                e = int(e)
                if not 0 <= e < E:
                    raise MoelabError(f"predictor proposed expert {e} for MoE layer {tgt}, which has {E} experts.")
                if e not in seen:
                    seen.add(e)
                    out.append(int(stream.key_offset[tgt]) + e)
        ptr[g + 1] = len(out)
    return ptr, np.asarray(out, dtype=np.int64)


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
