"""Per-forward replay and the online driver: offline replay of a trace equals a cache driven by
the running model, one access per forward pass and MoE layer, at any batch size."""

import numpy as np
import pytest
import torch

from moelab.caches import access_forward, make_cache, simulate
from moelab.caches.online import forward_experts
from moelab.caches.simulation import load_stream
from moelab.caches.stream import build_stream, forward_ids

POLICIES = ["lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass"]
ONLINE = ["lru", "lfu", "fifo", "static", "mrs"]  # the Belady bounds read the future: offline only


def _prompts(n):
    return ["expert caches", "route me", "a longer prompt here", "x"][:n]


@pytest.fixture(scope="module")
def batch3(tmp_path_factory):
    """One batch-3 ``generate`` of a tiny random Qwen2-MoE (8 experts, top-4, 3 MoE layers):
    the recorded trace, and every router call seen during it (what an online cache sees)."""
    import moelab
    from moelab.adapters import make_routing, moe_layers
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    model = build_tiny("qwen2_moe", seed=0)
    tok = byte_tokenizer()
    enc = tok(_prompts(3), return_tensors="pt", padding=True)
    calls, state = [], {}

    def pre(module, args, kwargs):  # which tokens are real (left padding), and the step
        ids = kwargs.get("input_ids", args[0] if args else None)
        S = ids.shape[1]
        past = kwargs.get("cache", kwargs.get("past_key_values"))  # 5.24 renamed it
        past_len = past.get_seq_length() if past is not None else 0
        state["valid"] = kwargs["attention_mask"][:, -S:].bool().reshape(-1)
        state["step"] = 0 if past_len == 0 else state.get("step", 0) + 1

    def router_hook(layer):
        def hook(module, args, output):
            logits, weights, ids = (output if output[0].is_floating_point() else output[::-1])  # either 5.x order
            r = make_routing(logits.detach(), weights.detach(), ids.detach(), layer.spec.scoring)
            calls.append((state["step"], layer.index, r.experts, r.weights, r.scores, state["valid"]))

        return hook

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True)]
    handles += [ly.router.register_forward_hook(router_hook(ly)) for ly in moe_layers(model)]
    out = tmp_path_factory.mktemp("trace") / "b3"
    try:
        with torch.no_grad(), moelab.record(model, out):
            model.generate(**enc, max_new_tokens=12, do_sample=False, pad_token_id=tok.pad_token_id)
    finally:
        for h in handles:
            h.remove()
    return moelab.open_trace(out), calls


@pytest.fixture(scope="module")
def batch1(tmp_path_factory):
    """Three prompts generated one at a time (batch 1) into one trace."""
    import moelab
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    model = build_tiny("qwen2_moe", seed=0)
    tok = byte_tokenizer()
    out = tmp_path_factory.mktemp("trace") / "b1"
    with torch.no_grad(), moelab.record(model, out):
        for p in _prompts(3):
            enc = tok([p], return_tensors="pt")
            model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    return moelab.open_trace(out)


def test_forward_ids_follow_the_recorded_row_order():
    # Forward A: step 0, layers 0,0,1,1 (2 tokens); B: step 1, layers 0,1; C: step 0 again
    # (a new prompt), layers 0,1; D: step 0 right after C (layer goes back).
    step = [0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    layer = [0, 0, 1, 1, 0, 1, 0, 1, 0, 1]
    assert forward_ids(step, layer).tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 3, 3]


def test_batch_one_traces_replay_identically_in_both_orders(batch1):
    for prefill in [False, True]:
        a = load_stream(batch1, prefill, replay="forward")
        b = load_stream(batch1, prefill, replay="sequence")
        for f in ("keys", "group_ptr", "group_layer", "group_seq", "group_step", "group_pass", "score_rows", "row_ptr"):
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        for policy in POLICIES:
            for scope in ["layer", "global"]:
                ra = simulate(batch1, policy, 0.25, scope, include_prefill=prefill, keep_hits=True)
                rb = simulate(batch1, policy, 0.25, scope, include_prefill=prefill, keep_hits=True, replay="sequence")
                assert np.array_equal(ra.hit, rb.hit), (policy, scope, prefill)


def test_batch_three_forward_groups_are_the_union_over_the_batch(batch3):
    trace, _ = batch3
    s = load_stream(trace, include_prefill=True)
    seq_order = load_stream(trace, include_prefill=True, replay="sequence")
    steps = sorted(set(trace.column("step").tolist()))
    assert s.num_groups == len(steps) * 3  # one group per forward (= step here) and MoE layer
    assert seq_order.num_groups == s.num_groups * 3  # per sequence: one group per row of the batch
    step, layer, ex, w = trace.column("step"), trace.column("moe_layer"), trace.experts_array(), trace.weights_array()
    for g in range(s.num_groups):
        rows = np.flatnonzero((step == s.group_step[g]) & (layer == s.group_layer[g]))
        best = {}
        for r in rows:
            for e, x in zip(ex[r], w[r]):
                best[int(e)] = max(best.get(int(e), -np.inf), float(x))
        want = sorted(best, key=lambda e: (-best[e], e))
        assert s.group_experts(g).tolist() == want, g


@pytest.mark.parametrize("insertion", ["always", "protect-step"])
def test_offline_per_forward_replay_equals_the_cache_driven_by_the_running_model(batch3, insertion):
    trace, calls = batch3
    for prefill in [False, True]:
        s = load_stream(trace, include_prefill=prefill)
        todo = [c for c in calls if prefill or c[0] > 0]
        counts = np.bincount(s.keys, minlength=s.num_keys)
        for policy in ONLINE:
            for scope, cap in [("layer", 0.25), ("layer", 3), ("global", 0.5)]:
                off = simulate(s, policy, cap, scope, keep_hits=True, insertion=insertion)
                extra = {"insertion": insertion}
                if policy == "mrs":
                    extra["top_k"] = s.top_k.tolist()
                if policy == "static":
                    extra["profile"] = counts
                cache = make_cache(policy, s.num_experts.tolist(), cap, scope, **extra)
                hits = []
                for _, layer, experts, weights, scores, valid in todo:
                    hits += access_forward(cache, layer, experts, weights, valid, scores)
                assert np.array_equal(np.asarray(hits, dtype=np.uint8), off.hit), (policy, scope, cap, prefill)
                assert (cache.hits, cache.evictions, cache.transfers) == (off.hits, off.evictions, off.transfers)


@pytest.mark.parametrize("insertion", ["always", "protect-step"])
def test_replaying_the_per_forward_stream_equals_access_forward_group_by_group(batch3, insertion):
    """The trace's own rows, one forward and layer at a time, through access_forward."""
    trace, _ = batch3
    s = load_stream(trace, include_prefill=True)
    fwd = forward_ids(trace.column("step"), trace.column("moe_layer"))
    layer, ex, w, sc = trace.column("moe_layer"), trace.experts_array(), trace.weights_array(), trace.scores_array()
    for policy in POLICIES:
        for scope, cap in [("layer", 2), ("global", 0.25)]:
            off = simulate(s, policy, cap, scope, keep_hits=True, insertion=insertion)
            extra = {"insertion": insertion, "top_k": s.top_k.tolist()} if policy == "mrs" else {"insertion": insertion}
            if policy.startswith("belady"):
                extra["stream"] = s
            if policy == "static":
                extra["profile"] = np.bincount(s.keys, minlength=s.num_keys)
            cache = make_cache(policy, s.num_experts.tolist(), cap, scope, **extra)
            hits = []
            for f in np.unique(fwd):
                for ly in range(s.num_layers):
                    rows = np.flatnonzero((fwd == f) & (layer == ly))
                    hits += access_forward(cache, ly, torch.from_numpy(ex[rows]), torch.from_numpy(w[rows]),
                                           None, torch.from_numpy(sc[rows]))
            assert np.array_equal(np.asarray(hits, dtype=np.uint8), off.hit), (policy, scope)


def test_forward_experts_orders_by_largest_weight_skips_padding_and_takes_any_dtype():
    experts = torch.tensor([[3, 1], [1, 0], [5, 6], [2, 7]])
    weights = torch.tensor([[0.5, 0.2], [0.6, 0.2], [0.9, 0.1], [0.3, 0.2]], dtype=torch.bfloat16)
    valid = torch.tensor([True, True, False, True])  # row 2 is padding: 5 and 6 are not accessed
    union, rows = forward_experts(experts, weights, valid)
    # largest weights: 1 -> 0.6, 3 -> 0.5, 2 -> 0.3, 0 -> 0.2, 7 -> 0.2 (tie: lower id first)
    assert union.tolist() == [1, 3, 2, 0, 7] and rows.tolist() == [0, 1, 3]
    cache = make_cache("lru", [8], 2)
    assert access_forward(cache, 0, experts, weights, valid) == [False] * 5
    assert cache.contents(0) == [0, 7]  # every miss inserted: the last two stay
    assert access_forward(cache, 0, experts[:1], weights[:1]) == [False, False]  # 3, 1


def test_build_stream_rejects_an_unknown_replay_order():
    from moelab.errors import MoelabError

    with pytest.raises(MoelabError, match="replay order"):
        build_stream([0], [1], [0], np.array([[0]]), None, [2], [1], replay="per-token")


def test_a_forward_column_separates_what_the_row_order_cannot():
    # One MoE layer, two prompt forwards in a row (seq 0, then seq 1): from the row order alone
    # they read as one forward (step 0, layer 0 throughout); a forward column splits them.
    seq, step, layer = [0, 0, 1], [0, 0, 0], [0, 0, 0]
    experts = np.array([[0], [1], [2]])
    weights = np.array([[0.9], [0.8], [0.7]])
    merged = build_stream(seq, step, layer, experts, weights, [4], [1], include_prefill=True)
    assert merged.num_groups == 1 and merged.keys.tolist() == [0, 1, 2]
    split = build_stream(seq, step, layer, experts, weights, [4], [1], include_prefill=True, forward=[0, 0, 1])
    assert split.num_groups == 2 and split.group_ptr.tolist() == [0, 2, 3] and split.group_seq.tolist() == [0, 1]


def test_unknown_insertion_rule_is_a_one_line_error_with_the_choices():
    from moelab.caches.synthetic import synthetic_stream
    from moelab.errors import MoelabError

    s = synthetic_stream(num_layers=1, num_experts=4, top_k=1, num_seqs=1, steps=3)
    with pytest.raises(MoelabError, match="protect-step"):
        simulate(s, "lru", 2, insertion="protect")
    with pytest.raises(MoelabError, match="always"):
        make_cache("lru", [4], 2, insertion="never")


@pytest.mark.parametrize("prefill", [False, True])
def test_a_cache_attached_through_the_forward_seam_equals_offline_replay_of_the_same_batch3_run(
        tmp_path, prefill):
    """One batch-3 ``generate`` drives a cache per policy and scope through ``attach_cache``
    while the recorder writes the trace; replaying that trace per forward gives the same hits."""
    import contextlib

    import moelab
    from moelab.caches.online import attach_cache
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    model = build_tiny("qwen2_moe", seed=0)
    tok = byte_tokenizer()
    enc = tok(_prompts(3), return_tensors="pt", padding=True, padding_side="left")
    num = [ly.num_experts for ly in moelab.moe_layers(model)]
    top_k = [ly.top_k for ly in moelab.moe_layers(model)]
    caches = {}
    for policy in ONLINE:
        if policy == "static":
            continue  # needs a profile of the run it is part of
        for scope, cap in [("layer", 0.25), ("global", 0.5)]:
            extra = {"top_k": top_k} if policy == "mrs" else {}
            caches[(policy, scope)] = make_cache(policy, num, cap, scope, **extra)
    with contextlib.ExitStack() as stack, torch.no_grad():
        rec = stack.enter_context(moelab.record(model, tmp_path / "t"))
        for c in caches.values():
            stack.enter_context(attach_cache(model, c, include_prefill=prefill))
        model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    for (policy, scope), c in caches.items():
        off = simulate(rec.trace, policy, c.capacity, scope, include_prefill=prefill)
        assert (c.hits, c.misses, c.evictions) == (off.hits, off.accesses - off.hits, off.evictions), (policy, scope)


def test_forward_experts_small_and_large_paths_agree():
    from moelab.caches import online

    g = np.random.default_rng(0)
    for T in (1, 2, 3, 40):
        ex = g.integers(-1, 12, size=(T, 4))
        w = g.random((T, 4)).astype(np.float32)
        w[:, 1] = w[:, 0]  # ties
        small = online.forward_experts(ex, w)[0]
        saved, online._SMALL = online._SMALL, -1
        try:
            large = online.forward_experts(ex, w)[0]
        finally:
            online._SMALL = saved
        assert small.tolist() == large.tolist(), T
