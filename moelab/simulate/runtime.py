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

# measured by the hybrid package's bench: the simulator builds on the hybrid package
from moelab.hybrid.bench import measure_executor_overhead
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


__all__ = ["EXECUTOR", "HARDWARE", "hardware_only", "has_runtime_overhead", "measure_executor_overhead",
           "prediction_label"]

