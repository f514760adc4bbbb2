"""One executor interface: a base class and a registry; the simulated executor a lazy entry; a
user's executor selectable by name; the sweep engine's local/ray are *backends*."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.hybrid import HybridConfig
from moelab.hybrid.executors import (
    EXECUTORS,
    Executor,
    available_executors,
    get_executor,
    register_executor,
)

torch.set_num_threads(1)


def test_the_registry_names_every_executor_and_resolves_the_lazy_ones():
    assert set(available_executors()) >= {"functional", "real", "cuda", "simulated"}
    for name in ("functional", "real", "simulated"):
        cls = get_executor(name)
        assert issubclass(cls, Executor) and cls.name == name
    with pytest.raises(MoelabError, match="Did you mean 'real'"):
        HybridConfig(executor="rael")
    with pytest.raises(MoelabError, match="executor 'cuda' runs its device lane on a GPU"):
        HybridConfig(executor="cuda", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU exists")
def test_the_cuda_executor_is_refused_without_a_gpu():
    model, _ = moelab.load("tiny-random-mixtral")
    with pytest.raises(MoelabError, match="needs a CUDA GPU"), moelab.hybrid(model, {"executor": "cuda"}):
        pass


def test_a_registered_executor_runs_and_is_closed():
    seen = {"steps": 0, "closed": 0}

    class Counting(Executor):
        name = "counting-test"

        def install(self, mgr):
            from moelab.forward import Order

            def on_end(ctx, ok):
                seen["steps"] += int(ok)

            return [mgr.add("forward_end", on_end, order=Order.OBSERVE, name="counting")]

        def close(self):
            seen["closed"] += 1

    model, _ = moelab.load("tiny-random-mixtral")
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    with EXECUTORS.temporarily("counting-test", Counting), \
            moelab.hybrid(model, {"executor": "counting-test", "cache": {"capacity": 0.5}}) as run:
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert run.plans  # the planner ran as for any executor
    assert seen == {"steps": 3, "closed": 1}
    with pytest.raises(MoelabError, match="already registered"):
        register_executor("real", Counting)


def test_the_hybrid_package_never_imports_the_simulator():
    code = ("import sys, moelab.hybrid, moelab.hybrid.runtime, moelab.hybrid.executors; "
            "print(any(m.startswith('moelab.simulate') for m in sys.modules))")
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_routing_memo_gives_the_plans_of_no_memo():
    from moelab.hybrid.offline import plan_routing
    from moelab.routing import ForwardRouting

    rng = np.random.default_rng(0)
    L, E, K = 3, 8, 4
    routing = []
    for f in range(12):
        ids = [np.stack([rng.permutation(E)[:K] for _ in range(2)]).astype(np.int64) for _ in range(L)]
        w = [np.sort(rng.random((2, K)).astype(np.float32), axis=1)[:, ::-1].copy() for _ in range(L)]
        routing.append(ForwardRouting(forward=f, step=f, phase="prefill" if f == 0 else "decode", tokens=2,
                                      ids=ids, weights=w))
    shape = {"num_experts": [E] * L, "top_k": [K] * L, "expert_bytes": 10}
    memo: dict = {}
    for deferred in (0, 1, 2, 1):
        cfg = {"cache": {"capacity": 0.5}, "routing": {"deferred": deferred, "min_immediate": 1}}
        want = plan_routing(routing, cfg, **shape)
        got = plan_routing(routing, cfg, **shape, routing_memo=memo)
        assert [(p.deferred, p.hits, p.misses, p.transfers) for p in got] == \
               [(p.deferred, p.hits, p.misses, p.transfers) for p in want]
    assert len({k[0] for k in memo}) == 2  # one entry per deferral setting that acts (D = 1, 2)


def test_sweeps_run_on_backends_not_executors():
    import moelab.sweeps.backends as backends
    from moelab.sweeps.backends import LocalBackend, make_backend

    assert isinstance(make_backend("local"), LocalBackend)
    with pytest.raises(MoelabError, match="unknown sweep backend 'rya'"):
        make_backend("rya")
    assert backends.SWEEP_BACKENDS == ("local", "ray")


def _lane_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("moelab-")}


@pytest.mark.parametrize("host_backend,device_backend", [("reference", "reference"), ("moelab", "reference"),
                                                          ("moelab", "moelab"), ("reference", "moelab")])
def test_the_real_executor_starts_only_the_lanes_it_uses_and_joins_them(host_backend, device_backend):
    """A native backend runs on a C++ worker of the kernels extension (the host side on lane 0, the
    device side on lane 1): no Python thread is started for its side; any other backend gets its
    side's Python lane. Every started thread is joined when the run is removed."""
    if "moelab" in (host_backend, device_backend):
        pytest.importorskip("moelab.kernels.op")
    model, _ = moelab.load("tiny-random-mixtral")
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    cfg = {"executor": "real", "device": "cpu", "planner": "reference", "host_backend": host_backend,
           "device_backend": device_backend, "cache": {"capacity": 0.25}, "placement": "host-misses"}
    before = _lane_threads()
    with moelab.hybrid(model, cfg) as run:
        started = _lane_threads() - before
        model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)
    want = {"moelab-copy"} | ({"moelab-host"} if host_backend == "reference" else set()) | \
        ({"moelab-device"} if device_backend == "reference" else set())
    assert sorted(t.name for t in started) == sorted(want)
    assert not any(t.is_alive() for t in started)
    # either way the host side ran: host-misses computes a cold cache's misses on the host (the
    # device side's native lane: tests/test_hybrid.py::test_real_executor_equals_functional_and_its_events_are_consistent)
    assert (run.events_table()["lane"] == "host").any()
