"""The hybrid model's planner and functional executor: parity, plan invariants, placement
definitions, configuration errors and reversibility."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.forward import forward_hooks
from moelab.hybrid import HybridConfig, get_placement
from moelab.models.tiny import FAMILIES, build_tiny
from moelab.policies import ExpertDeferral
from moelab.timing import HardwareProfile
from moelab.timing.costs import CostModel
from tests.test_policies_lifecycle import assert_same_state, snapshot

CONFIGS = {
    "lru-host": {"cache": {"capacity": 0.25, "policy": "lru"}},
    "mrs-greedy": {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16"},
    "none-fetch": {"cache": {"capacity": 0}, "placement": "fetch-misses"},
}


def _inputs(B=3, S=5, seed=0):
    ids = torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if B > 1:
        mask[1, :2] = 0
        ids[1, :2] = 0
    return ids, mask


def _gen(model, ids, mask, n=3):
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences, out.logits


@pytest.mark.parametrize("family", FAMILIES)
def test_no_deferral_is_bit_identical_and_deferral_equals_the_policy(family):
    model = build_tiny(family, seed=0)
    before = snapshot(model)
    for B in (1, 3):
        ids, mask = _inputs(B)
        want = _gen(model, ids, mask)
        for cfg in CONFIGS.values():
            with moelab.hybrid(model, cfg) as run:
                got = _gen(model, ids, mask)
            assert torch.equal(want[0], got[0])
            assert all(torch.equal(a, b) for a, b in zip(want[1], got[1], strict=True))
            assert run.plans
        top_k = min(layer.top_k for layer in moelab.moe_layers(model))
        if top_k >= 2:
            with ExpertDeferral(model, 1, min_immediate=1):
                pol = _gen(model, ids, mask)
            with moelab.hybrid(model, {**CONFIGS["mrs-greedy"], "routing": {"deferred": 1, "min_immediate": 1}}):
                got = _gen(model, ids, mask)
            assert torch.equal(pol[0], got[0])
            assert all(torch.equal(a, b) for a, b in zip(pol[1], got[1], strict=True))
    assert_same_state(before, snapshot(model))
    assert forward_hooks(model, create=False) is None


@pytest.fixture(scope="module")
def mixtral():
    return build_tiny("mixtral", seed=0)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_plans_account_for_every_needed_expert_once(mixtral, name):
    ids, mask = _inputs(3)
    cfg = {**CONFIGS[name], "routing": {"deferred": 1, "min_immediate": 1}}
    with moelab.hybrid(mixtral, cfg) as run:
        _gen(mixtral, ids, mask, n=4)
    assert len(run.plans) == 4 * len(moelab.moe_layers(mixtral))
    for p in run.plans:
        needed = set(p.hits) | set(p.misses)
        assert not set(p.hits) & set(p.misses)
        ran = [e for e, _ in p.device] + [e for e, _ in p.host]
        assert sorted(ran) == sorted(needed), "each needed expert runs exactly once, on one side"
        assert {e for e, _ in p.device} >= set(p.hits), "cached experts run on the device"
        fetched = {t.expert for t in p.transfers if t.priority == "demand" and t.layer == p.layer}
        assert fetched == {e for e, _ in p.device} - set(p.hits), "a miss on the device was fetched"
        assert sum(n for _, n in p.device) + sum(n for _, n in p.host) >= p.tokens
        assert {e for e, _ in p.deferred} <= needed
        if p.phase == "prefill":
            assert not p.deferred  # deferral acts in decode forwards by default


def test_placement_definitions_on_hand_made_costs():
    # device 10 µs per expert, host 30 µs per expert-token, a copy 15 µs (launch 0)
    hw = HardwareProfile(name="hand", link_bandwidth_gbs=1.0, link_latency_us=5.0, gpu_memory_bandwidth_gbs=1.0,
                         gpu_memory_efficiency=1.0, gpu_peak_tflops=1e9, gpu_launch_us=0.0, gpu_call_us=0.0,
                         numa_node_bandwidth_gbs=1e9, cpu_memory_efficiency=1.0, cpu_peak_tflops=1.0,
                         cpu_dispatch_us=0.0, cpu_call_us=0.0)
    cost = CostModel(profile=hw, num_experts=4, num_moe_layers=1, moe_layers=(0,), num_layers=1, expert_bytes=10_000,
                     expert_flops_per_token=3e7, shared_bytes=0.0, shared_flops_per_token=0.0, dense_mlp_bytes=0.0,
                     dense_mlp_flops_per_token=0.0, router_bytes=0.0, router_flops_per_token=0.0, lm_head_bytes=0.0,
                     lm_head_flops_per_token=0.0)
    assert cost.device_us(4) == pytest.approx(10.0) and cost.host_us(1) == pytest.approx(30.0)
    assert cost.fetch_us() == pytest.approx(15.0)
    hits = [(0, 1)]
    misses = [(1, 3), (2, 1), (3, 1)]
    assert get_placement("host-misses").place(hits, misses, None) == {1: "host", 2: "host", 3: "host"}
    assert get_placement("fetch-misses").place(hits, misses, None) == {1: "fetch", 2: "fetch", 3: "fetch"}
    # all on host: max(10, 90+30+30=150) = 150. Fetch the heaviest (1): device max(10,15)+10 = 25,
    # host 60 → 60. Then expert 2: device max(25,30)+10 = 40, host 30 → 40. Then 3: device
    # max(40,45)+10 = 55, host 0 → 55 > 40: stop there.
    assert get_placement("greedy-hss").place(hits, misses, cost) == {1: "fetch", 2: "fetch", 3: "host"}
    # min-cost searches every split; 40 is optimal here too
    assert get_placement("min-cost").place(hits, misses, cost) == {1: "fetch", 2: "fetch", 3: "host"}


def test_bad_configurations_are_refused_with_the_fix(mixtral):
    with pytest.raises(MoelabError, match=r"unknown key 'capacty'.*Did you mean 'capacity'"):
        HybridConfig.from_dict({"cache": {"capacty": 0.5}})
    with pytest.raises(MoelabError, match=r"unknown key 'placment'.*'placement'"):
        HybridConfig.from_dict({"placment": "host-misses"})
    with pytest.raises(MoelabError, match=r"unknown placement policy 'greedy-hs'.*'greedy-hss'"):
        moelab.hybrid(mixtral, {"placement": "greedy-hs"}).apply()
    with pytest.raises(MoelabError, match="needs a cost model; set hardware"):
        moelab.hybrid(mixtral, {"placement": "greedy-hss"}).apply()
    with pytest.raises(MoelabError, match=r"capacity=99 does not fit"):
        moelab.hybrid(mixtral, {"cache": {"capacity": 99}}).apply()
    with pytest.raises(MoelabError, match=r"capacity=-0.5 does not fit"):
        moelab.hybrid(mixtral, {"cache": {"capacity": -0.5}}).apply()
    if not torch.cuda.is_available():
        with pytest.raises(MoelabError, match="no CUDA GPU"):
            HybridConfig(device="cuda")
    assert forward_hooks(mixtral, create=False) is None


def test_config_round_trips_through_yaml(tmp_path):
    import yaml

    cfg = HybridConfig.from_dict({"cache": {"capacity": 0.5, "policy": "lfu"}, "placement": "min-cost",
                                  "hardware": "pcie5-x16", "routing": {"deferred": 2}})
    p = tmp_path / "h.yaml"
    p.write_text(yaml.safe_dump(cfg.to_dict()))
    assert HybridConfig.from_yaml(p) == cfg


def test_plans_are_saved_atomically(mixtral, tmp_path):
    import json

    with moelab.hybrid(mixtral, CONFIGS["lru-host"]) as run:
        _gen(mixtral, *_inputs(1), n=2)
    run.save(tmp_path / "run")
    lines = (tmp_path / "run" / "plans.jsonl").read_text().splitlines()
    assert len(lines) == len(run.plans) and json.loads(lines[0])["layer"] == 0
    with pytest.raises(MoelabError):
        run.save(tmp_path / "run")


@pytest.mark.parametrize("host_backend,device_backend", [("reference", "reference"), ("moelab", "reference"),
                                                          ("moelab", "moelab")])
def test_real_executor_equals_functional_and_its_events_are_consistent(mixtral, host_backend, device_backend,
                                                                       tmp_path):
    if "moelab" in (host_backend, device_backend):
        pytest.importorskip("moelab.kernels.op")
    ids, mask = _inputs(3)
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses",
           "routing": {"deferred": 1, "min_immediate": 1}}
    with moelab.hybrid(mixtral, cfg) as f:
        want = _gen(mixtral, ids, mask, n=4)
    before = snapshot(mixtral)
    with moelab.hybrid(mixtral, {**cfg, "executor": "real", "host_backend": host_backend,
                                 "device_backend": device_backend, "device": "cpu"}) as run:
        got = _gen(mixtral, ids, mask, n=4)
    assert_same_state(before, snapshot(mixtral))
    assert torch.equal(want[0], got[0])
    for a, b in zip(want[1], got[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # two partial sums instead of one
    assert [p.device for p in run.plans] == [p.device for p in f.plans]
    ev = run.events_table()
    # one worker per lane: no lane runs two things at once
    for lane, g in ev[ev["lane"] != "control"].groupby("lane"):
        g = g.sort_values("t_start_us")
        assert (g["t_start_us"].to_numpy()[1:] >= g["t_end_us"].to_numpy()[:-1]).all(), lane
    # a fetched expert's device compute starts after its copy ended
    dev = ev[(ev["kind"] == "expert-device") & (ev["cause"] != "deferred")].set_index(["step", "layer"])
    for _, t in ev[ev["kind"] == "transfer-demand"].iterrows():
        if (t["step"], t["layer"]) in dev.index:
            assert dev.loc[(t["step"], t["layer"]), "t_start_us"] >= t["t_end_us"]
    # the wait for those copies is recorded where it happens: on a Python device lane, or on the
    # control thread that queues a native one (a copy stall either way)
    waiter = "device" if device_backend == "reference" else "control"
    copy_waits = ev[(ev["lane"] == waiter) & (ev["kind"] == "wait") & (ev["cause"] == "copy")]
    fetched = {(s, ly) for s, ly in zip(ev.loc[ev["kind"] == "transfer-demand", "step"],
                                        ev.loc[ev["kind"] == "transfer-demand", "layer"], strict=True)}
    assert set(zip(copy_waits["step"], copy_waits["layer"], strict=True)) == fetched & set(dev.index)
    assert fetched & set(dev.index)  # the check saw some
    # a deferred expert's sum is merged after its host compute: the layer after next starts later
    dense = ev[ev["kind"] == "dense"].set_index(["step", "layer"])
    deferred = ev[ev["kind"] == "expert-deferred"]
    # deferral is a host technique: deferred slots of the device's experts run on the device at once
    on_host = [p for p in run.plans if {e for e, _ in p.deferred} - {e for e, _ in p.device}]
    assert len(deferred) == len(on_host)
    dev_deferred = ev[(ev["kind"] == "expert-device") & (ev["cause"] == "deferred")]
    assert len(dev_deferred) == sum(1 for p in run.plans if {e for e, _ in p.deferred} & {e for e, _ in p.device})
    for _, d in deferred.iterrows():
        nxt = (d["step"], d["layer"] + 2)
        if nxt in dense.index:
            assert dense.loc[nxt, "t_start_us"] >= d["t_end_us"]
    s = run.summary()
    assert set(s["busy_pct"]) >= {"control", "device", "copy"} and 0 <= s["overlap_pct"] <= 100
    # fetch-misses computes every expert on the device: the host lane works only for host-deferred slots
    assert ("host" in s["busy_pct"]) == bool(on_host or any(p.host for p in run.plans))
    run.save(tmp_path / "r")
    import pandas as pd

    assert len(pd.read_parquet(tmp_path / "r" / "events.parquet")) == len(ev)


@pytest.mark.parametrize("policy,scope", [("lru", "layer"), ("mrs", "global"), ("lfu", "layer")])
def test_cache_decisions_equal_an_offline_replay_of_the_runs_own_trace(mixtral, tmp_path, policy, scope):
    from moelab.caches import simulate

    ids, mask = _inputs(3)
    # admission "all": every miss is inserted, the cache simulation's rule
    cfg = {"cache": {"capacity": 0.25, "policy": policy, "scope": scope, "admission": "all"},
           "routing": {"deferred": 1, "min_immediate": 1}}
    with moelab.record(mixtral, tmp_path / "t") as rec, moelab.hybrid(mixtral, cfg) as run:
        _gen(mixtral, ids, mask, n=5)
    off = simulate(rec.trace, policy, 0.25, scope, include_prefill=True, keep_hits=True)
    online = [int(e in p.hits) for p in run.plans for e in p.accessed]
    assert online == off.hit.tolist()
    assert run.cache.hits == off.hits and run.cache.evictions == off.evictions


def test_moelab_run_writes_trace_plans_and_timeline_and_refuses_bad_configs(tmp_path, capsys):
    import json

    import pandas as pd

    from moelab.cli import main

    cfg = tmp_path / "h.yaml"
    cfg.write_text("cache: {capacity: 0.25, policy: mrs}\nplacement: greedy-hss\nhardware: pcie4-x16\n"
                   "routing: {deferred: 1, min_immediate: 1}\nexecutor: real\n")
    out = tmp_path / "run"
    rc = main(["run", "--model", "tiny-random-mixtral", "--hybrid", str(cfg), "--task", "demo", "--limit", "2",
               "--max-new-tokens", "3", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "events.parquet", "plans.jsonl", "summary.json",
                                                     "trace"]
    assert moelab.open_trace(out / "trace").num_rows == summary["trace_rows"] > 0
    assert 2 <= summary["generated_tokens"] <= 2 * 3  # 2 prompts, at most 3 new tokens each
    assert json.loads((out / "summary.json").read_text()) == summary
    ev = pd.read_parquet(out / "events.parquet")
    assert {"expert-deferred", "dense"} <= set(ev["kind"]) and summary["plans"] > 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache: {capacity: 0.25}\nplacment: host-misses\n")
    assert main(["run", "--model", "tiny-random-mixtral", "--hybrid", str(bad), "--task", "demo",
                 "--out", str(tmp_path / "x")]) == 2
    assert "unknown key 'placment'" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_eval_under_a_hybrid_config_scores_what_the_policy_scores_and_records_the_config():
    from moelab.evals import EvalConfig, evaluate

    model, tok = moelab.load("tiny-random-mixtral")
    cfg = EvalConfig(tasks=["arith"], limit=4, max_gen_toks=8)
    with ExpertDeferral(model, 1, min_immediate=1):
        want = evaluate(model, tok, config=cfg)
    with moelab.hybrid(model, {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "fetch-misses",
                               "routing": {"deferred": 1, "min_immediate": 1}}):
        got = evaluate(model, tok, config=cfg)
    assert got.tasks["arith"].metrics == want.tasks["arith"].metrics
    assert got.hybrid["placement"] == "fetch-misses" and want.hybrid is None
    assert [p["policy"] for p in got.policies] == ["ExpertDeferral"]



def test_real_executor_copies_low_priority_experts_in_chunks_that_assemble_the_expert(mixtral):
    """``prefetch.chunks: 3`` (ProMoE's chunked copies): every insert (a low-priority copy) goes to the
    copy lane as three copies of a third of its bytes each, a demand copy whole, and the pool slots
    hold exactly the experts' weights afterwards; outputs equal the functional executor's."""
    ids, mask = _inputs(3)
    cfg = {"cache": {"capacity": 0.25, "policy": "lru", "admission": "all"}, "prefetch": {"chunks": 3}}
    with moelab.hybrid(mixtral, cfg) as f:
        want = _gen(mixtral, ids, mask, n=3)
    with moelab.hybrid(mixtral, {**cfg, "executor": "real", "device": "cpu"}) as run:
        got = _gen(mixtral, ids, mask, n=3)
        pool = run._executor.pool
        layers = run.layers
    # read after the run closed its lanes: the copy lane may still be running the last step's
    # low-priority chunks when generation returns (a busy machine showed a half-copied slot)
    for (layer, expert), slot in pool.where.items():  # the pieces assembled each resident expert
        assert torch.equal(pool.gu[slot], layers[layer].experts.gate_up_proj[expert])
        assert torch.equal(pool.dn[slot], layers[layer].experts.down_proj[expert])
    assert pool.where
    assert torch.equal(want[0], got[0])
    assert [p.transfers for p in run.plans] == [p.transfers for p in f.plans]  # chunks change copies, not plans
    ev = run.events_table()
    inserts = [t for p in run.plans for t in p.transfers if t.priority == "insert"]
    assert inserts and not any(t.priority == "demand" for p in run.plans for t in p.transfers)
    chunks = ev[ev["kind"] == "transfer-insert"]
    assert len(chunks) == 3 * len(inserts)
    assert chunks["bytes"].sum() == sum(t.bytes for t in inserts)

@pytest.mark.parametrize("batch", [1, 3])
def test_cache_and_prefetch_decisions_equal_an_offline_replay_with_the_same_predictor(tmp_path, batch):
    from pathlib import Path

    from moelab.caches import simulate
    from moelab.caches.simulation import PrefetchConfig
    from moelab.predictors import as_prefetcher, load_predictor

    pred_dir = Path(__file__).resolve().parent.parent / "predictors" / "moelab-tiny-mixtral" / "learned-d1"
    model, tok = moelab.load("moelab-tiny-mixtral")
    predictor = load_predictor(pred_dir, model=model)
    cfg = {"cache": {"capacity": 0.25, "policy": "lru", "admission": "all"},  # the simulation inserts every miss
           "prefetch": {"predictor": str(pred_dir), "distance": 1}}
    with (moelab.record(model, tmp_path / "t", hidden_states=True, hidden_dtype="float32") as rec,
          moelab.hybrid(model, cfg) as run):
        prompts = ["Question: Tom has 3 apples and 4 more?\nAnswer:", "Question: 7 + 8 =?\nAnswer:",
                   "Question: 12 - 5?\nAnswer:"]
        for i in range(0, 3, batch):
            enc = tok(prompts[i:i + batch], return_tensors="pt", padding=True, padding_side="left")
            model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    off = simulate(rec.trace, "lru", 0.25, "layer", include_prefill=True, keep_hits=True,
                   prefetch=PrefetchConfig(as_prefetcher(predictor, rec.trace), 1))
    assert [int(e in p.hits) for p in run.plans for e in p.accessed] == off.hit.tolist()
    assert run.cache.prefetched == off.prefetched > 0
    planned = sum(1 for p in run.plans for t in p.transfers if t.priority == "prefetch")
    assert planned == run.cache.prefetched


def test_eval_cli_says_which_hybrid_configuration_it_scored(tmp_path, capsys):
    """`moelab eval --hybrid` printed the scores and nothing about the configuration behind them."""
    from moelab.cli import main

    cfg = tmp_path / "h.yaml"
    cfg.write_text("cache: {capacity: 0.25, policy: lfu}\nplacement: fetch-misses\n"
                   "routing: {deferred: 1, min_immediate: 1}\n")
    assert main(["eval", "--model", "tiny-random-mixtral", "--tasks", "arith", "--limit", "1",
                 "--max-gen-toks", "4", "--hybrid", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert ("scored under the hybrid configuration: executor functional; placement fetch-misses; "
            "cache lfu capacity 0.25 (layer); deferred 1, skipped 0") in out
    assert main(["eval", "--model", "tiny-random-mixtral", "--tasks", "arith", "--limit", "1",
                 "--max-gen-toks", "4"]) == 0
    assert "scored unmodified" in capsys.readouterr().out


def test_a_chunked_copy_evicted_between_its_pieces_leaves_the_slot_to_the_next_expert(mixtral):
    """The plan may evict an expert whose chunked copy is under way and hand its slot to a demand
    copy; the copy's remaining pieces then copy nothing (before: they took a slot, the demand copy's,
    and left it holding two thirds of the evicted expert)."""
    from moelab.hybrid.real import ExpertPool

    layers = moelab.moe_layers(mixtral)
    pool = ExpertPool(layers, 1, torch.device("cpu"))
    pool.copy_in(0, 1, 0, 3)  # the first piece of expert 1 takes the only slot
    pool.evict(0, 1)
    pool.copy_in(0, 2)  # a demand copy of expert 2, whole
    pool.copy_in(0, 1, 1, 3)
    pool.copy_in(0, 1, 2, 3)
    assert pool.where == {(0, 2): 0}
    assert torch.equal(pool.gu[0], layers[0].experts.gate_up_proj[2])
    assert torch.equal(pool.dn[0], layers[0].experts.down_proj[2])


def test_real_executor_runs_a_layers_device_experts_on_the_waiting_control_thread(mixtral, monkeypatch):
    """On a CPU-only machine the control thread, which would only wait for the device lane, runs the
    layer's device experts itself (the lane idle: ``Lane(helping=True)``); they stay device-lane
    events, one at a time, and the outputs equal the functional executor's."""
    import threading

    from moelab.backends.reference import REFERENCE

    threads: list[int] = []
    compute = REFERENCE.compute

    def probe(module, hidden, routing):
        threads.append(threading.get_ident())
        return compute(module, hidden, routing)

    ids, mask = _inputs(2)
    cfg = {"cache": {"capacity": 0.5, "policy": "lru"}, "placement": "fetch-misses", "routing": {"deferred": 0}}
    with moelab.hybrid(mixtral, cfg):
        want = _gen(mixtral, ids, mask, n=3)
    monkeypatch.setattr(REFERENCE, "compute", probe)
    with moelab.hybrid(mixtral, {**cfg, "executor": "real", "device": "cpu"}) as run:
        got = _gen(mixtral, ids, mask, n=3)
    assert torch.equal(want[0], got[0])
    ev = run.events_table()
    dev = ev[ev["kind"] == "expert-device"]
    assert len(dev) == len(threads) > 0 and set(threads) == {threading.get_ident()}
    g = dev.sort_values("t_start_us")
    assert (g["t_start_us"].to_numpy()[1:] >= g["t_end_us"].to_numpy()[:-1]).all()
