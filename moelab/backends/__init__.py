"""Experts backends: one call shape over every way to run a MoE layer's experts.

::

    from moelab.backends import get_backend
    backend = get_backend("moelab_int4")            # or "reference", "eager", "grouped_mm", …
    out = backend(experts_module, hidden (T, H), top_k_index (T, K), top_k_weights (T, K),
                  expert_map=None)                   # (E,) ints; -1 = expert not on this device

Entries of :data:`BACKENDS` (a :class:`~moelab.registry.Registry` of backend instances):

=================================  ======================================================
``reference``                      plain torch, transformers' eager maths, any device
``eager``, ``batched_mm``,         transformers' built-ins (``ExpertsInterface``), any
``grouped_mm``                     device (``TransformersBackend("deepgemm")`` etc. for
                                   the CUDA-only ones)
``moelab``, ``moelab_bf16``,       moelab's native CPU kernels, one packing spec each
``moelab_int8[_g32|_g128]``,       (:data:`moelab.kernels.integration.IMPLEMENTATIONS`);
``moelab_int4[_g32|_g128]``,       each owns its packed weights; CPU tensors only
``moelab_fp8``
=================================  ======================================================

The ``moelab*`` names are also transformers experts implementations
(``model.set_experts_implementation("moelab_int4")``), which run these same instances.
Why a package and not ``moelab/kernels/backends.py``: the interface spans three
independent sources of expert maths (plain torch, transformers, the native kernels), and
the torch backends must be usable (e.g. on CUDA) without importing or building the
native kernels; ``moelab.kernels`` stays the home of the kernels themselves.
"""

from __future__ import annotations

from moelab.backends.base import ExpertsBackend, Routing, check_expert_map, require_cpu, route
from moelab.registry import Registry

BACKENDS: Registry[ExpertsBackend] = Registry("experts backend", base=ExpertsBackend, instances=True)
"""Name → shared backend instance (lazy: the kernels load on first use of a ``moelab*`` name)."""

BACKENDS.register("reference", "moelab.backends.reference:REFERENCE")
for _name in ("eager", "batched_mm", "grouped_mm"):
    BACKENDS.register(_name, f"moelab.backends.builtin:DEFAULTS.{_name}")
for _name in (
    "moelab", "moelab_bf16", "moelab_int8", "moelab_int8_g32", "moelab_int8_g128",
    "moelab_int4", "moelab_int4_g32", "moelab_int4_g128", "moelab_fp8",
):
    BACKENDS.register(_name, f"moelab.kernels.backend:DEFAULTS.{_name}")


def get_backend(name: str | ExpertsBackend) -> ExpertsBackend:
    """The registered backend ``name`` (a backend instance is returned as is)."""
    if isinstance(name, ExpertsBackend):
        return name
    return BACKENDS.get(name)


def register_backend(name: str, backend: ExpertsBackend | str, *, overwrite: bool = False) -> None:
    """Register a backend instance (or a lazy ``"module:attr"``) under ``name``."""
    BACKENDS.register(name, backend, overwrite=overwrite, stacklevel=2)  # the caller is the place


__all__ = [
    "BACKENDS",
    "ExpertsBackend",
    "Routing",
    "check_expert_map",
    "get_backend",
    "register_backend",
    "require_cpu",
    "route",
]
