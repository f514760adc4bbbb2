"""`moelab bench hybrid --side-by-side` (issue #26 item 6): the table's rows, run on a bundled tiny
model so the test takes seconds (the benchmark itself uses DeepSeek-V2-Lite-shaped layers).

Checks what the rows mean, not how fast anything is: every plain experts implementation is
measured, the baseline is the fastest of them, moelab's two runs carry the simulator's prediction
of their own plans, and the full configuration really plans deferral and a partial cache."""

from __future__ import annotations

import pytest

import moelab
from moelab.errors import MoelabError
from moelab.simulate.side_by_side import PLAIN_EXPERTS, side_by_side, side_configs


@pytest.fixture(scope="module")
def tiny():
    model, _ = moelab.load("moelab-tiny-mixtral")
    return model


def test_configs_mean_what_the_table_says():
    cfgs = side_configs("pcie4-x16")
    nothing, full = cfgs["nothing enabled"], cfgs["full"]
    assert nothing["cache"]["capacity"] == 1.0 and nothing["routing"]["deferred"] == 0
    assert "prefetch" not in nothing and nothing["executor"] == "real"
    assert full["cache"]["capacity"] < 1 and full["routing"]["deferred"] > 0
    assert full["placement"] == "greedy-hss" and full["hardware"] == "pcie4-x16"


def test_rows_on_a_tiny_model(tiny, monkeypatch):
    monkeypatch.setenv("MOELAB_PLANNER", "reference")  # the rows' meaning, not the planner (tested elsewhere)
    before = getattr(tiny.config, "_experts_implementation", None)
    r = side_by_side(steps=2, repeats=1, profile="pcie4-x16", model=tiny)
    rows = r["rows"]
    plain = [row for row in rows if row["kind"] == "plain"]
    assert [row["label"].split(", ")[1] for row in plain] == [f"{impl} experts" for impl in PLAIN_EXPERTS]
    assert r["best_plain"]["step_ms"] == min(row["step_ms"] for row in plain)
    runs = {row["kind"]: row for row in rows if row["kind"] != "plain"}
    assert set(runs) == {"nothing enabled", "full"}
    # "every expert resident" holds: the warmed capacity-1.0 cache serves every decode step's work
    assert runs["nothing enabled"]["device_pct"] == 100.0
    assert 0.0 <= runs["full"]["device_pct"] <= 100.0
    for row in runs.values():
        assert row["step_ms"] > 0 and row["sim_step_ms"] > 0
        assert row["events_per_step"] > 0 and row["recording_pct"] > 0
    # the model's experts implementation is left as it was
    assert getattr(tiny.config, "_experts_implementation", None) == before
    # each ratio to the best plain row is taken loop by loop: the best plain row's own is 1
    assert r["best_plain"]["ratio"] == {"median": 1.0, "q25": 1.0, "q75": 1.0}
    for row in rows:
        q = row["ratio"]
        assert 0 < q["q25"] <= q["median"] <= q["q75"]


def test_the_rows_loops_are_interleaved_round_by_round(tiny, monkeypatch):
    """Every round runs one timed loop of every row in the table's order (plain implementations,
    then moelab's runs, each applied for its loop only), so a drift of the machine's speed touches
    every row alike."""
    from moelab.hybrid.runtime import active_hybrid
    from moelab.simulate import side_by_side as sbs

    monkeypatch.setenv("MOELAB_PLANNER", "reference")
    seen = []
    decode = sbs._decode

    def recording(model, ids, steps):
        run = active_hybrid(model)
        seen.append((steps, "moelab" if run is not None else model.config._experts_implementation))
        return decode(model, ids, steps)

    monkeypatch.setattr(sbs, "_decode", recording)
    sbs.side_by_side(steps=3, repeats=2, profile="pcie4-x16", model=tiny)
    timed = [who for steps, who in seen if steps == 3]
    one_round = [*PLAIN_EXPERTS, "moelab", "moelab"]
    # the warm-start traces (warm_cache) run their own loops first; the timed rounds follow
    assert timed[-2 * len(one_round):] == one_round * 2


def test_an_unwarmed_cache_stays_empty_under_host_misses(tiny, caplog):
    """Why side_by_side warms its caches: without a warm start, capacity 1.0 under host-misses
    never holds an expert (a host miss is not copied in), so "every expert resident" would be false;
    a run so configured says so."""
    import logging

    import torch

    from moelab.forward.bench import decode_loop
    from moelab.hybrid.runtime import HybridRun
    from moelab.simulate.side_by_side import device_share

    ids = torch.randint(3, 250, (1, 6), generator=torch.Generator().manual_seed(0))
    cfg = {**side_configs("pcie4-x16")["nothing enabled"], "executor": "functional"}
    run = HybridRun(tiny, cfg)
    with caplog.at_level(logging.WARNING, logger="moelab.hybrid.runtime"), run:
        decode_loop(tiny, ids, 3)
    assert device_share(run.plans) == 0.0
    assert "never fills" in caplog.text and "capacity=1.0" in caplog.text
    for fills in ({"placement": "fetch-misses"}, {"cache": {**cfg["cache"], "admission": "all"}}):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moelab.hybrid.runtime"), HybridRun(tiny, {**cfg, **fills}):
            pass
        assert "never fills" not in caplog.text, fills


def test_bad_repeats_named():
    with pytest.raises(MoelabError, match="repeats=0"):
        side_by_side(repeats=0, profile="pcie4-x16")


def test_the_device_lanes_backend_is_a_choice_and_a_bad_name_is_named(tiny, monkeypatch):
    monkeypatch.setenv("MOELAB_PLANNER", "reference")
    assert {c["device_backend"] for c in side_configs("pcie4-x16", device_backend="grouped_mm").values()} == \
        {"grouped_mm"}
    r = side_by_side(steps=2, repeats=1, profile="pcie4-x16", model=tiny, device_backend="grouped_mm")
    runs = {row["kind"]: row for row in r["rows"] if row["kind"] != "plain"}
    assert {row["device_backend"] for row in runs.values()} == {"grouped_mm"}
    assert runs["nothing enabled"]["device_pct"] == 100.0
    with pytest.raises(MoelabError, match="grouped_mn"):
        side_by_side(repeats=1, profile="pcie4-x16", model=tiny, device_backend="grouped_mn")


def test_auto_probes_the_plain_implementations_and_takes_the_fastest(tiny, monkeypatch):
    """``fastest_plain`` times every plain implementation in interleaved rounds (a warm-up loop each
    first) and picks the lowest median; the model's implementation is left as it was."""
    import torch

    from moelab.simulate import side_by_side as sbs

    fake = {"eager": [3.0, 3.1, 2.9], "batched_mm": [1.2, 0.9, 5.0], "grouped_mm": [1.0, 4.0, 4.0]}
    seen = []

    def timed(model, ids, steps):
        impl = model.config._experts_implementation
        seen.append((impl, steps))
        done = sum(1 for i, s in seen if i == impl and s == steps)
        return fake[impl][done - 1] if steps == 5 else 0.0

    before = getattr(tiny.config, "_experts_implementation", None)
    monkeypatch.setattr(sbs, "_decode", timed)
    best, med = sbs.fastest_plain(tiny, torch.ones(1, 4, dtype=torch.long), steps=5)
    assert best == "batched_mm"  # medians 3.0 / 1.2 / 4.0: one fast loop does not make grouped_mm the best
    assert med == {"eager": 3.0, "batched_mm": 1.2, "grouped_mm": 4.0}
    assert [i for i, s in seen if s == 2] == list(PLAIN_EXPERTS)  # warm-ups
    assert [i for i, s in seen if s == 5] == list(PLAIN_EXPERTS) * 3  # interleaved rounds
    assert getattr(tiny.config, "_experts_implementation", None) == before


def test_auto_is_the_default_and_runs_the_device_lane_on_the_probes_choice(tiny, monkeypatch):
    from moelab.simulate import side_by_side as sbs

    monkeypatch.setenv("MOELAB_PLANNER", "reference")
    monkeypatch.setattr(sbs, "fastest_plain", lambda model, ids, steps: ("eager", {"eager": 0.001}))
    r = sbs.side_by_side(steps=2, repeats=1, profile="pcie4-x16", model=tiny)
    runs = {row["kind"]: row for row in r["rows"] if row["kind"] != "plain"}
    assert r["device_backend"] == "eager" and r["device_backend_probe"] == {"eager": 0.001}
    assert {row["device_backend"] for row in runs.values()} == {"eager"}
    assert runs["nothing enabled"]["device_pct"] == 100.0
    named = sbs.side_by_side(steps=2, repeats=1, profile="pcie4-x16", model=tiny, device_backend="reference")
    assert named["device_backend"] == "reference" and named["device_backend_probe"] is None
