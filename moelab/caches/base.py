"""The expert-cache interface: one small base class, one subclass per policy, a registry.

An :class:`ExpertCache` is used the same way online (a running model calls
:meth:`ExpertCache.access` once per MoE layer per step) and offline
(:func:`moelab.caches.simulation` replays a trace's access stream through it, or through the
equivalent compiled kernel). This pure-Python class is also the *reference* every fast path
is tested against, so it is written for reading, not speed.

Semantics (every policy follows them; see also :mod:`moelab.caches.stream`):

* Each MoE layer has its own slots (``scope="layer"``) or all layers share one pool
  (``scope="global"``). Capacity counts routed experts only; shared experts are always
  resident and not counted.
* :meth:`access` takes the experts one (forward, layer) needs, in access order. What happens
  on a miss is the cache's ``insertion`` rule:

  - ``"always"`` (default; the rule of the published offloading runtimes): the experts
    already cached are served first (hits, updating recency and frequency in access order),
    then every miss is inserted in access order, and its victim may be *any* resident expert,
    one this step just used or just inserted included (not the incoming one: it is not
    resident yet). Peers: mixtral-offloading ``src/expert_cache.py``
    (``ExpertCache.load_experts`` with ``unordered=True`` yields on-device experts first;
    ``EvictionGroupInfo.choose_expert_to_evict`` returns the least recently used of all
    on-device experts; ``swap`` inserts every offloaded one); HybriMoE
    ``ktransformers/operators/experts.py`` (``KExpertsCache.get_expert_place`` /
    ``get_experts_weights`` serve loaded experts first, ``load_expert_weights`` evicts
    ``KScoreAwareCache.get_expert_to_unload``, the lowest score among all loaded experts of
    the layer); ProMoE's ``cache.cpp`` (``CacheMngr::miss`` always inserts, evicting
    ``policy->select_for_evict`` among the resident experts).
  - ``"protect-step"`` (moelab's earlier rule): experts are served in access order, and a
    miss may only evict a cached expert the current (step, layer) does **not** need; with no
    such victim the miss is served without insertion. At capacity ≤ top-k this makes LRU,
    LFU, FIFO and MRS identical.

  Either way a policy may decline to insert (``static`` outside its pinned set,
  ``belady-bypass``): such policies say so with ``bypasses = True``.
* Victim order is the policy's rank, smallest first: ``(speculative?, *priority, key)``,
  i.e. unused prefetched experts go first, then the policy's own priority, then the lowest
  (layer, expert) key. Every tie is thereby broken deterministically.
* :meth:`prefetch` inserts experts proposed by a predictor as *speculative* (low priority,
  evicted first while unused); a later demand access to one is a prefetch hit and turns it
  into an ordinary entry. Demand needs always win (ProMoE's early preemption). Prefetches of
  one batch never evict each other.
* Caches start empty unless ``warm`` gives initial contents.

Capabilities are class attributes, read by :func:`moelab.caches.simulate` and the CLI instead
of policy names: ``needs_scores`` (router score vectors), ``needs_future`` (built from the
whole stream; offline only), ``needs_profile`` (per-key access counts), ``bypasses`` (may
serve a miss without inserting it), ``accepts_prefetch`` (sweeps pair it with prefetch
settings), ``params`` (the keyword parameters it takes) and ``kernel`` (the compiled kernel's
policy code, or None: replayed by the reference class).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar, Literal

import numpy as np

from moelab.errors import MoelabError, unknown_name
from moelab.registry import Registry

logger = logging.getLogger(__name__)

Scope = Literal["layer", "global"]
SCOPES: tuple[str, ...] = ("layer", "global")
Insertion = Literal["always", "protect-step"]
INSERTIONS: tuple[str, ...] = ("always", "protect-step")


def check_insertion(insertion: str) -> str:
    """``insertion`` if it names a rule, else a clear error with the choices."""
    if insertion not in INSERTIONS:
        raise unknown_name("cache insertion rule", insertion, INSERTIONS)
    return insertion


def resolve_capacity(capacity: float | int, num_experts: Sequence[int], scope: Scope) -> np.ndarray:
    """Slots per partition: one entry per MoE layer (``layer`` scope) or one (``global``).

    ``capacity`` is a fraction of the experts in a partition when it is a float in (0, 1]
    (rounded to the nearest count, at least 1), or a count of experts when it is an int ≥ 1.
    """
    if scope not in SCOPES:
        raise unknown_name("cache scope", scope, SCOPES)
    sizes = np.asarray(num_experts, dtype=np.int64)
    if scope == "global":
        sizes = np.array([sizes.sum()], dtype=np.int64)
    what = "experts per MoE layer" if scope == "layer" else "experts in all MoE layers"
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float, np.integer, np.floating)):
        raise MoelabError(f"capacity must be a fraction in (0, 1] or a count ≥ 1, got {capacity!r}.")
    if isinstance(capacity, (float, np.floating)):
        if not 0.0 < capacity <= 1.0:
            raise MoelabError(
                f"capacity {capacity!r} as a fraction must lie in (0, 1]; pass an int for a count "
                f"of experts (there are {sizes.min()}..{sizes.max()} {what})."
            )
        return np.maximum(1, np.floor(capacity * sizes + 0.5)).astype(np.int64)
    capacity = int(capacity)
    if capacity <= 0:
        raise MoelabError(f"capacity must be ≥ 1 expert (or a fraction in (0, 1]), got {capacity}.")
    if capacity > sizes.min():
        raise MoelabError(
            f"capacity {capacity} is above the number of {what} ({sizes.min()}); "
            f"use at most {sizes.min()}, or a fraction such as 0.25."
        )
    return np.full(len(sizes), capacity, dtype=np.int64)


def check_expert_bytes(expert_bytes) -> int:
    """``expert_bytes`` as a positive int; a clear error for anything else (negative sizes
    would report negative traffic)."""
    if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, (int, np.integer)) or expert_bytes < 1:
        raise MoelabError(
            f"expert_bytes={expert_bytes!r}: expected the size of one expert in bytes, an integer ≥ 1 "
            "(leave it unset to use the size recorded in the trace, or count experts)."
        )
    return int(expert_bytes)


class ExpertCache:
    """Base class of all expert caches. Subclasses implement :meth:`_priority` (and hooks).

    Args:
        num_experts: routed experts per MoE layer.
        capacity: a fraction of the experts (float in (0, 1]) or a count (int), per partition.
        scope: ``"layer"``: each MoE layer its own slots; ``"global"``: one pool for all.
        expert_bytes: bytes one expert's weights take; ``bytes_moved = transfers × expert_bytes``.
        warm: keys to load before the first access (in order; least important first), or None.
        insertion: ``"always"`` (default: every miss is inserted, its victim may be any
            resident expert) or ``"protect-step"`` (a step's experts never evict each other;
            a miss with no other victim is not inserted). See the module docstring.
    """

    #: Registry name, set by :func:`register_policy`.
    name: ClassVar[str] = ""
    #: True if :meth:`access` needs the router score vectors.
    needs_scores: ClassVar[bool] = False
    #: True if the policy reads the future (offline only; built from a stream).
    needs_future: ClassVar[bool] = False
    #: True if the policy is built from per-key access counts (``profile``).
    needs_profile: ClassVar[bool] = False
    #: True if the policy may serve a miss without inserting it.
    bypasses: ClassVar[bool] = False
    #: False if the policy ignores prefetches (sweeps then run it without prefetch settings).
    accepts_prefetch: ClassVar[bool] = True
    #: Keyword parameters the policy takes besides capacity/scope/warm/expert_bytes/insertion;
    #: None: not checked (user policies).
    params: ClassVar[frozenset[str] | None] = None
    #: Policy code of the compiled kernel (:mod:`moelab.caches._fast`), or None. Read from the
    #: class itself only: a subclass that changes behaviour replays through the reference.
    kernel: ClassVar[int | None] = None
    #: False: serve accesses by the plain reference definitions only (parity tests set it).
    fast: ClassVar[bool] = True
    #: Former name of ``needs_scores``, kept in step with it for code written against it.
    uses_scores: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "uses_scores" in cls.__dict__ and "needs_scores" not in cls.__dict__:
            cls.needs_scores = cls.uses_scores  # a subclass written against the former name
        cls.uses_scores = cls.needs_scores

    def __init__(
        self,
        num_experts: Sequence[int],
        capacity: float | int,
        scope: Scope = "layer",
        expert_bytes: int = 1,
        warm: Sequence[int] | None = None,
        insertion: Insertion = "always",
    ) -> None:
        self.insertion = check_insertion(insertion)
        self.num_experts = [int(e) for e in num_experts]
        self.capacity = capacity
        self.scope = scope
        self.expert_bytes = check_expert_bytes(expert_bytes)
        self.warm = None if warm is None else [int(k) for k in warm]
        self._evicted_log: list[int] | None = None
        self._inserted_log: list[int] | None = None
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Empty the cache (then load ``warm``) and zero the counters."""
        self.slots_ = resolve_capacity(self.capacity, self.num_experts, self.scope)
        self.key_offset_ = np.concatenate([[0], np.cumsum(self.num_experts)]).astype(int).tolist()
        n_keys = self.key_offset_[-1]
        self._key_layer = [ly for ly, e in enumerate(self.num_experts) for _ in range(e)]
        self._resident: list[set[int]] = [set() for _ in self.slots_]
        self._speculative: set[int] = set()
        self._last_use = [0] * n_keys
        self._inserted_at = [0] * n_keys
        self._clock = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.transfers = 0
        self.prefetched = 0
        self.prefetch_hits = 0
        self._wasted_evicted = 0
        self.layer_hits = [0] * len(self.num_experts)
        self.layer_misses = [0] * len(self.num_experts)
        cls = type(self)
        # the streamlined access inlines _count (and skips the no-op _on_access): only for
        # classes that keep the base definitions of both, under the "always" rule
        self._fast_ok = bool(cls.fast) and self.insertion == "always" and cls._count is ExpertCache._count
        self._has_on_access = cls._on_access is not ExpertCache._on_access
        self._has_on_evict = cls._on_evict is not ExpertCache._on_evict
        self._has_replace = cls._replace is not ExpertCache._replace  # the base's always agrees
        self._plain_admit = cls._admit_prefetch is ExpertCache._admit_prefetch and cls._admit is ExpertCache._admit
        self._reset_policy()
        for key in self.warm or []:  # initial contents: not misses, not transfers
            part = self._partition(key)
            if len(self._resident[part]) < self.slots_[part]:
                self._clock += 1
                self._store(key, speculative=False)
        self.transfers = 0

    def _reset_policy(self) -> None:
        """Hook: (re)initialise the policy's own state."""

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def bytes_moved(self) -> int:
        return self.transfers * self.expert_bytes

    @property
    def wasted_prefetches(self) -> int:
        """Prefetched experts evicted before any use, plus those still unused now."""
        return self._wasted_evicted + len(self._speculative)

    def contents(self, layer: int | None = None) -> list[int] | dict[int, list[int]]:
        """Cached expert ids of ``layer`` (sorted), or ``{layer: ids}`` for all layers."""
        if layer is None:
            return {ly: self.contents(ly) for ly in range(len(self.num_experts))}
        self._check_layer(layer)
        off = self.key_offset_[layer]
        return sorted(
            k - off for part in self._resident for k in part if self._key_layer[k] == layer
        )

    def partition_keys(self, layer: int) -> set[int]:
        """A copy of the keys cached in ``layer``'s partition (its own slots, or the global pool):
        what an insertion into ``layer`` can evict. O(slots), for per-step bookkeeping."""
        return set(self._resident[self._key_layer[self.key_offset_[layer]] if self.scope == "layer" else 0])

    def journal(self, evicted: list[int] | None, inserted: list[int] | None) -> None:
        """Append every key this cache evicts to ``evicted`` and every key it inserts (demand
        or prefetch, in order) to ``inserted`` from now on (None: stop). The caller owns and
        clears the lists: a planner reads what one access or prefetch changed without copying
        the resident set before and after it (:meth:`partition_keys`)."""
        self._evicted_log, self._inserted_log = evicted, inserted

    @property
    def speculative(self) -> set[int]:
        """Keys of the prefetched experts no demand access has used yet (read-only view)."""
        return self._speculative

    def is_resident(self, key: int) -> bool:
        """Whether the expert of global ``key`` is cached now."""
        return key in self._resident[self._partition(key)]

    def layer_expert(self, key: int) -> tuple[int, int]:
        """``(MoE layer, expert)`` of a global key (the inverse of :meth:`key`)."""
        layer = self._key_layer[key]
        return layer, int(key - self.key_offset_[layer])

    def resident_keys(self) -> np.ndarray:
        """(num_keys,) bool: which keys are cached now."""
        out = np.zeros(self.key_offset_[-1], dtype=bool)
        for part in self._resident:
            out[list(part)] = True
        return out

    def eviction_order(self) -> list[int]:
        """The cached keys, the next victim first (the policy's order now): a warm start's order
        for another cache of this policy (``warm`` takes keys least important first)."""
        return sorted((k for part in self._resident for k in part), key=self._rank)

    def key(self, layer: int, expert: int) -> int:
        """The global key of ``expert`` in MoE layer ``layer``."""
        self._check_layer(layer)
        if not 0 <= expert < self.num_experts[layer]:
            raise MoelabError(f"expert {expert} out of range for MoE layer {layer} (E = {self.num_experts[layer]}).")
        return self.key_offset_[layer] + int(expert)

    def _check_layer(self, layer: int) -> None:
        n = len(self.num_experts)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
            raise MoelabError(
                f"MoE layer {layer!r} out of range: this cache has {n} MoE layers (ordinals 0..{n - 1}); "
                "pass the MoE layer's ordinal, not its decoder-layer index."
            )

    def _partition(self, key: int) -> int:
        return self._key_layer[key] if self.scope == "layer" else 0

    # ------------------------------------------------------------------ online API
    def access(self, layer: int, experts: Sequence[int], scores: Any = None,
               admit: Collection[int] | None = None) -> list[bool]:
        """Serve the experts one (forward, MoE layer) needs; returns hit/miss per expert.

        ``experts`` are in access order (descending router weight) and distinct; ``scores``
        is the router score vector (E,) of the step's token, or (tokens, E) for several
        tokens — needed only by score-aware policies (``mrs``). For a batch's (T, K) router
        output use :func:`moelab.caches.online.access_forward`. ``admit``: the experts a miss
        may be inserted for (None: every miss, the cache simulation's rule); the hybrid planner
        passes the misses its placement runs on the device, so a miss computed on the host is
        counted, and seen by the policy's statistics, but not copied in (admission follows
        placement).

        Under ``insertion="always"`` this runs a streamlined copy of :meth:`_access_reference`
        (the plain definition; a class with ``fast = False`` uses it): the same decisions,
        counters and hook calls in the same order, with the per-access method calls and key
        checks inlined (tests/test_caches_fast_path.py checks they agree on random streams).
        """
        if not self._fast_ok:
            return self._access_reference(layer, experts, scores, admit)
        nums = self.num_experts
        if type(layer) is not int or not 0 <= layer < len(nums):
            return self._access_reference(layer, experts, scores, admit)  # raises the reference's error
        off, E = self.key_offset_[layer], nums[layer]
        keys = []
        for e in experts:
            if type(e) is not int or not 0 <= e < E:
                return self._access_reference(layer, experts, scores, admit)
            keys.append(off + e)
        if len(set(keys)) != len(keys) or (self.needs_scores and scores is None):
            return self._access_reference(layer, experts, scores, admit)
        self._begin_group(layer, keys, scores)
        part = layer if self.scope == "layer" else 0
        res = self._resident[part]
        out = [k in res for k in keys]
        last = self._last_use
        on_access = self._on_access if self._has_on_access else None
        clock = self._clock
        nhit = 0
        spec = self._speculative
        for k, hit in zip(keys, out):  # hits first, in access order
            if hit:
                clock += 1
                nhit += 1
                if k in spec:
                    spec.discard(k)
                    self.prefetch_hits += 1
                last[k] = clock
                if on_access is not None:
                    self._clock = clock
                    on_access(k)
        self.hits += nhit
        self.layer_hits[layer] += nhit
        nmiss = len(keys) - nhit
        if nmiss:
            self.misses += nmiss
            self.layer_misses[layer] += nmiss
            admit_key = self._admit
            for k, hit in zip(keys, out):  # then every miss, in access order
                if not hit:
                    clock += 1
                    self._clock = clock
                    if (admit is None or k - off in admit) and admit_key(k) and self._make_room(part, _NOTHING, k):
                        self._store(k, speculative=False)
                    last[k] = clock
                    if on_access is not None:
                        on_access(k)
        self._clock = clock
        return out

    def _access_reference(self, layer: int, experts: Sequence[int], scores: Any = None,
                          admit: Collection[int] | None = None) -> list[bool]:
        """Serve the experts one (forward, MoE layer) needs; returns hit/miss per expert.

        ``experts`` are in access order (descending router weight) and distinct; ``scores``
        is the router score vector (E,) of the step's token, or (tokens, E) for several
        tokens — needed only by score-aware policies (``mrs``). For a batch's (T, K) router
        output use :func:`moelab.caches.online.access_forward`. ``admit``: the experts a miss
        may be inserted for (None: all).
        """
        keys = self._keys(layer, experts, scores)
        off = self.key_offset_[layer]
        allowed = (lambda key: True) if admit is None else (lambda key: key - off in admit)
        self._begin_group(layer, keys, scores)
        if self.insertion == "protect-step":
            needed = set(keys)
            out = []
            for key in keys:
                self._clock += 1
                hit = self._count(layer, key)
                if not hit and allowed(key) and self._admit(key) and self._make_room(self._partition(key), needed, key):
                    self._store(key, speculative=False)
                out.append(hit)
                self._last_use[key] = self._clock
                self._on_access(key)
            return out
        out = [key in self._resident[self._partition(key)] for key in keys]
        for key, hit in zip(keys, out):  # hits first, in access order
            if hit:
                self._clock += 1
                self._count(layer, key)
                self._last_use[key] = self._clock
                self._on_access(key)
        for key, hit in zip(keys, out):  # then every miss, in access order
            if not hit:
                self._clock += 1
                self._count(layer, key)
                if allowed(key) and self._admit(key) and self._make_room(self._partition(key), set(), key):
                    self._store(key, speculative=False)
                self._last_use[key] = self._clock
                self._on_access(key)
        return out

    def _keys(self, layer: int, experts: Sequence[int], scores: Any) -> list[int]:
        keys = [self.key(layer, e) for e in experts]
        if len(set(keys)) != len(keys):
            raise MoelabError(f"experts of one step must be distinct, got {list(experts)}.")
        if self.needs_scores and scores is None:
            raise MoelabError(f"policy {self.name!r} needs the router scores of each step.")
        return keys

    def prefetch(self, layer: int, experts: Sequence[int], budget: int | None = None) -> int:
        """Insert predicted experts of ``layer`` as speculative entries; returns how many moved.

        Experts already cached are skipped; at most ``budget`` transfers (None: no limit).
        Prefetches never evict an expert of the same batch.
        """
        self._check_layer(layer)
        off, E = self.key_offset_[layer], self.num_experts[layer]
        for e in experts:
            if not 0 <= e < E:
                self.key(layer, e)  # raises the error naming the expert
        keys = list(dict.fromkeys([off + int(e) for e in experts]))
        part = self._partition(off)  # every key of one layer lies in the same partition
        res = self._resident[part]
        # the batch's keys are never evicted by the batch, and distinct: those cached now stay
        # cached and are skipped, the others are not cached by an earlier one of the batch
        new = [k for k in keys if k not in res]
        if not new:
            return 0
        batch = set(keys)
        moved = 0
        admit = None if self._plain_admit else self._admit_prefetch
        for key in new:
            if budget is not None and moved >= budget:
                break
            if (admit is not None and not admit(key)) or not self._make_room(part, batch, key):
                continue
            self._clock += 1
            self._store(key, speculative=True)
            self.prefetched += 1
            moved += 1
        return moved

    # ------------------------------------------------------------------ mechanics
    def _count(self, layer: int, key: int) -> bool:
        """Count a demand access of ``key`` as a hit or a miss; True on a hit."""
        if key in self._resident[self._partition(key)]:
            self.hits += 1
            self.layer_hits[layer] += 1
            if key in self._speculative:
                self._speculative.discard(key)
                self.prefetch_hits += 1
            return True
        self.misses += 1
        self.layer_misses[layer] += 1
        return False

    def _make_room(self, part: int, protected: set[int], key: int) -> bool:
        """Evict the policy's victim if ``part`` is full; False if ``key`` must bypass."""
        if len(self._resident[part]) < self.slots_[part]:
            return True
        candidates = self._resident[part].difference(protected) if protected else self._resident[part]
        if not candidates:
            return False
        victim = min(candidates, key=self._rank)
        if self._has_replace and not self._replace(key, victim):
            return False
        self._resident[part].discard(victim)
        self.evictions += 1
        if self._evicted_log is not None:
            self._evicted_log.append(victim)
        if victim in self._speculative:
            self._speculative.discard(victim)
            self._wasted_evicted += 1
        if self._has_on_evict:
            self._on_evict(victim)
        return True

    def _store(self, key: int, speculative: bool) -> None:
        self._resident[self._partition(key)].add(key)
        if self._inserted_log is not None:
            self._inserted_log.append(key)
        self._inserted_at[key] = self._clock
        self._last_use[key] = self._clock
        self.transfers += 1
        if speculative:
            self._speculative.add(key)

    def _rank(self, key: int) -> tuple:
        """Victim order (smallest goes first): unused prefetches, then the policy priority.

        With :meth:`_priority`, the reference definition of eviction; its one compiled
        counterpart, for every built-in policy, is :mod:`moelab.caches._fast` (tested equal)."""
        return (0 if key in self._speculative else 1, *self._priority(key), key)

    # ------------------------------------------------------------------ policy hooks
    def _priority(self, key: int) -> tuple:
        """The policy's eviction priority of a cached key: the smallest is evicted first."""
        raise NotImplementedError

    def _begin_group(self, layer: int, keys: list[int], scores: Any) -> None:
        """Hook called before a (step, layer)'s accesses (MRS updates its scores here)."""

    def _on_access(self, key: int) -> None:
        """Hook called after every demand access (hit or miss)."""

    def _on_evict(self, key: int) -> None:
        """Hook called when ``key`` leaves the cache."""

    def _admit(self, key: int) -> bool:
        """Whether a missed ``key`` may be inserted at all (policies with ``bypasses``)."""
        return True

    def _admit_prefetch(self, key: int) -> bool:
        return self._admit(key)

    def _replace(self, key: int, victim: int) -> bool:
        """Whether inserting ``key`` is worth evicting ``victim`` (a bypassing optimum)."""
        return True


#: The empty protected set of the "always" rule (never modified).
_NOTHING: frozenset[int] = frozenset()


# ---------------------------------------------------------------------- registry
def _load_builtins() -> None:
    import moelab.caches.policies  # noqa: F401  (registers the built-in policies)


#: Cache policies by name (``ExpertCache`` subclasses); the built-ins register on first lookup.
POLICIES: Registry[type[ExpertCache]] = Registry("cache policy", base=ExpertCache, loader=_load_builtins)


def register_policy(name: str, *, overwrite: bool = False) -> Callable[[type[ExpertCache]], type[ExpertCache]]:
    """Class decorator: make a cache policy available by ``name`` (user policies too).

    A different class under a registered name raises (naming both places) unless ``overwrite=True``.
    """
    return POLICIES.class_decorator(name, attr="name", overwrite=overwrite, stacklevel=2)


def available_policies() -> list[str]:
    """Registered policy names."""
    return sorted(POLICIES.names())


def get_policy(name: str | type[ExpertCache]) -> type[ExpertCache]:
    """The cache class registered as ``name`` (classes pass through)."""
    if isinstance(name, type) and issubclass(name, ExpertCache):
        return name
    return POLICIES.get(name)
