"""The built-in cache policies (pure-Python reference implementations).

=================  ===========================================================  ===========================
name               evicts first                                                 source
=================  ===========================================================  ===========================
``lru``            least recently used                                          Mixtral-offloading, ProMoE
``lfu``            fewest accesses so far; ties: least recently used            llama.cpp, KTransformers
``fifo``           earliest inserted                                            baseline
``static``         never evicts: only the most popular experts of a profile     Fiddler
``mrs``            lowest Minus-Recent-Score priority; ties: least recent       HybriMoE §IV-D
``belady``         the expert used again farthest in the future; inserts        Belady's MIN (ProMoE's
                   every miss (offline)                                         ``CachePolicyMIN``)
``belady-bypass``  the same, but a miss used again no sooner than every         the bypassing optimum
                   cached expert is not inserted (offline)
=================  ===========================================================  ===========================

Candidates are the resident experts (``insertion="always"``, the default) or those the current
step does not need (``insertion="protect-step"``); see :mod:`moelab.caches.base`. Every tie
left after the stated order is broken by the lowest (layer, expert) key.

Which bound bounds what. ``belady-bypass`` (default ``insertion="always"``) is the most hits
any schedule can get when a step's cached experts are hits and each miss may be inserted
(evicting anything) or not: every policy here, under either insertion rule, is such a
schedule, so ``belady-bypass ≥`` all of them, ``belady`` included (checked against exhaustive
search in the tests). ``belady`` is the literature's MIN (every miss inserted, farthest next
use evicted): with one expert per step it is the most hits of any schedule that inserts every
miss, hence a bound on ``lru``, ``lfu``, ``fifo``, ``mrs``; when a step needs several experts
it is the reference the papers report but not always that optimum (a step's misses must all be
inserted, in order; exhaustive search finds schedules a hit or two better), and it never
bounds ``static`` (pinning one expert beats inserting every miss on ``a b a b ...``). Under
``insertion="protect-step"`` both variants replay access by access and may evict a step's own
experts; ``belady-bypass`` is then moelab's earlier bound, the optimum of that relaxation.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from moelab.caches import _codes
from moelab.caches.base import ExpertCache, Scope, register_policy, resolve_capacity
from moelab.caches.stream import AccessStream, belady_future
from moelab.errors import MoelabError, unknown_name


@register_policy("lru")
class LRUCache(ExpertCache):
    """Least recently used: a hit or an insertion makes an expert the most recent.

    Follows mixtral-offloading ``src/expert_cache.py`` (``EvictionGroupInfo``: an
    ``OrderedDict`` per layer from least to most recently used; ``mark_used`` moves a hit to
    the end, ``choose_expert_to_evict`` returns the first on-device entry) and ProMoE's
    ``CachePolicyLRU`` (``access_on_hit`` moves to the back, ``access_on_miss`` appends).
    """

    params = frozenset()
    kernel = _codes.LRU

    def _priority(self, key: int) -> tuple:
        return (self._last_use[key],)



@register_policy("fifo")
class FIFOCache(ExpertCache):
    """First in, first out: evicts the expert inserted longest ago; hits change nothing
    (ProMoE's ``CachePolicyFIFO``: a queue pushed on miss)."""

    params = frozenset()
    kernel = _codes.FIFO

    def _priority(self, key: int) -> tuple:
        return (self._inserted_at[key],)



@register_policy("lfu")
class LFUCache(ExpertCache):
    """Least frequently used, counting every demand access of the expert so far.

    The count includes accesses made while the expert was not cached ("perfect LFU"),
    so a popular expert that was evicted comes back strong; ``reset_on_evict=True`` gives
    classic in-cache LFU (count restarts at 0 when evicted). Ties: least recently used,
    then the lowest key. Prefetches do not count as accesses.
    """

    params = frozenset({"reset_on_evict"})
    kernel = _codes.LFU

    def __init__(self, *args: Any, reset_on_evict: bool = False, **kwargs: Any) -> None:
        self.reset_on_evict = reset_on_evict
        super().__init__(*args, **kwargs)

    def _reset_policy(self) -> None:
        self._freq = [0] * self.key_offset_[-1]

    def _on_access(self, key: int) -> None:
        self._freq[key] += 1

    def _on_evict(self, key: int) -> None:
        if self.reset_on_evict:
            self._freq[key] = 0

    def _priority(self, key: int) -> tuple:
        return (self._freq[key], self._last_use[key])



@register_policy("mrs")
class MRSCache(ExpertCache):
    """HybriMoE's Minus Recent Score: ``S ← α·TopP(s) + (1 − α)·S`` per router score vector.

    Before each (step, layer) is served, every token's score vector ``s`` over the layer's E
    experts updates that layer's priorities ``S`` (tokens in order); ``TopP`` keeps the ``p``
    largest scores (ties: lower expert id) and counts the others as 0. The cached expert with
    the lowest ``S`` is evicted; ties: least recently used, then the lowest key.

    Follows HybriMoE ``ktransformers/operators/experts.py``: ``KScoreAwareCache``
    (``update_priority_scores``: ``S ← α·topP + (1−α)·S`` on the top-p, ``(1−α)·S`` elsewhere;
    ``get_expert_to_unload``: ``argmin S`` over the layer's loaded experts, whose dict order is
    least recently used first, as ``get_expert_weights`` re-inserts every hit).

    Special case: with ``alpha=1`` and ``p = top-k``, a layer's ``S`` is its latest token's
    top-k scores and 0 elsewhere. Under ``insertion="protect-step"`` with per-layer slots the
    current step's experts are protected anyway, so every candidate has ``S = 0`` and MRS
    evicts exactly like LRU (when the selected experts are the top-k of the recorded scores,
    as for softmax top-k routers).
    """

    needs_scores = True
    params = frozenset({"alpha", "p", "pairing", "rows"})
    #: Options the compiled kernel implements only at these values (others replay in Python).
    kernel_defaults = {"pairing": "paper", "rows": "all"}
    kernel = _codes.MRS

    def __init__(
        self,
        *args: Any,
        alpha: float = 0.5,
        p: int | Sequence[int] | None = None,
        top_k: Sequence[int] | None = None,
        pairing: str = "paper",
        rows: str = "all",
        **kwargs: Any,
    ) -> None:
        self.alpha = alpha
        self.p = p
        self.top_k = top_k
        self.pairing = pairing
        """``paper`` (eq. 3: each top-p expert gets its own score) or ``published`` (HybriMoE's
        published code: the top-p scores sorted descending are paired with the top-p experts in
        ascending id, so the highest score goes to the lowest id; with it MRS falls below LRU)."""
        self.rows = rows
        """``all`` (every token's score vector updates S) or ``first`` (HybriMoE's code: only row 0
        of a multi-token forward)."""
        super().__init__(*args, **kwargs)

    def _reset_policy(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise MoelabError(f"mrs alpha must lie in (0, 1], got {self.alpha!r}.")
        for name, allowed in (("pairing", ("paper", "published")), ("rows", ("all", "first"))):
            if getattr(self, name) not in allowed:
                raise unknown_name(f"mrs {name}", getattr(self, name), allowed)
        if self.pairing != "paper" or self.rows != "all":
            self.fast = False  # the variants are defined on the reference path only
        self.p_ = mrs_p(self.p, self.top_k, self.num_experts)
        self._score = [0.0] * self.key_offset_[-1]

    def _begin_group(self, layer: int, keys: list[int], scores: Any) -> None:
        if not self.fast:
            return self._begin_group_reference(layer, keys, scores)
        # the reference's arithmetic, on Python floats: the float32 scores as lists (one C call),
        # top-p by a stable descending sort (ties: lower id, as the reference's (-s, e) key),
        # then S <- a*s + (1-a)*S on the top-p and (1-a)*S elsewhere (a*0 + x == x exactly)
        E, off, p = self.num_experts[layer], self.key_offset_[layer], self.p_[layer]
        rows = np.asarray(scores, dtype=np.float32)
        rows = (rows[None, :E] if rows.ndim == 1 else rows[:, :E]).tolist()
        for row in rows:
            t = sum(row)
            if t - t != 0:  # NaN or ±inf somewhere (a sum of finite float32 values is finite)
                raise MoelabError(nan_scores_message(None, layer))
        a = self.alpha
        b = 1 - a
        seg = self._score[off : off + E]
        rng = range(E)
        for row in rows:
            top = sorted(rng, key=row.__getitem__, reverse=True)[:p] if p < E else rng
            new = [b * x for x in seg]
            for e in top:
                new[e] = a * row[e] + b * seg[e]
            seg = new
        self._score[off : off + E] = seg
        return None

    def _begin_group_reference(self, layer: int, keys: list[int], scores: Any) -> None:
        rows = np.atleast_2d(np.asarray(scores, dtype=np.float32))
        E, off, p = self.num_experts[layer], self.key_offset_[layer], self.p_[layer]
        a = self.alpha
        if not np.isfinite(rows[:, :E]).all():
            raise MoelabError(nan_scores_message(None, layer))
        if self.rows == "first":
            rows = rows[:1]
        for s in rows:
            s = [float(x) for x in s[:E]]
            top = sorted(range(E), key=lambda e: (-s[e], e))[:p]
            kept = {e: s[e] for e in top}
            if self.pairing == "published":  # sorted scores onto ascending ids
                kept = dict(zip(sorted(top), (s[e] for e in top)))
            for e in range(E):
                self._score[off + e] = a * kept.get(e, 0.0) + (1 - a) * self._score[off + e]

    def _priority(self, key: int) -> tuple:
        return (self._score[key], self._last_use[key])



def nan_scores_message(row: int | None = None, layer: int | None = None) -> str:
    """The error for router scores with NaN or ±inf, which turn MRS's priorities into NaN."""
    where = f"row {row} of the trace's router scores" if row is not None else f"the router scores of MoE layer {layer}"
    return (
        f"{where} contains NaN or an infinity, on which MRS's priorities are undefined; the model produced "
        "non-finite router scores. "
        "Re-record the trace from a healthy model, or use a policy that does not read scores (lru, lfu, fifo, belady)."
    )


def mrs_p(p: int | Sequence[int] | None, top_k: Sequence[int] | None, num_experts: Sequence[int]) -> list[int]:
    """MRS's ``p`` per layer: given, or ``2 × top_k`` (capped at E)."""
    L = len(num_experts)
    if p is None:
        if top_k is None:
            raise MoelabError("mrs needs p or the model's top_k (p defaults to 2 × top_k).")
        ps = [2 * int(k) for k in top_k]
    elif isinstance(p, (int, np.integer)):
        ps = [int(p)] * L
    else:
        ps = [int(x) for x in p]
    if len(ps) != L or any(x < 1 for x in ps):
        raise MoelabError(f"mrs p must be ≥ 1 for each of the {L} MoE layers, got {p!r}.")
    return [min(x, int(e)) for x, e in zip(ps, num_experts)]


@register_policy("static")
class StaticCache(ExpertCache):
    """Fiddler-style static placement: only the ``pinned`` experts are ever cached.

    ``pinned`` are keys, at most the capacity per partition — by default the most popular
    experts of a profiling stream (``profile``: per-key access counts, see
    :func:`popular_keys`). Pinned experts are loaded on first use (a compulsory miss)
    unless the cache is warmed; other experts always miss and are served without insertion.
    Prefetches are ignored.
    """

    needs_profile = True
    bypasses = True
    accepts_prefetch = False
    params = frozenset({"pinned"})
    kernel = _codes.STATIC

    def __init__(
        self,
        *args: Any,
        pinned: Sequence[int] | None = None,
        profile: np.ndarray | None = None,
        **kwargs: Any,
    ) -> None:
        self.pinned = pinned
        self.profile = profile
        super().__init__(*args, **kwargs)

    def _reset_policy(self) -> None:
        if self.pinned is not None:
            keys = [int(k) for k in self.pinned]
        elif self.profile is not None:
            keys = popular_keys(self.profile, self.num_experts, self.slots_, self.scope)
        else:
            raise MoelabError("static needs pinned keys or a profile (per-key access counts).")
        self.pinned_ = set(keys)

    def _admit(self, key: int) -> bool:
        return key in self.pinned_

    def _admit_prefetch(self, key: int) -> bool:
        return False

    def _priority(self, key: int) -> tuple:
        return (0,)


@register_policy("belady")
class BeladyCache(ExpertCache):
    """Belady's MIN: every miss is inserted, evicting the cached expert used again farthest
    in the future (never used again counts as farthest; ties: the lowest key).

    Offline only: it is built from the whole :class:`AccessStream` (``stream``) and must be
    driven with exactly that stream. Under ``insertion="always"`` (default) a step's hits are
    served first, then its misses in access order, and "next use" counts in groups (one per
    forward and MoE layer), as ProMoE's ``CachePolicyMIN`` (``cache.cpp``: ``use_times`` per
    (layer, token); ``access_on_hit``/``access_on_miss`` set the priority to minus the next
    use time; ``CacheMngr::miss`` always inserts, evicting the heap's farthest). With one
    expert per step it is the most hits any schedule that inserts every miss can get; with
    several it is close to but not always that optimum (see the module docstring):
    ``belady-bypass`` is the bound. Under ``insertion="protect-step"`` it replays access by
    access in stream order (positions as time) and may evict an expert its step already used.
    """

    needs_future = True
    accepts_prefetch = False
    params = frozenset({"oracle_scope"})
    kernel = _codes.BELADY

    def __init__(self, *args: Any, stream: AccessStream | None = None, oracle_scope: str = "stream",
                 **kwargs: Any) -> None:
        if stream is None:
            raise MoelabError(f"{self.name} reads the future: build it with stream=<AccessStream> (offline only).")
        self.stream = stream
        self.scope_future = oracle_scope
        """``stream`` (default: the whole replay's future) or ``sequence`` (ProMoE's MIN oracle: only
        the current sequence's future)."""
        super().__init__(*args, **kwargs)

    def _reset_policy(self) -> None:
        unit = "group" if self.insertion == "always" else "access"
        self._nxt, first, self._never = belady_future(self.stream, unit, self.scope_future)
        self._next = first.tolist()  # per key: when it is needed next, from now
        self._pos = 0
        self._allowed: set[int] | None = None

    def access(self, layer: int, experts: Sequence[int], scores: Any = None,
               admit: Collection[int] | None = None) -> list[bool]:
        keys = [self.key(layer, e) for e in experts]
        self._allowed = None if admit is None else {self.key_offset_[layer] + int(e) for e in admit}
        got = self.stream.keys[self._pos : self._pos + len(keys)].tolist()
        if got != keys:
            raise MoelabError(
                f"{self.name} must replay its own stream: access #{self._pos} is {got}, called with {keys}."
            )
        at = list(range(self._pos, self._pos + len(keys)))
        self._pos += len(keys)
        if self.insertion == "protect-step":  # access by access, nothing protected
            return [self._serve(layer, key, i) for key, i in zip(keys, at)]
        out = [key in self._resident[self._partition(key)] for key in keys]
        for key, i, hit in zip(keys, at, out):  # hits first
            if hit:
                self._serve(layer, key, i)
        for key, i, hit in zip(keys, at, out):  # then the misses, in access order
            if not hit:
                self._serve(layer, key, i)
        return out

    def _serve(self, layer: int, key: int, i: int) -> bool:
        self._clock += 1
        hit = self._count(layer, key)
        self._next[key] = int(self._nxt[i])  # next use after this access
        allowed = self._allowed is None or key in self._allowed
        if not hit and allowed and self._admit(key) and self._make_room(self._partition(key), set(), key):
            self._store(key, speculative=False)
        self._last_use[key] = self._clock
        return hit

    def _admit(self, key: int) -> bool:
        return not self.bypasses or self._next[key] < self._never

    def _replace(self, key: int, victim: int) -> bool:
        return not self.bypasses or self._next[key] < self._next[victim]

    def _rank(self, key: int) -> tuple:
        return (1, -self._next[key], key)

    def _priority(self, key: int) -> tuple:
        return (-self._next[key],)


@register_policy("belady-bypass")
class BeladyBypassCache(BeladyCache):
    """The bypassing optimum: Belady's MIN, except that a missed expert is not inserted when
    it is used again no sooner than every cached expert (or never).

    Under ``insertion="always"`` it keeps, after each step, the cached experts and misses with
    the nearest next uses (at most the capacity): the most hits of any schedule whose step's
    cached experts are hits and whose misses may each be inserted or not, so it bounds every
    policy here under either insertion rule, ``static`` and ``belady`` included. With
    ``insertion="protect-step"`` it is moelab's earlier ``belady`` (access-by-access optimum).
    """

    bypasses = True
    params = frozenset({"oracle_scope"})
    kernel = _codes.BELADY


def popular_keys(
    counts: np.ndarray, num_experts: Sequence[int], slots: np.ndarray, scope: Scope
) -> list[int]:
    """The ``slots`` most-accessed keys of each partition, least popular first.

    ``counts`` is (num_keys,) access counts (e.g. ``np.bincount(stream.keys)``); ties go to
    the lower key. Used for ``static``'s pinned set and for warming caches.
    """
    counts = np.asarray(counts)
    off = np.concatenate([[0], np.cumsum(num_experts)]).astype(int)
    parts = [range(off[i], off[i + 1]) for i in range(len(num_experts))] if scope == "layer" else [range(0, off[-1])]
    out: list[int] = []
    for part, c in zip(parts, slots):
        ranked = sorted(part, key=lambda k: (-counts[k], k))[: int(c)]
        out.extend(reversed(ranked))
    return out


def make_cache(
    policy: str | type[ExpertCache],
    num_experts: Sequence[int],
    capacity: float | int,
    scope: Scope = "layer",
    **kwargs: Any,
) -> ExpertCache:
    """Build an online cache by policy name, e.g. ``make_cache("lru", [8] * 4, 0.25)``.

    Extra keyword arguments go to the policy (``alpha``, ``p``, ``top_k`` for ``mrs``;
    ``profile``/``pinned`` for ``static``; ``stream`` for ``belady``/``belady-bypass``; ``warm``,
    ``expert_bytes``, ``insertion``).
    """
    from moelab.caches.base import get_policy

    resolve_capacity(capacity, num_experts, scope)
    return get_policy(policy)(num_experts, capacity, scope, **kwargs)
