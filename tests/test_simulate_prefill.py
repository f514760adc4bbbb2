"""Stream-loading prefill (OSDI '26 §3.1) and the hybrid path: the ring recurrences by hand, the
ring-size rule, memory refusal, the crossover search, events and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moelab.errors import MoelabError
from moelab.events import COLUMNS
from moelab.simulate.prefill import (
    PrefillConfig,
    crossover_tokens,
    expected_load,
    hybrid_time_us,
    prefill,
    reexpand_flops,
    slp_schedule,
    stream_schedule,
)
from moelab.timing.costs import CostModel
from moelab.timing.memory import MemoryDoesNotFit
from moelab.timing.profile import apply_settings, get_profile
from moelab.timing.shapes import get_shape

LITE = get_shape("deepseek-v2-lite")
HW = "pcie4-x16"


def _run(load, comp, R, ring=None, **kw):
    ring = [True] * len(load) if ring is None else ring
    ls, le, cs, ce, slot = stream_schedule(load, comp, ring, R, **kw)
    return [tuple(float(x) for x in row) for row in zip(ls, le, cs, ce, strict=True)], slot.tolist()


# ---------------------------------------------------------------------- the recurrences, by hand
def test_ring_of_one_slot_serialises_copy_and_compute():
    # load_start(j) >= max(load_end(j-1), compute_end(j-1)): nothing overlaps
    rows, slot = _run([2, 2, 2], [3, 3, 3], R=1)
    assert rows == [(0, 2, 2, 5), (5, 7, 7, 10), (10, 12, 12, 15)]
    assert slot == [0, 0, 0]


def test_ping_pong_of_two_slots():
    # j1 loads while j0 computes; j2 waits for j0's compute to free slot 0
    rows, slot = _run([2, 2, 2], [3, 3, 3], R=2)
    assert rows == [(0, 2, 2, 5), (2, 4, 5, 8), (5, 7, 8, 11)]
    assert slot == [0, 1, 0]


def test_ring_of_e_slots_never_waits_for_a_slot_and_beats_two_here():
    load, comp = [1, 1, 1, 1], [5, 0.5, 0.5, 0.5]
    r2, _ = _run(load, comp, R=2)
    r4, slot = _run(load, comp, R=4)
    assert r2 == [(0, 1, 1, 6), (1, 2, 6, 6.5), (6, 7, 7, 7.5), (7, 8, 8, 8.5)]
    assert r4 == [(0, 1, 1, 6), (1, 2, 6, 6.5), (2, 3, 6.5, 7), (3, 4, 7, 7.5)]
    assert slot == [0, 1, 2, 3]


def test_dense_budget_blocks_the_loader_until_a_dense_module_is_freed():
    # dense (0.6 GB), expert, dense (0.6 GB) under a 1 GB budget, one ring slot
    kw = dict(ring=[False, True, False], budget_bytes=[0.6e9, 0, 0.6e9])
    rows, slot = _run([1, 1, 1], [3, 1, 1], R=1, dense_budget=1e9, **kw)
    assert rows == [(0, 1, 1, 4), (1, 2, 4, 5), (4, 5, 5, 6)]  # the 2nd dense waits for the 1st's compute end
    assert slot == [-1, 0, -1]
    free, _ = _run([1, 1, 1], [3, 1, 1], R=1, dense_budget=2e9, **kw)
    assert free[2] == (2, 3, 5, 6)
    with pytest.raises(MoelabError, match="dense budget"):
        _run([1], [1], R=1, ring=[False], budget_bytes=[2e9], dense_budget=1e9)


def test_expected_load_is_uniform_routing():
    assert expected_load(2048, 256, 8) == (256, 64.0)
    a, n = expected_load(1, 64, 6)  # one token hits k experts
    assert a == 6 and n == 1.0


# ---------------------------------------------------------------------- the schedule on a shape
def test_slp_time_is_at_least_every_copy_and_every_compute():
    costs = CostModel.of(LITE, HW)
    s, _, _ = slp_schedule(costs, PrefillConfig(prompt_tokens=2048, crossover=False))
    n_x = LITE.num_experts * LITE.num_moe_layers
    assert (s.kind == "expert").sum() == n_x
    assert s.time_us >= (s.load_end - s.load_start).sum() - 1e-6  # one copy engine, all weights streamed
    assert s.time_us >= (s.compute_end - s.compute_start).sum() - 1e-6
    assert np.all(s.compute_start >= s.load_end - 1e-9)
    assert np.all(np.diff(s.compute_start) >= 0)


def test_ring_of_e_never_slower_than_two_when_it_fits():
    for T in (256, 4096, 32768):
        tE = prefill(LITE, HW, PrefillConfig(prompt_tokens=T, ring_slots=LITE.num_experts, crossover=False))
        t2 = prefill(LITE, HW, PrefillConfig(prompt_tokens=T, ring_slots=2, crossover=False))
        assert tE.time_us <= t2.time_us + 1e-6


def test_faster_link_is_never_slower():
    hw = get_profile(HW)
    fast = apply_settings(hw, ["link_bandwidth_gbs=64"])
    for T in (512, 8192):
        for R in (2, None):
            cfg = PrefillConfig(prompt_tokens=T, ring_slots=R, crossover=False)
            assert prefill(LITE, fast, cfg).time_us <= prefill(LITE, hw, cfg).time_us + 1e-6


def test_ring_rule_e_while_transfer_dominates_then_two():
    short = prefill(LITE, HW, PrefillConfig(prompt_tokens=64, crossover=False))
    assert short.ring_slots == LITE.num_experts and "transfer dominates" in short.ring_reason
    fast = apply_settings(get_profile(HW), ["link_bandwidth_gbs=10000"])  # copies cheaper than compute
    long = prefill(LITE, fast, PrefillConfig(prompt_tokens=32768, crossover=False))
    assert long.ring_slots == 2 and "turning point" in long.ring_reason


def test_ring_of_two_when_e_slots_overflow_gpu_memory():
    costs = CostModel.of(LITE, HW)
    # E slots need 64 × 17.3 MB = 1.1 GB; give the GPU room for the rest and a few slots only
    hw = apply_settings(get_profile(HW), ["gpu_memory_gb=2.7"])
    r = prefill(LITE, hw, PrefillConfig(prompt_tokens=1024, crossover=False))
    assert r.ring_slots == 2 and "overflow" in r.ring_reason
    assert r.memory.fits and costs.num_experts > r.memory.max_slots_that_fit >= 2


def test_memory_refusal_names_the_numbers():
    hw = apply_settings(get_profile(HW), ["gpu_memory_gb=1.5"])
    with pytest.raises(MemoryDoesNotFit) as e:
        prefill(LITE, hw, PrefillConfig(prompt_tokens=4096, path="slp", crossover=False))
    msg = str(e.value)
    assert "1.5 GB" in msg and "gpu_memory_gb" in msg and "R=2" in msg and "expert ring" in msg
    assert "4096 tokens" in msg


# ---------------------------------------------------------------------- the crossover
def test_crossover_is_where_slp_starts_to_win():
    costs = CostModel.of(LITE, HW)
    c = crossover_tokens(costs, PrefillConfig(prompt_tokens=1))
    assert c is not None and c > 1

    def times(t):
        cfg = PrefillConfig(prompt_tokens=t, crossover=False)
        return slp_schedule(costs, cfg)[0].time_us, hybrid_time_us(costs, cfg)[0]

    s, h = times(c)
    assert s <= h
    s, h = times(c - 1)
    assert s > h


def test_crossover_moves_shorter_with_a_faster_link():
    hw = get_profile(HW)
    slow = crossover_tokens(CostModel.of(LITE, apply_settings(hw, ["link_bandwidth_gbs=16"])), PrefillConfig(1))
    fast = crossover_tokens(CostModel.of(LITE, apply_settings(hw, ["link_bandwidth_gbs=64"])), PrefillConfig(1))
    assert slow is not None and fast is not None and fast < slow


def test_auto_path_follows_the_crossover():
    r = prefill(LITE, HW, PrefillConfig(prompt_tokens=64, path="auto"))
    assert r.crossover_tokens is not None
    assert r.path == ("slp" if r.crossover_tokens <= 64 else "hybrid")
    long = prefill(LITE, HW, PrefillConfig(prompt_tokens=max(2 * r.crossover_tokens, 64), path="auto"))
    assert long.path == "slp" and long.time_us <= long.hybrid_time_us


def test_bad_inputs_name_the_value():
    for kw, word in ((dict(prompt_tokens=0), "prompt_tokens"), (dict(prompt_tokens=8, path="gpu"), "gpu"),
                     (dict(prompt_tokens=8, ring_slots=0), "ring_slots"),
                     (dict(prompt_tokens=8, dense_budget_gb=0), "dense_budget_gb")):
        with pytest.raises(MoelabError, match=word):
            PrefillConfig(**kw)


# ---------------------------------------------------------------------- events and the timeline
def test_events_have_the_schema_and_ring_slots_as_lanes():
    r = prefill(LITE, HW, PrefillConfig(prompt_tokens=256, ring_slots=4, crossover=False))
    ev = r.events()
    assert list(ev.columns) == list(COLUMNS)
    lanes = set(ev["lane"])
    assert {"copy", "device", "unloader", "slot0", "slot1", "slot2", "slot3"} <= lanes and "slot4" not in lanes
    s = r.schedule
    assert (ev["kind"] == "transfer-prefetch").sum() == len(s.kind)
    # a slot never holds two experts at once
    for lane in ("slot0", "slot3"):
        sl = ev[ev["lane"] == lane].sort_values("t_start_us")
        assert np.all(sl["t_start_us"].to_numpy()[1:] >= sl["t_end_us"].to_numpy()[:-1] - 1e-9)
    assert ev["t_end_us"].max() == pytest.approx(r.time_us)


def test_a_timeline_figure_builds_from_the_slp_events():
    pytest.importorskip("plotly")
    from moelab.timeline import Timeline

    r = prefill(LITE, HW, PrefillConfig(prompt_tokens=128, ring_slots=2, crossover=False))
    tl = Timeline(r.events(), name="slp")
    assert {"slot0", "slot1"} <= set(tl.lanes)
    fig = tl.figure()
    assert len(fig.data) > 0


# ---------------------------------------------------------------------- CLI
def test_cli_prefill_text_and_json(capsys):
    from moelab.cli import main

    assert main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
                 "--prompt-tokens", "4096", "--prefill-path", "slp", "--ring-slots", "8"]) == 0
    out = capsys.readouterr().out
    assert "prefill of 4096 tokens on the slp path" in out and "R=8" in out and "crossover" in out
    assert main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
                 "--prompt-tokens", "300", "--prefill-path", "hybrid", "--chunk-tokens", "128", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["path"] == "hybrid" and d["prompt_tokens"] == 300 and d["chunk_tokens"] == 128
    assert d["tokens_per_s"] > 0 and d["crossover_tokens"] is not None


def test_cli_prefill_refusal_is_one_clear_error(capsys):
    from moelab.cli import main

    rc = main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
               "--set", "gpu_memory_gb=1", "--prompt-tokens", "4096", "--prefill-path", "slp"])
    assert rc != 0
    assert "gpu_memory_gb" in capsys.readouterr().err


# ---------------------------------------------------------------------- batch > 1 decode (what-if grid)
def test_batch_decode_counts_every_sequence_and_its_kv_cache():
    from moelab.simulate.whatif import whatif

    df = whatif(LITE, HW, synthetic=True, steps=2, warmup=1, batch=4, context=256, grid=["capacity=0"],
                oracle=False)
    row = df.iloc[0]
    # tokens per decode step = the batch: tok/s × step time
    assert row["tokens_per_s"] * row["step_ms"] / 1e3 == pytest.approx(4.0, rel=1e-6)
    one = whatif(LITE, HW, synthetic=True, steps=2, warmup=1, batch=1, context=256, grid=["capacity=0"],
                 oracle=False).iloc[0]
    assert row["gpu_need_gb"] > one["gpu_need_gb"]  # four sequences' KV cache
    with pytest.raises(MemoryDoesNotFit, match="batch 4096"):
        whatif(LITE, HW, synthetic=True, steps=1, warmup=0, batch=4096, context=32768, grid=["capacity=0"],
               oracle=False)


# ---------------------------------------------------------------------- validation rows (predictions)
def test_osdi_prefill_rows_are_predictions_without_a_score():
    from moelab.simulate.prefill_cases import osdi_prefill_rows
    from moelab.simulate.validate import format_rows

    rows = osdi_prefill_rows(quick=True)
    assert [r["case"] for r in rows] == ["osdi26-slp-prefill-2k", "osdi26-slp-prefill-32k", "osdi26-slp-crossover"]
    for r in rows:
        assert r["reference"] is None and r["error"] is None and r["target"] == "prediction only"
    assert all(r["simulated"] > 0 for r in rows[:2])
    cross = rows[2]["simulated"]
    # the crossover separates the two paths at 2K: SLP faster there iff 2K is past it
    hyb = float(rows[0]["sensitivity"].split("hybrid path ")[1].split(" tok/s")[0])
    assert (rows[0]["simulated"] >= hyb) == (cross is not None and cross <= 2048)
    text = format_rows(rows, {"wall_s": 0})
    assert "osdi26-slp-crossover" in text and "prediction only" in text and "no published number" in text


# ---------------------------------------------------------------------- mixed prefill + decode
def test_decode_lane_shares_the_gpu_at_module_boundaries_by_hand():
    from moelab.simulate.prefill_mixed import _DecodeLane

    lane = _DecodeLane([(1.0, 1.0)])  # a decode step: 1 µs GPU, then 1 µs CPU
    rows, _ = _run([1, 1], [2, 2], R=2, gpu=lane)
    # decode runs 0-1 first (ready at 0); SLP 1-3; decode (ready 2) waits for the GPU: 3-4; SLP 4-6
    assert rows == [(0, 1, 1, 3), (1, 2, 4, 6)]
    assert lane.step_ends == [2.0, 5.0] and lane.busy == 2.0


def test_mixed_prefill_is_never_faster_and_decode_never_faster_than_alone():
    from moelab.simulate.prefill_mixed import mixed_prefill_decode

    for T, Y in ((512, 1), (2048, 4)):
        m = mixed_prefill_decode(LITE, HW, PrefillConfig(prompt_tokens=T, crossover=False), decode_batch=Y)
        assert m.prefill_us >= m.prefill_alone_us - 1e-6
        assert m.decode_tokens_per_s <= m.decode_tokens_per_s_alone + 1e-9
        assert m.cpu_slowdown > 1.0 and m.memory.gpu.term("decode dense weights").bytes > 0


def test_mixed_refusal_names_decode_memory(capsys):
    from moelab.cli import main

    rc = main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
               "--set", "gpu_memory_gb=4", "--prompt-tokens", "1024", "--prefill-path", "slp", "--decode-batch", "2"])
    assert rc != 0 and "decode dense weights" in capsys.readouterr().err
    assert main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
                 "--prompt-tokens", "1024", "--prefill-path", "slp", "--decode-batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["decode_batch"] == 2 and d["prefill_ms"] >= d["prefill_alone_ms"]


# ---------------------------------------------------------------------- the CPU stand-in of the real executor
@pytest.fixture(scope="module")
def tiny_layer():
    from moelab.adapters import moe_layers
    from moelab.loading import load

    model, _ = load("moelab-tiny-mixtral")
    return model, moe_layers(model)[1]


@pytest.mark.parametrize("R", [1, 2, 8])
def test_real_slp_layer_equals_the_plain_layer_and_keeps_the_ring_order(tiny_layer, R):
    import torch

    from moelab.backends.reference import REFERENCE
    from moelab.hybrid.slp import slp_layer

    model, layer = tiny_layer
    torch.manual_seed(R)
    hidden = torch.randn(29, model.config.hidden_size, dtype=layer.experts.down_proj.dtype)
    out, log = slp_layer(layer, hidden, ring_slots=R)
    r = layer.route(hidden)
    with torch.no_grad():
        assert torch.equal(out, REFERENCE(layer.experts, hidden, r.experts, r.weights))  # same maths and order
        torch.testing.assert_close(out, layer.experts(hidden, r.experts, r.weights))  # the eager layer
    ev = log.table().to_pandas()
    E = layer.num_experts
    copy = ev[ev["lane"] == "copy"].set_index("expert")
    dev = ev[ev["lane"] == "device"].set_index("expert")
    rel = ev[ev["lane"] == "unloader"].set_index("expert")
    assert len(copy) == len(dev) == len(rel) == E
    assert set(ev["lane"]) - {"copy", "device", "unloader"} == {f"slot{i}" for i in range(min(R, E))}
    for j in range(E):
        assert dev.at[j, "t_start_us"] >= copy.at[j, "t_end_us"]  # ON: compute after its copy
        assert rel.at[j, "t_start_us"] >= dev.at[j, "t_end_us"]  # OFF: release after compute
        if j >= R:  # the slot is reused only once the unloader freed expert j - R
            assert copy.at[j, "t_start_us"] >= rel.at[j - R, "t_start_us"]
    assert dev["tokens"].sum() == r.experts.numel()


def test_real_slp_events_draw_as_a_timeline(tiny_layer):
    pytest.importorskip("plotly")
    import torch

    from moelab.hybrid.slp import slp_layer
    from moelab.timeline import Timeline

    model, layer = tiny_layer
    _, log = slp_layer(layer, torch.randn(5, model.config.hidden_size), ring_slots=2)
    tl = Timeline(log, name="slp-real")
    assert {"slot0", "slot1", "copy", "device"} <= set(tl.lanes)
    assert len(tl.figure().data) > 0
    with pytest.raises(MoelabError, match="ring_slots"):
        slp_layer(layer, torch.randn(2, model.config.hidden_size), ring_slots=0)


def test_cli_prefill_writes_events_the_timeline_opens(tmp_path, capsys):
    from moelab.cli import main
    from moelab.timeline import Timeline

    out = tmp_path / "slp.parquet"
    assert main(["simulate", "--phase", "prefill", "--model-shape", "deepseek-v2-lite", "--hardware", HW,
                 "--prompt-tokens", "512", "--prefill-path", "slp", "--ring-slots", "3", "--events", str(out)]) == 0
    capsys.readouterr()
    tl = Timeline(out)
    assert {"slot0", "slot1", "slot2", "copy", "device", "unloader"} == set(tl.lanes)


def test_a_given_routing_loads_every_expert_but_computes_only_the_routed():
    costs = CostModel.of(LITE, HW)
    T, E, L = 64, LITE.num_experts, LITE.num_moe_layers
    tpe = np.zeros((L, E))
    tpe[:, 3] = T * LITE.top_k  # every token's every slot on expert 3 (a degenerate routing)
    s, _, _ = slp_schedule(costs, PrefillConfig(prompt_tokens=T, tokens_per_expert=tpe, crossover=False))
    x = s.kind == "expert"
    busy = s.compute_end[x] - s.compute_start[x]
    assert x.sum() == L * E  # loading ignores routing
    assert np.all(busy[s.expert[x] != 3] == 0)
    assert np.allclose(busy[s.expert[x] == 3], costs.device_us(float(T * LITE.top_k)))
    with pytest.raises(MoelabError, match="tokens_per_expert"):
        slp_schedule(costs, PrefillConfig(prompt_tokens=T, tokens_per_expert=np.zeros((2, 2)), crossover=False))


def test_mla_prefill_flops_are_the_up_projected_form():
    s = LITE  # MLA: each attended position costs 2 × heads × (qk_nope + qk_rope + v_head) in prefill kernels
    step = s.attention_flops(2, 1, layer=0, prefill=True) - s.attention_flops(1, 1, layer=0, prefill=True)
    assert step == 2 * s.num_heads * (s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim)
    dec = s.attention_flops(2, 1, layer=0) - s.attention_flops(1, 1, layer=0)  # decode: the absorbed form
    assert dec == 2 * s.num_heads * (2 * s.kv_lora_rank + s.qk_rope_head_dim)


def test_chunked_mla_prefill_re_expands_the_cached_latent_per_chunk(monkeypatch):
    import moelab.simulate.prefill as pf

    s = LITE  # each cached token: its latent (kv_lora_rank) up-projected to every head's nope key and value
    assert reexpand_flops(s, 100) == 100 * 2 * s.kv_lora_rank * s.num_heads * (s.qk_nope_head_dim + s.v_head_dim)
    assert reexpand_flops(s, 0) == 0 and reexpand_flops(get_shape("mixtral-8x7b"), 100) == 0  # GQA caches K, V
    costs = CostModel.of(LITE, get_profile(HW))
    one_chunk = PrefillConfig(prompt_tokens=2048, chunk_tokens=2048, crossover=False)
    chunked = PrefillConfig(prompt_tokens=2048, chunk_tokens=256, crossover=False)
    mix = CostModel.of(get_shape("mixtral-8x7b"), get_profile(HW))
    with_re = {c.chunk_tokens: hybrid_time_us(costs, c)[0] for c in (one_chunk, chunked)}
    mix_with = hybrid_time_us(mix, chunked)[0]
    monkeypatch.setattr(pf, "reexpand_flops", lambda shape, cached: 0.0)
    without = {c.chunk_tokens: hybrid_time_us(costs, c)[0] for c in (one_chunk, chunked)}
    assert with_re[2048] == without[2048]  # one chunk: nothing cached before it
    assert with_re[256] > without[256]  # seven later chunks each re-expand the prompt before them
    assert mix_with == hybrid_time_us(mix, chunked)[0]  # GQA: the cache holds K and V, nothing to expand


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(),
                    reason="needs a CUDA GPU (stream-loading on CUDA streams and events); none here")
@pytest.mark.parametrize("R", [1, 2, 8])
def test_cuda_slp_layer_equals_the_cpu_stand_in_and_keeps_the_ring_order(R):
    import torch

    from moelab.adapters import moe_layers
    from moelab.hybrid.slp import slp_layer, slp_layer_cuda
    from moelab.loading import load

    model, _ = load("moelab-tiny-mixtral")
    layer = moe_layers(model)[1]
    torch.manual_seed(R)
    hidden = torch.randn(29, model.config.hidden_size, dtype=layer.experts.down_proj.dtype)
    want, _ = slp_layer(layer, hidden, ring_slots=R)
    layer.router.cuda()  # the dense module on the GPU; the experts stay in host memory
    out, log = slp_layer_cuda(layer, hidden.cuda(), ring_slots=R)
    assert layer.experts.down_proj.device.type == "cpu"
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-6)
    ev = log.table().to_pandas()
    E = layer.num_experts
    copy = ev[ev["lane"] == "copy"].set_index("expert")
    dev = ev[ev["lane"] == "device"].set_index("expert")
    assert len(copy) == len(dev) == E and dev["tokens"].sum() == 29 * layer.top_k
    for j in range(E):
        assert dev.at[j, "t_start_us"] >= copy.at[j, "t_end_us"] - 1  # ON (1 µs: two streams' clocks)
        if j >= R:
            assert copy.at[j, "t_start_us"] >= dev.at[j - R, "t_end_us"] - 1  # OFF frees the slot
    with pytest.raises(MoelabError, match="CUDA"):
        slp_layer_cuda(layer, hidden, ring_slots=R)
