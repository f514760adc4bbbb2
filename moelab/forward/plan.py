"""The plan of one MoE layer's experts call: what happens to each token's top-k slots.

Built by the forward-hook manager (:mod:`moelab.forward.points`) at the ``plan`` point of
every MoE layer, edited in place by routing policies (deferral, skipping) and the hybrid
runtime, and executed by the manager's functional executor: immediate slots run now,
deferred slots run on this layer's input and their sum is added to the next MoE
layer's output, dropped slots do not run.

Shape legend: T tokens in the forward (B·S), K top-k of the layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from moelab.adapters import MoELayer

#: Slot states in a :class:`SlotPlan`.
IMMEDIATE, DEFERRED, DROPPED = 0, 1, 2

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
