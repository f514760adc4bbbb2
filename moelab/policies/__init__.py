"""Routing policies: reversible changes to which routed experts run, and when.

>>> with moelab.ExpertDeferral(model, deferred=2):     # KTransformers' Expert Deferral
...     model.generate(...)
>>> with moelab.ExpertSkipping(model, skipped=2):      # the skipping baseline
...     model.generate(...)

Both restore the model exactly on exit and compose when nested (in the order entered).
"""

from moelab.policies.base import DEFERRED, DROPPED, IMMEDIATE, RoutingPolicy, SlotPlan
from moelab.policies.deferral import DeferralConfig, ExpertDeferral
from moelab.policies.runtime import active_policies
from moelab.policies.skipping import ExpertSkipping, SkippingConfig

__all__ = [
    "DEFERRED",
    "DROPPED",
    "IMMEDIATE",
    "DeferralConfig",
    "ExpertDeferral",
    "ExpertSkipping",
    "RoutingPolicy",
    "SkippingConfig",
    "SlotPlan",
    "active_policies",
]
