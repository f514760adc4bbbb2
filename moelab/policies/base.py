"""``RoutingPolicy``: the base class of reversible changes to which routed experts run, and when.

A policy never touches weights, the router or the model's code. While it is active, the
model's MoE layers hand each experts call to a shared per-model runtime
(:mod:`moelab.policies.runtime`), which builds a :class:`SlotPlan` — every token's top-k
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
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from moelab.adapters import MoELayer, moe_layers
from moelab.errors import MoelabError

log = logging.getLogger(__name__)

PolicyPhase = Literal["decode", "all"]
"""Where a policy acts: ``decode`` forwards only, or ``all`` forwards (prefill and decode)."""

#: Slot states in a :class:`SlotPlan`.
IMMEDIATE, DEFERRED, DROPPED = 0, 1, 2

#: A per-layer setting: one value for every layer, a value per MoE layer (length L), or
#: ``{moe layer ordinal: value}`` (layers not named get 0).
PerLayer = int | Sequence[int] | Mapping[int, int]


@dataclass
class SlotPlan:
    """One experts call of one MoE layer: what happens to each of every token's top-k slots.

    Slots keep the router's order (policies rank them by weight themselves); editing
    ``state`` and ``weights`` in place is how a policy acts.
    """

    layer: MoELayer
    """The MoE layer being computed."""
    experts: torch.Tensor
    """(T, K) int64 routed expert ids, in the router's slot order."""
    weights: torch.Tensor
    """(T, K) router weights (policies may rescale them, e.g. renormalising after a skip)."""
    state: torch.Tensor
    """(T, K) int8: ``IMMEDIATE`` (0), ``DEFERRED`` (1) or ``DROPPED`` (2)."""
    valid: torch.Tensor
    """(T,) bool: real tokens (False for padding)."""
    phase: Literal["prefill", "decode"]
    """Phase of the forward in flight."""
    weights_changed: bool = False
    """Set by a policy that rescaled ``weights``."""

    def rank(self, among: torch.Tensor) -> torch.Tensor:
        """(T, K) rank of each slot by descending weight among the slots where ``among`` is True
        (0 = highest); ties keep the router's slot order. Slots outside ``among`` rank last."""
        key = torch.where(among, self.weights.float(), torch.full_like(self.weights, float("-inf"), dtype=torch.float32))
        order = torch.argsort(key, dim=1, descending=True, stable=True)
        rank = torch.empty_like(order)
        rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        return rank

    def demote_lowest(self, count: torch.Tensor | int, frm: int, to: int) -> None:
        """Move the ``count`` lowest-weight slots of state ``frm`` to state ``to``, per token."""
        among = self.state == frm
        n = among.sum(1, keepdim=True)
        rank = self.rank(among)
        if isinstance(count, int):
            count = torch.full_like(n, count)
        move = among & (rank >= n - count.reshape(-1, 1).clamp(min=0))
        self.state = torch.where(move, torch.full_like(self.state, to), self.state)

    @property
    def changed(self) -> bool:
        """Whether the plan differs from running every slot immediately with the router's weights."""
        return self.weights_changed or bool((self.state != IMMEDIATE).any())


class RoutingPolicy:
    """A reversible routing policy on ``model``: use it as a context manager.

    ``__init__`` only stores settings; entering resolves them against the model's MoE
    layers (errors name the layer and the limits), attaches the policy, and exiting
    detaches it — also after an exception — leaving hooks, forward methods, weights and
    config exactly as they were. A policy object can be entered again after exiting.
    """

    #: Short name used in tables and the CLI (its name in :data:`moelab.policies.POLICIES`).
    kind: ClassVar[str] = "policy"
    #: The dataclass of the policy's settings (``make_policy`` checks keywords against its fields).
    config_class: ClassVar[type | None] = None

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
