"""The simulator's inputs and engine: model shapes without weights, synthetic routing.

Names are imported on first use (importing ``moelab.simulate`` stays cheap).
"""

from moelab._lazy import lazy_attributes

_LAZY = {
    "ModelShape": "moelab.simulate.shapes",
    "SHAPES": "moelab.simulate.shapes",
    "available_shapes": "moelab.simulate.shapes",
    "get_shape": "moelab.simulate.shapes",
    "register_shape": "moelab.simulate.shapes",
    "RoutingStats": "moelab.simulate.synthetic",
    "fit_routing_stats": "moelab.simulate.synthetic",
    "synthetic_routing": "moelab.simulate.synthetic",
    "simulate_plans": "moelab.simulate.executor",
    "SimResult": "moelab.simulate.executor",
    "whatif": "moelab.simulate.whatif",
    "run_validation": "moelab.simulate.validate",
}

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())

__all__ = sorted(_LAZY)
