"""Runtime overhead as a term: "this hardware" or "moelab's executor on this hardware".

The simulator's costs are the hardware's (bytes over bandwidths, launches, synchronisations). The
real executor (:mod:`moelab.hybrid.real`) adds its own: per MoE layer the control thread plans the
layer, hands the work to the lanes and merges their results (Python), and every lane call is a
hand-off between threads (submit, wake-up, result back). ``moelab calibrate`` measures both with
the real executor on a tiny model and writes them as two profile fields:

``runtime_layer_us``  control-thread cost per MoE layer (the real executor's ``plan`` and
                      ``dispatch`` events: the planner, submitting, merging)
``runtime_call_us``   hand-off of one lane call (an empty task's round trip through a lane)

The one cost model (:class:`moelab.timing.costs.CostModel`) adds ``runtime_layer_us`` to each
layer's control-thread work and ``runtime_call_us`` to each lane call (the layer's device call,
its host call per host lane, its deferred call per host lane), so the simulator and the
placements see the same overhead. A profile with both at 0 (every shipped profile: they
describe machines, not moelab on them) predicts the hardware; :func:`hardware_only` zeroes them on
any profile; :func:`prediction_label` says which of the two a simulated number is, and every
simulated figure ``moelab simulate validate`` prints carries that label.
"""

from __future__ import annotations

import dataclasses

from moelab.errors import MoelabError
from moelab.measure import spread_of
from moelab.timing import HardwareProfile

HARDWARE = "hardware"
EXECUTOR = "moelab executor"


def has_runtime_overhead(hw: HardwareProfile) -> bool:
    return bool(getattr(hw, "runtime_layer_us", 0.0) or getattr(hw, "runtime_call_us", 0.0))


def prediction_label(hw: HardwareProfile) -> str:
    """``"moelab executor"`` when ``hw`` carries the executor's runtime overhead, else ``"hardware"``."""
    return EXECUTOR if has_runtime_overhead(hw) else HARDWARE


def hardware_only(hw: HardwareProfile) -> HardwareProfile:
    """``hw`` without moelab's executor overhead: it predicts the hardware alone."""
    if not has_runtime_overhead(hw):
        return hw
    prov = dict(hw.provenance)
    for k in ("runtime_layer_us", "runtime_call_us"):
        prov[k] = "assumed: 0, the hardware alone (moelab.simulate.runtime.hardware_only)"
    return dataclasses.replace(hw, runtime_layer_us=0.0, runtime_call_us=0.0, provenance=prov)


__all__ = ["EXECUTOR", "HARDWARE", "hardware_only", "has_runtime_overhead",
           "prediction_label"]


# ---------------------------------------------------------------------- measurement
def measure_executor_overhead(*, host_backend: str = "reference", device_backend: str = "reference",
                              steps: int = 6, warmup: int = 2) -> dict:
    """The real executor's control-thread cost per MoE layer, measured on a tiny model (random
    weights, 3 MoE layers, hidden 32: its experts and attention cost microseconds, so the control
    thread's ``plan`` and ``dispatch`` events are the executor's own work): host-misses at a quarter
    of the experts cached, one deferred expert per token, ``steps`` decode steps after ``warmup``.
    Returns ``layer_us`` (the median over steps × MoE layers of plan + dispatch µs), its spread, the
    points, and the median of the other control-thread spans for reference."""
    import statistics

    import torch

    from moelab.forward.bench import decode_loop
    from moelab.hybrid.runtime import HybridRun
    from moelab.models.tiny import build_tiny

    model = build_tiny("deepseek_v2", seed=0, dtype=torch.bfloat16)
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses", "executor": "real",
           "device_backend": device_backend, "host_backend": host_backend, "device": "cpu",
           "routing": {"deferred": 1, "min_immediate": 1}}
    run = HybridRun(model, cfg)
    with run, torch.no_grad():
        decode_loop(model, ids, warmup)
        first = int(run.events_table()["step"].max()) + 1
        decode_loop(model, ids, steps)
        ev = run.events_table()
    ev = ev[(ev["step"] > first) & (ev["lane"].astype(str) == "control") & (ev["layer"] >= 0)]  # > : no prefill
    ev = ev.assign(us=ev["t_end_us"] - ev["t_start_us"], kind=ev["kind"].astype(str))
    own = ev[ev["kind"].isin(["plan", "dispatch"])].groupby(["step", "layer"])["us"].sum()
    if not len(own):
        raise MoelabError("the real executor recorded no plan/dispatch events on the tiny model; cannot measure "
                          "its runtime overhead.")
    other = {k: float(g.groupby(["step", "layer"])["us"].sum().median()) for k, g in ev.groupby("kind")
             if k not in ("plan", "dispatch")}
    vals = own.tolist()
    return {"layer_us": float(statistics.median(vals)), "spread": spread_of(vals), "points": vals,
            "moe_layers": int(own.index.get_level_values("layer").nunique()), "steps": steps,
            "other_control_us": other, "config": cfg}
