"""The extension's expert map and its C++ lane workers (``moe_submit``), against the reference.

* An expert map (vLLM's convention: ``-1`` = not here, else the local index) gives the kernel
  run on the mapped ids with the unmapped slots' weights set to 0 — checked against the plain
  reference over shapes, weight formats and ISA paths.
* A call queued on a lane worker returns exactly what the synchronous call returns, calls on one
  lane run in submission order, concurrent submitters each get their own results, and the
  worker's timestamps sit inside the caller's clock readings (the event log's clock).
* Bad input is refused on the submitting thread, before anything is queued.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moelab.errors import MoelabError
from moelab.kernels import KernelSpec, moe_experts, pack_experts, reference_experts, supported_isas
from moelab.kernels.op import moe_experts_submit

SPECS = [KernelSpec("fp32"), KernelSpec("bf16"), KernelSpec("int8", 32), KernelSpec("fp8")]
TOL = {"fp32": 1e-5, "bf16": 2e-3, "int8": 5e-3, "fp8": 5e-3}
SHAPES = [(8, 32, 64, 2, 1), (6, 64, 96, 3, 17), (16, 48, 80, 4, 33)]


def _layer(e: int, h: int, i: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(gate=torch.randn(e, i, h, generator=g) * 0.1, up=torch.randn(e, i, h, generator=g) * 0.1,
                down=torch.randn(e, h, i, generator=g) * 0.1)


def _routing(t: int, e: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return ids, torch.rand(t, k, generator=g)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-6)


@pytest.mark.parametrize("isa", supported_isas())
@pytest.mark.parametrize("shape", SHAPES, ids=[f"E{e}H{h}I{i}K{k}T{t}" for e, h, i, k, t in SHAPES])
@pytest.mark.parametrize("spec", SPECS, ids=[s.dtype for s in SPECS])
def test_expert_map_is_the_reference_with_absent_experts_weighted_zero(isa, shape, spec):
    e, h, i, k, t = shape
    w = _layer(e, h, i)
    ids, wts = _routing(t, e, k, seed=t)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1))
    if spec.dtype in ("bf16", "fp8"):
        x = x.to(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    # a map over the router's ids: a permutation of the local experts, a third of them absent
    emap = torch.randperm(e, generator=g)
    emap[torch.randperm(e, generator=g)[: e // 3]] = -1
    local = emap[ids]
    ref = reference_experts(x, local.clamp(min=0), torch.where(local >= 0, wts, torch.zeros_like(wts)), spec=spec, **w)
    packed = pack_experts(spec=spec, **w)
    out = moe_experts(x, ids, wts, packed, isa=isa, expert_map=emap)
    assert out.dtype == x.dtype and _rel(out, ref) <= TOL[spec.dtype]
    queued = moe_experts_submit(x, ids, wts, packed, isa=isa, expert_map=emap).result()
    assert torch.equal(queued, out)  # the same kernel on the same inputs


def test_tokens_with_no_expert_here_get_zeros():
    w = _layer(4, 32, 32)
    packed = pack_experts(spec=KernelSpec("fp32"), **w)
    ids = torch.tensor([[0, 1], [2, 3]])
    emap = torch.tensor([0, 1, -1, -1])
    out = moe_experts(torch.randn(2, 32), ids, torch.ones(2, 2), packed, expert_map=emap)
    assert torch.equal(out[1], torch.zeros(32)) and out[0].abs().sum() > 0


def test_calls_on_a_lane_run_in_order_and_their_times_bracket_the_work():
    w = _layer(8, 64, 96)
    packed = pack_experts(spec=KernelSpec("fp32"), **w)
    xs = [torch.randn(5, 64, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    ids, wts = _routing(5, 8, 2)
    before = time.perf_counter_ns()
    calls = [moe_experts_submit(x, ids, wts, packed, lane=3) for x in xs]
    outs = [c.result() for c in calls]
    after = time.perf_counter_ns()
    for x, out in zip(xs, outs, strict=True):
        assert torch.equal(out, moe_experts(x, ids, wts, packed))
    times = [c.times_ns() for c in calls]
    for sub, start, end in times:
        assert before <= sub <= start <= end <= after
    for (_, _, end), (_, start, _) in zip(times, times[1:], strict=False):
        assert start >= end  # one worker: FIFO, one call at a time
    assert calls[0].result() is outs[0]  # a result is taken once and kept


def test_concurrent_submitters_get_their_own_results():
    w = _layer(8, 32, 64)
    packed = pack_experts(spec=KernelSpec("bf16"), **w)
    ids, wts = _routing(3, 8, 2)
    errors: list[str] = []

    def worker(seed: int, lane: int) -> None:
        for j in range(10):
            x = torch.randn(3, 32, generator=torch.Generator().manual_seed(seed * 100 + j)).to(torch.bfloat16)
            if not torch.equal(moe_experts_submit(x, ids, wts, packed, lane=lane).result(),
                               moe_experts(x, ids, wts, packed)):
                errors.append(f"submitter {seed} call {j}")

    threads = [threading.Thread(target=worker, args=(s, s % 2)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors


def test_bad_input_is_refused_before_it_is_queued():
    w = _layer(4, 32, 32)
    packed = pack_experts(spec=KernelSpec("fp32"), **w)
    with pytest.raises(RuntimeError, match="out of range"):
        moe_experts_submit(torch.randn(1, 32), torch.tensor([[0, 7]]), torch.ones(1, 2), packed)
    with pytest.raises(RuntimeError, match="expert_map entry"):
        moe_experts(torch.randn(1, 32), torch.tensor([[0, 1]]), torch.ones(1, 2), packed,
                    expert_map=torch.tensor([0, 9, -1, 2]))
    with pytest.raises(MoelabError, match="lane=8"):
        moe_experts_submit(torch.randn(1, 32), torch.tensor([[0, 1]]), torch.ones(1, 2), packed, lane=8)
    with pytest.raises(MoelabError, match="hidden states have shape"):
        moe_experts_submit(torch.randn(1, 31), torch.tensor([[0, 1]]), torch.ones(1, 2), packed)


def test_native_lane_records_one_event_per_call_with_the_workers_times():
    from moelab.adapters import moe_layers
    from moelab.hybrid.events import EventLog
    from moelab.hybrid.lanes import NativeLane
    from moelab.kernels.backend import KernelBackend
    from moelab.models.tiny import build_tiny

    module = moe_layers(build_tiny("mixtral", seed=0, dtype=torch.float32))[0].experts
    e = module.gate_up_proj.shape[0]
    backend = KernelBackend(KernelSpec("fp32"))
    log = EventLog("t")
    lane = NativeLane("host", log, lane=1)
    hidden = moe_layers_hidden(module)
    ids = torch.tensor([[0, 2], [1, 3]]) % e
    wts = torch.rand(2, 2)
    x = torch.randn(2, hidden)
    hmap = torch.arange(e)
    hmap[1::2] = -1
    call = lane.submit_experts(backend, module, x, ids, wts, hmap, step=4, layer=1, kind="expert-host", tokens=2,
                               cause="miss")
    out = call.result()
    call.result()
    assert torch.equal(out, backend(module, x, ids, wts, expert_map=hmap))
    assert len(log) == 1
    ev = log.events[0]
    assert (ev.step, ev.layer, ev.lane, ev.kind, ev.tokens, ev.cause) == (4, 1, "host", "expert-host", 2, "miss")
    _, start, end = call.times_ns()
    assert ev.t_start_us == (start - log.t0) / 1e3 and ev.t_end_us == (end - log.t0) / 1e3 >= ev.t_start_us


def moe_layers_hidden(module) -> int:
    from moelab.backends.base import hidden_size

    return hidden_size(module)


# ---------------------------------------------------------------------- a backend's prepared calls
def _experts_module(h: int = 32, i: int = 48, e: int = 8, seed: int = 0):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeExperts

    torch.manual_seed(seed)
    mod = Qwen2MoeExperts(Qwen2MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e, num_experts_per_tok=2))
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.1)
    return mod


def test_a_backends_repeated_submits_reuse_the_prepared_call_and_follow_changes():
    """KernelBackend.submit keeps each module's last call (its pack, path and threads) and reuses
    it while the weights, the ISA path and the thread count stay; any change is seen at once."""
    from moelab.kernels.backend import KernelBackend
    from moelab.kernels.build import force_isa

    be = KernelBackend(KernelSpec("fp32"))
    mod = _experts_module()
    ids, w = _routing(3, 8, 2, seed=1)
    x = torch.randn(3, 32)
    emap = torch.tensor([0, 1, 2, -1, 4, 5, 6, 7])

    def expected():
        return be(mod, x, ids, w, expert_map=emap)

    first = be.submit(mod, x, ids, w, emap).result()
    entry = be._calls[mod]
    again = be.submit(mod, x, ids, w, emap).result()
    assert be._calls[mod] is entry  # reused, not rebuilt
    torch.testing.assert_close(first, expected(), rtol=0, atol=0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)

    with torch.no_grad():
        mod.down_proj.mul_(2.0)  # in place: a new version, so a new pack
    changed = be.submit(mod, x, ids, w, emap).result()
    assert be._calls[mod] is not entry
    torch.testing.assert_close(changed, expected(), rtol=0, atol=0)
    assert not torch.equal(changed, first)
    for change in ("data", "parameter"):  # new storage under the same parameter; a new parameter
        entry = be._calls[mod]
        with torch.no_grad():
            if change == "data":
                mod.down_proj.data = mod.down_proj.data * 0.5
            else:
                mod.down_proj = torch.nn.Parameter(mod.down_proj.detach() * 3.0)
        got = be.submit(mod, x, ids, w, emap).result()
        assert be._calls[mod] is not entry, change
        torch.testing.assert_close(got, expected(), rtol=0, atol=0)

    other = [i for i in supported_isas() if i != be._calls[mod][1][0]]
    if other:
        with force_isa(other[-1]):
            got = be.submit(mod, x, ids, w, emap).result()
            assert be._calls[mod][1][0] == other[-1]
            torch.testing.assert_close(got, expected(), rtol=1e-5, atol=1e-6)

    with pytest.raises(MoelabError, match=r"hidden states have shape \(3, 16\)"):
        be.submit(mod, torch.randn(3, 16), ids, w, emap)  # named on the prepared path too
    with pytest.raises(MoelabError, match="top_k_index"):
        be.submit(mod, x, ids[:2], w, emap)
    assert be.forget(mod) and mod not in be._calls


def test_the_fast_submit_takes_a_prepared_call_only_as_the_python_checks_would():
    """``submit_prepared`` (kernels/moe_op.cpp; KernelBackend.submit's per-layer path) queues the
    prepared call where the parameters still have its key, every tensor is on the CPU and the
    hidden states are float32 or bfloat16; else None before anything was queued (the backend then
    prepares again or runs the full checks), and the extension's own refusal as a message."""
    from moelab.kernels import backend as kb
    from moelab.kernels.backend import KernelBackend
    from moelab.kernels.build import load_extension

    be = KernelBackend(KernelSpec("fp32"))
    mod = _experts_module()
    ids, w = _routing(3, 8, 2, seed=2)
    x = torch.randn(3, 32)
    be.submit(mod, x, ids, w).result()  # prepared
    key, _, prepared, _, _ = be._calls[mod]
    assert key == kb.call_key(mod)
    submit = load_extension().submit_prepared
    params = tuple(mod._parameters.values())
    got = submit(prepared, key, params, x, ids, w, None, 0)
    assert not isinstance(got, (str, type(None)))
    torch.testing.assert_close(kb.NativeCall(got, x.dtype).result(), be(mod, x, ids, w), rtol=0, atol=0)
    meta = torch.empty(3, 32, device="meta")
    for name, call in {
        "another key": (prepared, key + b"x", params, x, ids, w, None, 0),
        "hidden states off the CPU": (prepared, key, params, meta, ids, w, None, 0),
        "a map off the CPU": (prepared, key, params, x, ids, w, torch.empty(8, device="meta", dtype=torch.long), 0),
        "float64 hidden states": (prepared, key, params, x.double(), ids, w, None, 0),
        "ids that are no tensor": (prepared, key, params, x, ids.tolist(), w, None, 0),
    }.items():
        assert submit(*call) is None, name
    assert "out of range" in submit(prepared, key, params, x, ids + 8, w, None, 0)
    with pytest.raises(TypeError, match="not a Prepared"):
        submit(object(), key, params, x, ids, w, None, 0)
    with pytest.raises(TypeError, match="8 positional"):
        submit(prepared, key)


def test_a_prepared_call_follows_the_settings_its_path_and_threads_come_from(monkeypatch):
    """A prepared call compares the raw settings (config_token: forced path, both environment
    settings, torch's threads) instead of deriving path and threads on every call: a changed
    setting is seen at the next call; one that leaves path and threads as they were keeps the
    prepared call; a bad one is refused by name, as the full derivation refuses it."""
    from moelab.kernels.backend import KernelBackend
    from moelab.kernels.build import ISA_ENV, force_isa
    from moelab.kernels.op import THREADS_ENV, config_token

    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.delenv(ISA_ENV, raising=False)
    be = KernelBackend(KernelSpec("fp32"))
    mod = _experts_module()
    ids, w = _routing(3, 8, 2, seed=2)
    x = torch.randn(3, 32)
    first = be.submit(mod, x, ids, w, None).result()
    entry = be._calls[mod]
    assert entry[4] == config_token()

    monkeypatch.setenv(THREADS_ENV, str(torch.get_num_threads() + 1))
    got = be.submit(mod, x, ids, w, None).result()
    assert be._calls[mod][1] == (entry[1][0], torch.get_num_threads() + 1)
    assert be._calls[mod][2] is not entry[2]  # prepared again for the new thread count
    torch.testing.assert_close(got, first, rtol=1e-6, atol=1e-7)

    monkeypatch.delenv(THREADS_ENV)
    be.submit(mod, x, ids, w, None).result()
    back = be._calls[mod]
    assert back[1] == entry[1]
    with force_isa(back[1][0]):  # the path it runs on anyway: another token, the same path and threads
        torch.testing.assert_close(be.submit(mod, x, ids, w, None).result(), first, rtol=0, atol=0)
        assert be._calls[mod][2] is back[2] and be._calls[mod][4] != back[4]
    monkeypatch.setenv(ISA_ENV, "no-such-path")
    with pytest.raises(MoelabError, match=ISA_ENV):
        be.submit(mod, x, ids, w, None)


def _in_threads(target, n: int) -> None:
    """Run ``target(i)`` on ``n`` threads at once, i = 0 .. n - 1, and wait for all of them."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _result(call, timeout_s: float = 60.0):
    """``call.result()``, failing (not hanging) if the lane never runs it: a lost wake-up."""
    deadline = time.monotonic() + timeout_s
    while not call.done():
        assert time.monotonic() < deadline, "the lane worker never ran the call (a lost wake-up)"
        time.sleep(1e-4)
    return call.result()


@pytest.mark.parametrize("spin_us", [0, 200, 50_000])
def test_a_lane_worker_gives_the_same_results_polling_or_asleep(spin_us):
    """A worker polls its queue ``spin_us`` after each call before it sleeps, and a ``result()``
    polls as long before it sleeps: calls submitted while it polls (back to back), after it has
    gone to sleep (a gap longer than the spin) and from two threads at once all get their own,
    exact results; 0 never polls."""
    from moelab.kernels.op import lane_spin_us, set_lane_spin_us

    before = lane_spin_us()
    w = _layer(8, 32, 64)
    packed = pack_experts(spec=KernelSpec("bf16"), **w)
    ids, wts = _routing(2, 8, 2)
    xs = [torch.randn(2, 32, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16) for s in range(6)]
    want = [moe_experts(x, ids, wts, packed) for x in xs]
    set_lane_spin_us(spin_us)
    try:
        assert lane_spin_us() == spin_us
        got = [_result(moe_experts_submit(x, ids, wts, packed, lane=5)) for x in xs]  # back to back
        for x in xs:  # each after the worker's spin has run out (asleep), but for the longest spin
            time.sleep(min(spin_us, 2000) * 2e-6 + 1e-3)
            got.append(_result(moe_experts_submit(x, ids, wts, packed, lane=5)))
        pending = [moe_experts_submit(x, ids, wts, packed, lane=5) for x in xs]  # queued before any result
        got += [_result(c) for c in pending]
        for i, out in enumerate(got):
            assert torch.equal(out, want[i % len(xs)]), i
        errors: list[str] = []

        def submitter(seed: int) -> None:
            for j in range(20):
                try:
                    out = _result(moe_experts_submit(xs[(seed + j) % 6], ids, wts, packed, lane=6))
                except AssertionError as e:  # a lost wake-up: a failure here, not a thread's warning
                    errors.append(f"{seed}/{j}: {e}")
                    return
                if not torch.equal(out, want[(seed + j) % 6]):
                    errors.append(f"{seed}/{j}: a wrong result")

        _in_threads(submitter, 2)
        assert not errors
    finally:
        set_lane_spin_us(before)


def test_the_lane_spin_setting_refuses_bad_values():
    from moelab.kernels.op import set_lane_spin_us

    for bad in (-1, 1.5, "10", True, 10**9):
        with pytest.raises(MoelabError, match="non-negative integer of microseconds"):
            set_lane_spin_us(bad)


def test_a_bad_lane_spin_environment_variable_is_named_when_a_run_starts():
    import subprocess
    import sys

    code = ("from moelab.hybrid.lanes import NativeLane\nfrom moelab.hybrid.events import EventLog\n"
            "NativeLane('host', EventLog('r'), lane=0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "MOELAB_LANE_SPIN_US": "5ms"})
    assert r.returncode != 0 and "MOELAB_LANE_SPIN_US='5ms': expected a non-negative integer" in r.stderr


def test_the_worker_pool_gives_every_caller_the_one_thread_result():
    """Every kernel call's stages run on the extension's one worker pool (kernels/pool.h): the
    caller and up to ``num_threads - 1`` workers claim tasks from a counter. Whatever the thread
    count (beyond this machine's CPUs too), and with several callers sharing the workers at once
    (Python threads calling synchronously, two lane workers), each output equals the one-thread
    call's, bit for bit (stage 2 sums each output slice's experts in a fixed order), for a
    decode-sized call and a prefill-sized one (the pool's row conversion and quantisation run only
    from 64 tokens)."""
    w = _layer(8, 64, 96)
    cases = []
    for spec in (KernelSpec("bf16"), KernelSpec("int8", 32)):
        packed = pack_experts(spec=spec, **w)
        for t in (1, 80):
            ids, wts = _routing(t, 8, 2, seed=t)
            x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
            x = x.to(torch.bfloat16) if spec.dtype == "bf16" else x
            cases.append((x, ids, wts, packed, moe_experts(x, ids, wts, packed, num_threads=1)))
    for threads in (2, 3, 8):
        for x, ids, wts, packed, want in cases:
            assert torch.equal(moe_experts(x, ids, wts, packed, num_threads=threads), want), threads
    errors: list[str] = []

    def caller(seed: int) -> None:
        for j in range(12):
            x, ids, wts, packed, want = cases[(seed + j) % len(cases)]
            try:
                if seed < 3:
                    got = moe_experts(x, ids, wts, packed, num_threads=2 + seed)
                else:  # a lane worker's call (its stages on the same pool)
                    got = _result(moe_experts_submit(x, ids, wts, packed, lane=seed - 3))
            except Exception as e:  # noqa: BLE001 - reported below, not as a thread's warning
                errors.append(f"caller {seed} call {j}: {e}")
                return
            if not torch.equal(got, want):
                errors.append(f"caller {seed} call {j}: a different result")

    _in_threads(caller, 5)
    assert not errors, errors
