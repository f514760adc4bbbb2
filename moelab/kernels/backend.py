"""The native CPU kernels as experts backends, each owning its packed weights, and the
transformers experts implementations (``moelab``, ``moelab_int4`` ...) that run them.

The kernels build on the backends' interface (:class:`moelab.backends.base.ExpertsBackend`);
the backends registry names these backends lazily (``moelab.backends.get_backend("moelab_int4")``),
so the torch backends never import the kernels.

A :class:`KernelBackend` runs :func:`moelab.kernels.op.moe_experts` with one
:class:`~moelab.kernels.packing.KernelSpec` (``None``: follow the weights' dtype — fp32,
bf16; fp16 weights are packed as fp32). It packs a module's experts the first time it
runs them and keeps the pack in its own ``weakref.WeakKeyDictionary`` (module → {spec:
(key, pack)}), so a pack lives exactly as long as the module and the backend, and nothing
is stored on the module. The key is the module's parameters' ``(data_ptr, version, dtype,
shape)``: replacing a weight, changing it in place or casting the module repacks it. A
module given stored e4m3 weights (:func:`~moelab.kernels.integration.install_fp8`,
:func:`~moelab.kernels.fp8.load_fp8_checkpoint`) runs them intact under an fp8 spec while
the key still matches.

Only CPU tensors are accepted (a clear :class:`~moelab.errors.MoelabError` otherwise).
With every slot active the call is the kernel's; with skipped slots (expert not here,
weight 0) it is the kernel's call with those slots' weights set to 0. The kernel leaves slots of
weight exactly 0 out of its routing (it computes an expert only for its slots of non-zero
weight), so a skipped slot costs nothing, and the result is the kernel run on all slots with the
skipped weights set to 0, bit for bit. (Until 2026-11-29 a call with skipped slots ran the kernel
on the active (token, slot) pairs one row each and summed them per token in Python: the same
bits, at 0.5 ms a decode-sized call on the development VM.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from moelab.backends.base import ExpertsBackend, Routing, check_map_type, check_routing_types
from moelab.errors import MoelabError
from moelab.kernels.build import load_extension
from moelab.kernels.fp8 import forget_fp8_pack, stored_fp8_pack
from moelab.kernels.integration import IMPLEMENTATIONS, cache_key, canonical_experts, resolve_spec
from moelab.kernels.op import (
    KERNEL_INPUT_DTYPES,
    LANES,
    NativeCall,
    _checked_input,
    call_config,
    config_token,
    moe_experts,
    prepared_call,
)
from moelab.kernels.packing import KernelSpec, PackedExperts, pack_experts

logger = logging.getLogger(__name__)

_ALL: weakref.WeakSet[KernelBackend] = weakref.WeakSet()


class KernelBackend(ExpertsBackend):
    """moelab's native kernels with one packing spec; owns its packs (see the module docstring)."""

    devices = ("cpu",)

    def __init__(self, spec: KernelSpec | None = None, name: str | None = None) -> None:
        self.spec = spec
        self.name = name or ("moelab" if spec is None else f"moelab[{spec}]")
        self._packs: weakref.WeakKeyDictionary[torch.nn.Module, dict[KernelSpec, tuple[tuple, PackedExperts]]]
        self._packs = weakref.WeakKeyDictionary()
        self._calls: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
        """module → (pack key, (isa, threads), the extension's prepared call, hidden size, config
        token): its last call's, reused while the key, path and threads stay the same
        (:meth:`_call_args`; the token, :func:`~moelab.kernels.op.config_token`, what they were
        derived from)."""
        self._lock = threading.Lock()
        _ALL.add(self)

    # ------------------------------------------------------------------ packs
    def packed(self, module: torch.nn.Module) -> PackedExperts:
        """``module``'s packed weights for this backend's spec, packing on first use."""
        spec = resolve_spec(module, self.spec)
        key = cache_key(module)
        if spec.dtype == "fp8":
            intact = stored_fp8_pack(module, key)
            if intact is not None:
                return intact  # the checkpoint's own e4m3 weights and block scales
        hit = self._packs.get(module, {}).get(spec)  # a lookup needs no lock (atomic under the GIL)
        if hit is not None and hit[0] == key:
            return hit[1]
        logger.info("packing %s for moelab kernels (%s)", type(module).__name__, spec)
        packed = pack_experts(spec=spec, **canonical_experts(module))
        with self._lock:
            self._packs.setdefault(module, {})[spec] = (key, packed)
        return packed

    def cached(self, module: torch.nn.Module) -> dict[KernelSpec, PackedExperts]:
        """The packs this backend holds for ``module`` (spec → pack; stale ones included)."""
        with self._lock:
            return {s: p for s, (_, p) in self._packs.get(module, {}).items()}

    def forget(self, module: torch.nn.Module) -> bool:
        """Drop ``module``'s packs (and its prepared call); whether there were any."""
        with self._lock:
            self._calls.pop(module, None)
            return self._packs.pop(module, None) is not None

    # ------------------------------------------------------------------ running
    def __call__(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's experts output through the kernel, the expert map applied by the kernel
        (see :meth:`_call_args` for the checks)."""
        args = self._call_args(module, hidden_states, top_k_index, top_k_weights, expert_map)
        if args is None:  # a first or changed call: every check in Python, then the kernel (compute)
            return super().__call__(module, hidden_states, top_k_index, top_k_weights, expert_map)
        x, ids, w, prepared = args
        out = prepared.forward(x, ids, w, expert_map)
        if isinstance(out, str):  # the extension's check failed (it returns the message: kernels/moe_op.cpp)
            raise self._refusal(module, args, expert_map, out)
        return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)

    def compute(self, module: torch.nn.Module, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        packed = self.packed(module)
        self._prepare(module, packed)
        x = hidden_states.detach()
        weights = routing.weights.detach()
        if routing.all_active:
            return moe_experts(x, routing.index, weights, packed)
        # a skipped slot gets weight 0 (and a valid expert id): the kernel leaves slots of weight
        # exactly 0 out of its routing, so they are not computed
        active = routing.active
        index = torch.where(active, routing.index, 0)
        return moe_experts(x, index, torch.where(active, weights, torch.zeros((), dtype=weights.dtype)), packed)

    def submit(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, expert_map: torch.Tensor | None = None, *, lane: int = 0) -> NativeCall:
        """This backend's call queued on the extension's C++ lane worker ``lane`` (the real
        executor's host lane without a Python thread): the expert map is applied by the kernel
        (experts not here add 0 and are not computed). ``result()`` of the returned call waits."""
        hit = self._calls.get(module)
        if hit is not None and 0 <= lane < LANES and config_token() == hit[4]:
            # the prepared call, its checks made by the extension (one fast call, no Python getters)
            ticket = _submit_prepared(hit[2], hit[0], tuple(module._parameters.values()), hidden_states,
                                      top_k_index, top_k_weights, expert_map, lane)
            if ticket is not None and not isinstance(ticket, str):
                return NativeCall(ticket, hidden_states.dtype)
            # None: stale, or not as the extension takes it; a refusal: named below by the full path
        args = self._call_args(module, hidden_states, top_k_index, top_k_weights, expert_map)
        if args is None:
            self.check_devices(module, {"hidden_states": hidden_states, "top_k_index": top_k_index,
                                        "top_k_weights": top_k_weights, "expert_map": expert_map})
            self._prepare(module, self.packed(module))
            args = self._call_args(module, hidden_states, top_k_index, top_k_weights, expert_map)
            if args is None:  # a map that is no tensor (route() names it), or the weights changed meanwhile
                check_map_type(expert_map)
                raise MoelabError(f"the {self.name!r} experts backend could not prepare a call of "
                                  f"{type(module).__name__}: its weights changed while it was being packed; retry.")
        if not 0 <= lane < LANES:
            raise MoelabError(f"lane={lane!r}: the extension has lanes 0..{LANES - 1}.")
        x, ids, w, prepared = args
        ticket = prepared.submit(x, ids, w, expert_map, lane)
        if isinstance(ticket, str):  # the extension's check failed: nothing was queued
            raise self._refusal(module, args, expert_map, ticket)
        return NativeCall(ticket, hidden_states.dtype)

    def _refused(self, module: torch.nn.Module, message: str) -> str:
        """The error of a call the extension refused (an expert id or map entry out of range)."""
        return (f"{message} (the {self.name!r} experts backend on {type(module).__name__}: expert ids index the "
                "expert map if one is given, else the module's experts; map entries are -1 or a local index).")

    def _refusal(self, module: torch.nn.Module, args: tuple, expert_map: torch.Tensor | None,
                 message: str) -> MoelabError:
        """The error of a prepared call the extension refused: the routing's and the hidden states'
        checks in Python name a wrong type or shape (the prepared path leaves them to the
        extension); otherwise the extension's message (an expert id or map entry out of range)."""
        x, ids, w, _ = args
        check_routing_types(ids, expert_map)
        hit = self._calls.get(module)
        _checked_input(x, ids, w, hit[3] if hit is not None else int(x.shape[-1]))
        return MoelabError(self._refused(module, message))

    def _prepare(self, module: torch.nn.Module, packed: PackedExperts) -> None:
        """Keep ``module``'s call for its next calls (:meth:`_call_args`): the pack's tensors and meta
        row on the current path and threads, held by the extension (:func:`prepared_call`), under the
        module's pack key."""
        config = call_config()
        token = config_token()  # after call_config(): it detects the CPU's features on a first call
        prepared = prepared_call(packed, *config)  # (loads the extension: call_key reads through it)
        with self._lock:
            self._calls[module] = (call_key(module), config, prepared, packed.hidden, token)

    def _call_args(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, expert_map: torch.Tensor | None) -> tuple | None:
        """``(x, ids, weights, prepared call)`` of a call of a prepared module (:meth:`_prepare`: the
        same weights, path and threads as its last call), or None (a first call, changed weights,
        another path or thread count, a tensor off the CPU: the caller then runs the full checks).

        A decode step's layers call every step, so the device check, the pack lookup and the
        routing's checks in torch run once per module, not per call (several microseconds each,
        tens between a forward's layers). A prepared call checks here only what the extension
        cannot (that every tensor is on the CPU, which path and threads apply); the extension
        checks the shapes, the dtypes, every expert id and map entry, and refuses a bad call before
        anything runs (:meth:`_refusal` then names the problem as the full checks would)."""
        hit = self._calls.get(module)
        if hit is None or not (expert_map is None or isinstance(expert_map, torch.Tensor)):
            return None  # (a map that is no tensor: the full checks name it)
        x, w = hidden_states, top_k_weights
        if not (x.is_cpu and top_k_index.is_cpu and w.is_cpu and (expert_map is None or expert_map.is_cpu)):
            return None
        if hit[0] != _params_key(tuple(module._parameters.values())):  # (call_key, one frame less)
            return None
        token = config_token()
        if token != hit[4]:  # a setting changed since the call was prepared: the same path and threads?
            if hit[1] != call_config():
                return None
            hit = (*hit[:4], token)
            with self._lock:
                self._calls[module] = hit
        if x.requires_grad:  # the kernel is forward only: its output has no graph either way
            x = x.detach()
        if x.dtype not in KERNEL_INPUT_DTYPES:
            x = x.float()
        return x, top_k_index, w.detach() if w.requires_grad else w, hit[2]


def call_key(module: torch.nn.Module) -> bytes:
    """What a prepared call of ``module`` depends on: :func:`~moelab.kernels.integration.cache_key`'s
    parameters (each one's data pointer, version, dtype and shape; None entries and repeats skipped),
    read by the extension in one call (``params_key``, kernels/fastcall.cpp) where the four Python
    getters per parameter cost 17 µs a call between a forward's layers on the development VM.
    Needs the extension (a prepared call has it loaded)."""
    global _params_key, _submit_prepared
    if _params_key is None:
        ext = load_extension()
        _params_key, _submit_prepared = ext.params_key, ext.submit_prepared
    return _params_key(tuple(module._parameters.values()))


_params_key: Callable[[tuple], bytes] | None = None
_submit_prepared: Callable[..., Any] | None = None


def all_kernel_backends() -> list[KernelBackend]:
    """Every live :class:`KernelBackend` (for :func:`clear_packed`)."""
    return list(_ALL)


#: One default backend per ``moelab*`` experts implementation name (the registry's entries).
DEFAULTS = SimpleNamespace(**{name: KernelBackend(spec, name) for name, spec in IMPLEMENTATIONS.items()})
_BY_SPEC: dict[KernelSpec | None, KernelBackend] = {}
for _b in vars(DEFAULTS).values():
    _BY_SPEC.setdefault(_b.spec, _b)


def kernel_backend(spec: KernelSpec | None = None) -> KernelBackend:
    """The shared default backend for ``spec`` (the registered one where a name exists)."""
    backend = _BY_SPEC.get(spec)
    if backend is None:
        backend = _BY_SPEC.setdefault(spec, KernelBackend(spec))
    return backend


def packed_for(module: torch.nn.Module, spec: KernelSpec | None = None) -> PackedExperts:
    """The module's packed weights for ``spec``, packed (and kept) by the default backend for ``spec``."""
    return kernel_backend(spec).packed(module)


def clear_packed(model: torch.nn.Module) -> int:
    """Drop every pack any kernel backend holds for modules under ``model`` (stored fp8 packs too).

    Returns how many modules had one.
    """
    backends = all_kernel_backends()
    n = 0
    for m in model.modules():
        had = [b.forget(m) for b in backends]
        if forget_fp8_pack(m) or any(had):
            n += 1
    return n


_warned_grad = False


def make_experts_forward(spec: KernelSpec | None) -> Callable[..., torch.Tensor]:
    """An ``ExpertsInterface`` function running the module's experts on the default backend for ``spec``."""
    backend = None

    def forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        nonlocal backend
        global _warned_grad
        if torch.is_grad_enabled() and not _warned_grad and self.gate_up_proj.requires_grad:
            logger.warning("moelab experts kernels are forward-only: no gradients flow through the experts.")
            _warned_grad = True
        if backend is None:
            backend = kernel_backend(spec)
        return backend(self, hidden_states, top_k_index, top_k_weights)

    forward.__name__ = "moelab_experts_forward"
    return forward


def register() -> tuple[str, ...]:
    """Register the ``moelab*`` experts implementations with transformers (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    for name, spec in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, make_experts_forward(spec))
    return tuple(IMPLEMENTATIONS)


__all__ = ["DEFAULTS", "KernelBackend", "all_kernel_backends", "clear_packed", "kernel_backend", "make_experts_forward",
           "packed_for", "register"]
