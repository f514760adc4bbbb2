"""Recipe: add a cache policy (evict the most recently used expert) and replay it."""

from moelab.caches import ExpertCache, make_cache, register_policy, simulate
from moelab.caches.stream import stream_from_groups


@register_policy("mru")
class MRUCache(ExpertCache):
    """Most recently used first: keeps part of a cyclic scan that does not fit the cache."""

    params = frozenset()  # the keyword parameters the policy takes (none); needs_scores etc. stay False

    def _priority(self, key: int) -> tuple:
        # the victim is the resident expert with the smallest priority; _last_use is the base
        # class's clock of each key's last access (hits, insertions)
        return (-self._last_use[key],)


# Online, as a running model calls it: one MoE layer of 4 experts, 2 slots, one expert per step.
cache = make_cache("mru", num_experts=[4], capacity=2)
online = [cache.access(0, [e])[0] for e in [0, 1, 2, 0, 1, 2]]
print("online hits:", online, "resident:", cache.contents(0))

# Offline, over an access stream (here written by hand; usually a recorded trace's):
# 3 experts visited in a cycle, 20 times, through 2 slots.
stream = stream_from_groups([(0, [e]) for e in [0, 1, 2] * 20], num_experts=[4])
hit_rate = {p: simulate(stream, p, capacity=2).hit_rate for p in ("lru", "mru", "belady")}
print("hit rate on a cyclic scan:", hit_rate)  # LRU always evicts what comes next: 0 hits
