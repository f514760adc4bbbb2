"""The experts-backend interface: one call shape over every way to run a layer's experts.

A backend computes ``Σ_k w[t,k] · expert_{ids[t,k]}(x_t)`` for one MoE layer's tokens::

    out = backend(module, hidden_states, top_k_index, top_k_weights, expert_map=None)

``module`` is a transformers experts module (``gate_up_proj``/``down_proj`` stacks),
``hidden_states`` ``(T, H)``, ``top_k_index``/``top_k_weights`` ``(T, K)``; the result is
``(T, H)`` in the hidden states' dtype.

``expert_map`` (vLLM's convention) is an ``(E,)`` integer tensor over the router's expert
ids: ``expert_map[e] == -1`` means expert ``e`` is not on this device, so its slots
contribute 0 and are not computed; otherwise ``expert_map[e]`` is the index of expert
``e`` in ``module``'s weight stacks. The identity map (``arange(E)``) and a map with some
entries set to -1 describe a full module of which only some experts run here; a module
that holds only its local experts (``E_local`` stacks) takes a map with values in
``[-1, E_local)``. Slots whose weight is exactly 0 (padding) are not computed either.
Skipped slots change nothing in the result beyond what a backend's own arithmetic does
with fewer rows (see each backend's docstring).

The work shared by every backend (checking inputs, applying the map, finding the
(token, slot) pairs that run) is done here, once, in :meth:`ExpertsBackend.__call__`;
subclasses implement :meth:`ExpertsBackend.compute`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelab.errors import MoelabError


@dataclass(frozen=True)
class Routing:
    """One call's routing after the expert map: what runs, in the module's local numbering.

    (Until 2026-11-27 ``active`` was the third field; it is now read-only and built on first use,
    and the third field is :attr:`mask`.)"""

    index: torch.Tensor
    """``(T, K)`` local expert index per slot (-1 where the expert is not here)."""
    weights: torch.Tensor
    """``(T, K)`` routing weights (as given)."""
    mask: torch.Tensor | None
    """:attr:`active` where :func:`route` made it; None where it did not need to (no expert
    map: :attr:`active` is then ``weights != 0``, made on first use)."""
    all_active: bool
    """Every slot runs: the backend can take its unmasked path."""

    @property
    def active(self) -> torch.Tensor:
        """``(T, K)`` bool: the slot runs here (expert present, weight != 0). Made once, on first
        read, and kept in the instance's ``__dict__`` (not a ``functools.cached_property``: before
        Python 3.12 that takes one lock shared by every instance, and a call makes one of these)."""
        a = self.__dict__.get("_active")
        if a is None:
            a = self.mask if self.mask is not None else self.weights != 0
            self.__dict__["_active"] = a
        return a

    def pairs(self, order: str = "expert") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(token, slot, expert)`` of the active slots.

        ``order="expert"``: sorted by expert, then token, then slot (a stable sort of the
        token-major pairs); ``order="token"``: token-major (token, then slot).
        """
        tok, slot = torch.nonzero(self.active, as_tuple=True)
        exp = self.index[tok, slot]
        if order == "expert" and exp.numel():
            perm = torch.sort(exp, stable=True).indices
            tok, slot, exp = tok[perm], slot[perm], exp[perm]
        return tok, slot, exp


def _stack(module: torch.nn.Module, name: str):
    """``getattr(module, name, None)``, reading a registered parameter directly (``nn.Module``'s
    attribute fallback costs microseconds, and every experts call reads its stacks)."""
    p = module._parameters.get(name)
    return p if p is not None else getattr(module, name, None)


def num_local_experts(module: torch.nn.Module) -> int:
    """How many experts ``module`` holds (the leading dimension of its weight stacks)."""
    w = _stack(module, "gate_up_proj")
    if w is None:
        w = _stack(module, "up_proj")
    if w is None or not isinstance(w, torch.Tensor) or w.dim() != 3:
        raise MoelabError(
            f"{type(module).__name__} has no (E, ., .) gate_up_proj or up_proj stack; experts backends "
            "run transformers' fused experts modules (model.set_experts_implementation works on them)."
        )
    return int(w.shape[0])


def hidden_size(module: torch.nn.Module) -> int:
    """The hidden size ``H`` the module's experts read."""
    w = _stack(module, "down_proj")
    if w is None:
        w = module.down_proj  # its own error
    return int(w.shape[2] if getattr(module, "is_transposed", False) else w.shape[1])


def require_cpu(backend: str, **tensors: torch.Tensor | None) -> None:
    """Refuse tensors that are not on the CPU (the native kernels cannot read them).

    The error names the tensor, its device, what the backend needs and the fix.
    """
    for what, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.device.type != "cpu":
            raise MoelabError(
                f"{what} is on {t.device}; the {backend!r} experts backend runs moelab's native CPU kernels "
                "and needs CPU tensors. Use get_backend('reference') or a torch backend ('eager', "
                f"'grouped_mm') for tensors on {t.device.type}, or move the experts and inputs to the CPU."
            )


def check_routing_types(top_k_index: torch.Tensor, expert_map: torch.Tensor | None) -> None:
    """Integer expert ids, and ``expert_map`` (if any) a 1-D integer tensor: the checks that read no
    values (:func:`route` and a kernel backend's prepared call, whose extension checks the values)."""
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise MoelabError(f"top_k_index has dtype {top_k_index.dtype}; expected integer expert ids (torch.long).")
    if expert_map is not None:
        check_map_type(expert_map)


def check_map_type(expert_map: torch.Tensor) -> None:
    """``expert_map`` is a 1-D integer tensor (its values unread)."""
    if not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1:
        shape = tuple(expert_map.shape) if isinstance(expert_map, torch.Tensor) else type(expert_map).__name__
        raise MoelabError(
            f"expert_map {shape} is not a 1-D tensor; expected (E,) with expert_map[e] = local index or -1."
        )
    if expert_map.dtype.is_floating_point or expert_map.dtype.is_complex or expert_map.dtype == torch.bool:
        raise MoelabError(f"expert_map has dtype {expert_map.dtype}; expected an integer tensor (torch.long).")


def check_expert_map(expert_map: torch.Tensor, num_local: int) -> None:
    """``expert_map`` is a 1-D integer tensor with values in ``[-1, num_local)``."""
    check_map_type(expert_map)
    if expert_map.numel():
        lo, hi = torch.aminmax(expert_map)  # (no generator: a function call per MoE layer)
        lo, hi = int(lo), int(hi)
        if lo < -1 or hi >= num_local:
            raise MoelabError(
                f"expert_map has values in [{lo}, {hi}]; expected -1 (not here) or a local expert index in "
                f"[0, {num_local}) for a module holding {num_local} experts."
            )


def route(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    expert_map: torch.Tensor | None,
) -> Routing:
    """Check one call's inputs and apply ``expert_map`` (see the module docstring)."""
    h = hidden_size(module)
    if hidden_states.dim() != 2 or hidden_states.shape[1] != h:
        raise MoelabError(
            f"hidden states have shape {tuple(hidden_states.shape)}; expected (T, {h}) for "
            f"{type(module).__name__}. Flatten (batch, seq, H) to (batch·seq, H) first."
        )
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or top_k_index.shape[0] != hidden_states.shape[0]:
        raise MoelabError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} must both "
            f"be (T, K) with T = {hidden_states.shape[0]}."
        )
    check_routing_types(top_k_index, None)  # the map's type: check_expert_map, with its values
    num_local = num_local_experts(module)
    if expert_map is not None:
        check_expert_map(expert_map, num_local)
    n_ids = num_local if expert_map is None else int(expert_map.numel())
    small = top_k_index.numel() <= _SMALL and top_k_index.is_cpu and top_k_weights.is_cpu
    if top_k_index.numel():
        if small:  # a decode step's few ids: Python's min/max over a list beat two torch calls
            flat = top_k_index.reshape(-1).tolist()
            lo, hi = min(flat), max(flat)
        else:
            lo, hi = torch.aminmax(top_k_index)
            lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= n_ids:
            where = "the expert map's length" if expert_map is not None else "the module's expert count"
            raise MoelabError(
                f"top_k_index has expert ids in [{lo}, {hi}]; expected [0, {n_ids}) ({where})."
            )
    index = top_k_index if top_k_index.dtype == torch.long else top_k_index.long()
    if expert_map is None:
        if small:  # NaN != 0 and -0.0 == 0, as the tensor comparison has them
            return Routing(index, top_k_weights, None, 0 not in top_k_weights.reshape(-1).tolist())
        active = top_k_weights != 0
    else:
        index = expert_map.to(device=index.device, dtype=torch.long)[index]
        active = (index >= 0) & (top_k_weights != 0)
    return Routing(index, top_k_weights, active, bool(active.all()))


#: Slots up to which :func:`route` checks a CPU call's routing with Python lists (a decode step's
#: few values) instead of torch reductions (each a few microseconds however small the tensor).
_SMALL = 64


#: The weight stacks of an experts module that :meth:`ExpertsBackend.check_devices` checks.
_STACKS = ("gate_up_proj", "up_proj", "down_proj")


def _all_on_cpu(module: torch.nn.Module, tensors: dict[str, torch.Tensor | None]) -> bool:
    """Whether the inputs and ``module``'s weight stacks are all CPU tensors, checked without
    building the full check's names (it runs on every experts call): False also for a stack
    that is not a plain parameter, which the full check then reads as the module exposes it."""
    for t in tensors.values():
        if isinstance(t, torch.Tensor) and not t.is_cpu:  # (what is no tensor, route() names)
            return False
    params = module._parameters
    for n in _STACKS:
        p = params.get(n)
        if p is None:
            if n in module._buffers or n in module.__dict__ or hasattr(type(module), n):
                return False
        elif not p.is_cpu:
            return False
    return True


class ExpertsBackend:
    """Runs one MoE layer's experts: ``backend(module, hidden, top_k_index, top_k_weights, expert_map)``.

    Subclasses set :attr:`name` and :attr:`devices` and implement :meth:`compute`.
    """

    name: str = "backend"
    devices: tuple[str, ...] | None = None
    """Device types the backend accepts (``None``: any torch device)."""

    def check_devices(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor | None]) -> None:
        """Refuse inputs or expert weights on a device type not in :attr:`devices`."""
        if self.devices is None or (self.devices == ("cpu",) and _all_on_cpu(module, tensors)):
            return
        named = dict(tensors)
        for n in _STACKS:  # the stacks the experts read
            p = getattr(module, n, None)
            if isinstance(p, torch.Tensor):
                named[f"{type(module).__name__}.{n}"] = p
        if self.devices == ("cpu",):
            require_cpu(self.name, **named)
            return
        for what, t in named.items():
            if isinstance(t, torch.Tensor) and t.device.type not in self.devices:
                raise MoelabError(
                    f"{what} is on {t.device}; the {self.name!r} experts backend runs on {', '.join(self.devices)}. "
                    "Use get_backend('reference') there, or move the experts and inputs."
                )

    def __call__(
        self,
        module: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        expert_map: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_devices(
            module,
            dict(hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
                 expert_map=expert_map),
        )
        routing = route(module, hidden_states, top_k_index, top_k_weights, expert_map)
        if not routing.all_active and not bool(routing.active.any()):
            return torch.zeros_like(hidden_states)
        return self.compute(module, hidden_states, routing)

    def compute(self, module: torch.nn.Module, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The layer's output for the active slots of ``routing`` (inputs already checked)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"
