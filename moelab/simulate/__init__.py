"""The simulator: the hybrid planner's plans on any hardware profile, as the real executor's events.

* :mod:`moelab.simulate.executor` — :func:`simulate_plans` (plans + model shape + hardware
  profile → events in :data:`moelab.hybrid.events.COLUMNS` and a summary);
* :mod:`moelab.simulate.engine` — the discrete-event engine (lanes, priorities, dependencies,
  memory bandwidth shared by max-min fair processor sharing), a plain reference and a C fast path;
* :mod:`moelab.simulate.online` — ``executor: simulated`` in a hybrid config;
* :mod:`moelab.simulate.calibrate` — ``moelab calibrate``: this machine as a hardware profile;
* :mod:`moelab.simulate.bench` — ``moelab bench simulate``;
* :mod:`moelab.timing.shapes`, :mod:`moelab.simulate.synthetic` — model shapes without
  weights, synthetic routing with fitted statistics;
* :mod:`moelab.simulate.whatif` — ``moelab simulate --grid``: what-if grids with oracle bounds;
* :mod:`moelab.simulate.moegen` — MoE-Gen's throughput schedule: a DAG of jobs per layer and the
  search over batch sizes under GPU and host memory (``moelab simulate throughput``);
* :mod:`moelab.simulate.validate` — ``moelab simulate validate``: the simulator's error.

Names are imported on first use (importing ``moelab.simulate`` stays cheap).
"""

from moelab._lazy import lazy_attributes

_LAZY = {
    "ModelShape": "moelab.timing.shapes",
    "SHAPES": "moelab.timing.shapes",
    "available_shapes": "moelab.timing.shapes",
    "get_shape": "moelab.timing.shapes",
    "register_shape": "moelab.timing.shapes",
    "RoutingStats": "moelab.simulate.synthetic",
    "fit_routing_stats": "moelab.simulate.synthetic",
    "synthetic_routing": "moelab.simulate.synthetic",
    "simulate_plans": "moelab.simulate.executor",
    "SimResult": "moelab.simulate.executor",
    "whatif": "moelab.simulate.whatif",
    "plan_throughput": "moelab.simulate.moegen",
    "ThroughputPlan": "moelab.simulate.moegen",
    "run_validation": "moelab.simulate.validate",
    "summarize_sim": "moelab.simulate.executor",
    "Graph": "moelab.simulate.engine",
    "Schedule": "moelab.simulate.engine",
    "simulate": "moelab.simulate.engine",
    "simulate_reference": "moelab.simulate.engine",
    "CalibrateConfig": "moelab.simulate.calibrate",
    "calibrate": "moelab.simulate.calibrate",
    "write_profile": "moelab.simulate.calibrate",
    "ValidationCase": "moelab.simulate.validate_cases",
    "cases_table": "moelab.simulate.validate_cases",
    "validation_cases": "moelab.simulate.validate_cases",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
