"""``RoutingPolicy``: the base class of reversible changes to which routed experts run, and when.

A policy never touches weights, the router or the model's code. While it is active, the
model's MoE layers hand each experts call to a shared per-model runtime
(:mod:`moelab.policies.runtime`, a handler at the ``plan`` point of :mod:`moelab.forward`),
which builds a :class:`SlotPlan` — every token's top-k
slots, each *immediate*, *deferred* (computed on this layer's input, added to the next
MoE layer's output) or *dropped* — and lets each active policy edit it, in the order the
policies were entered. Policies compose: ``with skip, defer:`` skips, then defers among
what is left.

Subclasses implement :meth:`RoutingPolicy._resolve` (check the settings against the
model's layers, once, on entry) and :meth:`RoutingPolicy._plan` (edit one layer's plan).

Shape legend: T tokens in the forward (B·S), K top-k of the layer, L MoE layers.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from torch import nn

from moelab.adapters import MoELayer, moe_layers
from moelab.errors import MoelabError
from moelab.forward.plan import DEFERRED, DROPPED, IMMEDIATE, SlotPlan  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

PolicyPhase = Literal["decode", "all"]
"""Where a policy acts: ``decode`` forwards only, or ``all`` forwards (prefill and decode)."""

#: A per-layer setting: one value for every layer, a value per MoE layer (length L), or
#: ``{moe layer ordinal: value}`` (layers not named get 0).
PerLayer = int | Sequence[int] | Mapping[int, int]


class RoutingPolicy:
    """A reversible routing policy on ``model``: use it as a context manager.

    ``__init__`` only stores settings; entering resolves them against the model's MoE
    layers (errors name the layer and the limits), attaches the policy, and exiting
    detaches it — also after an exception — leaving hooks, forward methods, weights and
    config exactly as they were. A policy object can be entered again after exiting.
    """

    #: Short name used in tables and the CLI.
    kind: ClassVar[str] = "policy"

    def __init__(self, model: Any) -> None:
        self.model = model
        self.active_ = False

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> RoutingPolicy:
        return self.apply()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.remove()
        return False

    def apply(self) -> RoutingPolicy:
        """Resolve the settings on the model and attach; ``remove()`` undoes it."""
        from moelab.policies.runtime import runtime_for

        if self.active_:
            raise MoelabError(
                f"{type(self).__name__} is already applied to this model; exit it (or call remove()) "
                "before applying it again, or create a second policy object."
            )
        self.layers_: list[MoELayer] = moe_layers(self.model)
        self._resolve(self.layers_)
        runtime_for(self.model, create=True).attach(self)
        self.active_ = True
        log.debug("applied %r", self)
        return self

    def remove(self) -> None:
        """Detach; the model is restored exactly once no policy is left on it."""
        from moelab.policies.runtime import runtime_for

        if not self.active_:
            return
        runtime = runtime_for(self.model, create=False)
        if runtime is not None:
            runtime.detach(self)
        self.active_ = False

    # ------------------------------------------------------------------ subclass API
    def acts_in(self, phase: str) -> bool:
        """Whether the policy acts in a forward of ``phase`` (``prefill`` or ``decode``)."""
        return getattr(self.config, "phase", "decode") == "all" or phase == "decode"

    def _resolve(self, layers: list[MoELayer]) -> None:  # pragma: no cover - abstract
        """Check the settings against ``layers`` and store per-layer values (attributes ending in ``_``)."""
        raise NotImplementedError

    def _plan(self, plan: SlotPlan) -> None:  # pragma: no cover - abstract
        """Edit ``plan`` (one layer's experts call) in place."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'config', '')})"


def resolve_per_layer(value: PerLayer, layers: list[MoELayer], what: str) -> list[int]:
    """One non-negative int per MoE layer from a global, per-layer list or mapping setting."""
    n = len(layers)
    if isinstance(value, bool):
        raise MoelabError(f"{what}={value!r}: expected an integer, a list of {n} integers or a {{layer: int}} mapping.")
    if isinstance(value, int):
        out = [value] * n
    elif isinstance(value, Mapping):
        unknown = [k for k in value if not isinstance(k, int) or not 0 <= k < n]
        if unknown:
            raise MoelabError(
                f"{what}: MoE layer(s) {unknown} do not exist; keys are MoE layer ordinals 0..{n - 1} "
                f"(decoder layers {[layer.layer_idx for layer in layers]})."
            )
        out = [int(value.get(i, 0)) for i in range(n)]
    elif isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n:
            raise MoelabError(
                f"{what}: got {len(value)} per-layer values, but the model has {n} MoE layers; "
                f"pass one value per MoE layer (decoder layers {[layer.layer_idx for layer in layers]})."
            )
        out = [int(v) for v in value]
    else:
        raise MoelabError(f"{what}={value!r}: expected an integer, a list of {n} integers or a {{layer: int}} mapping.")
    negative = [(i, v) for i, v in enumerate(out) if v < 0]
    if negative:
        raise MoelabError(f"{what}: values must be ≥ 0; got {negative[0][1]} for MoE layer {negative[0][0]}.")
    return out


def layer_label(layer: MoELayer) -> str:
    """``MoE layer 2 (decoder layer 3, top-k 4)`` — how error messages name a layer."""
    return f"MoE layer {layer.index} (decoder layer {layer.layer_idx}, top-k {layer.top_k})"


def model_of(model: Any) -> nn.Module:
    """The torch model behind ``model`` (unwraps lm-eval's HFLM)."""
    from moelab.adapters import _unwrap

    return _unwrap(model)
