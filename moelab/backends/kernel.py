"""The native CPU kernels as experts backends, each owning its packed weights.

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
from types import SimpleNamespace

import torch

from moelab.backends.base import ExpertsBackend, Routing
from moelab.kernels.fp8 import stored_fp8_pack
from moelab.kernels.integration import IMPLEMENTATIONS, cache_key, canonical_experts, resolve_spec
from moelab.kernels.op import moe_experts
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
        """Drop ``module``'s packs; whether there were any."""
        with self._lock:
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


def all_kernel_backends() -> list[KernelBackend]:
    """Every live :class:`KernelBackend` (for :func:`~moelab.kernels.integration.clear_packed`)."""
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
