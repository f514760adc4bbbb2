"""Offline planning: the hybrid planner over recorded or synthetic routing, with no model.

>>> from moelab.hybrid.offline import plan_routing, routing_from_trace, trace_shape
>>> trace = moelab.open_trace("runs/r1/trace")
>>> plans = plan_routing(routing_from_trace(trace), cfg, **trace_shape(trace))

A *routing source* is an iterable of :class:`ForwardRouting`: one per forward pass, with the
real tokens' top-k ids and combine weights per MoE layer (and optionally the router scores,
the router inputs and the token ids). :func:`plan_routing` runs **the same**
:class:`~moelab.hybrid.planner.Planner` as ``moelab.hybrid(model, cfg)``, in the same order
(routing policy → cache → placement → prefetch), so the plans of a run equal the offline
plans of its own trace field by field (tests/test_hybrid_offline.py).

* **Routing policy**: deferral and skipping are the :mod:`moelab.policies` objects themselves
  (their ``_plan`` on a :class:`~moelab.forward.plan.SlotPlan` built from the recorded ids and
  weights): deferral defers the D lowest-weight slots of each token's top-k (decode forwards
  unless ``phase: all``, at least ``min_immediate`` left, never in the last MoE layer);
  skipping drops them.
* **Prefetch** (``predictor=`` or ``config.prefetch.predictor``), the prefetch sources of
  :mod:`moelab.predictors.protocol`: the routing-reading kinds ``"oracle"`` (the experts MoE
  layer ``l + d`` of the same forward actually needs: the upper bound a what-if grid shows
  beside every policy) and ``"repeat"`` (what layer ``l + d`` needed at the previous step of the
  same sequences: the caches' training-free baseline), by name or as unfitted instances; a
  fitted online predictor (a :class:`~moelab.predictors.Predictor` or a saved directory),
  asked ``predict_union`` with the forward's router inputs (``ForwardRouting.hidden``, from a
  trace recorded with hidden states) and token ids, exactly as the running model asks it; an
  object with ``propose(context) -> experts`` (:class:`~moelab.predictors.protocol.Prefetcher`),
  asked with a :class:`~moelab.predictors.protocol.PredictContext` whose ``routing`` is the
  forward; None: no prefetch.
* **Cache** ``belady`` / ``belady-bypass`` read the future: plan_routing first derives every
  (forward, layer)'s needed experts from the routing source, builds their access stream
  (:func:`moelab.caches.stream.stream_from_groups`) and gives it to the cache. Belady's MIN
  with the oracle prefetch is the bound of what any cache and predictor could do.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from moelab.caches import get_policy
from moelab.caches.activation import NAME as ACTIVATION
from moelab.caches.activation import ActivationAware, is_activation
from moelab.caches.base import resolve_capacity
from moelab.caches.policies import popular_keys
from moelab.caches.prefetch import routing_kinds, routing_rule
from moelab.caches.stream import forward_ids, stream_from_groups
from moelab.errors import MoelabError
from moelab.hybrid.config import HybridConfig, RoutingConfig
from moelab.hybrid.planner import LayerPlan, Planner, slots_and_union
from moelab.models.bundled import bundled_path
from moelab.predictors.protocol import PredictContext, union_predictions
from moelab.routing import ForwardRouting  # noqa: F401 - re-exported: the routing sources' type
from moelab.timing.shapes import ModelShape, get_shape


# ---------------------------------------------------------------------- routing policy
class OfflineRouting:
    """The routing policies of a :class:`~moelab.hybrid.config.RoutingConfig` on plain arrays.

    They are :class:`moelab.policies.ExpertSkipping` / :class:`~moelab.policies.ExpertDeferral`
    (skipping first, as :class:`~moelab.hybrid.runtime.HybridRun` applies them), resolved
    against the layers' top-k and run on a :class:`~moelab.forward.plan.SlotPlan` of the
    recorded ids and weights: the same code as in a running model.
    """

    def __init__(self, routing: RoutingConfig, top_k: Sequence[int], policies: Sequence[Any] | None = None) -> None:
        from moelab.policies import ExpertDeferral, ExpertSkipping

        self.layers = [SimpleNamespace(index=i, top_k=int(k), layer_idx=i) for i, k in enumerate(top_k)]
        self.policies = []
        if policies is not None:  # given policy objects (their own settings and guards), not routing's
            self.policies = list(policies)
        else:
            if (skipping := routing.skipping()) is not None:
                self.policies.append(ExpertSkipping(None, config=skipping))
            if (deferral := routing.deferral()) is not None:
                self.policies.append(ExpertDeferral(None, config=deferral))
        for p in self.policies:
            p._resolve(self.layers)

    def states(self, layer: int, phase: str, ids: np.ndarray, weights: np.ndarray) -> np.ndarray | None:
        """(tokens, K) int8 slot states of one layer's routing, or None where no policy acts."""
        acting = [p for p in self.policies if p.acts_in(phase)]
        if not acting or len(ids) == 0:
            return None
        import torch

        from moelab.forward.plan import SlotPlan

        n = len(ids)
        plan = SlotPlan(layer=self.layers[layer], experts=torch.from_numpy(np.ascontiguousarray(ids, np.int64)),
                        weights=torch.from_numpy(np.ascontiguousarray(weights, np.float32)),
                        state=torch.zeros(ids.shape, dtype=torch.int8), valid=torch.ones(n, dtype=torch.bool),
                        phase=phase)
        for p in acting:
            p._plan(plan)
        return plan.state.numpy()

    @property
    def per_token(self) -> bool:
        """Whether every policy decides each token's slots from that token alone (skipping, and
        deferral's ``per_token`` rule), so several forwards' rows may share one slot plan."""
        return all(getattr(p.config, "batch_rule", "per_token") == "per_token" for p in self.policies)

    def states_many(self, layer: int, phase: str, ids: list[np.ndarray], weights: list[np.ndarray]
                    ) -> list[np.ndarray | None]:
        """:meth:`states` of several forwards' routing of one layer and phase: one slot plan for
        all their rows when the policies are :attr:`per_token` (the same states, row by row)."""
        if not any(p.acts_in(phase) for p in self.policies):
            return [None] * len(ids)
        if not self.per_token or len(ids) == 1:
            return [self.states(layer, phase, i, w) for i, w in zip(ids, weights, strict=True)]
        sizes = [len(i) for i in ids]
        st = self.states(layer, phase, np.concatenate(ids), np.concatenate(weights))
        if st is None:
            return [None] * len(ids)
        cut = np.cumsum(sizes)[:-1]
        return [part if len(part) else None for part in np.split(st, cut)]


# ---------------------------------------------------------------------- routing sources
def routing_from_trace(trace: Any, *, hidden: bool | None = None) -> Iterator[ForwardRouting]:
    """Yield one :class:`ForwardRouting` per forward pass of a routing trace (a
    :class:`~moelab.trace.RoutingTrace` or its directory), in recorded order.

    ``hidden``: attach the recorded router inputs (``ForwardRouting.hidden``; default: when
    the trace has them), which learned predictors read.
    """
    from moelab.trace import open_trace

    tr = open_trace(trace) if isinstance(trace, (str, Path)) else trace
    if hidden is None:
        hidden = tr.has_hidden_states
    step = tr.column("step")
    phase = tr.column("phase")
    moe = tr.column("moe_layer")
    parquet = getattr(tr, "_parquet", None)
    names = set(parquet.schema_arrow.names) if parquet is not None else set()
    fwd = tr.column("forward") if "forward" in names else forward_ids(step, moe)
    ids_all = tr.experts_array().astype(np.int64)
    w_all = tr.weights_array()
    sc_all = tr.scores_array() if tr.has_scores else None
    hid_all = tr.hidden_states() if hidden else None
    tok_all = tr.column("token_id")
    E = tr.num_experts_per_layer
    K = tr.top_k_per_layer
    L = len(E)
    n = len(fwd)
    cut = np.flatnonzero(np.diff(fwd) != 0) + 1
    starts = np.r_[0, cut].astype(np.int64)
    ends = np.r_[cut, n].astype(np.int64)
    for a, b in zip(starts.tolist(), ends.tolist()):
        ly = moe[a:b]
        rows = [a + np.flatnonzero(ly == i) for i in range(L)]
        tokens = len(rows[0])
        yield ForwardRouting(
            forward=int(fwd[a]),
            step=int(step[a]),
            phase=str(phase[a]),
            tokens=tokens,
            ids=[ids_all[r, : K[i]] for i, r in enumerate(rows)],
            weights=[w_all[r, : K[i]] for i, r in enumerate(rows)],
            scores=None if sc_all is None else [sc_all[r, : E[i]] for i, r in enumerate(rows)],
            hidden=None if hid_all is None else [hid_all[torch_index(r)] for r in rows],
            token_ids=tok_all[rows[0]].astype(np.int64),
        )



def trace_shape(trace: Any) -> dict[str, Any]:
    """What :func:`plan_routing` needs of the model, from a trace's metadata: ``num_experts``,
    ``top_k``, ``expert_bytes`` (the largest layer's) and ``shape``, the model's
    :class:`~moelab.timing.shapes.ModelShape` for a cost-aware placement — found by the recorded
    model's name (a bundled model, or a packaged shape / Hub id) in the recorded dtype, or None
    (then pass ``shape=`` yourself: ``ModelShape.from_model(model)``)."""
    from moelab.trace import open_trace

    tr = open_trace(trace) if isinstance(trace, (str, Path)) else trace
    m = tr.meta["model"]
    sizes = m.get("expert_bytes")
    eb = int(max(sizes)) if sizes else 1
    return {"num_experts": list(tr.num_experts_per_layer), "top_k": list(tr.top_k_per_layer), "expert_bytes": eb,
            "shape": _recorded_shape(m, tr.num_experts_per_layer, tr.top_k_per_layer)}


_TORCH_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _recorded_shape(model: dict, num_experts: Sequence[int], top_k: Sequence[int]) -> ModelShape | None:
    """The shape of a trace's model by its recorded name, if moelab knows it and it matches the trace."""
    name = model.get("name")
    if not name:
        return None
    try:
        path = bundled_path(str(name))
        shape = ModelShape.from_hf_config(path / "config.json") if path else get_shape(str(name))
        dtype = _TORCH_DTYPES.get(str(model.get("dtype")))
        shape = shape.with_dtype(dtype) if dtype else shape
    except (MoelabError, OSError, ValueError, KeyError):
        return None
    if shape.num_experts != max(num_experts) or shape.top_k != max(top_k) or shape.num_moe_layers != len(num_experts):
        return None
    return shape


def torch_index(rows: np.ndarray):
    import torch

    return torch.from_numpy(rows)


# ---------------------------------------------------------------------- prefetch sources
class _PredictorProposals:
    """A fitted online predictor asked as the running model asks it: at each source layer,
    ``predict_union`` with the forward's real tokens' router inputs and token ids."""

    def __init__(self, predictor: Any, m: int | None) -> None:
        self.predictor = predictor
        self.m = m
        self.sources = set(predictor.source_layers())

    def propose(self, context: PredictContext) -> list[int] | None:
        r, layer = context.routing, context.layer
        if layer not in self.sources or r.tokens == 0:
            return None
        p = self.predictor
        hidden = getattr(r, "hidden", None)  # optional: routing sources may not carry them
        h = hidden[layer] if hidden is not None else None
        if h is None and p.needs_hidden:
            raise MoelabError(
                f"the {p.kind!r} predictor reads the router inputs, but the routing source has none; "
                "record the trace with hidden_states=True (CLI: --hidden-states), or prefetch with 'oracle'."
            )
        ids = getattr(r, "token_ids", None)
        ids = ids if ids is not None and len(ids) == r.tokens else None
        return p.predict_union(layer, hidden=h, token_ids=ids, m=self.m).tolist()


def _proposer(predictor: Any, config: HybridConfig, num_experts: Sequence[int]) -> Any:
    """The prefetch source as ``"same"`` / ``"previous"`` (a routing-reading kind's rule, applied
    to the forwards below) or an object with ``propose(PredictContext)``; None: no prefetch."""

    if predictor is None:
        predictor = config.prefetch.predictor
    if predictor is None:
        return None
    rule = routing_rule(predictor)
    if rule is not None:
        return rule
    if is_activation(predictor):  # MoE-Infinity's EAM matching, one state per planning pass
        return ActivationAware(list(num_experts), m=config.prefetch.m)
    if isinstance(predictor, (str, Path)):
        if not Path(predictor).is_dir():
            raise MoelabError(
                f"prefetch predictor {str(predictor)!r} is neither {', '.join(map(repr, sorted(routing_kinds())))}, "
                f"{ACTIVATION!r} "
                "nor a saved predictor directory; pass one of those, a directory written by `moelab predict fit "
                "--out DIR`, or a fitted predictor."
            )
        from moelab.predictors import load_predictor

        predictor = load_predictor(predictor)
    if callable(getattr(predictor, "predict", None)) and callable(getattr(predictor, "source_layers", None)):
        if not predictor.online:
            raise MoelabError(f"the {predictor.kind!r} predictor works only offline; it cannot drive a prefetch.")
        if int(predictor.distance) != config.prefetch.distance:
            raise MoelabError(
                f"prefetch.distance={config.prefetch.distance} but the predictor predicts distance "
                f"{predictor.distance}; set prefetch.distance: {predictor.distance}."
            )
        if list(predictor.num_experts_) != [int(e) for e in num_experts]:
            raise MoelabError(
                f"the predictor was fitted on a model with experts per MoE layer {list(predictor.num_experts_)}, "
                f"the routing has {list(num_experts)}; fit it on this model."
            )
        return _PredictorProposals(predictor, config.prefetch.m)
    if callable(getattr(predictor, "propose", None)):
        return predictor
    raise MoelabError(
        f"prefetch predictor {predictor!r}: expected 'oracle', 'repeat', a fitted predictor (or its directory), "
        "an object with propose(context) -> experts (moelab.predictors.protocol.Prefetcher), or None."
    )


def _ask(proposer: Any, context: PredictContext) -> list[int] | None:
    """A ``propose`` object's answer as a ranked list (per-token rows unioned in order)."""
    got = proposer.propose(context)
    if got is None:
        return None
    got = np.asarray(got)
    return (union_predictions(got) if got.ndim == 2 else got.astype(np.int64).reshape(-1)).tolist()


# ---------------------------------------------------------------------- planning
#: Forwards whose routing-policy slot states are computed together.
_CHUNK = 256


def _as_config(config: HybridConfig | dict | str | Path | None) -> HybridConfig:
    from moelab.hybrid.runtime import _as_config as as_config

    return as_config(config)


def _check(r: Any, L: int) -> None:
    if len(r.ids) != L or len(r.weights) != L:
        raise MoelabError(
            f"forward {r.forward}: routing has {len(r.ids)} id and {len(r.weights)} weight arrays, expected one "
            f"per MoE layer ({L}); give ids/weights for every MoE layer."
        )


def plan_routing(
    routing: Iterable[ForwardRouting],
    config: HybridConfig | dict | str | Path | None,
    *,
    num_experts: Sequence[int],
    top_k: Sequence[int],
    expert_bytes: int | Sequence[int],
    shape: Any = None,
    predictor: Any = None,
    routing_policies: Sequence[Any] | None = None,
    routing_memo: dict | None = None,
    warm_routing: Iterable[ForwardRouting] | None = None,
) -> list[LayerPlan]:
    """The plans of every MoE layer of every forward of ``routing`` under ``config``.

    Args:
        routing: a routing source (an iterable of :class:`ForwardRouting`).
        config: a :class:`HybridConfig` (or a dict / YAML path).
        num_experts: routed experts per MoE layer.
        top_k: experts selected per token, per MoE layer.
        expert_bytes: bytes of one expert (one value, or one per MoE layer).
        shape: the model's :class:`~moelab.timing.shapes.ModelShape`, for the cost model of the
            cost-aware placements (``greedy-hss``, ``min-cost``) and the frequency warm-up.
        predictor: prefetch source; default ``config.prefetch.predictor`` (see the module
            docstring: ``"oracle"``, a fitted predictor or its directory, a ``propose`` object).
        routing_policies: :mod:`moelab.policies` objects applied to no model (e.g.
            ``ExpertSkipping(None, config=SkippingConfig(skipped=2, min_kept=0))``), run in order
            instead of ``config.routing``'s: settings a :class:`RoutingConfig` has no field for
            (``min_kept``, ``last_layer``, ``batch_rule``), or any registered policy.
        routing_memo: a dict kept by the caller across calls that plan **the same routing
            source** (a what-if grid's cells): the routing policy's slot states are computed once
            per (deferral/skipping setting, forwards, layer, phase) and reused. Keys hold the
            forwards' ``forward`` ids, not object identities, so a memo is safe to share between
            threads; it is ignored with ``routing_policies`` (their settings are not in the key).
        warm_routing: the routing ``cache.warm`` (``frequency``/``trace``) and a pin-less ``static``
            cache count or replay (default: ``routing`` itself, or ``cache.warm_from``): e.g. the
            warm-up steps of a what-if grid, so the measured steps are not seen in advance.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    cfg = _as_config(config)
    if cfg.planner == "auto":  # offline planning runs the reference under auto (HybridConfig.planner): a
        # process's first compiled plan loads numba (1–2 s, a minute with a cold cache); planner: compiled asks for it
        cfg = dataclasses.replace(cfg, planner="reference")
    L = len(num_experts)
    states = _RoutingStates(cfg.routing, top_k, routing_policies, routing_memo)
    proposer = _proposer(predictor, cfg, num_experts)
    cap = cfg.cache.capacity
    policy = get_policy(cfg.cache.policy) if cap != 0 else None
    future = policy is not None and policy.needs_future
    if proposer is not None and cap == 0:
        raise MoelabError("prefetch needs a device cache to prefetch into; set cache.capacity > 0.")
    counts_needed = policy is not None and (cfg.cache.warm != "empty" or _needs_counts(policy, cfg))
    # the needed experts of every layer: for the future-reading cache, the warm start, the
    # routing-reading kinds and a propose object's context (a fitted predictor reads the router
    # inputs instead)
    want_needed = future or counts_needed or (proposer is not None and not isinstance(proposer, _PredictorProposals))
    source: Iterable = _prepared(routing, states, L, want_needed)
    extra: dict[str, Any] = {}
    if future or counts_needed:
        source = list(source)
    if future:
        groups = [(ly, x[3]) for _, layers in source for ly, x in enumerate(layers)]
        extra["stream"] = stream_from_groups(groups, num_experts, top_k)
    if counts_needed and warm_routing is not None:
        warm_src = list(_prepared(warm_routing, _RoutingStates(cfg.routing, top_k, routing_policies, None), L, True))
        extra.update(warm_start(cfg, warm_src, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes,
                                shape=shape, proposer=proposer, extra=extra))
    elif counts_needed and cfg.cache.warm_from is None:
        extra.update(warm_start(cfg, source, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes,
                                shape=shape, proposer=proposer, extra=extra))
    elif counts_needed:
        extra.update(warm_start_from_trace(cfg, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes,
                                           shape=shape))
    planner = Planner.build(cfg, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes,
                            shape=shape, **extra)
    return _plan_all(planner, source, proposer, cfg)


def _needs_counts(policy: Any, cfg: HybridConfig) -> bool:
    """A profile-built policy (``static``) without its pinned set or counts in the options."""
    return bool(policy.needs_profile) and not ({"pinned", "profile"} & set(cfg.cache.options))


def _plan_all(planner: Planner, source: Iterable, proposer: Any, cfg: HybridConfig) -> list[LayerPlan]:
    """Every layer's plan of every prepared forward of ``source`` (see :func:`plan_routing`)."""
    need_scores = planner.cache is not None and planner.cache.needs_scores
    plans: list[LayerPlan] = []
    prev: tuple[int, list] | None = None  # (step, layers) of the previous forward, for "repeat"
    for i, (r, layers) in enumerate(source):
        if need_scores and getattr(r, "scores", None) is None:
            raise MoelabError(
                f"cache policy {cfg.cache.policy!r} reads the router scores, but forward {r.forward} of the routing "
                "has none; record the trace with scores (the default), or use lru, lfu or fifo."
            )
        for ly, (il, wl, sl, _) in enumerate(layers):
            proposal = _proposal(proposer, r, i, ly, layers, prev, int(cfg.prefetch.distance))
            scores = r.scores[ly] if need_scores else None
            plans.append(planner.plan_layer(r.forward, r.step, r.phase, ly, il, wl, sl, scores, proposal))
        prev = (r.step, layers)
    return plans


def access_counts(source: Iterable, num_experts: Sequence[int]) -> np.ndarray:
    """(num_keys,) how often each (MoE layer, expert) key is needed over prepared forwards (keys:
    layer offset + expert, the caches' numbering)."""
    off = np.concatenate([[0], np.cumsum(num_experts)]).astype(np.int64)
    counts = np.zeros(int(off[-1]), dtype=np.int64)
    for _, layers in source:
        for ly, x in enumerate(layers):
            if x[3]:
                np.add.at(counts, off[ly] + np.asarray(x[3], dtype=np.int64), 1)
    return counts


def warm_start(cfg: HybridConfig, source: list, *, num_experts: Sequence[int], top_k: Sequence[int],
               expert_bytes: int | Sequence[int], shape: Any = None, proposer: Any = None,
               extra: dict | None = None) -> dict[str, Any]:
    """The cache's starting state over prepared forwards ``source``: ``{"warm": keys}`` (least
    important first) for ``cache.warm``, plus ``{"profile": counts}`` for a profile-built policy
    without its own. ``frequency``: each partition's most needed experts; ``trace``: what one
    planning pass over ``source`` leaves resident, in the policy's victim order."""
    out: dict[str, Any] = {}
    policy = get_policy(cfg.cache.policy)
    counts = access_counts(source, num_experts)
    if _needs_counts(policy, cfg):
        out["profile"] = counts
    if cfg.cache.warm == "frequency":
        slots = resolve_capacity(cfg.cache.capacity, num_experts, cfg.cache.scope)
        out["warm"] = popular_keys(counts, num_experts, slots, cfg.cache.scope)
    elif cfg.cache.warm == "trace":
        first = Planner.build(cfg, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes, shape=shape,
                              **{**(extra or {}), **out})
        # a stateful source (activation-aware matching) warms on its own copy: the planned pass must
        # not start with what it will see (the warm source is often the routing being planned)
        _plan_all(first, source, copy.deepcopy(proposer) if isinstance(proposer, ActivationAware) else proposer, cfg)
        out["warm"] = first.cache.eviction_order()
    return out


def warm_start_from_trace(cfg: HybridConfig, *, num_experts: Sequence[int], top_k: Sequence[int],
                          expert_bytes: int | Sequence[int], shape: Any = None) -> dict[str, Any]:
    """:func:`warm_start` over the routing of the trace ``cfg.cache.warm_from`` (a running model's
    warm start, or an offline plan warmed on other routing)."""
    path = cfg.cache.warm_from
    if path is None:
        raise MoelabError(
            f"cache.warm={cfg.cache.warm!r} needs routing to count or replay: set cache.warm_from to a routing "
            "trace directory (moelab trace ...), or use warm: empty."
        )
    ts = trace_shape(path)
    if list(ts["num_experts"]) != [int(e) for e in num_experts] or list(ts["top_k"]) != [int(k) for k in top_k]:
        raise MoelabError(
            f"cache.warm_from={str(path)!r} was recorded on a model with {ts['num_experts']} experts and top-k "
            f"{ts['top_k']} per MoE layer, not {list(num_experts)} / {list(top_k)}; record a trace of this model."
        )
    states = _RoutingStates(cfg.routing, top_k, None, None)
    source = list(_prepared(routing_from_trace(path, hidden=False), states, len(num_experts), True))
    return warm_start(cfg, source, num_experts=num_experts, top_k=top_k, expert_bytes=expert_bytes, shape=shape)


class _RoutingStates:
    """The routing policy's slot states of several forwards of one layer and phase, through the
    caller's memo where one is given (see ``plan_routing``'s ``routing_memo``)."""

    def __init__(self, routing: RoutingConfig, top_k: Sequence[int], policies: Sequence[Any] | None,
                 memo: dict | None) -> None:
        self.policy = OfflineRouting(routing, top_k, policies)
        self.memo = memo
        self.key = None if memo is None or policies else (
            repr(routing.deferred), repr(routing.skipped), routing.phase, routing.min_immediate)

    def __call__(self, chunk: list, idx: list[int], layer: int, phase: str) -> list:
        key = None if self.key is None else (self.key, tuple(chunk[i].forward for i in idx), layer, phase)
        got = self.memo.get(key) if key is not None else None
        if got is None:
            got = self.policy.states_many(layer, phase, [chunk[i].ids[layer] for i in idx],
                                          [chunk[i].weights[layer] for i in idx])
            if key is not None:
                self.memo[key] = got
        return got


def _prepared(routing: Iterable[ForwardRouting], states: _RoutingStates, L: int, want_needed: bool
              ) -> Iterator[tuple[Any, list]]:
    """Each forward with its layers as ``(ids, weights, slot states, needed experts)`` lists. The
    routing policy runs on chunks of forwards at once (one slot plan per layer and phase: its
    per-call cost dominated)."""
    it = iter(routing)
    while chunk := list(islice(it, _CHUNK)):
        per_forward: list[list] = [[None] * L for _ in chunk]
        if states.policy.policies:
            for r in chunk:
                _check(r, L)
            for phase in {r.phase for r in chunk}:
                idx = [i for i, r in enumerate(chunk) if r.phase == phase]
                for ly in range(L):
                    for i, st in zip(idx, states(chunk, idx, ly, phase), strict=True):
                        per_forward[i][ly] = st
        for r, sts in zip(chunk, per_forward, strict=True):
            _check(r, L)
            layers = []
            for ly in range(L):
                il, wl = r.ids[ly].tolist(), np.asarray(r.weights[ly], dtype=np.float32).tolist()
                sl = sts[ly].tolist() if sts[ly] is not None else None
                layers.append((il, wl, sl, slots_and_union(il, wl, sl)[0] if want_needed else None))
            yield r, layers


def _proposal(proposer: Any, r: ForwardRouting, i: int, ly: int, layers: list, prev: tuple[int, list] | None,
              d: int) -> list[int] | None:
    """What the prefetch source proposes for layer ``ly + d`` after layer ``ly`` of forward ``r``
    (the ``i``-th of the routing source), or None."""
    L = len(layers)
    if proposer is None or ly + d >= L:
        return None
    if proposer == "same":  # oracle: what layer l + d of this forward needs
        return layers[ly + d][3]
    if proposer == "previous":  # repeat: what layer l + d needed at the sequences' previous step
        ok = prev is not None and prev[0] == r.step - 1 and r.step > 0
        return prev[1][ly + d][3] if ok else None
    return _ask(proposer, PredictContext(
        stream=None, group=i * L + ly, seq=-1, step=r.step, layer=ly, target_layer=ly + d,
        experts=np.asarray(layers[ly][3] if layers[ly][3] is not None else [], dtype=np.int64),
        scores=r.scores[ly] if getattr(r, "scores", None) is not None else None, routing=r))


__all__ = ["ForwardRouting", "OfflineRouting", "access_counts", "plan_routing", "routing_from_trace", "trace_shape",
           "warm_start", "warm_start_from_trace"]
