"""Routing policies: reversible changes to which routed experts run, and when.

>>> with moelab.ExpertDeferral(model, deferred=2):     # KTransformers' Expert Deferral
...     model.generate(...)
>>> with moelab.ExpertSkipping(model, skipped=2):      # the skipping baseline
...     model.generate(...)

Both restore the model exactly on exit and compose when nested (in the order entered).
By name: ``make_policy("deferral", model, deferred=2)`` (registry: ``POLICIES``).
"""

from moelab._lazy import lazy_attributes

# Imported on first use (PEP 562): the CLI names policies (``moelab.policies.registry``) to
# build its parser, which must not pull in torch.
_LAZY: dict[str, str] = {
    "DEFERRED": "moelab.policies.base",
    "DROPPED": "moelab.policies.base",
    "IMMEDIATE": "moelab.policies.base",
    "RoutingPolicy": "moelab.policies.base",
    "SlotPlan": "moelab.policies.base",
    "DeferralConfig": "moelab.policies.deferral",
    "ExpertDeferral": "moelab.policies.deferral",
    "active_policies": "moelab.policies.runtime",
    "ExpertSkipping": "moelab.policies.skipping",
    "SkippingConfig": "moelab.policies.skipping",
    "POLICIES": "moelab.policies.registry",
    "available_policies": "moelab.policies.registry",
    "make_policy": "moelab.policies.registry",
    "policy_params": "moelab.policies.registry",
    "register_policy": "moelab.policies.registry",
}

__all__ = [
    "POLICIES",
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
    "available_policies",
    "make_policy",
    "policy_params",
    "register_policy",
]

__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
