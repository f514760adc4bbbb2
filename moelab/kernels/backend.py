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
weight 0) the kernel runs on the active (token, slot) pairs only (one row each, fp32
out) and the pairs are summed per token in fp32 in expert order — the kernel's own
accumulation order — so the result equals the kernel run on all slots with the skipped
weights set to 0, bit for bit.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch

from moelab.backends.base import ExpertsBackend, Routing
from moelab.kernels.build import active_isa
from moelab.kernels.fp8 import forget_fp8_pack, stored_fp8_pack
from moelab.kernels.integration import IMPLEMENTATIONS, cache_key, canonical_experts, resolve_spec
from moelab.kernels.op import (
    NativeCall,
    _checked_input,
    call_tail,
    default_threads,
    moe_experts,
    moe_experts_submit,
    submit_args,
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
        """module → (pack key, isa, threads, the extension's arguments after (x, ids, weights), hidden):
        its last :meth:`submit`, reused while the key, path and threads stay the same."""
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
    def compute(self, module: torch.nn.Module, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        packed = self.packed(module)
        x = hidden_states.detach()
        weights = routing.weights.detach()
        if routing.all_active:
            return moe_experts(x, routing.index, weights, packed)
        tok, slot, exp = routing.pairs("expert")
        y = moe_experts(x[tok].float(), exp[:, None], weights[tok, slot, None], packed)  # (S, H) fp32
        out = torch.zeros(x.shape, dtype=torch.float32)
        out.index_add_(0, tok, y)
        return out if x.dtype == torch.float32 else out.to(x.dtype)


    def submit(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor, expert_map: torch.Tensor | None = None, *, lane: int = 0) -> NativeCall:
        """This backend's call queued on the extension's C++ lane worker ``lane`` (the real
        executor's host lane without a Python thread): the expert map is applied by the kernel
        (experts not here add 0 and are not computed). ``result()`` of the returned call waits."""
        x, w = hidden_states.detach(), top_k_weights.detach()
        key, isa, threads = cache_key(module), active_isa(), default_threads()
        hit = self._calls.get(module)
        on_cpu = x.is_cpu and top_k_index.is_cpu and w.is_cpu and (expert_map is None or expert_map.is_cpu)
        if hit is not None and on_cpu and hit[0] == key and hit[1] == isa and hit[2] == threads:
            # prepared: the same weights, path and threads as the module's last call (a decode step's
            # layers call every step: the device check, the pack lookup and its meta row once, not per call)
            x = _checked_input(x, top_k_index, w, hit[4])
            return submit_args((x, top_k_index, w, *hit[3]), expert_map, lane, hidden_states.dtype)
        self.check_devices(module, {"hidden_states": hidden_states, "top_k_index": top_k_index,
                                    "top_k_weights": top_k_weights, "expert_map": expert_map})
        packed = self.packed(module)
        if on_cpu:
            with self._lock:
                self._calls[module] = (key, isa, threads, call_tail(packed, isa, threads), packed.hidden)
        return moe_experts_submit(x, top_k_index, w, packed, lane=lane, expert_map=expert_map, isa=isa,
                                  num_threads=threads)


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
