"""Independent replays of the peers' published cache code agree with ``moelab.caches.simulate``.

Each function below re-implements, in plain Python and apart from moelab's code, the cache
update of one published system, following the file named in its docstring (read at the
commit the docstring gives). They replay the same access streams as moelab (one group per
forward and MoE layer, per-layer slots, caches starting empty) and must give the same hits
as moelab's default semantics (``insertion="always"``). What the peers leave open (the order
in which ProMoE's engine calls ``CacheMngr::access`` within a layer, MIN's ties) is stated
where it is chosen.
"""

from collections import OrderedDict

import numpy as np
import pytest
import torch

from moelab.caches import simulate
from moelab.caches.simulation import load_stream
from moelab.caches.synthetic import synthetic_stream


def _groups(stream):
    """[(layer, [expert ids in access order], scores (tokens, E) or None), ...]."""
    return [
        (int(stream.group_layer[g]), stream.group_experts(g).tolist(), stream.group_scores(g))
        for g in range(stream.num_groups)
    ]


def mixtral_offloading_lru(groups, cap):
    """dvmazur/mixtral-offloading ``src/expert_cache.py`` (commit 0d3c605): ``ExpertCache.load_experts``
    with ``unordered=True`` sorts the uids so that on-device experts come first, calls
    ``EvictionGroupInfo.mark_used`` on every uid (a hit moves to the end of ``main_infos``, an
    OrderedDict from least to most recently used), then swaps each offloaded expert in for
    ``choose_expert_to_evict()`` (the first, least recently used, entry of ``main_infos``);
    ``swap`` moves the loaded expert to the end. One eviction group per MoE layer. (The
    original starts with every slot filled; here slots start empty and fill before evicting.)"""
    main: dict[int, OrderedDict] = {}
    hits = 0
    for layer, uids, _ in groups:
        m = main.setdefault(layer, OrderedDict())
        uids = sorted(uids, key=lambda u: u not in m)  # unordered=True: on-device first, stable
        for u in uids:  # mark_used
            if u in m:
                m.move_to_end(u)
                hits += 1
        for u in [u for u in uids if u not in m]:  # the offloaded ones, in order
            if len(m) >= cap:
                m.pop(next(iter(m)))  # choose_expert_to_evict: least recently used
            m[u] = None  # swap: loaded, moved to the end
    return hits


def promoe_lru(groups, cap):
    """ProMoE ``cache.cpp`` (``CacheMngr::access``/``hit``/``miss``, ``CachePolicyLRU``): a hit
    calls ``access_on_hit`` (the node moves to the back of the list); a miss takes a free slot
    or evicts ``select_for_evict`` (the front of the list) and calls ``access_on_miss`` (push
    back). Per-layer slots (``SlotMapperPerLayer``). The order of ``access`` calls within a
    layer is the engine's, not in ``cache.cpp``: cached experts first, as mixtral-offloading."""
    lists: dict[int, list[int]] = {}
    hits = 0
    for layer, experts, _ in groups:
        lst = lists.setdefault(layer, [])
        cached = [e for e in experts if e in lst]
        for e in cached + [e for e in experts if e not in lst]:
            if e in lst:  # hit
                lst.remove(e)
                lst.append(e)
                hits += 1
            else:  # miss
                if len(lst) >= cap:
                    lst.pop(0)
                lst.append(e)
    return hits


def promoe_min(groups, cap):
    """ProMoE ``cache.cpp`` ``CachePolicyMIN`` with ``CacheOracle``: every expert's use times
    are the (layer, token) time steps it is used at (time advances once per layer per token,
    i.e. once per group here), plus +inf; ``access_on_hit``/``access_on_miss`` advance the
    expert's pointer and set its priority to minus its next use time; ``CacheMngr::miss``
    always inserts, evicting the heap's top (the farthest next use). Heap ties are left to
    the heap; here: the lowest expert id. Access order within a layer: cached first."""
    uses: dict[tuple[int, int], list[int]] = {}
    for t, (layer, experts, _) in enumerate(groups):
        for e in experts:
            uses.setdefault((layer, e), []).append(t)
    ptr = {k: 0 for k in uses}

    def next_use(k):
        u = uses[k]
        return u[ptr[k]] if ptr[k] < len(u) else float("inf")

    cache: dict[int, set] = {}
    hits = 0
    for layer, experts, _ in groups:
        c = cache.setdefault(layer, set())
        order = [e for e in experts if e in c] + [e for e in experts if e not in c]
        for e in order:
            k = (layer, e)
            ptr[k] += 1  # this use is consumed; the priority is minus the next one
            if e in c:
                hits += 1
                continue
            if len(c) >= cap:
                victim = max(c, key=lambda x: (next_use((layer, x)), -x))
                c.remove(victim)
            c.add(e)
    return hits


def hybrimoe_mrs(groups, cap, alpha, p):
    """PKU-SEC-Lab/HybriMoE ``ktransformers/operators/experts.py`` (commit 0f6e78b):
    ``KScoreAwareCache.update_priority_scores`` (called by the MoE gate before the experts):
    ``S ← α·s + (1−α)·S`` on the top-p scores of the (first) token, ``S ← (1−α)·S``
    elsewhere; ``KExpertsCache.get_experts_weights`` serves the loaded experts first
    (``load_idxs + unload_idxs``), ``get_expert_weights`` re-inserts a hit at the end of the
    layer's ``loaded_experts_idx`` dict, and ``load_expert_weights`` evicts
    ``get_expert_to_unload``: ``argmin S`` over that dict's keys (the first minimum, i.e. the
    least recently used on ties). Decode steps of batch 1 (one score row per group)."""
    loaded: dict[int, dict] = {}
    S: dict[int, list[float]] = {}
    hits = 0
    for layer, experts, scores in groups:
        s = [float(x) for x in np.asarray(scores)[0]]
        E = len(s)
        pri = S.setdefault(layer, [0.0] * E)
        top = set(sorted(range(E), key=lambda e: (-s[e], e))[:p])
        for e in range(E):
            pri[e] = alpha * s[e] + (1 - alpha) * pri[e] if e in top else (1 - alpha) * pri[e]
        d = loaded.setdefault(layer, {})
        for e in [e for e in experts if e in d] + [e for e in experts if e not in d]:
            if e in d:
                d[e] = d.pop(e)
                hits += 1
                continue
            if len(d) >= cap:
                keys = list(d)
                victim = keys[int(np.argmin([pri[k] for k in keys]))]
                d.pop(victim)
            d[e] = None
    return hits


def moe_lrc_lru_hit_counts(groups, num_experts, layer):
    """ljcleo/moe-lrc ``src/50_chr_calc.py`` ``calc_lru`` (one MoE layer's top-k sequence):
    an LRU stack; every expert of a token is looked up in the stack as it was before the token
    (``stat[depth] += 1``), then the token's experts move to the top in order. A first use
    while fewer than ``E`` experts have been seen counts at depth ``uni`` (the cache still has
    room). Returns hits at every capacity 1..E (the cumulative sum, not divided by n)."""
    stack: list[int] = []  # most recent first
    stat = [0] * num_experts
    uni = 0
    for ly, experts, _ in groups:
        if ly != layer:
            continue
        for e in experts:
            if e in stack:
                stat[stack.index(e)] += 1
            elif uni < num_experts:
                stat[uni] += 1
                uni += 1
        for e in experts:
            if e in stack:
                stack.remove(e)
            stack.insert(0, e)
    return np.cumsum(stat), uni


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """Batch-1 traces of two tiny random models (top-2 of 8 and top-4 of 8 experts)."""
    import moelab
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    out = {}
    for family in ["mixtral", "qwen2_moe"]:
        model = build_tiny(family, seed=0)
        d = tmp_path_factory.mktemp("trace") / family
        with torch.no_grad(), moelab.record(model, d):
            for prompt in ["expert caches", "route me", "the literature's rule"]:
                enc = tok([prompt], return_tensors="pt")
                model.generate(**enc, max_new_tokens=20, do_sample=False, pad_token_id=tok.pad_token_id)
        out[family] = moelab.open_trace(d)
    return out


def _streams(traces):
    for family, tr in traces.items():
        yield family, load_stream(tr)
    # One sequence: batch-1 decode steps (HybriMoE's score update reads one token's scores).
    yield "synthetic", synthetic_stream(num_layers=3, num_experts=8, top_k=2, num_seqs=1, steps=150, seed=11)
    yield "synthetic-flat", synthetic_stream(num_layers=2, num_experts=16, top_k=4, num_seqs=1, steps=120,
                                             skew=0.0, locality=0.3, seed=12)


def test_peers_lru_and_min_give_moelabs_hits(traces):
    old_differs = 0
    for name, s in _streams(traces):
        g = _groups(s)
        for cap in range(1, int(s.num_experts.min()) + 1):
            lru = simulate(s, "lru", cap).hits
            assert mixtral_offloading_lru(g, cap) == lru, (name, cap)
            assert promoe_lru(g, cap) == lru, (name, cap)
            assert promoe_min(g, cap) == simulate(s, "belady", cap).hits, (name, cap)
            old_differs += simulate(s, "lru", cap, insertion="protect-step").hits != lru
    assert old_differs  # the earlier rule does not reproduce the peers (the comparison can fail)


def test_hybrimoe_mrs_gives_moelabs_hits(traces):
    for name, s in _streams(traces):
        g = _groups(s)
        for alpha, p in [(0.5, 2 * int(s.top_k.max())), (0.3, 3), (1.0, int(s.top_k.max()))]:
            for cap in range(1, int(s.num_experts.min()) + 1):
                ours = simulate(s, "mrs", cap, alpha=alpha, p=p).hits
                assert hybrimoe_mrs(g, cap, alpha, p) == ours, (name, alpha, p, cap)


def test_moe_lrc_lru_stack_equals_moelab_lru_up_to_its_free_first_uses():
    """moe-lrc counts a first use into a free slot as a hit and orders a token's experts by
    access, not hits first; with one expert per token (top-1) the second difference vanishes
    and its hits are moelab's LRU hits plus one per distinct expert that fit (min(c, seen))."""
    s = synthetic_stream(num_layers=2, num_experts=8, top_k=1, num_seqs=1, steps=200, seed=13)
    g = _groups(s)
    for layer in range(2):
        theirs, seen = moe_lrc_lru_hit_counts(g, 8, layer)
        for cap in range(1, 9):
            r = simulate(s, "lru", cap)
            assert theirs[cap - 1] == r.layer_hits[layer] + min(cap, seen), (layer, cap)


def test_step_protection_made_policies_identical_at_small_capacity_and_the_default_does_not(traces):
    """Under the earlier rule, at capacity <= top-k every miss evicts all of the non-needed
    experts whatever the policy, so LRU, LFU, FIFO and MRS hit identically; under the peers'
    rule they differ (the gap HybriMoE reports between MRS and LRU can show)."""
    for family, tr in traces.items():
        s = load_stream(tr)
        k = int(s.top_k.max())
        differ = False
        for cap in range(1, k + 1):
            old = [simulate(s, p, cap, insertion="protect-step", keep_hits=True).hit for p in ("lru", "lfu", "fifo", "mrs")]
            assert all(np.array_equal(old[0], h) for h in old[1:]), (family, cap)
            new = {simulate(s, p, cap).hits for p in ("lru", "lfu", "fifo", "mrs")}
            differ |= len(new) > 1
        assert differ, family
