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
from dataclasses import dataclass
from typing import Any

import numpy as np

from moelab.caches.activation import NAME as ACTIVATION
from moelab.caches.activation import ActivationAware, is_activation
from moelab.caches.stream import AccessStream
from moelab.errors import MoelabError, did_you_mean, unknown_name
from moelab.predictors.protocol import PredictContext, Prefetcher, union_predictions
from moelab.timing import Link, get_profile

logger = logging.getLogger(__name__)


#: ``PrefetchConfig.select`` values.
PREFETCH_SELECTIONS = ("impact", "order")


@dataclass
class PrefetchConfig:
    """Predictor-driven prefetch into the cache.

    The transfer budget is given one of three ways: ``budget`` (experts), ``budget_bytes``
    (bytes; whole experts that fit), or a ``link`` and a time window (:meth:`from_link`,
    :meth:`from_profile`): the experts whose back-to-back transfers, all requested at the
    start of the window, end within it on the FIFO link of :class:`moelab.timing.Link`
    (``latency + bytes / bandwidth`` each) — the same link model as GoodPred.

    One configuration for the cache simulator (``simulate(..., prefetch=PrefetchConfig(...))``),
    the hybrid planner and a running hybrid model (``HybridConfig.prefetch``). What the budget
    applies to (``budget_scope``) is one definition across moelab: by default
    ``"layer"``, the literature's per-layer link budget (ProMoE: the prefetches issued
    after MoE layer ``l`` for layer ``l + d`` must cross the link while the layers between
    compute, so a budget is what the link moves per layer) — at most ``budget`` prefetch
    transfers after each MoE layer of each forward; or ``"forward"``, one budget per forward
    pass (a decode step) shared by its MoE layers in order. :meth:`from_link` and
    :meth:`from_profile` state a window per step, so they use ``"forward"``.
    """

    predictor: Any = None
    """The prefetch source, or None for no prefetch. In the cache simulator and the offline
    planner (:func:`get_prefetcher`): a predictor kind that reads the recorded routing
    (``oracle``, ``repeat``), a fitted predictor (in the cache simulator wrapped by
    :func:`moelab.predictors.as_prefetcher`; in the planner and a running model a
    :class:`~moelab.predictors.Predictor` or its saved directory), or an object with
    ``propose(context)`` / ``propose_stream(stream, distance)`` (:class:`Prefetcher`)."""
    distance: int = 1
    """Prediction distance d: after MoE layer l, prefetch for layer l + d."""
    budget: int | None = None
    """Prefetch transfers per :attr:`budget_scope` (MoE layer, or forward pass), in experts;
    None = unlimited."""
    budget_bytes: float | None = None
    """Alternatively, bytes per :attr:`budget_scope`; whole experts of ``expert_bytes`` each fit in it."""
    link: Any = None
    """Alternatively, a :class:`moelab.timing.Link` with :attr:`window_us`."""
    window_us: float | None = None
    """The time per :attr:`budget_scope` (µs) the link may spend on prefetches (with :attr:`link`)."""
    budget_scope: str = "layer"
    """``layer`` (default): the budget applies after each MoE layer of each forward;
    ``forward``: one budget per forward pass (step), shared by its MoE layers."""
    select: str = "impact"
    """How the hybrid planner picks among the proposal (the cache simulator always takes it in
    order): ``impact`` (HybriMoE §IV-C, impact-driven prefetch) — with a cost model (a
    configuration with ``hardware`` and the model's shape), the proposed experts whose residence
    shortens the target layer's planned schedule most, one at a time, while each lowers it and
    their copies (after the layer's demand copies) fit in the lead time, ``distance ×
    decode_layer_time_us`` on the profile's link; without a cost model, as ``order``. ``order``
    (ProMoE): the proposal in confidence order, within the budget."""
    m: int | None = None
    """Experts a fitted predictor proposes per token (default: the target layer's top-k), where
    the planner or a running model asks it; the cache simulator's fitted predictors take it
    once, in ``as_prefetcher(predictor, trace, m=...)``."""
    chunks: int = 1
    """Each low-priority copy (a prefetch; an ``insert`` of ``cache.admission: all``) crosses the
    link in this many equal chunks, issued one after another (ProMoE §5: copies chunked per
    projection, 3 for an expert's gate, up and down), so a demand copy that arrives while one is on
    the link waits for at most one chunk instead of the whole expert; every chunk pays the link's
    latency. ``1``: whole experts. The simulator models it (:func:`moelab.simulate.simulate_plans`,
    ``copy_chunks``; the what-if grid's ``chunks`` axis; the ``simulated`` executor), and the real
    executors' copy lanes do it (CPU and CUDA: each piece a copy task of its own, a demand copy
    queued meanwhile going first; one transfer event per piece)."""

    def __post_init__(self) -> None:
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, (int, np.integer)) or self.chunks < 1:
            raise MoelabError(f"prefetch chunks={self.chunks!r}: expected an integer ≥ 1 (chunks per low-priority "
                              "copy; 3 is ProMoE's per-projection chunking, 1 copies whole experts).")
        if self.select not in PREFETCH_SELECTIONS:
            raise MoelabError(f"prefetch select={self.select!r}: expected one of {', '.join(PREFETCH_SELECTIONS)}."
                              f"{did_you_mean(str(self.select), PREFETCH_SELECTIONS)}")
        if isinstance(self.link, dict):  # from YAML or a config's to_dict(): {bandwidth_gbs, latency_us}
            self.link = Link(**self.link)

    @classmethod
    def from_link(
        cls, predictor: Any = "oracle", distance: int = 1, *, gb_per_s: float, step_ms: float,
        latency_us: float = 0.0,
    ) -> PrefetchConfig:
        """A budget from a host-to-GPU link: ``gb_per_s`` GB/s for ``step_ms`` ms per step,
        ``latency_us`` per transfer (0: the budget is bandwidth × step time, in whole experts)."""

        for name, v in (("gb_per_s", gb_per_s), ("step_ms", step_ms)):
            if not v > 0:
                raise MoelabError(f"{name} must be > 0, got {v!r}.")
        return cls(predictor, distance, link=Link(float(gb_per_s), float(latency_us)), window_us=step_ms * 1e3,
                   budget_scope="forward")

    @classmethod
    def from_profile(
        cls, profile: Any = None, predictor: Any = "oracle", distance: int = 1, *, num_layers: int,
    ) -> PrefetchConfig:
        """A budget from a hardware profile (name, file or instance; default
        :data:`moelab.timing.DEFAULT_PROFILE`): its link, over one decode step of
        ``num_layers`` MoE layers × ``decode_layer_time_us``."""

        hw = get_profile(profile)
        if isinstance(num_layers, bool) or not isinstance(num_layers, (int, np.integer)) or num_layers < 1:
            raise MoelabError(f"num_layers must be an integer ≥ 1 (MoE layers per step), got {num_layers!r}.")
        return cls(predictor, distance, link=hw.link, window_us=int(num_layers) * hw.decode_layer_time_us,
                   budget_scope="forward")

    @property
    def needs_expert_bytes(self) -> bool:
        """Whether the budget depends on the size of an expert (bytes or a link)."""
        return self.budget_bytes is not None or self.link is not None

    @property
    def per_layer(self) -> bool:
        """Whether the budget applies per (forward, MoE layer) rather than per forward."""
        if self.budget_scope not in ("layer", "forward"):
            raise MoelabError(f"prefetch budget_scope={self.budget_scope!r}: expected 'layer' or 'forward'.")
        return self.budget_scope == "layer"

    def experts_budget(self, expert_bytes: int) -> int | None:
        given = [n for n, v in (("budget", self.budget), ("budget_bytes", self.budget_bytes), ("link", self.link))
                 if v is not None]
        if len(given) > 1:
            raise MoelabError(f"give the prefetch budget in experts, in bytes or as a link, not {' and '.join(given)}.")
        if self.link is not None:
            if self.window_us is None or not self.window_us >= 0:
                raise MoelabError(f"a prefetch link needs window_us ≥ 0 (µs per {self.budget_scope}), got {self.window_us!r}.")
            return self.link.transfers_within(self.window_us, max(1, expert_bytes))
        if self.budget_bytes is not None:
            if not self.budget_bytes >= 0:
                raise MoelabError(f"prefetch budget_bytes must be ≥ 0 bytes per {self.budget_scope}, got {self.budget_bytes!r}.")
            return int(self.budget_bytes // max(1, expert_bytes))
        if self.budget is not None and self.budget < 0:
            raise MoelabError(f"prefetch budget must be ≥ 0 experts per step, got {self.budget}.")
        return self.budget

    def describe(self, expert_bytes: int = 1) -> str:
        name = self.predictor if isinstance(self.predictor, str) else type(self.predictor).__name__
        b = self.experts_budget(expert_bytes)
        scope = "" if b is None else f"/{'layer' if self.per_layer else 'forward'}"
        return f"{name} d={self.distance} budget={'inf' if b is None else b}{scope}"


def routing_kinds() -> dict[str, str]:
    """The predictor kinds that read the recorded routing, ``{name: rule}`` (``same`` / ``previous``)."""
    # the kinds (sklearn): only when a source is resolved
    from moelab.predictors.registry import PREDICTORS

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


def get_prefetcher(source: str | Any, *, m: int | None = None) -> Any:
    """The prefetch source ``source`` (see the module docstring) as an object with ``propose``;
    ``m``: experts per proposal of a named source that takes it (``activation``)."""
    rule = routing_rule(source)
    if rule is not None:
        name = source if isinstance(source, str) else (getattr(source, "kind", "") or type(source).__name__)
        return _RoutingProposals(name, rule)
    if is_activation(source):
        return ActivationAware(m=m)
    if isinstance(source, str):
        err = unknown_name("prefetch predictor", source, [*routing_kinds(), ACTIVATION])
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


__all__ = ["PredictContext", "PrefetchConfig", "Prefetcher", "check_compatible", "get_prefetcher", "proposals", "routing_kinds",
           "routing_rule"]
