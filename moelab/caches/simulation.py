"""Offline cache simulation: replay a routing trace's access stream through a policy.

``simulate(trace, "lru", 0.25)`` replays the stream (see :mod:`moelab.caches.stream` for
the semantics) through the compiled kernel when the policy is a built-in and numba is
installed, else through the pure-Python reference class — the same class a running model
drives online. ``sweep`` runs policies × capacities × scopes (× prefetch settings).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from moelab.caches import _fast
from moelab.caches.base import (
    ExpertCache,
    Insertion,
    Scope,
    check_expert_bytes,
    check_insertion,
    get_policy,
    resolve_capacity,
)
from moelab.caches.policies import mrs_p, nan_scores_message, popular_keys
from moelab.caches.prefetch import PrefetchConfig, get_prefetcher, proposals
from moelab.caches.results import CacheResult, CacheSweep
from moelab.caches.stream import AccessStream, Replay, belady_future, build_stream
from moelab.errors import MoelabError, unknown_name

logger = logging.getLogger(__name__)

Backend = Literal["auto", "fast", "reference"]

#: How to record router scores, quoted by errors about traces without them.
RECORD_SCORES_HINT = (
    "record the trace with router scores: moelab.record(model, out, scores=True) "
    "(the default) or `moelab trace` without --no-scores"
)


# ---------------------------------------------------------------------- streams from traces
def load_stream(
    source: Any, include_prefill: bool = False, scores: bool = True, replay: Replay = "forward"
) -> AccessStream:
    """The access stream of a trace (``RoutingTrace``, a trace directory) or a stream as is.

    ``scores=False`` skips loading the router scores (they are only needed by ``mrs``).
    ``replay``: ``forward`` (one group per forward pass and MoE layer: the batch's union, what
    an online cache sees) or ``sequence`` (per sequence, step and layer); see
    :mod:`moelab.caches.stream`. A given stream is returned as is (its order was chosen when
    it was built).
    """
    if isinstance(source, AccessStream):
        return source
    if isinstance(source, (str, Path)):
        from moelab.trace import open_trace

        source = open_trace(source)
    if not hasattr(source, "experts_array"):
        raise MoelabError(f"expected a RoutingTrace, a trace directory or an AccessStream, got {type(source).__name__}.")
    tr = source
    stream = build_stream(
        seq=tr.column("seq"),
        step=tr.column("step"),
        moe_layer=tr.column("moe_layer"),
        experts=tr.experts_array(),
        weights=tr.weights_array() if (include_prefill or replay == "forward") else None,
        num_experts=tr.num_experts_per_layer,
        top_k=tr.top_k_per_layer,
        scores=tr.scores_array() if (scores and tr.has_scores) else None,
        include_prefill=include_prefill,
        model_name=tr.meta["model"].get("name"),
        replay=replay,
        forward=tr.column("forward") if "forward" in _columns(tr) else None,
    )
    sizes = tr.meta["model"].get("expert_bytes")  # traces recorded before it was added lack it
    if sizes:
        object.__setattr__(stream, "expert_bytes", int(max(sizes)))
    return stream


def _columns(tr: Any) -> set[str]:
    """Column names of a trace (empty if the reader does not say)."""
    parquet = getattr(tr, "_parquet", None)
    return set(parquet.schema_arrow.names) if parquet is not None else set()


# ---------------------------------------------------------------------- simulation
def simulate(
    source: Any,
    policy: str | type[ExpertCache] = "lru",
    capacity: float | int = 0.25,
    scope: Scope = "layer",
    *,
    include_prefill: bool = False,
    warm: bool = False,
    prefetch: PrefetchConfig | None = None,
    backend: Backend = "auto",
    expert_bytes: int | None = None,
    profile: Any = None,
    keep_hits: bool = False,
    insertion: Insertion = "always",
    replay: Replay = "forward",
    access_order: str = "weight",
    **policy_kwargs: Any,
) -> CacheResult:
    """Replay ``source``'s access stream through one policy at one capacity.

    Args:
        source: a ``RoutingTrace``, a trace directory, or an :class:`AccessStream`.
        policy: a registered name (``lru``, ``lfu``, ``fifo``, ``static``, ``mrs``, ``belady``,
            ``belady-bypass``) or an :class:`ExpertCache` subclass.
        capacity: fraction of the experts (float in (0, 1]) or a count (int), per partition.
        scope: ``layer`` (per-MoE-layer slots) or ``global`` (one pool for all layers).
        include_prefill: also replay the prompt (step 0) groups (only when building from a trace).
        warm: start with the most popular experts of ``profile`` loaded instead of empty.
        prefetch: predictor-driven prefetching, or None for demand caching.
        backend: ``fast`` (compiled), ``reference`` (pure Python), ``auto`` (fast when possible).
        expert_bytes: bytes per expert for ``bytes_moved`` (an integer ≥ 1); default: the
            trace's recorded expert size (meta.json ``model.expert_bytes``), else 1 (then
            ``bytes_moved`` counts experts). ``transfers`` always counts experts.
        profile: what ``static`` and ``warm`` rank popularity on: an AccessStream, a trace, or
            per-key counts; default the replayed stream itself (an optimistic profile).
        keep_hits: keep the per-access hit flags on the result (``result.hit``).
        insertion: ``always`` (default; the published runtimes' rule: a step's hits are served
            first, then every miss is inserted, its victim any resident expert) or
            ``protect-step`` (moelab's earlier rule: a step's experts never evict each other,
            a miss without another victim is not inserted). See :mod:`moelab.caches.base`.
        replay: ``forward`` (default; one group per forward pass and MoE layer, the batch's
            union) or ``sequence`` (per sequence, step and layer). Only when building from a
            trace.
        access_order: ``weight`` (default; each step's experts served in descending router
            weight) or ``id`` (ascending expert id, as mixtral-offloading serves a step's misses;
            it matters when the slots are fewer than the top-k).
        policy_kwargs: policy parameters (``alpha``, ``p``, ``pairing``, ``rows`` for mrs;
            ``oracle_scope`` (``stream``/``sequence``) for the Belady oracles; ``reset_on_evict`` for
            lfu; ``pinned`` for static).

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.caches.stream import ordered_by_id

    cls = get_policy(policy)
    check_insertion(insertion)
    if access_order not in ("weight", "id"):
        raise unknown_name("access order", access_order, ("weight", "id"))
    stream = load_stream(source, include_prefill, scores=cls.needs_scores, replay=replay)
    if access_order == "id":
        stream = ordered_by_id(stream)
    return _simulate_stream(
        stream, cls, capacity, scope, warm, prefetch, backend, expert_bytes, profile, keep_hits, insertion,
        policy_kwargs,
    )


def sweep(
    source: Any,
    policies: Sequence[str] = ("lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass"),
    capacities: Sequence[float | int] = (0.125, 0.25, 0.5, 0.75),
    scopes: Sequence[Scope] = ("layer",),
    prefetch: Sequence[PrefetchConfig | None] = (None,),
    *,
    include_prefill: bool = False,
    progress: bool = True,
    replay: Replay = "forward",
    **kwargs: Any,
) -> CacheSweep:
    """Every combination of ``policies × capacities × scopes × prefetch``; the stream is built once.

    Prefetch settings are applied only to policies with ``accepts_prefetch`` (not to the
    Belady bounds, which stay demand-caching bounds, nor to ``static``, which ignores them).
    Other keyword arguments (``insertion``, ``warm``, ...) go to :func:`simulate`.

    Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from tqdm.auto import tqdm

    for arg, values, example in (("policies", policies, "('lru', 'belady')"),
                                 ("capacities", capacities, "(0.25, 0.5)"),
                                 ("scopes", scopes, "('layer',)"), ("prefetch", prefetch, "(None,)")):
        if isinstance(values, (str, bytes)) or len(values) == 0:
            raise MoelabError(f"sweep({arg}={values!r}): expected a non-empty sequence, e.g. {arg}={example}.")
    need_scores = any(get_policy(p).needs_scores for p in policies)
    stream = load_stream(source, include_prefill, scores=need_scores, replay=replay)
    combos = [
        (p, c, s, pf)
        for pf in prefetch
        for s in scopes
        for p in policies
        for c in capacities
        if pf is None or get_policy(p).accepts_prefetch
    ]
    results = [
        simulate(stream, p, c, s, prefetch=pf, **kwargs)
        for p, c, s, pf in tqdm(combos, desc="cache sweep", disable=not progress or len(combos) < 8, leave=False)
    ]
    return CacheSweep(results)


def _simulate_stream(
    stream: AccessStream,
    cls: type[ExpertCache],
    capacity: float | int,
    scope: Scope,
    warm: bool,
    prefetch: PrefetchConfig | None,
    backend: Backend,
    expert_bytes: int | None,
    profile: Any,
    keep_hits: bool,
    insertion: Insertion,
    policy_kwargs: dict[str, Any],
) -> CacheResult:
    """Size: long and wide: simulate()'s settings resolved in one pass (capacity, warm set, profile, prefetch
    proposals and budget, backend choice) before the replay; it is the one place these checks and their error
    messages live.
    """
    slots = resolve_capacity(capacity, stream.num_experts, scope)
    allowed = cls.__dict__.get("params")
    if allowed is not None and set(policy_kwargs) - allowed:
        bad = ", ".join(sorted(set(policy_kwargs) - allowed))
        raise MoelabError(
            f"unknown parameter(s) for policy {cls.name!r}: {bad}; it takes: {', '.join(sorted(allowed)) or 'none'}."
        )
    if cls.needs_scores and not stream.has_scores:
        raise MoelabError(f"policy {cls.name!r} needs router scores but the trace has none; {RECORD_SCORES_HINT}.")
    if expert_bytes is not None:
        check_expert_bytes(expert_bytes)
    size_known = bool(expert_bytes or stream.expert_bytes)
    expert_bytes = int(expert_bytes or stream.expert_bytes or 1)
    counts = None
    if warm or cls.needs_profile:
        counts = _profile_counts(profile if profile is not None else stream, stream)
    warm_keys = popular_keys(counts, stream.num_experts, slots, scope) if warm else []
    if cls.needs_profile:
        policy_kwargs = {"profile": counts, **policy_kwargs}

    pf_ptr = np.zeros(stream.num_groups + 1, dtype=np.int64)
    pf_keys = np.zeros(0, dtype=np.int64)
    budget = None
    per_group = True
    if prefetch is not None and prefetch.predictor is None:
        prefetch = None  # a configuration without a source: no prefetch (HybridConfig's default)
    if prefetch is not None:
        if prefetch.m is not None:
            raise MoelabError(
                f"prefetch m={prefetch.m}: the cache simulator's fitted predictors propose per token as "
                "moelab.predictors.as_prefetcher(predictor, trace, m=...) fixed them; set m there.")
        if not cls.accepts_prefetch:
            logger.info("%s ignores prefetches", cls.name or cls.__name__)
        if prefetch.needs_expert_bytes and not size_known:
            raise MoelabError(
                "a prefetch budget in bytes needs the size of an expert, and the trace does not record it: "
                "pass expert_bytes (CLI: --expert-bytes), or give the budget in experts."
            )
        pf_ptr, pf_keys = proposals(get_prefetcher(prefetch.predictor, m=prefetch.m), stream, prefetch.distance)
        budget = prefetch.experts_budget(expert_bytes)
        per_group = prefetch.per_layer

    kernel = cls.__dict__.get("kernel")  # the class's own: a subclass that changes behaviour has none
    variant = {k: v for k, v in (cls.__dict__.get("kernel_defaults") or {}).items()
               if policy_kwargs.get(k, v) != v}
    fast_ok = _fast.HAVE_NUMBA and kernel is not None and not variant
    if backend == "fast" and not fast_ok:
        why = ("numba is not installed" if not _fast.HAVE_NUMBA else f"{cls.__name__} has no compiled kernel"
               if kernel is None else f"{', '.join(f'{k}={policy_kwargs[k]!r}' for k in variant)} replays in Python only")
        raise MoelabError(f"backend 'fast' is unavailable: {why}; use backend='reference'.")
    if backend not in ("auto", "fast", "reference"):
        raise MoelabError(f"backend must be 'auto', 'fast' or 'reference', got {backend!r}.")
    use_fast = fast_ok and backend != "reference"
    if use_fast:
        raw = _run_fast(
            stream, cls, slots, scope, warm_keys, pf_ptr, pf_keys, budget, per_group, insertion, policy_kwargs
        )
    else:
        if backend == "auto" and kernel is not None and not _fast.HAVE_NUMBA and not variant:
            logger.warning("numba is not installed: replaying %s in pure Python (slow)", cls.name)
        raw = _run_reference(
            stream, cls, capacity, scope, warm_keys, pf_ptr, pf_keys, budget, per_group, expert_bytes, insertion,
            policy_kwargs,
        )

    hit, counters, spec_left = raw
    key_layer = stream.key_layer()
    acc_layer = key_layer[stream.keys]
    L = stream.num_layers
    layer_acc = np.bincount(acc_layer, minlength=L)
    layer_hits = np.bincount(acc_layer, weights=hit, minlength=L).astype(np.int64)
    sizes = np.diff(stream.group_ptr)
    prefill = np.repeat(stream.group_step == 0, sizes)
    phase_acc = {"decode": int((~prefill).sum())}
    phase_hits = {"decode": int(hit[~prefill].sum())}
    if prefill.any():
        phase_acc["prefill"] = int(prefill.sum())
        phase_hits["prefill"] = int(hit[prefill].sum())
    return CacheResult(
        policy=cls.name or cls.__name__,
        capacity=capacity,
        scope=scope,
        slots=slots.tolist(),
        capacity_fraction=float(slots.sum() / max(1, stream.num_keys)),
        accesses=int(len(hit)),
        hits=int(hit.sum()),
        evictions=int(counters[_fast.EVICTIONS]),
        transfers=int(counters[_fast.TRANSFERS]),
        expert_bytes=expert_bytes,
        layer_accesses=layer_acc.tolist(),
        layer_hits=layer_hits.tolist(),
        phase_accesses=phase_acc,
        phase_hits=phase_hits,
        prefetch=prefetch.describe(expert_bytes) if prefetch is not None else None,
        prefetched=int(counters[_fast.PREFETCHED]),
        prefetch_hits=int(counters[_fast.PREFETCH_HITS]),
        wasted_prefetches=int(counters[_fast.WASTED_EVICTED] + spec_left),
        backend="fast" if use_fast else "reference",
        model=stream.model_name,
        insertion=insertion,
        replay=stream.replay,
        hit=hit if keep_hits else None,
    )


def _profile_counts(profile: Any, stream: AccessStream) -> np.ndarray:
    if isinstance(profile, np.ndarray):
        counts = profile
    else:
        prof = load_stream(profile, scores=False)
        if prof.num_experts.tolist() != stream.num_experts.tolist():
            raise MoelabError(
                f"the profile's experts per layer {prof.num_experts.tolist()} differ from the trace's "
                f"{stream.num_experts.tolist()}: profile on the same model."
            )
        counts = np.bincount(prof.keys, minlength=prof.num_keys)
    if len(counts) != stream.num_keys:
        raise MoelabError(f"profile counts must have one entry per key ({stream.num_keys}), got {len(counts)}.")
    return counts


def _run_fast(stream, cls, slots, scope, warm_keys, pf_ptr, pf_keys, budget, per_group, insertion, kw):
    """Size: the arrays the compiled replay takes (see moelab.caches._fast.replay).
    """
    code = cls.kernel
    n, NK, G = stream.num_accesses, stream.num_keys, stream.num_groups
    key_layer = stream.key_layer().astype(np.int64)
    key_part = key_layer if scope == "layer" else np.zeros(NK, dtype=np.int64)
    row_ptr = np.zeros(G + 1, dtype=np.int64)
    top_v = np.zeros((0, 1), dtype=np.float32)
    top_e = np.zeros((0, 1), dtype=np.int32)
    p_layer = np.zeros(stream.num_layers, dtype=np.int64)
    alpha = float(kw.get("alpha", 0.5))
    if code == _fast.MRS:
        if not 0.0 < alpha <= 1.0:
            raise MoelabError(f"mrs alpha must lie in (0, 1], got {alpha!r}.")
        ps = mrs_p(kw.get("p"), stream.top_k.tolist(), stream.num_experts.tolist())
        p_layer = np.asarray(ps, dtype=np.int64)
        row_ptr = stream.row_ptr
        R = len(stream.score_rows)
        top_v = np.zeros((R, max(ps)), dtype=np.float32)
        top_e = np.zeros((R, max(ps)), dtype=np.int32)
        scores = np.ascontiguousarray(stream.scores, dtype=np.float32)  # the reference's precision
        bad = _fast.top_p_rows(
            stream.group_layer, row_ptr, stream.score_rows, scores, p_layer, stream.key_offset, top_v, top_e
        )
        if bad >= 0:
            raise MoelabError(nan_scores_message(int(bad)))
    nxt, first, never = np.zeros(0, dtype=np.int64), np.zeros(NK, dtype=np.int64), 0
    if code == _fast.BELADY:
        nxt, first, never = belady_future(stream, "group" if insertion == "always" else "access",
                                          kw.get("oracle_scope", "stream"))
    pinned = np.zeros(NK, dtype=np.bool_)
    if code == _fast.STATIC:
        keys = kw.get("pinned")
        if keys is None:
            keys = popular_keys(kw["profile"], stream.num_experts, slots, scope)
        pinned[np.asarray(list(keys), dtype=np.int64)] = True
    hit = np.zeros(n, dtype=np.uint8)
    policy = _fast.Policy(code, _fast.INSERTION_CODES[insertion], bool(kw.get("reset_on_evict", False)), alpha,
                          pinned, bool(cls.bypasses), int(never))
    cache = _fast.new_cache(policy, key_part, slots, stream.key_offset, warm_keys, first)
    _fast.replay(cache, _fast.Stream(stream.keys, stream.group_ptr, stream.group_layer, stream.group_pass, nxt),
                 _fast.Scores(row_ptr, top_v, top_e, p_layer),
                 _fast.Prefetches(pf_ptr, pf_keys.astype(np.int64), -1 if budget is None else int(budget),
                                  bool(per_group)), hit)
    counters, spec = cache.counters, cache.spec
    return hit, counters, int(spec.sum())


def _run_reference(stream, cls, capacity, scope, warm_keys, pf_ptr, pf_keys, budget, per_group, expert_bytes,
                   insertion, kw):
    """Size: the same settings as _run_fast, for the Python reference replay.
    """
    kwargs = dict(kw)
    if cls.needs_future:
        kwargs["stream"] = stream
    if cls.needs_scores and "top_k" not in kwargs:
        kwargs["top_k"] = stream.top_k.tolist()
    cache = cls(
        stream.num_experts.tolist(), capacity, scope, expert_bytes=expert_bytes, warm=list(warm_keys),
        insertion=insertion, **kwargs,
    )
    hit = np.zeros(stream.num_accesses, dtype=np.uint8)
    cur_pass, left = -1, budget
    for g in range(stream.num_groups):
        if per_group or stream.group_pass[g] != cur_pass:
            cur_pass, left = stream.group_pass[g], budget
        layer = int(stream.group_layer[g])
        a = stream.group_ptr[g]
        out = cache.access(layer, stream.group_experts(g).tolist(), stream.group_scores(g))
        hit[a : a + len(out)] = out
        pk = pf_keys[pf_ptr[g] : pf_ptr[g + 1]]
        if len(pk):
            tgt = int(np.searchsorted(stream.key_offset, pk[0], side="right") - 1)
            moved = cache.prefetch(tgt, (pk - stream.key_offset[tgt]).tolist(), left)
            if left is not None:
                left -= moved
    counters = np.zeros(5, dtype=np.int64)
    counters[_fast.EVICTIONS] = cache.evictions
    counters[_fast.TRANSFERS] = cache.transfers
    counters[_fast.PREFETCHED] = cache.prefetched
    counters[_fast.PREFETCH_HITS] = cache.prefetch_hits
    counters[_fast.WASTED_EVICTED] = cache._wasted_evicted
    return hit, counters, len(cache._speculative)


__all__ = ["PrefetchConfig", "load_stream", "simulate", "sweep"]

