"""The hybrid planner: one model-free object that plans a MoE layer of a forward from its routing.

A :class:`Planner` is built from a :class:`~moelab.hybrid.config.HybridConfig` and the model's
shape (experts and top-k per MoE layer, bytes of an expert), with a cost model, an expert
cache and a placement policy. :meth:`Planner.plan_layer` takes plain routing data of one MoE
layer of one forward — the real tokens' expert ids, combine weights and slot states (lists),
optional router scores and the prefetch proposal for this layer's target — and returns the
:class:`LayerPlan`. The same object runs

* online, inside ``moelab.hybrid(model, cfg)`` (:mod:`moelab.hybrid.runtime`: its handlers
  turn the forward's tensors into lists and call :meth:`Planner.plan_layer`), and
* offline, over recorded or synthetic routing (:func:`moelab.hybrid.offline.plan_routing`),

so a run's plans and the offline plans of its own trace are equal field by field.

Per layer, in this order: the routing policy's slot states (given: immediate / deferred /
dropped) → the experts the layer needs (the union over the real tokens of the slots that run
now or deferred, by descending router weight, ties lower id) split into hits and misses →
placement of each miss (host or fetched) → the cache serves the accesses: **admission follows
placement** (``cache.admission: placement``, the default): a fetched miss is inserted (its
victim evicted), a miss computed on the host is counted but not copied in — as KTransformers'
static placement and HybriMoE do; ``cache.admission: all`` also copies host misses in afterwards,
as low-priority ``insert`` transfers → the prefetch proposal for layer ``l + d`` is inserted as
speculative entries within the budget (after the layer's own demand accesses: demand always
comes first).

Prefetch budget (``HybridConfig.prefetch.budget``): by default **per MoE layer** — at most
that many prefetched experts are issued after each MoE layer of each forward (ProMoE's
per-layer link budget: the prefetches of layer ``l + d`` must cross the link while layer
``l`` computes, so the budget is what the link moves in one layer's time;
docs/techniques.md §3). ``budget_scope: forward`` makes it a budget per forward pass shared
by all its MoE layers, first come first served (the offline cache simulation's historical ``PrefetchConfig``
budget, :mod:`moelab.caches.simulation`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moelab.caches import get_policy
from moelab.caches import make_cache as _make
from moelab.caches.online import union_small
from moelab.errors import MoelabError
from moelab.forward.plan import DEFERRED, DROPPED
from moelab.hybrid.config import HybridConfig
from moelab.hybrid.placement import FETCH, HOST, Placement, get_placement
from moelab.timing import get_profile
from moelab.timing.costs import CostModel

log = logging.getLogger(__name__)

@dataclass
class Transfer:
    """One host→device copy of an expert."""

    layer: int
    expert: int
    bytes: int
    priority: str
    """``demand`` (a miss placed on the device), ``prefetch`` (a predicted expert), or ``insert``
    (a miss run on the host and copied in afterwards: only under ``cache.admission: all``, at the
    lowest priority)."""


@dataclass
class LayerPlan:
    """What one MoE layer of one forward does (plain data; see the module docstring)."""

    forward: int
    step: int
    phase: str
    layer: int
    tokens: int
    """Real tokens in the forward."""
    device: list[tuple[int, int]] = field(default_factory=list)
    """(expert, tokens) computed on the device: cache hits and fetched misses."""
    host: list[tuple[int, int]] = field(default_factory=list)
    """(expert, tokens) computed on the host."""
    deferred: list[tuple[int, int]] = field(default_factory=list)
    """(expert, tokens) pairs whose slots are deferred to the next MoE layer's output."""
    skipped: int = 0
    """(token, expert) slots dropped by skipping."""
    accessed: list[int] = field(default_factory=list)
    """Experts the layer needs, in the order the cache served them."""
    hits: list[int] = field(default_factory=list)
    misses: list[int] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    evictions: list[tuple[int, int]] = field(default_factory=list)
    """(layer, expert) pairs evicted by this layer's insertions and prefetches."""
    prefetch_hits: list[int] = field(default_factory=list)
    """The hits (a subset of :attr:`hits`, in the same order) on experts a prefetch brought
    in and no demand access had used since: hits only because of the prefetch."""


def union_order(ids: list[list[int]], weights: list[list[float]]) -> list[int]:
    """The experts a layer needs, in access order: one token's in router order (``-1``
    skipped); several tokens' each once, by descending largest weight, ties lower id
    (:func:`moelab.caches.online.union_small`, the rule of the offline access stream)."""

    return union_small(ids, weights) if ids else []


def slots_and_union(ids: list[list[int]], weights: list[list[float]] | None, state: list[list[int]] | None = None
                    ) -> tuple[list[int], dict[int, int], list[tuple[int, int]], int]:
    """One layer's routing under its slot states: ``(needed, tokens, deferred, skipped)`` —
    the experts it needs in access order (:func:`union_order` of the slots that run now or
    deferred), tokens per needed expert, sorted (expert, deferred slots) pairs, dropped slots."""
    if len(ids) == 1:  # a decode step at batch 1: the token's experts in router order
        row = ids[0]
        if state is None:
            needed = [e for e in row if e >= 0]
            return needed, dict.fromkeys(needed, 1), [], 0
        srow = state[0]
        if DROPPED in srow:
            needed = [e for e, st in zip(row, srow, strict=True) if st != DROPPED and e >= 0]
        else:
            needed = [e for e in row if e >= 0]
        deferred = sorted((e, 1) for e, st in zip(row, srow, strict=True) if st == DEFERRED) if DEFERRED in srow \
            else []
        return needed, dict.fromkeys(needed, 1), deferred, srow.count(DROPPED)
    deferred: list[tuple[int, int]] = []
    skipped = 0
    if state is not None:
        dfr: dict[int, int] = {}
        run_ids = []
        for row, srow in zip(ids, state, strict=True):
            run_row = []
            for e, st in zip(row, srow, strict=True):
                if st == DROPPED:
                    skipped += 1
                    run_row.append(-1)
                    continue
                run_row.append(e)
                if st == DEFERRED:
                    dfr[e] = dfr.get(e, 0) + 1
            run_ids.append(run_row)
        deferred = sorted(dfr.items())
        ids = run_ids
    needed = union_order(ids, weights)
    tokens: dict[int, int] = {}
    for row in ids:
        for e in row:
            if e >= 0:
                tokens[e] = tokens.get(e, 0) + 1
    return needed, tokens, deferred, skipped


def make_cache(config: HybridConfig, num_experts: Sequence[int], top_k: Sequence[int], expert_bytes: int,
               **extra: Any):
    """The expert cache of ``config`` for a model with these experts per MoE layer, or None
    (capacity 0). ``extra`` goes to the policy (``stream=`` for ``belady``: offline only)."""

    c = config.cache
    cap = c.capacity
    if isinstance(cap, bool) or not isinstance(cap, (int, float)):
        raise MoelabError(f"cache.capacity must be a fraction in (0, 1] or an expert count, got {cap!r}.")
    if cap < 0 or (isinstance(cap, int) and cap > max(num_experts)) or (isinstance(cap, float) and cap > 1):
        raise MoelabError(
            f"cache.capacity={cap!r} does not fit this model ({max(num_experts)} experts per layer); use a fraction "
            f"in (0, 1] or a count in 0..{max(num_experts)}."
        )
    if cap == 0:
        return None
    cls = get_policy(c.policy)
    if cls.needs_future and "stream" not in extra:
        raise MoelabError(
            f"cache policy {c.policy!r} reads the future routing: it works only offline "
            "(moelab.hybrid.offline.plan_routing); use lru, lfu, fifo or mrs in a running model."
        )
    options = dict(c.options)
    if cls.needs_scores:
        options.setdefault("top_k", list(top_k))
    return _make(c.policy, list(num_experts), cap, c.scope, expert_bytes=int(expert_bytes), **options, **extra)


def make_cost_model(config: HybridConfig, shape: Any) -> CostModel:
    """The one cost model (:class:`moelab.timing.costs.CostModel`) of ``shape`` on ``config.hardware``."""
    if config.hardware is None:
        raise MoelabError(
            f"placement {config.placement!r} needs a cost model; set hardware: to a profile name "
            "(e.g. pcie4-x16), or use placement host-misses / fetch-misses."
        )
    if shape is None:
        raise MoelabError(
            f"placement {config.placement!r} needs the model's shape for its cost model; pass shape= "
            "(moelab.timing.get_shape(name), or ModelShape.from_model(model))."
        )
    return CostModel.of(shape, get_profile(config.hardware))


class Planner:
    """Plans each MoE layer of each forward (see the module docstring); keeps no model.

    Args:
        config: the hybrid configuration (its cache, placement, prefetch and routing parts).
        num_experts: routed experts per MoE layer.
        top_k: experts selected per token, per MoE layer.
        expert_bytes: bytes of one expert, per MoE layer.
        cost: the cost model (placements ``greedy-hss`` / ``min-cost``), or None.
        cache: the expert cache (:func:`make_cache`), or None (nothing resident).
        placement: a placement policy; default ``config.placement``.
    """

    def __init__(self, config: HybridConfig, *, num_experts: Sequence[int], top_k: Sequence[int],
                 expert_bytes: Sequence[int], cost: CostModel | None = None, cache: Any = None,
                 placement: Placement | None = None) -> None:
        self.config = config
        self.num_experts = [int(e) for e in num_experts]
        self.top_k = [int(k) for k in top_k]
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.num_layers = len(self.num_experts)
        self.cache = cache
        self.placement = placement if placement is not None else get_placement(config.placement)
        if self.placement.needs_cost_model and cost is None:
            raise MoelabError(
                f"placement {config.placement!r} needs a cost model; set hardware: to a profile name "
                "(e.g. pcie4-x16), or use placement host-misses / fetch-misses."
            )
        self.cost = cost
        self.admit_all = config.cache.admission == "all"
        pf = config.prefetch
        self.distance = int(pf.distance)
        if pf.budget_scope not in ("layer", "forward"):
            raise MoelabError(f"prefetch.budget_scope={pf.budget_scope!r}: expected 'layer' or 'forward'.")
        # in experts; a budget in bytes or from a link counts the largest layer's experts
        self.budget = pf.experts_budget(max(self.expert_bytes, default=1))
        self.budget_per_forward = pf.budget_scope == "forward"
        # impact-driven selection (PrefetchConfig.select) needs the cost model
        self.impact = pf.select == "impact" and cost is not None
        self.lead_us = self.distance * cost.profile.decode_layer_time_us if cost is not None else 0.0
        self._budget_left: int | None = None
        self._budget_forward: int | None = None
        self._evicted: list[int] = []
        self._inserted: list[int] = []
        if cache is not None:
            # the cache appends what it evicts and inserts to these lists: a plan's evictions and
            # insertions without copying the resident set before and after every access
            cache.journal(self._evicted, self._inserted)
            self._offsets = [int(cache.key_offset_[i]) for i in range(self.num_layers)]
            self._key_pair = [cache.layer_expert(k) for k in range(cache.key_offset_[-1])]
        # the compiled per-layer path (moelab.hybrid._compiled) where this configuration allows
        # it and MOELAB_PLANNER does not say otherwise; it then owns the cache's state, and
        # self.cache is its read view (the reference cache object stays as built)
        from moelab.hybrid._compiled import choose

        self.path_reason: str | None = None
        self.deferral: tuple[list[int], int, bool] | None = None
        """Expert Deferral handed to the planner (:meth:`defer_with`): D per layer, ``min_immediate``, union rule."""
        self._compiled = choose(self)
        self.path = "compiled" if self._compiled is not None else "reference"
        """Which per-layer path plans: ``compiled`` or ``reference`` (:attr:`path_reason`: why not compiled)."""
        if self._compiled is not None:
            self.reference_cache, self.cache = cache, self._compiled.view
            self.plan_layer = self._compiled.plan_layer  # one Python call less per layer (same signature)
        log.debug("hybrid planner: %s path%s", self.path, f" ({self.path_reason})" if self.path_reason else "")

    @classmethod
    def build(cls, config: HybridConfig, *, num_experts: Sequence[int], top_k: Sequence[int],
              expert_bytes: Sequence[int] | int, shape: Any = None, **cache_extra: Any) -> Planner:
        """A planner with the cache, placement and cost model ``config`` names (``shape``: the model's
        :class:`~moelab.timing.shapes.ModelShape`, which a cost-aware placement needs)."""
        L = len(num_experts)
        try:
            eb = [int(b) for b in expert_bytes]  # one per MoE layer
        except TypeError:
            eb = [int(expert_bytes)] * L  # one for all
        if len(eb) != L or min(eb, default=1) < 1:
            raise MoelabError(
                f"expert_bytes={expert_bytes!r}: expected the bytes of one expert (an integer ≥ 1), or one per "
                f"MoE layer ({L})."
            )
        placement = get_placement(config.placement)
        # the cost model: for the cost-aware placements, and for impact-driven prefetch where the
        # hardware and the shape are known
        costed = placement.needs_cost_model or (config.hardware is not None and shape is not None)
        cost = make_cost_model(config, shape) if costed else None
        cache = make_cache(config, num_experts, top_k, max(eb), **cache_extra)
        return cls(config, num_experts=num_experts, top_k=top_k, expert_bytes=eb, cost=cost, cache=cache,
                   placement=placement)

    def defer_with(self, deferred: Sequence[int], min_immediate: int, union: bool) -> None:
        """Apply Expert Deferral in the plan calls that ask for it (``plan_layer(..., defer=True)``):
        ``deferred`` D per MoE layer, its ``min_immediate`` and ``batch_rule == "union"``
        (:class:`moelab.policies.deferral.DeferralConfig`). The hybrid run hands its own deferral
        policy's edit to the planner this way, so the compiled path makes it in the same call as
        the plan (:func:`moelab.policies.deferral.defer_rows` is the reference)."""
        if len(deferred) != self.num_layers:
            raise MoelabError(f"defer_with: {len(deferred)} deferred counts for {self.num_layers} MoE layers; "
                              "give one per MoE layer.")
        self.deferral = ([int(d) for d in deferred], int(min_immediate), bool(union))
        if self._compiled is not None:
            self._compiled.defer_with(*self.deferral)

    def _defer(self, layer: int, ids: list[list[int]], weights: list[list[float]] | None, state: Any) -> None:
        """The reference's deferral edit of ``state`` (lists, or an integer array written back)."""
        from moelab.policies.deferral import defer_rows

        if self.deferral is None or state is None or weights is None:
            raise MoelabError("plan_layer(defer=True) needs defer_with() first, the slot states to edit and "
                              "every token's weights (one token's too).")
        deferred, mi, union = self.deferral
        rows = state.tolist() if isinstance(state, np.ndarray) else state
        defer_rows(rows, weights, deferred[layer], mi, ids if union else None)
        if isinstance(state, np.ndarray):
            state[...] = rows

    # ------------------------------------------------------------------ planning
    def plan_layer(self, forward: int, step: int, phase: str, layer: int, ids: list[list[int]],
                   weights: list[list[float]] | None, state: list[list[int]] | None = None, scores: Any = None,
                   prefetch: list[int] | None = None, defer: bool = False) -> LayerPlan:
        """The plan of MoE layer ``layer`` of one forward.

        Args:
            forward: the forward's ordinal (recorded on the plan).
            step: the forward's step (recorded on the plan).
            phase: the forward's phase (recorded on the plan).
            layer: the MoE layer's ordinal.
            ids: per real token, its top-k expert ids (router order, ``-1`` = none), as lists.
            weights: per real token, its combine weights, as lists (may be None for one token:
                they only order a union of several tokens' experts).
            state: per real token, its slots' states (``IMMEDIATE``/``DEFERRED``/``DROPPED`` of
                :mod:`moelab.forward.plan`), or None (every slot immediate).
            scores: (tokens, E) router scores of the real tokens (numpy), for score-aware caches.
            prefetch: the experts proposed for MoE layer ``layer + distance`` (most confident
                first), or None for no prefetch.
            defer: first apply the Expert Deferral given to :meth:`defer_with` to ``state``, in
                place (then ``weights`` are needed for one token too; uint16 arrays of weights
                are read as bfloat16 bit patterns).

        Size: one layer's routing as the model hands it (ids, weights, slot states, scores, the prefetch
        proposal) and where it sits (forward, step, phase, layer), positional on the per-layer hot path, where
        packing them into an object per call would cost a share of the planner's time.
        """
        if self._compiled is not None:
            return self._compiled.plan_layer(forward, step, phase, layer, ids, weights, state, scores, prefetch,
                                             defer)
        if isinstance(ids, np.ndarray):  # the runtime's arrays, for the compiled path: the reference takes lists
            ids = ids.tolist()
        if isinstance(weights, np.ndarray):  # (uint16: bfloat16 bit patterns)
            weights = (weights.astype(np.uint32) << 16).view(np.float32).tolist() if weights.dtype == np.uint16 \
                else weights.tolist()
        if defer:
            self._defer(layer, ids, weights, state)
        state = state.tolist() if isinstance(state, np.ndarray) else state
        lp = LayerPlan(forward, step, phase, layer, len(ids))
        needed, tokens, lp.deferred, lp.skipped = slots_and_union(ids, weights, state)
        lp.accessed = needed
        cache = self.cache
        if cache is None:
            lp.misses = list(needed)
            miss_pairs = [(e, tokens[e]) for e in needed]
            hit_pairs = []
        else:
            off = self._offsets[layer]
            spec = cache.speculative
            was_spec = [e for e in needed if off + e in spec] if spec else ()
            resident = cache.is_resident
            hit_pairs, miss_pairs = [], []
            for e in needed:
                (hit_pairs if resident(off + e) else miss_pairs).append((e, tokens[e]))
        nbytes = self.expert_bytes[layer]
        where = self.placement.place(hit_pairs, miss_pairs, self.cost) \
            if miss_pairs or (hit_pairs and self.placement.steal) else {}
        if cache is not None:
            # the cache sees every access (its statistics), but by default only the misses the
            # placement runs on the device are copied in: admission follows placement
            admit = None if self.admit_all else [e for e, _ in miss_pairs if where[e] == FETCH]
            evicted, inserted = self._evicted, self._inserted
            evicted.clear()
            inserted.clear()
            cache.access(layer, needed, scores, admit)
            if evicted:  # resident before and not after: evicted, and not inserted by this access
                gone = set(evicted).difference(inserted)
                pair = self._key_pair
                lp.evictions = [pair[k] for k in sorted(gone)]
            lp.hits = [e for e, _ in hit_pairs]
            lp.misses = [e for e, _ in miss_pairs]
            if was_spec:
                lp.prefetch_hits = [e for e in lp.hits if e in was_spec]
        if len(where) > len(miss_pairs):  # the placement gives the host some hits (HybriMoE's steal)
            stolen = [(e, n) for e, n in hit_pairs if where.get(e) == HOST]
            hit_pairs = [(e, n) for e, n in hit_pairs if where.get(e) != HOST]
        else:
            stolen = []
        if miss_pairs:
            fetched = [(e, n) for e, n in miss_pairs if where[e] == FETCH]
            lp.device = hit_pairs + fetched if fetched else hit_pairs
            lp.host = [(e, n) for e, n in miss_pairs if where[e] == HOST] + stolen
            for e, _ in miss_pairs:
                if where[e] == FETCH:
                    lp.transfers.append(Transfer(layer, e, nbytes, "demand"))
                elif cache is not None and cache.is_resident(off + e):  # admission "all": copied after
                    lp.transfers.append(Transfer(layer, e, nbytes, "insert"))
        else:
            lp.device = hit_pairs
            lp.host = stolen
        if prefetch is not None and cache is not None:
            self._prefetch(forward, layer + self.distance, prefetch, lp)
        return lp

    def _prefetch(self, forward: int, target: int, experts: list[int], lp: LayerPlan) -> None:
        if target >= self.num_layers:
            return
        budget = self.budget
        if self.budget_per_forward and budget is not None:
            if self._budget_forward != forward:
                self._budget_forward, self._budget_left = forward, budget
            budget = self._budget_left
        cache = self.cache
        if self.impact:
            experts = self._impactful(target, experts, lp)
        evicted, inserted = self._evicted, self._inserted
        evicted.clear()
        inserted.clear()
        moved = cache.prefetch(target, experts, budget)
        if self.budget_per_forward and budget is not None:
            self._budget_left -= moved
        if moved:
            nbytes = self.expert_bytes[target]
            off = self._offsets[target]
            for k in inserted:  # in proposal order; a prefetch batch never evicts its own entries
                lp.transfers.append(Transfer(target, k - off, nbytes, "prefetch"))
            if evicted:
                pair = self._key_pair
                lp.evictions += [pair[k] for k in sorted(evicted)]

    def _impactful(self, target: int, experts: list[int], lp: LayerPlan) -> list[int]:
        """HybriMoE's impact-driven prefetch: of the proposed experts not resident, the ones whose
        residence shortens MoE layer ``target``'s planned schedule (its placement on the cost
        model) most, one at a time, while one does and its copy — after this layer's demand copies
        — still lands within the lead time. The tokens per expert are guessed from this forward
        (1 in decode)."""
        cost, place = self.cost, self.placement.place
        off = self._offsets[target]
        resident = self.cache.is_resident
        k, E = self.top_k[target], self.num_experts[target]
        n = 1 if lp.tokens <= 1 else max(1, -(-lp.tokens * k // E))
        proposal = list(dict.fromkeys(experts))
        hits = [(e, n) for e in proposal if resident(off + e)]
        left = [e for e in proposal if not resident(off + e)]
        if not left:
            return []
        fetch_us = cost.fetch_us()
        link = fetch_us * sum(1 for t in lp.transfers if t.priority == "demand")

        def span(h: list, m: list) -> float:
            where = place(h, m, cost) if m or (h and self.placement.steal) else {}
            dev = [p for p in h if where.get(p[0]) != HOST]
            host = [p for p in h + m if where.get(p[0]) == HOST]
            return max(cost.lanes_us(dev, [p for p in m if where[p[0]] == FETCH], host, tokens=max(n, lp.tokens)))

        best = span(hits, [(e, n) for e in left])
        chosen: list[int] = []
        while left and link + fetch_us <= self.lead_us:
            pick, best_t = None, best
            for e in left:
                t = span(hits + [(e, n)], [(x, n) for x in left if x != e])
                if t < best_t - 1e-9:
                    pick, best_t = e, t
            if pick is None:
                break
            best = best_t
            chosen.append(pick)
            hits.append((pick, n))
            left.remove(pick)
            link += fetch_us
        return chosen


__all__ = ["LayerPlan", "Planner", "Transfer", "make_cache", "make_cost_model", "slots_and_union", "union_order"]
