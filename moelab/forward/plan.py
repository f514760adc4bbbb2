"""The plan of one MoE layer's experts call: what happens to each token's top-k slots.

Built by the forward-hook manager (:mod:`moelab.forward.points`) at the ``plan`` point of
every MoE layer, edited in place by routing policies (deferral, skipping) and the hybrid
runtime, and executed by the manager's functional executor: immediate slots run now,
deferred slots run on this layer's input and their sum is added to the next MoE
layer's output, dropped slots do not run.

Shape legend: T tokens in the forward (B·S), K top-k of the layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch

if TYPE_CHECKING:
    from moelab.adapters import MoELayer

#: Slot states in a :class:`SlotPlan`.
IMMEDIATE, DEFERRED, DROPPED = 0, 1, 2

#: A plan of at most this many CPU slots (T·K: a decode step's) is edited as Python lists
#: (:attr:`SlotPlan.small`): between a forward's layers every torch call on tiny tensors costs
#: tens of microseconds (its code and data are out of the caches after the layer's weights went
#: through them), a list of a few ints a fraction of one. Same decisions as the tensor path
#: (``tests/test_plan_small.py``).
SMALL = 64

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
    """(T,) bool: real tokens (False for padding); shared by the forward's plans, read only."""
    phase: Literal["prefill", "decode"]
    """Phase of the forward in flight."""
    weights_changed: bool = False
    """Set by a policy that rescaled ``weights``."""
    split: tuple | None = None
    """The routing of the immediate slots and of the deferred ones (None: none deferred), as the
    seam compacts them (``_split_plan``), precomputed by the last ``plan`` handler for the plan as
    it leaves it (the hybrid run's compiled planner); None: the seam compacts the plan itself."""

    def rank(self, among: torch.Tensor) -> torch.Tensor:
        """(T, K) rank of each slot by descending weight among the slots where ``among`` is True
        (0 = highest; NaN above every number); ties keep the router's slot order. Slots outside
        ``among`` rank after all of them (even below an ``among`` slot of weight -inf)."""
        order = torch.argsort(self.weights.float(), dim=1, descending=True, stable=True)
        outside = (~among).gather(1, order).to(torch.int8)  # then the among slots first, in that order
        order = order.gather(1, torch.argsort(outside, dim=1, stable=True))
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
    def small(self) -> bool:
        """Whether policies edit this plan as lists (at most :data:`SMALL` slots, on the CPU, ≥ 1 token)."""
        st = self.state
        return 0 < st.numel() <= SMALL and st.is_cpu

    @property
    def changed(self) -> bool:
        """Whether the plan differs from running every slot immediately with the router's weights."""
        if self.weights_changed:
            return True
        if self.small:
            return any(any(row) for row in self.state.tolist())  # IMMEDIATE is 0
        return bool((self.state != IMMEDIATE).any())


_NUMPY = {torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
          torch.uint8: np.uint8, torch.bool: np.bool_, torch.float32: np.float32, torch.float64: np.float64}


def small_tensor(rows: list, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of ``dtype`` from nested lists of a small plan, through numpy where numpy has
    the dtype (a third of ``torch.tensor``'s cost, which walks the lists in torch), else
    ``torch.tensor``; the values are the same."""
    np_dtype = _NUMPY.get(dtype)
    if np_dtype is None:
        return torch.tensor(rows, dtype=dtype)
    return torch.from_numpy(np.array(rows, dtype=np_dtype))


def _descending(keys: list[float]) -> list[int]:
    """Positions of ``keys`` by descending value, ties in position order, NaN first: the order of
    ``torch.argsort(keys, descending=True, stable=True)``."""
    return sorted(range(len(keys)), key=lambda j: (0, 0.0) if math.isnan(keys[j]) else (1, -keys[j]))


def demote_lowest_rows(state: list[list[int]], weights: list[list[float]], counts: list[int], frm: int,
                       to: int) -> None:
    """:meth:`SlotPlan.demote_lowest` on lists (edits ``state`` in place): per token, the slots in
    state ``frm`` ranked as :meth:`SlotPlan.rank` ranks them (by descending weight, NaN first, ties
    in slot order), and those at rank ≥ n − count move to ``to``."""
    for srow, wrow, count in zip(state, weights, counts, strict=True):
        if count <= 0:
            continue
        ranked = [j for j in _descending(wrow) if srow[j] == frm]
        for j in ranked[max(len(ranked) - count, 0):]:
            srow[j] = to


def compact_rows(ids: list[list[int]], weights: list[list[float]], keep: list[list[bool]]
                 ) -> tuple[list[list[int]], list[list[float]]] | None:
    """:func:`moelab.forward.points._compact` on lists: every token's kept slots packed to the left
    in router order, padded to the widest token's count (at least 1) with the first packed slot's
    expert at weight 0; None when every slot is kept."""
    if all(all(row) for row in keep):
        return None
    m = max(max(sum(row) for row in keep), 1)
    out_ids, out_w = [], []
    for irow, wrow, krow in zip(ids, weights, keep, strict=True):
        order = ([j for j, k in enumerate(krow) if k] + [j for j, k in enumerate(krow) if not k])[:m]
        first = irow[order[0]]
        out_ids.append([irow[j] if krow[j] else first for j in order])
        out_w.append([wrow[j] if krow[j] else 0.0 for j in order])
    return out_ids, out_w
