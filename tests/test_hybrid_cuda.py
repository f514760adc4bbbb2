"""The real executor's CUDA lanes: parity with the functional executor on the CPU, consistent
events, exact reversibility. Needs a GPU (``scripts/gpu_check.sh`` runs them on one)."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.forward import forward_hooks
from moelab.hybrid.events import COLUMNS
from moelab.models.tiny import build_tiny
from tests.test_hybrid import _inputs  # batch B with the second row left-padded
from tests.test_policies_lifecycle import assert_same_state, snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (the CUDA lanes of the real executor); none here")

CONFIGS = {
    "cache-fetch": {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses"},
    # admission "all": host misses are copied in behind demand copies (insert transfers), so the device and copy
    # lanes work under host-misses too (with the default admission an empty cache stays empty)
    "host-misses": {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}, "placement": "host-misses"},
    "nocache-fetch": {"cache": {"capacity": 0}, "placement": "fetch-misses"},
    "global-greedy": {"cache": {"capacity": 0.25, "policy": "mrs", "scope": "global"}, "placement": "greedy-hss",
                      "hardware": "pcie4-x16"},
}
MODELS = ["moelab-tiny-mixtral", "moelab-tiny-qwen2moe", "gpt_oss", "deepseek_v3", "qwen3_next"]


def _model(name):
    if name.startswith("moelab-"):
        from moelab.loading import load

        return load(name)[0]
    return build_tiny(name, seed=0)


def _gen(model, ids, mask, n=4):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences.cpu(), [x.float().cpu() for x in out.logits]


def _tol(dtype):
    return {torch.float32: (1e-3, 1e-3), torch.bfloat16: (5e-2, 5e-2), torch.float16: (1e-2, 1e-2)}[dtype]


def _with_deferral(model, cfg):
    k = min(layer.top_k for layer in moelab.moe_layers(model))
    return {**cfg, "routing": {"deferred": min(2, k - 1), "min_immediate": 1}} if k >= 2 else cfg


def _check_events(run):
    ev = run.events_table()
    assert tuple(ev.columns) == COLUMNS
    for lane, g in ev[ev["lane"] != "control"].groupby("lane"):  # one stream / worker per lane
        g = g.sort_values("t_start_us")
        assert (g["t_start_us"].to_numpy()[1:] >= g["t_end_us"].to_numpy()[:-1] - 1e-6).all(), lane
        assert (g["t_end_us"] >= g["t_start_us"]).all(), lane
    dev = ev[ev["kind"] == "expert-device"].groupby(["step", "layer"])["t_start_us"].min()
    copies = ev[ev["kind"] == "transfer-demand"]
    for _, t in copies.iterrows():  # a fetched expert's compute starts after its copy ended
        if (t["step"], t["layer"]) in dev.index:
            assert dev.loc[(t["step"], t["layer"])] >= t["t_end_us"] - 1e-6
    return ev


def _configs(name):
    """The shared configurations, and for a bundled model its learned-predictor prefetch (the
    copy lane's prefetch queue, cancelled prefetches and evictions of another layer's slots)."""
    from pathlib import Path

    pred = Path(__file__).resolve().parents[1] / "predictors" / name / "learned-d1"
    if not pred.is_dir():
        return CONFIGS
    # host-misses: the link carries prefetches alone (under fetch-misses / greedy-hss the demand copies of this
    # tiny model leave no prefetch budget, and no prefetch is planned)
    return {**CONFIGS, "prefetch": {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "host-misses",
                                    "hardware": "pcie4-x16", "prefetch": {"predictor": str(pred), "distance": 1}}}


@pytest.mark.parametrize("name", MODELS)
def test_cuda_real_executor_equals_functional_on_the_cpu(name):
    model = _model(name)
    dtype = next(model.parameters()).dtype
    rtol, atol = _tol(dtype)
    before = snapshot(model)
    for B in (1, 3):
        ids, mask = _inputs(B)
        for cname, cfg in _configs(name).items():
            cfg = _with_deferral(model, cfg)
            with moelab.hybrid(model, {**cfg, "executor": "functional", "device": "cpu"}):
                want = _gen(model, ids, mask)
            with moelab.hybrid(model, {**cfg, "executor": "real", "device": "cuda"}) as run:
                assert next(model.parameters()).device.type == "cuda"
                got = _gen(model, ids.cuda(), mask.cuda())
            assert torch.equal(want[0], got[0]), (name, B, cname)
            for a, b in zip(want[1], got[1], strict=True):
                torch.testing.assert_close(b, a, rtol=rtol, atol=atol, msg=f"{name} B={B} {cname}")
            ev = _check_events(run)
            kinds = set(ev["kind"])
            assert "expert-device" in kinds or "expert-host" in kinds
            if cfg["placement"] == "fetch-misses":
                assert "transfer-demand" in kinds
            if cfg.get("routing"):
                assert "expert-deferred" in kinds
            if cname == "prefetch":
                assert "transfer-prefetch" in kinds
    assert_same_state(before, snapshot(model))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    assert forward_hooks(model, create=False) is None


def test_cuda_run_is_reversible_on_exceptions_and_auto_picks_cuda(tmp_path):
    import json

    model = build_tiny("mixtral", seed=0)
    before = snapshot(model)
    ids, mask = _inputs(3)
    with pytest.raises(RuntimeError, match="boom"), moelab.hybrid(model, {**CONFIGS["cache-fetch"], "executor": "real"}):
        _gen(model, ids.cuda(), mask.cuda(), n=2)
        raise RuntimeError("boom")
    assert_same_state(before, snapshot(model))
    assert all(p.device.type == "cpu" and not p.is_pinned() for p in model.parameters())
    assert forward_hooks(model, create=False) is None
    # a forward with inputs on the wrong device fails inside the run: still restored
    with pytest.raises(RuntimeError), moelab.hybrid(model, {**CONFIGS["host-misses"], "executor": "real"}):
        model(input_ids=ids, attention_mask=mask)
    assert_same_state(before, snapshot(model))
    run = moelab.hybrid(model, {**CONFIGS["host-misses"], "executor": "real",
                                "routing": {"deferred": 1, "min_immediate": 1}})
    with run:
        _gen(model, ids.cuda(), mask.cuda(), n=2)
    run.save(tmp_path / "r")
    assert json.loads((tmp_path / "r" / "config.json").read_text())["device"] == "cuda"
    import pandas as pd

    ev = pd.read_parquet(tmp_path / "r" / "events.parquet")
    assert tuple(ev.columns) == COLUMNS and {"device", "host", "copy", "control"} <= set(ev["lane"])
    assert_same_state(before, snapshot(model))


def test_cuda_lanes_overlap_deferred_host_work_with_the_next_layer():
    """Deferred host work runs while the control thread launches the next layer: with deferral,
    some host-lane time overlaps the device side (device lane or the control thread's dense work)."""
    model = build_tiny("qwen3_moe", seed=0)
    ids, mask = _inputs(3)
    cfg = {"cache": {"capacity": 0.5, "policy": "lru", "admission": "all"}, "placement": "host-misses",
           "executor": "real", "device": "cuda", "routing": {"deferred": 1, "min_immediate": 1}}
    with moelab.hybrid(model, cfg) as run:
        _gen(model, ids.cuda(), mask.cuda(), n=6)
    s = run.summary()
    assert {"device", "host", "copy"} <= set(s["busy_pct"]) and 0 <= s["overlap_pct"] <= 100
    ev = run.events_table()
    assert len(ev[ev["kind"] == "expert-deferred"]) == sum(1 for p in run.plans if p.deferred)


def test_cuda_warm_cache_is_resident_before_the_first_forward():
    """``cache.warm``: what a warm cache holds is copied into the GPU pool when the run starts, so with
    capacity 1.0 no step copies an expert and every expert runs on the device (before, the pool
    started empty and each expert's first use paid a demand copy inside the measured steps)."""
    from moelab.hybrid.bench import warm_cache

    model = build_tiny("qwen3_moe", seed=0)
    ids, mask = _inputs(1)
    memo = {}  # holds the trace's temporary directory for the test's duration
    cache = warm_cache(1.0, model, ids, 3, memo)
    with moelab.hybrid(model, {"cache": cache, "placement": "host-misses", "executor": "real", "device": "cuda"}) as run:
        got = _gen(model, ids.cuda(), mask.cuda())
    with moelab.hybrid(model, {"cache": cache, "placement": "host-misses", "executor": "functional", "device": "cpu"}):
        want = _gen(model, ids, mask)
    assert torch.equal(want[0], got[0])
    kinds = set(run.events_table()["kind"])
    assert "expert-device" in kinds and "expert-host" not in kinds, kinds
    assert not {k for k in kinds if k.startswith("transfer-")}, kinds


def test_cuda_copies_low_priority_experts_in_chunks_that_assemble_the_expert():
    """``prefetch.chunks: 3`` on the CUDA lanes: each insert goes to the copy stream as three pieces
    (one event each, a third of the bytes), and the GPU pool's slots hold exactly the experts'
    weights afterwards; outputs equal the functional executor's."""
    model = build_tiny("mixtral", seed=0)
    ids, mask = _inputs(3)
    cfg = {"cache": {"capacity": 0.25, "policy": "lru", "admission": "all"}, "prefetch": {"chunks": 3}}
    with moelab.hybrid(model, {**cfg, "executor": "functional", "device": "cpu"}):
        want = _gen(model, ids, mask)
    with moelab.hybrid(model, {**cfg, "executor": "real", "device": "cuda"}) as run:
        got = _gen(model, ids.cuda(), mask.cuda())
        torch.cuda.synchronize()
        pool = run._executor.pool
        for (layer, expert), slot in pool.where.items():
            masters = run.layers[layer].experts._parameters
            for n, dst in pool.stacks.items():
                assert torch.equal(dst[slot].cpu(), masters[n].data[expert].cpu()), (layer, expert, n)
    assert torch.equal(want[0], got[0])
    ev = _check_events(run)
    inserts = [t for p in run.plans for t in p.transfers if t.priority == "insert"]
    chunks = ev[ev["kind"] == "transfer-insert"]
    assert inserts and chunks["bytes"].sum() == sum(t.bytes for t in inserts)
    assert len(chunks) == 3 * len(inserts)


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("device_backend", ["batched_mm", "reference"])
def test_cuda_every_expert_resident_computes_each_layer_before_its_plan(device_backend, B):
    """Capacity 1.0, warm: every expert of every layer is in the GPU pool, so no plan can do anything but
    compute on the device. The executor then runs each layer at once through its fixed expert → slot
    map (no wait for the routing on the host) and the plans are made at the forward's end from pinned
    copies of the routing: the same plans as the functional executor's, the same tokens, one device
    event per layer with the plan's tokens and bytes, nothing on the host or copy lanes. With B = 3
    the prompt is padded: planned at once (the synchronous path), its decode steps wait."""
    from moelab.hybrid.bench import warm_cache

    model = build_tiny("qwen3_moe", seed=0)
    ids, mask = _inputs(B)
    memo = {}
    cache = warm_cache(1.0, model, _inputs(1)[0], 3, memo)
    cfg = {"cache": cache, "placement": "host-misses", "device_backend": device_backend}
    with moelab.hybrid(model, {**cfg, "executor": "functional", "device": "cpu"}) as want_run:
        want = _gen(model, ids, mask)
    with moelab.hybrid(model, {**cfg, "executor": "real", "device": "cuda"}) as run:
        got = _gen(model, ids.cuda(), mask.cuda())
        assert run._executor._smaps is not None  # the resident path was taken
    assert torch.equal(want[0], got[0])
    rtol, atol = _tol(next(model.parameters()).dtype)
    for a, b in zip(want[1], got[1], strict=True):
        torch.testing.assert_close(b, a, rtol=rtol, atol=atol)
    assert run.plans == want_run.plans and run.timing["plans"] == len(run.plans)
    ev = _check_events(run)
    dev = ev[ev["kind"] == "expert-device"]
    assert len(dev) == len(run.plans) and set(ev["lane"]) == {"device", "control"}
    waited = dev[dev["cause"] == "hit"]  # the resident path's events (the synchronous path's: hit+fetch)
    assert len(waited) == sum(1 for p in run.plans if B == 1 or p.phase == "decode") > 0
    control = ev[ev["lane"] == "control"]
    assert len(control[control["cause"] == "after-forward"]) == len({p.forward for p in run.plans
                                                                      if B == 1 or p.phase == "decode"})
    if B == 1:
        assert not (control["kind"] == "wait").any()  # no layer waited for its lanes
    by = {(p.forward, p.layer): p for p in run.plans}
    # the padded prompt (B = 3, planned at once) computes its padding rows too, as the plain model
    # does, on the experts they route to (all resident): its event counts them, its plan does not
    padding = int((mask == 0).sum()) * model.config.num_experts_per_tok
    for _, e in dev.iterrows():
        p = by[(e["step"], e["layer"])]
        extra = padding if e["cause"] == "hit+fetch" else 0
        assert e["tokens"] == sum(n for _, n in p.device) + extra > 0
        assert e["bytes"] == run.expert_bytes[p.layer] * len(p.device)
