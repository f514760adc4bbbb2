"""Choose the experts backend of a model's MoE layers through the forward seam."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from moelab.backends import ExpertsBackend, get_backend
from moelab.forward.points import Order, forward_hooks


@contextmanager
def use_backend(model, backend: str | ExpertsBackend, *, layers=None, expert_map=None) -> Iterator[ExpertsBackend]:
    """Run ``model``'s experts calls through ``backend`` inside the ``with`` block.

    A handler at the ``experts`` point of the model's forward hooks
    (:mod:`moelab.forward`, level ``BACKEND``) sets the backend of every MoE layer's
    experts call (``layers``: only these MoE layer ordinals) and, if given, the expert map.
    Deferral and skipping still apply: the backend runs whatever the plan keeps. Removed on
    exit, also after an exception.

    >>> with use_backend(model, "moelab_int4"):
    ...     model.generate(**inputs, max_new_tokens=16)
    """
    chosen = get_backend(backend)

    def choose(ctx, layer, call) -> None:
        call.backend = chosen
        if expert_map is not None:
            call.expert_map = expert_map

    handle = forward_hooks(model).add("experts", choose, order=Order.BACKEND, layers=layers,
                                      name=f"experts backend {backend}")
    try:
        yield chosen
    finally:
        handle.remove()


__all__ = ["use_backend"]
