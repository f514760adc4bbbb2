"""The seam every component plugs into: one context per forward, named points per MoE layer.

>>> from moelab.forward import hooks
>>> with hooks(model, router=lambda ctx, layer, call: print(ctx.phase, layer.index, call.experts.shape)):
...     model.generate(**inputs, max_new_tokens=2)

See :mod:`moelab.forward.points` for the points and their order, and
:mod:`moelab.forward.context` for what a :class:`ForwardContext` knows.
"""

from moelab.compat import past_length
from moelab.forward.backend import use_backend
from moelab.forward.context import (
    ForwardContext,
    ForwardInputs,
    Phase,
    inspect_forward,
)
from moelab.forward.plan import DEFERRED, DROPPED, IMMEDIATE, SlotPlan
from moelab.forward.points import (
    POINTS,
    ExpertsCall,
    ForwardHooks,
    Handle,
    Order,
    RouterCall,
    forward_hooks,
    hooks,
)

__all__ = [
    "DEFERRED", "DROPPED", "IMMEDIATE", "POINTS", "ExpertsCall", "ForwardContext", "ForwardHooks",
    "ForwardInputs", "Handle", "Order", "Phase", "RouterCall", "SlotPlan", "forward_hooks", "hooks",
    "inspect_forward", "past_length", "use_backend",
]
