"""Expert caches: LRU, LFU, FIFO, static, MRS and the Belady bounds, offline and online.

Offline::

    from moelab.caches import simulate, sweep
    r = simulate("traces/run1", "mrs", capacity=0.25, scope="layer")
    r.hit_rate, r.layer_hit_rate, r.bytes_moved

Online (a runtime calls it once per MoE layer per forward)::

    cache = make_cache("lru", num_experts=[8] * 4, capacity=0.25)
    hits = access_forward(cache, layer, topk_ids, topk_weights, valid)   # (T, K) tensors
    hits = cache.access(layer, experts)          # or: experts in descending router weight

Semantics: :mod:`moelab.caches.stream` and :mod:`moelab.caches.base`.
"""

from __future__ import annotations

from moelab._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "ExpertCache": "moelab.caches.base",
    "POLICIES": "moelab.caches.base",
    "register_policy": "moelab.caches.base",
    "get_policy": "moelab.caches.base",
    "available_policies": "moelab.caches.base",
    "resolve_capacity": "moelab.caches.base",
    "make_cache": "moelab.caches.policies",
    "LRUCache": "moelab.caches.policies",
    "LFUCache": "moelab.caches.policies",
    "FIFOCache": "moelab.caches.policies",
    "StaticCache": "moelab.caches.policies",
    "MRSCache": "moelab.caches.policies",
    "BeladyCache": "moelab.caches.policies",
    "BeladyBypassCache": "moelab.caches.policies",
    "access_forward": "moelab.caches.online",
    "ordered_union": "moelab.caches.stream",
    "INSERTIONS": "moelab.caches.base",
    "AccessStream": "moelab.caches.stream",
    "build_stream": "moelab.caches.stream",
    "stream_from_groups": "moelab.caches.stream",
    "synthetic_stream": "moelab.caches.synthetic",
    "simulate": "moelab.caches.simulation",
    "sweep": "moelab.caches.simulation",
    "load_stream": "moelab.caches.simulation",
    "expert_bytes_of": "moelab.timing.experts",
    "PrefetchConfig": "moelab.caches.simulation",
    "Prefetcher": "moelab.predictors.protocol",
    "get_prefetcher": "moelab.caches.prefetch",
    "PredictContext": "moelab.predictors.protocol",
    "CacheResult": "moelab.caches.results",
    "CacheSweep": "moelab.caches.results",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
