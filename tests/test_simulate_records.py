"""The simulator's encoder reads the compiled planner's packed records (moelab.simulate.records)
into the same arrays it reads from the reference planner's plain plans, and the events follow."""

from __future__ import annotations

import numpy as np
import pytest

from moelab.caches._fast import HAVE_NUMBA

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed: the compiled planner does not run")



@pytest.fixture(autouse=True)
def _planner_unforced(monkeypatch):
    monkeypatch.delenv("MOELAB_PLANNER", raising=False)  # these tests name the planner of each plan


ARRAYS = ("forward", "step", "layer", "tokens", "prefill", "nx", "nv", "nh", "nf", "last", "x", "v", "h", "f")


def _shape():
    import transformers

    from moelab.timing.shapes import ModelShape

    # 4 MoE layers (the first decoder layer dense) of 16 experts top-4, one shared expert
    return ModelShape.from_hf_config(transformers.Qwen2MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4, num_hidden_layers=5,
        shared_expert_intermediate_size=128, intermediate_size=512, vocab_size=1000, mlp_only_layers=[0],
        num_attention_heads=4, num_key_value_heads=2))


def _plans(shape, config: dict, planner: str, steps: int, tokens: int, seed: int):
    from moelab.simulate.bench import random_plans

    return random_plans(shape, {**config, "planner": planner}, steps=steps, tokens=tokens, seed=seed)


CONFIGS = [  # every branch of a record: hits, fetches, host misses, stolen hits, inserts, deferral, prefetch
    dict(capacity=0.25, policy="lru", placement="host-misses", deferred=2, prefetch=2),
    dict(capacity=0.5, policy="lfu", placement="fetch-misses", deferred=1, prefetch=3, predictor="oracle"),
    dict(capacity=0.25, policy="fifo", placement="greedy-hss", deferred=0, prefetch=2),
    dict(capacity=0.5, policy="lru", placement="greedy-hss", deferred=2, prefetch=0),
]


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_records_encode_to_the_arrays_of_the_reference_planners_plans(i):
    from moelab.simulate.bench import bench_config
    from moelab.simulate.executor import encode
    from moelab.simulate.records import plan_columns

    shape = _shape()
    config = bench_config(**CONFIGS[i])
    if i % 2:
        config["cache"]["admission"] = "all"  # host misses copied in afterwards: insert transfers
    for tokens, seed in ((1, i), (3, 10 + i)):
        compiled = _plans(shape, config, "compiled", steps=5, tokens=tokens, seed=seed)
        reference = _plans(shape, config, "reference", steps=5, tokens=tokens, seed=seed)
        assert plan_columns(compiled) is not None  # the records are read, not the lists
        assert plan_columns(reference) is None
        a = encode(compiled, 16, 4, has_shared=True)
        b = encode(reference, 16, 4, has_shared=True)
        for name in ARRAYS:
            assert np.array_equal(getattr(a, name), getattr(b, name)), (name, tokens)
        # and against the compiled plans' own lists (reading them drops the records)
        c = encode([p.plain() for p in compiled], 16, 4, has_shared=True)
        assert plan_columns(compiled) is None
        for name in ARRAYS:
            assert np.array_equal(getattr(a, name), getattr(c, name)), name


def test_a_record_by_hand():
    """One plan's columns from a record written out by hand (the layout of moelab.hybrid._compiled.pack)."""
    from types import SimpleNamespace

    from moelab.hybrid._compiled import DEVICE, FETCHED, HOSTED, STOLEN
    from moelab.simulate.records import plan_columns

    # needed 5, 3, 7, 1: 5 a hit on an unused prefetch, 3 fetched (and so copied), 7 a host miss copied
    # afterwards, 1 a hit stolen by the host; deferred (7, 1); no evictions; prefetch moved keys 18, 20 into
    # layer 1 (key offset 16)
    needed, tokens = [5, 3, 7, 1], [1, 2, 1, 1]
    hit, where, spec, ins = [1, 0, 0, 1], [DEVICE, FETCHED, HOSTED, STOLEN], [1, 0, 0, 0], [0, 0, 1, 0]
    counts = [4, 1, 0, 0, 2, 0, 2, 0]  # needed, deferred, skipped, evicted, pf in, pf out, moved, error
    rec = counts + needed + tokens + hit + where + spec + ins + [7, 1] + [18, 20]  # (a list, as a lazy plan keeps it)
    dec = SimpleNamespace(planner=SimpleNamespace(expert_bytes=[100, 200]), _offsets=[0, 16, 32])
    plan = SimpleNamespace(_rec=rec, _target=1, _dec=dec, forward=0, step=0, layer=0, tokens=2, phase="decode")
    c = plan_columns([plan])
    assert c["v"].tolist() == [[5, 1, 1], [3, 2, 2]]  # hits first (a prefetch-hit), then fetched (miss-fetch)
    assert c["h"].tolist() == [[7, 1], [1, 1]]  # host misses, then stolen hits
    assert c["f"].tolist() == [[7, 1]]
    assert c["x"].tolist() == [[0, 3, 100, 0], [0, 7, 100, 1], [1, 2, 200, 2], [1, 4, 200, 2]]
    assert (c["nv"].tolist(), c["nh"].tolist(), c["nf"].tolist(), c["nx"].tolist()) == ([2], [2], [1], [4])
    rec[6] = 0  # the prefetch moved nothing: its insertions are not transfers
    assert plan_columns([plan])["x"].tolist() == [[0, 3, 100, 0], [0, 7, 100, 1]]


def test_fast_path_events_from_records_equal_the_reference():
    from moelab.simulate.bench import bench_config, events_equal
    from moelab.simulate.executor import simulate_plans
    from moelab.timing import get_profile

    shape = _shape()
    hw = get_profile("ktransformers-a100")
    config = bench_config()
    fast = simulate_plans(_plans(shape, config, "compiled", steps=4, tokens=1, seed=3), shape, hw, engine="fast")
    ref = simulate_plans(_plans(shape, config, "reference", steps=4, tokens=1, seed=3), shape, hw,
                         engine="reference", reference_graph=True)
    assert len(fast.events) > 0 and events_equal(ref.events, fast.events)


def test_bench_cli_reads_records_and_checks_parity(capsys):
    import json

    from moelab.cli import main

    args = ["bench", "simulate", "--tokens", "2", "--reference-tokens", "1", "--repeat", "1", "--allow-busy", "--json"]
    assert main([*args, "--planner", "compiled"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["planner"], d["plans_from"], d["parity"]) == ("compiled", "records", True)
    assert d["fast"]["events"] > 0 and d["plans"] == 2 * 58
    assert main([*args, "--planner", "reference"]) == 0
    d2 = json.loads(capsys.readouterr().out)
    assert (d2["planner"], d2["plans_from"], d2["parity"]) == ("reference", "lists", True)
    assert d2["fast"]["events"] == d["fast"]["events"]  # the same plans either way


def test_bench_planner_names_are_checked(monkeypatch):
    from moelab.errors import MoelabError
    from moelab.simulate.bench import bench_planner

    assert bench_planner("reference") == "reference" and bench_planner("auto") == "compiled"
    monkeypatch.setenv("MOELAB_PLANNER", "reference")  # the environment overrides, as for every planner
    assert bench_planner("compiled") == "reference"
    with pytest.raises(MoelabError, match="bench planner 'compild'"):
        bench_planner("compild")


def test_plans_of_two_planners_are_read_from_their_lists():
    from moelab.simulate.bench import bench_config
    from moelab.simulate.records import plan_columns

    shape = _shape()
    a = _plans(shape, bench_config(), "compiled", steps=1, tokens=1, seed=0)
    b = _plans(shape, bench_config(), "compiled", steps=1, tokens=1, seed=1)
    assert plan_columns(a) is not None and plan_columns(b) is not None
    assert plan_columns(a + b) is None  # two planners' records: the lists are read instead
