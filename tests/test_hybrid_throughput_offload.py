"""MoE-Gen's decode with weights and KV cache in host memory (moelab.hybrid.throughput_offload).

Where no GPU is, the CPU stand-in runs the same code (every copy a memcpy between separate host
buffers); with ``defer_copies`` each copy runs as late as CUDA may run it, so a missing wait between
streams changes the output (and the test that drops the waits shows that it does). Parity: the greedy decode equals the plain model's; a run after the model's own weights
were overwritten with NaN still does, so every weight the decode reads went through the decoder's
copies. Events, from MoE-Gen's schedule (techniques.md §7.1): per layer and micro-batch one KV copy
in and one write-back of the new position; one S_Dense load per layer and step; no copy of a pinned
expert; every active streamed expert copied before it computes, ring slot by slot; the host KV
store ends holding the plain model's K/V of every position. The CUDA tests need a GPU
(``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.hybrid.throughput import plain_generate
from moelab.hybrid.throughput_offload import OffloadedDecoder
from moelab.models.tiny import build_tiny

NAMES = ["moelab-tiny-mixtral", "moelab-tiny-qwen2moe", "tiny-deepseek_v2"]


@pytest.fixture(scope="module")
def models():
    out = {name: moelab.load(name)[0] for name in NAMES[:2]}
    out["tiny-deepseek_v2"] = build_tiny("deepseek_v2", seed=0)
    return out


def _ids(model, B: int, P: int = 5) -> torch.Tensor:
    return torch.randint(3, int(model.config.vocab_size), (B, P), generator=torch.Generator().manual_seed(B))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("B,ba,be,slots,pinned", [(4, 2, 3, 2, 0), (5, 5, 1, 1, 3), (6, 4, 64, 3, 5)])
def test_offloaded_greedy_equals_plain_greedy(models, name, B, ba, be, slots, pinned):
    m = models[name]
    ids = _ids(m, B)
    ref = plain_generate(m, ids, 3)
    out = OffloadedDecoder(m, ba, be, device="cpu", expert_slots=slots, pinned_experts=pinned).generate(ids, 3)
    assert torch.equal(out.tokens, ref.tokens)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_with_copies_as_late_as_cuda_may_run_them_the_decode_is_unchanged(models, name):
    m = models[name]
    ids = _ids(m, 5)
    ref = plain_generate(m, ids, 3)
    out = OffloadedDecoder(m, 2, 3, device="cpu", expert_slots=2, pinned_experts=2, defer_copies=True).generate(ids, 3)
    assert torch.equal(out.tokens, ref.tokens)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dropped", ["reader-waits-for-copy", "copy-waits-for-copy", "copy-waits-for-compute"])
def test_the_late_copies_catch_a_missing_wait(models, monkeypatch, dropped):
    """The check works: drop one kind of wait — the compute stream's for its copies (a read before the
    copy), a copy stream's for the other (a staging buffer refilled before its write-back), or a copy
    stream's for the compute stream (a slot refilled while a kernel may read it, a write-back before
    the kernel that wrote its data) — and the decode goes wrong or the check refuses the copy."""
    from moelab.hybrid import throughput_offload as t

    m = models["moelab-tiny-mixtral"]
    ids = _ids(m, 5)
    ref = plain_generate(m, ids, 4)
    real = t._DeferredStreams.wait

    def wait(self, stream, ev):
        src = ev[0] if ev is not None else None
        kind = ("reader-waits-for-copy" if stream == "compute" else
                "copy-waits-for-compute" if src == "compute" else "copy-waits-for-copy")
        return None if kind == dropped else real(self, stream, ev)

    monkeypatch.setattr(t._DeferredStreams, "wait", wait)
    dec = OffloadedDecoder(m, 2, 3, device="cpu", expert_slots=2, defer_copies=True)
    try:
        out = dec.generate(ids, 4)
    except MoelabError as exc:
        assert "missing wait" in str(exc) and dropped != "reader-waits-for-copy"
        return
    wrong = not torch.equal(out.tokens, ref.tokens) or any(
        not torch.allclose(a, b, atol=1e-3, rtol=1e-3) for a, b in zip(out.logits, ref.logits, strict=True))
    assert wrong


def test_the_decode_reads_only_the_decoders_copies():
    m = moelab.load("moelab-tiny-qwen2moe")[0]  # shared experts, a shared-expert gate: every kind of module
    ids = _ids(m, 4)
    ref = plain_generate(m, ids, 3)
    dec = OffloadedDecoder(m, 2, 4, device="cpu", expert_slots=2, pinned_experts=2)
    caches, logits = dec.prefill(ids)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))
    dec.prefill = lambda _ids: (caches, logits)
    out = dec.generate(ids, 3)
    assert torch.equal(out.tokens, ref.tokens)
    assert all(torch.isfinite(x).all() for x in out.logits)


def test_events_follow_the_offloaded_schedule(models):
    m = models["tiny-deepseek_v2"]  # layer 0 dense, layers 1-3 MoE (8 experts, top-4, shared experts)
    B, ba, be, steps, R, pinned = 5, 2, 3, 2, 2, 4  # pinned: 2, 1, 1 over the three MoE layers
    dec = OffloadedDecoder(m, ba, be, device="cpu", expert_slots=R, pinned_experts=pinned)
    dec.generate(_ids(m, B), steps)
    ev = dec.log.events
    assert dec.pinned == {1: 2, 2: 1, 3: 1}
    ebytes = {i: sum(t[0].numel() * t.element_size() for t in dec._experts_host[i].values()) for i in (1, 2, 3)}
    for s in range(steps):
        for layer in range(m.config.num_hidden_layers):
            mine = [e for e in ev if e.step == s and e.layer == layer]
            kv_in = [e for e in mine if e.kind == "transfer-kv"]
            kv_out = [e for e in mine if e.kind == "writeback-kv"]
            assert [e.cause for e in kv_in] == ["KV HtoD[0]", "KV HtoD[1]", "KV HtoD[2]"]
            assert [e.tokens for e in kv_out] == [2, 2, 1]
            assert {e.lane for e in kv_in} == {"copy-htod"} and {e.lane for e in kv_out} == {"copy-dtoh"}
            # the KV read grows by one position per step; the write-back is one position
            assert kv_in[0].bytes == (5 + s) * kv_out[0].bytes
            if layer == 0:
                assert not [e for e in mine if e.kind in ("expert-device", "transfer-prefetch")]
                continue
            computed = [e.expert for e in sorted((e for e in mine if e.kind == "expert-device"),
                                                 key=lambda e: e.t_start_us)]
            copied = [e.expert for e in mine if e.kind == "transfer-prefetch"]
            p = dec.pinned[layer]
            assert not [x for x in copied if x < p]  # a pinned expert is never copied
            pinned_run = [x for x in computed if x < p]
            assert computed[:len(pinned_run)] == pinned_run  # pinned experts first, no wait for the link
            streamed = sorted({x for x in computed if x >= p})
            # the first R streamed ids are copied before the router ran, then every other active one
            assert copied == list(range(p, p + R)) + [x for x in streamed if x >= p + R]
            assert all(e.bytes == ebytes[layer] for e in mine if e.kind == "transfer-prefetch")
            for x in streamed:  # each expert's copy ends before its first chunk starts
                c = next(e for e in mine if e.kind == "transfer-prefetch" and e.expert == x)
                first = min(e.t_start_us for e in mine if e.kind == "expert-device" and e.expert == x)
                assert c.t_end_us <= first
        loads = [e for e in ev if e.step == s and e.kind == "transfer-dense"]
        # one S_Dense load per layer and step: layer 0 of the first step on demand, every other prefetched
        # by the layer before it (layer 0 by the last layer of the step before; the last step prefetches
        # nothing for a step that will not run)
        L = m.config.num_hidden_layers
        assert len(loads) == L - 1 + (s == 0) + (s != steps - 1)
    t = moelab.Timeline(dec.log.table())
    assert len(t.events) == len(ev)


def test_only_active_experts_stream_after_the_router_and_the_first_slots_fill_before_it(models):
    m = models["tiny-deepseek_v2"]  # 8 experts, top-4: one sequence leaves experts idle in every layer
    R = 2
    dec = OffloadedDecoder(m, 1, 4, device="cpu", expert_slots=R, pinned_experts=0)
    dec.generate(_ids(m, 1), 3)
    ev = dec.log.events
    idle_seen = False
    for s in range(3):
        for layer in (1, 2, 3):
            mine = [e for e in ev if e.step == s and e.layer == layer]
            active = sorted({e.expert for e in mine if e.kind == "expert-device"})
            copies = [e for e in mine if e.kind == "transfer-prefetch"]
            router = next(e for e in mine if e.cause == "Router")
            assert [e.expert for e in copies[:R]] == [0, 1]  # the first slots fill whatever the routing
            assert all(e.t_start_us < router.t_start_us for e in copies[:R])  # before the router ran
            assert [e.expert for e in copies[R:]] == [x for x in active if x >= R]  # then only active ones
            idle_seen |= len(active) < 8
    assert idle_seen


@pytest.mark.parametrize("defer", [False, True])
def test_a_step_that_raised_leaves_nothing_behind(models, monkeypatch, defer):
    """A step raises in layer 2's experts (S_Dense already holds layer 3); the same step retried on the
    same host KV store, then the rest of the decode, give the plain model's tokens."""
    m = models["tiny-deepseek_v2"]
    ids = _ids(m, 3)
    ref = plain_generate(m, ids, 3)
    dec = OffloadedDecoder(m, 2, 4, device="cpu", expert_slots=2, defer_copies=defer)
    real, calls = dec._run_experts, {"n": 0}

    def flaky(module, hidden, idx, w, st):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(module, hidden, idx, w, st)

    monkeypatch.setattr(dec, "_run_experts", flaky)
    with pytest.raises(KeyboardInterrupt):
        dec.generate(ids, 3)
    monkeypatch.setattr(dec, "_run_experts", real)
    kv, P = dec._kv, ids.shape[1]
    tok = ref.tokens[:, 0]
    for s in range(3):  # step 0 again, then the rest, straight through step()
        logits = dec.step(tok, kv, P + s, step=s)
        torch.testing.assert_close(logits, ref.logits[s + 1], atol=1e-4, rtol=1e-4)
        tok = logits.argmax(-1)
        assert torch.equal(tok, ref.tokens[:, s + 1])
    out = dec.generate(ids, 3)  # and a new decode
    assert torch.equal(out.tokens, ref.tokens)


def test_the_host_kv_store_holds_every_position(models):
    m = models["moelab-tiny-mixtral"]
    ids = _ids(m, 3, P=4)
    dec = OffloadedDecoder(m, 2, 8, device="cpu")
    out = dec.generate(ids, 3)
    full = torch.cat([ids, out.tokens[:, :-1]], 1)  # every position whose K/V the decode wrote
    with torch.no_grad():
        ref = m(input_ids=full, use_cache=True)
    from moelab.compat import output_cache

    cache = output_cache(ref)
    for j, j0 in enumerate((0, 2)):
        for i, layer in enumerate(cache.layers):
            K, V = dec._kv.host[j][i]  # (positions, b, heads, d)
            b = K.shape[1]
            torch.testing.assert_close(K.permute(1, 2, 0, 3), layer.keys[j0:j0 + b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(V.permute(1, 2, 0, 3), layer.values[j0:j0 + b], atol=1e-5, rtol=1e-5)


def test_bad_settings_are_refused(models):
    m = models["moelab-tiny-mixtral"]
    with pytest.raises(MoelabError, match="expert_slots=0"):
        OffloadedDecoder(m, 2, 2, device="cpu", expert_slots=0)
    with pytest.raises(MoelabError, match="pinned_experts=999"):
        OffloadedDecoder(m, 2, 2, device="cpu", pinned_experts=999)
    with pytest.raises(MoelabError, match="device 'meta'"):
        OffloadedDecoder(m, 2, 2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(MoelabError, match="no CUDA GPU"):
            OffloadedDecoder(m, 2, 2, device="cuda")


def test_device_bytes_count_the_buffers_moegen_names(models):
    m = models["tiny-deepseek_v2"]
    dec = OffloadedDecoder(m, 2, 4, device="cpu", expert_slots=3, pinned_experts=0)
    dec.generate(_ids(m, 4), 2)
    b = dec.device_bytes
    one_expert = sum(t[0].numel() * t.element_size() for t in dec._experts_host[1].values())
    assert b["S_Expert"] == 3 * one_expert
    assert b["S_KV-GPU"] > 0 and b["S_Dense"] > 0 and b["S_Params"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the offloaded decoder's streams); none here")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_offloaded_greedy_equals_plain_and_copies_overlap(models, name):
    m = models[name]
    ids = _ids(m, 6)
    ref = plain_generate(m, ids, 3)
    dec = OffloadedDecoder(m, 2, 4, device="cuda", expert_slots=2, pinned_experts=2)
    out = dec.generate(ids, 3)
    assert torch.equal(out.tokens, ref.tokens)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=1e-3)
    ev = dec.log.events
    assert {e.lane for e in ev} == {"device", "copy-htod", "copy-dtoh"}
    assert all(e.t_end_us >= e.t_start_us for e in ev)
    tol = 1.0  # µs: CUDA timing events' resolution
    for e in ev:  # a streamed expert computes after its copy on the CUDA clock too
        if e.kind == "expert-device" and e.expert >= dec.pinned.get(e.layer, 0):
            c = [x for x in ev if x.kind == "transfer-prefetch" and x.step == e.step and x.layer == e.layer
                 and x.expert == e.expert]
            assert c and c[-1].t_end_us <= e.t_start_us + tol
    for s in range(3):
        for layer in range(m.config.num_hidden_layers):
            mine = [e for e in ev if e.step == s and e.layer == layer]
            kv_in = [e for e in mine if e.kind == "transfer-kv"]
            kv_out = [e for e in mine if e.kind == "writeback-kv"]
            for j in range(2, len(kv_in)):  # a staging buffer is reused only after its write-back
                assert kv_in[j].t_start_us >= kv_out[j - 2].t_end_us - tol
            copies = [e for e in mine if e.kind == "transfer-prefetch"]
            chunks = [e for e in mine if e.kind == "expert-device" and e.expert >= dec.pinned.get(layer, 0)]
            for q in range(2, len(copies)):  # a ring slot is refilled only after its expert computed
                prev = [e.t_end_us for e in chunks if e.expert == copies[q - 2].expert]
                if prev:
                    assert copies[q].t_start_us >= max(prev) - tol


def test_the_offloaded_simulation_charges_the_copies_the_in_place_one_does_not(models):
    from moelab.simulate.moegen.real import (
        offloaded_config,
        simulated_offloaded_step,
        simulated_step,
    )
    from moelab.timing.shapes import ModelShape

    shape = ModelShape.from_model(models["tiny-deepseek_v2"], name="tiny-deepseek_v2")
    in_place, _ = simulated_step(shape, "pcie4-x16", 8, 4, 8, 16, 8)
    slow, mem = simulated_offloaded_step(shape, "pcie4-x16", offloaded_config(shape, 8, 4, 8, 16, 8, 2, 0))
    fast, _ = simulated_offloaded_step(shape, "pcie5-x16", offloaded_config(shape, 8, 4, 8, 16, 8, 2, 0))
    assert slow.step_us > in_place.step_us and fast.step_us < slow.step_us  # a faster link, a shorter step
    cfg = offloaded_config(shape, 8, 4, 8, 16, 8, 3, 5)
    assert (cfg.expert_slots, cfg.pinned_experts, cfg.pin_dense, cfg.cpu_attention) == (3, 5, False, 0.0)
    assert mem.fits


def test_the_gpu_bench_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the CUDA bench test runs instead")
    from moelab.simulate.moegen.bench import run_bench

    with pytest.raises(MoelabError, match="no CUDA GPU"):
        run_bench(["moelab-tiny-mixtral"], batches=[4], micro_batches=[2], expert_batches=[3], repeats=1, steps=2,
                  device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (moelab bench throughput --device cuda)")
def test_cuda_bench_runs_the_offloaded_decoder_beside_its_simulation():
    from moelab.simulate.moegen.bench import format_result, run_bench

    r = run_bench(["moelab-tiny-mixtral"], batches=[8], micro_batches=[4], expert_batches=[8], repeats=2, steps=2,
                  allow_busy=True, device="cuda", expert_slots=2, pinned_experts=4)
    row = r["rows"][0]
    assert row["device_bytes"]["S_Expert"] > 0 and row["sim_tokens_per_s"] > 0 and row["tokens_per_s"] > 0
    assert "S_Expert" in format_result(r)


def test_pinned_dense_modules_are_never_copied_and_decode_the_same(models):
    m = models["tiny-deepseek_v2"]
    ids = _ids(m, 4)
    ref = plain_generate(m, ids, 3)
    dec = OffloadedDecoder(m, 2, 4, device="cpu", pin_dense=True, defer_copies=True)
    out = dec.generate(ids, 3)
    assert torch.equal(out.tokens, ref.tokens)
    assert not [e for e in dec.log.events if e.kind == "transfer-dense"]
    streamed = OffloadedDecoder(m, 2, 4, device="cpu")
    dense_bytes = sum(t.numel() * t.element_size() for layer in m.model.layers
                      for n, t in (*layer.named_parameters(), *layer.named_buffers()) if not n.startswith("mlp.experts."))
    assert dec.device_bytes["S_Params"] - streamed.device_bytes["S_Params"] == dense_bytes
    assert dec.device_bytes["S_Dense"] == 0


def test_a_searched_configuration_builds_its_decoder(models):
    from moelab.simulate.moegen.schedule import ThroughputConfig

    m = models["moelab-tiny-mixtral"]
    cfg = ThroughputConfig(batch=6, micro_batch=3, expert_batch=5, expert_slots=3, pinned_experts=2, pin_dense=True)
    dec = OffloadedDecoder.from_config(m, cfg, device="cpu")
    assert (dec.micro_batch, dec.expert_batch, dec.expert_slots, sum(dec.pinned.values()), dec.pin_dense) == \
        (3, 5, 3, 2, True)
    ids = _ids(m, cfg.batch)
    assert torch.equal(dec.generate(ids, 2).tokens, plain_generate(m, ids, 2).tokens)
    from moelab.simulate.moegen import plan_throughput
    from moelab.timing.shapes import ModelShape

    plan = plan_throughput(ModelShape.from_model(m, name="tiny"), "pcie4-x16", prompt=5, generate=2, batch=4,
                           cpu_attention=0)  # the search's best, run for real
    best = plan.best.config
    dec = OffloadedDecoder.from_config(m, best, device="cpu", defer_copies=True)
    ids = _ids(m, best.batch)
    assert torch.equal(dec.generate(ids, best.generate).tokens, plain_generate(m, ids, best.generate).tokens)
    with pytest.raises(MoelabError, match="cpu_attention"):
        OffloadedDecoder.from_config(m, ThroughputConfig(batch=4, cpu_attention=0.5), device="cpu")
    with pytest.raises(MoelabError, match="phase 'prefill'"):
        OffloadedDecoder.from_config(m, ThroughputConfig(phase="prefill"), device="cpu")
