"""The hybrid CPU/GPU model: one configuration, one planner on the forward seam, executors.

See :mod:`moelab.hybrid.runtime` (``moelab.hybrid(model, config)``), :mod:`moelab.hybrid.planner`
(the one model-free planner), :mod:`moelab.hybrid.offline` (the planner over recorded or
synthetic routing), :mod:`moelab.hybrid.config` and :mod:`moelab.hybrid.placement`.
"""

from moelab.hybrid.config import CacheConfig, HybridConfig, PrefetchConfig, RoutingConfig
from moelab.hybrid.offline import ForwardRouting, plan_routing, routing_from_trace
from moelab.hybrid.placement import PLACEMENTS, Placement, get_placement
from moelab.hybrid.planner import LayerPlan, Planner, Transfer
from moelab.hybrid.runtime import HybridRun, hybrid

__all__ = [
    "PLACEMENTS", "CacheConfig", "ForwardRouting", "HybridConfig", "HybridRun", "LayerPlan",
    "Placement", "Planner", "PrefetchConfig", "RoutingConfig", "Transfer", "get_placement", "hybrid",
    "plan_routing", "routing_from_trace",
]


class _CallableModule(type(__import__("sys"))):
    """``moelab.hybrid(model, config)`` calls :func:`hybrid`, although ``moelab.hybrid`` is
    also this package (importing a subpackage binds the parent's attribute to it)."""

    def __call__(self, model, config=None):
        return hybrid(model, config)


__import__("sys").modules[__name__].__class__ = _CallableModule
