"""The per-model runtime that executes active routing policies (internal).

One runtime per model, created when the first policy is applied and removed (with all
its hooks) when the last one exits, so a model with no policy carries no trace of
moelab. It installs:

* a forward pre-hook and an always-called forward hook on the base model (the module
  that runs the decoder layers), which open and close a per-forward state: the phase
  (``decode``: a non-empty KV cache and one new token per row — the rule the trace
  recorder uses, :func:`moelab.trace.forward.inspect_forward`), which tokens are real,
  and the deferred outputs waiting for the next MoE layer. The state lives for one
  forward only, so nothing leaks across decode steps, sequences or batch rows (deferred
  outputs are per token);
* on every MoE layer's ``experts`` module, a forward pre-hook that asks the active
  policies for a :class:`~moelab.policies.base.SlotPlan` and narrows the call to the
  immediate slots, and a forward hook that computes the deferred slots on the same
  input (a second call of the same experts module: no weights are copied) and adds the
  previous MoE layer's deferred output to this layer's routed output.

When no policy changes a layer's plan the call is left untouched, which is why
``deferred=0`` / ``skipped=0`` reproduce the model bit for bit.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from moelab.adapters import MoELayer, moe_layers
from moelab.policies.base import DEFERRED, IMMEDIATE, RoutingPolicy, SlotPlan, model_of
from moelab.trace.forward import inspect_forward

log = logging.getLogger(__name__)

_RUNTIMES: weakref.WeakKeyDictionary[nn.Module, PolicyRuntime] = weakref.WeakKeyDictionary()

_INDEX_NAMES = ("top_k_index", "router_indices")
_WEIGHT_NAMES = ("top_k_weights", "routing_weights")


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


@dataclass
class _ForwardState:
    phase: str
    valid: torch.Tensor | None  # (T,) bool
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # moe index -> deferred sum to add
    jobs: dict[int, tuple] = field(default_factory=dict)  # moe index -> (hidden, experts, weights)


class PolicyRuntime:
    """Hooks that run the active policies of one model (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: list[MoELayer] = moe_layers(model)
        self.policies: list[RoutingPolicy] = []
        self._hooks: list = []
        self._state: _ForwardState | None = None
        self._depth = 0
        self._inner = False

    # ------------------------------------------------------------------ attach/detach
    def attach(self, policy: RoutingPolicy) -> None:
        if not self.policies:
            self._install()
        self.policies.append(policy)

    def detach(self, policy: RoutingPolicy) -> None:
        if policy in self.policies:
            self.policies.remove(policy)
        if not self.policies:
            self._uninstall()
            if _RUNTIMES.get(self.model) is self:
                del _RUNTIMES[self.model]

    def _install(self) -> None:
        top = getattr(self.model, "base_model", None)
        top = top if isinstance(top, nn.Module) else self.model
        try:
            self._hooks.append(top.register_forward_pre_hook(self._forward_pre, with_kwargs=True))
            self._hooks.append(top.register_forward_hook(self._forward_post, always_call=True))
            for layer in self.layers:
                self._hooks.append(layer.experts.register_forward_pre_hook(self._experts_pre(layer), with_kwargs=True))
                self._hooks.append(layer.experts.register_forward_hook(self._experts_post(layer), with_kwargs=True))
        except BaseException:
            self._uninstall()
            raise

    def _uninstall(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        self._state = None
        self._depth = 0
        self._inner = False

    # ------------------------------------------------------------------ per forward
    def _forward_pre(self, module, args, kwargs):
        self._depth += 1
        if self._depth == 1:
            info = inspect_forward(args, kwargs)
            self._state = _ForwardState(
                phase=info.phase if info is not None else "prefill",
                valid=info.mask.reshape(-1) if info is not None else None,
            )
        return None

    def _forward_post(self, module, args, output):
        self._depth = max(self._depth - 1, 0)
        if self._depth == 0:
            self._state = None  # deferred state never outlives its forward
        return None

    # ------------------------------------------------------------------ per MoE layer
    def _experts_pre(self, layer: MoELayer):
        def hook(module, args, kwargs):
            state = self._state
            if self._inner or state is None:
                return None
            acting = [p for p in self.policies if p.acts_in(state.phase)]
            if not acting:
                return None
            hidden, experts, weights = _unpack(args, kwargs)
            T, K = experts.shape
            valid = state.valid
            if valid is None or valid.numel() != T:
                valid = torch.ones(T, dtype=torch.bool, device=experts.device)
            plan = SlotPlan(
                layer=layer,
                experts=experts,
                weights=weights,
                state=torch.zeros((T, K), dtype=torch.int8, device=experts.device),
                valid=valid.to(experts.device),
                phase=state.phase,  # type: ignore[arg-type]
            )
            for policy in acting:
                policy._plan(plan)
            if not plan.changed:
                return None
            deferred = plan.state == DEFERRED
            if bool(deferred.any()):
                state.jobs[layer.index] = (hidden, *_compact(experts, plan.weights, deferred))
            return _repack(args, kwargs, *_compact(experts, plan.weights, plan.state == IMMEDIATE))

        return hook

    def _experts_post(self, layer: MoELayer):
        def hook(module, args, kwargs, output):
            state = self._state
            if self._inner or state is None:
                return None
            job = state.jobs.pop(layer.index, None)
            if job is not None:
                self._inner = True
                try:
                    late = module(*job)  # the same experts module: weights are not copied
                finally:
                    self._inner = False
                state.pending[layer.index + 1] = state.pending.get(layer.index + 1, 0) + late
            incoming = state.pending.pop(layer.index, None)
            if incoming is None:
                return None
            return output + incoming.to(output.dtype)

        return hook


def _unpack(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (T,H), experts (T,K), weights (T,K)) from an experts call, positional or keyword."""
    values = list(args[:3])
    names = (("hidden_states",), _INDEX_NAMES, _WEIGHT_NAMES)
    for i in range(len(values), 3):
        found = next((kwargs[n] for n in names[i] if n in kwargs), None)
        values.append(found)
    if any(v is None for v in values):
        raise TypeError(f"unexpected experts call signature: {len(args)} positional, keywords {sorted(kwargs)}")
    return values[0], values[1], values[2]


def _repack(args: tuple, kwargs: dict, experts: torch.Tensor, weights: torch.Tensor) -> tuple[tuple, dict]:
    args = list(args)
    kwargs = dict(kwargs)
    for i, (value, names) in enumerate(((experts, _INDEX_NAMES), (weights, _WEIGHT_NAMES)), start=1):
        if len(args) > i:
            args[i] = value
        else:
            key = next(n for n in names if n in kwargs)
            kwargs[key] = value
    return tuple(args), kwargs


def _compact(experts: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept slots of every token, packed to the left in router order: (T, m) ids and weights.

    Tokens with fewer than m kept slots are padded with one of their own experts at weight 0,
    which adds an exact zero (only the union rule and fully dropped tokens need padding).
    """
    if bool(keep.all()):
        return experts, weights
    m = max(int(keep.sum(1).max()) if keep.numel() else 0, 1)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :m]
    ids = experts.gather(1, order)
    w = weights.gather(1, order)
    kept = keep.gather(1, order)
    if not bool(kept.all()):
        ids = torch.where(kept, ids, ids[:, :1].expand_as(ids))
        w = torch.where(kept, w, torch.zeros_like(w))
    return ids, w
