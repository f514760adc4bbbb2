"""The per-model runtime that executes active routing policies (internal).

One runtime per model, created when the first policy is applied and removed when the
last one exits. It registers one handler at the ``plan`` point of the model's forward
hooks (:mod:`moelab.forward.points`, level :attr:`~moelab.forward.Order.ROUTING`): for
every MoE layer's experts call it lets the active policies edit the layer's
:class:`~moelab.forward.SlotPlan`, in the order they were applied. The forward hooks'
functional executor runs the plan — immediate slots now, deferred slots on the same
input with their sum added to the next MoE layer's output, dropped slots not at all —
and keeps deferred outputs in the forward's context, so nothing leaks across decode
steps, sequences or batch rows.

The phase (``decode``: one new token per row continuing the sequences on a non-empty KV
cache) and the valid-token mask come from the one forward context
(:mod:`moelab.forward.context`), the rule the trace recorder uses too. When no policy
changes a layer's plan the call is left untouched, which is why ``deferred=0`` /
``skipped=0`` reproduce the model bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import nn

from moelab.forward import ExpertsCall, ForwardContext, Handle, Order, forward_hooks
from moelab.policies.base import RoutingPolicy, model_of

log = logging.getLogger(__name__)

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, PolicyRuntime] = weakref.WeakKeyDictionary()


def runtime_for(model: Any, *, create: bool) -> PolicyRuntime | None:
    """The runtime of ``model``; with ``create`` a new one if there is none."""
    m = model_of(model)
    rt = _RUNTIMES.get(m)
    if rt is None and create:
        rt = PolicyRuntime(m)
        _RUNTIMES[m] = rt
    return rt


def active_policies(model: Any) -> list[RoutingPolicy]:
    """The policies active on ``model``, in the order they were applied."""
    rt = runtime_for(model, create=False)
    return list(rt.policies) if rt is not None else []


class PolicyRuntime:
    """The ``plan`` handler that runs the active policies of one model."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.policies: list[RoutingPolicy] = []
        self._handle: Handle | None = None
        self._handed: tuple[RoutingPolicy, Handle] | None = None
        self._order: tuple | None = None  # the plan handlers' tuple the hand-over was checked against
        self._adjacent = False

    def hand_over(self, policy: RoutingPolicy, to: Handle | None) -> None:
        """Let the ``plan`` handler ``to`` make ``policy``'s edit itself (None: take it back).

        Whenever ``policy`` is the last policy acting on a plan and ``to`` is the very next ``plan``
        handler (nothing in between could see the plan without the edit), this runtime does not
        run the policy: it leaves it in :attr:`~moelab.forward.ExpertsCall.pending` for ``to``,
        which must make the edit (or run ``pending._plan(call.plan)``). The hybrid run hands its
        compiled planner its own Expert Deferral this way: one compiled call defers and plans."""
        self._handed = (policy, to) if to is not None else None
        self._order = None

    def attach(self, policy: RoutingPolicy) -> None:
        if self._handle is None:
            self._handle = forward_hooks(self.model).add("plan", self._plan, order=Order.ROUTING, name="routing policies")
        self.policies.append(policy)

    def detach(self, policy: RoutingPolicy) -> None:
        if self._handed is not None and self._handed[0] is policy:
            self._handed = None
        if policy in self.policies:
            self.policies.remove(policy)
        if not self.policies:
            if self._handle is not None:
                self._handle.remove()
                self._handle = None
            if _RUNTIMES.get(self.model) is self:
                del _RUNTIMES[self.model]

    def _plan(self, ctx: ForwardContext, layer, call: ExpertsCall) -> None:
        phase = ctx.phase
        acting = []
        for p in self.policies:  # (a loop, not a comprehension: a function call less per MoE layer)
            if p.acts_in(phase):
                acting.append(p)
        if not acting:
            return
        plan = call.plan
        handed = self._handed
        if handed is not None and acting[-1] is handed[0] and self._next_is(handed[1]):
            for policy in acting[:-1]:
                policy._plan(plan)
            call.pending = handed[0]
            return
        for policy in acting:
            policy._plan(plan)

    def _next_is(self, handle: Handle) -> bool:
        """Whether ``handle`` runs right after this runtime's handler at the ``plan`` point."""
        order = self._handle.manager._fns["plan"] if self._handle is not None else ()
        if order is not self._order:  # re-checked only when the handlers change
            self._order = order
            i = order.index(self._handle) if self._handle in order else -1
            self._adjacent = 0 <= i < len(order) - 1 and order[i + 1] is handle
        return self._adjacent
