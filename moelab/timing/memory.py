"""Memory: what a hybrid configuration keeps on the GPU and on the host, and whether it fits.

A configuration is a model shape (:class:`~moelab.timing.shapes.ModelShape`, its dtypes), a
hardware profile (``gpu_memory_gb``, ``host_memory_gb``), a cache capacity, a context length
and a batch. :func:`memory_needs` adds up, each term named:

GPU
    * **dense weights** — every weight that is not a routed expert, in the shape's dtype:
      attention, shared experts, routers, dense MLPs, embeddings, LM head, norms
      (``total_bytes() − MoE layers × experts × expert_bytes()``);
    * **KV cache** — ``batch × tokens`` at the context length, per layer as
      :meth:`~moelab.timing.shapes.ModelShape.kv_cache_bytes` counts it (MLA's compressed
      ``kv_lora_rank + qk_rope_head_dim`` values, GQA's ``2 × kv_heads × head_dim``, sliding
      windows capped, linear-attention state), unless the schedule keeps it on the host;
    * **expert slots** — the cache's slots per MoE layer (the capacity, resolved exactly as the
      caches do, :func:`slots_per_layer`) × MoE layers × expert bytes;
    * **workspace** — :data:`WORKSPACE_GB` (CUDA context, library workspaces, allocator slack)
      plus the decode step's activations (``batch × (4 × hidden + vocab)`` fp32 values).

host
    * **routed experts** — every routed expert of every MoE layer (the host keeps the full set
      and the GPU slots are copies, as KTransformers, HybriMoE and ProMoE do);
    * **KV cache**, when ``kv_on_host=True`` (MoE-Gen's schedule keeps it there).

On a profile whose "device" is a CPU worker (``device_shares_host_memory``) every term shares
host memory. A size the profile does not state (None) is not checked, and the result says so.

:func:`check_memory` raises :class:`MemoryDoesNotFit` with the numbers: each term, what was
available and the fix (the largest capacity that fits, a smaller dtype, more memory)::

    25 % of deepseek-v3's BF16 experts is 327 GB on an 80 GB GPU ...

Units: bytes internally; messages in GB (10^9 bytes), as the profiles' sizes are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from moelab.errors import MoelabError

#: Fixed GPU reserve (GB) besides weights, KV and expert slots: the CUDA context (~0.3–0.5 GB on
#: recent GPUs), cuBLAS/attention workspaces and the caching allocator's slack. Assumed, not
#: measured: set ``workspace_gb=`` to what ``torch.cuda.mem_get_info`` shows on your machine.
WORKSPACE_GB = 1.0


@dataclass(frozen=True)
class MemoryTerm:
    """One named amount of memory: what it is, its bytes, and how it was counted."""

    name: str
    bytes: float
    detail: str = ""


@dataclass(frozen=True)
class Pool:
    """One memory (the GPU's or the host's): its terms and its size (None: not stated)."""

    name: str
    terms: tuple[MemoryTerm, ...]
    capacity_bytes: float | None

    @property
    def need_bytes(self) -> float:
        return float(sum(t.bytes for t in self.terms))

    @property
    def fits(self) -> bool | None:
        """True/False, or None when the profile does not state this memory's size."""
        return None if self.capacity_bytes is None else self.need_bytes <= self.capacity_bytes

    def term(self, name: str) -> MemoryTerm | None:
        return next((t for t in self.terms if t.name == name), None)


@dataclass(frozen=True)
class MemoryNeeds:
    """What one configuration needs on the GPU and the host (:func:`memory_needs`)."""

    shape: str
    profile: str
    capacity: float | int
    slots_per_layer: int
    gpu: Pool
    host: Pool
    notes: tuple[str, ...] = ()
    max_slots_that_fit: int | None = None
    """The most expert slots per MoE layer the GPU holds beside the other terms (None: unknown)."""
    problems: tuple[str, ...] = field(default=())
    """One message per pool that does not fit (empty when everything fits or is unchecked)."""

    @property
    def fits(self) -> bool | None:
        """False if a pool does not fit; None if one could not be checked; else True."""
        f = [self.gpu.fits, self.host.fits]
        return False if False in f else None if None in f else True

    def summary(self) -> str:
        """One line per pool: need of size, with the terms."""
        out = []
        for pool in (self.gpu, self.host):
            terms = " + ".join(f"{t.name} {gb(t.bytes)}" for t in pool.terms if t.bytes) or "nothing"
            size = "size not stated" if pool.capacity_bytes is None else f"of {pool.capacity_bytes / 1e9:g} GB"
            out.append(f"{pool.name}: {gb(pool.need_bytes)} {size} ({terms})")
        return "\n".join(out + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict[str, Any]:
        return {"fits": self.fits, "slots_per_layer": self.slots_per_layer,
                "gpu_need_gb": self.gpu.need_bytes / 1e9, "host_need_gb": self.host.need_bytes / 1e9,
                "gpu_memory_gb": _gb_or_none(self.gpu.capacity_bytes),
                "host_memory_gb": _gb_or_none(self.host.capacity_bytes),
                "max_slots_that_fit": self.max_slots_that_fit, "problems": list(self.problems)}


class MemoryDoesNotFit(MoelabError):
    """A configuration needs more GPU or host memory than the profile has; ``needs`` holds the terms."""

    def __init__(self, message: str, needs: MemoryNeeds) -> None:
        super().__init__(message)
        self.needs = needs


def gb(nbytes: float) -> str:
    """Bytes as GB (10^9) with three significant figures or so: ``327 GB``, ``17.3 GB``, ``0.07 GB``."""
    v = nbytes / 1e9
    return f"{v:.0f} GB" if v >= 99.5 else f"{v:.1f} GB" if v >= 9.95 else f"{v:.2f} GB"


def _size(nbytes: float, noun: str) -> str:
    """A memory's stated size with its article: ``an 80 GB GPU``, ``a 24 GB GPU``."""
    text = f"{nbytes / 1e9:g} GB"
    return f"{'an' if text.startswith(('8', '11 ', '18 ')) else 'a'} {text} {noun}"


def _gb_or_none(b: float | None) -> float | None:
    return None if b is None else b / 1e9


def _capacity_text(capacity: float | int, slots: int, experts: int) -> str:
    if isinstance(capacity, float):
        return f"{capacity * 100:g} %"
    return f"{slots} of {experts}"


def slots_per_layer(capacity: float | int, num_experts: int) -> int:
    """Expert slots of one MoE layer at ``capacity``: a fraction (float in [0, 1]) rounds to the
    nearest count, at least 1 unless 0; a count (int) is itself. The rule of
    :func:`moelab.caches.base.resolve_capacity` (layer scope; timing sits below caches, so it is
    restated here and a test holds the two equal)."""
    E = int(num_experts)
    if isinstance(capacity, bool) or not isinstance(capacity, (int, float)):
        raise MoelabError(f"capacity must be a fraction in [0, 1] or a count of experts, got {capacity!r}.")
    if isinstance(capacity, float):
        if not 0.0 <= capacity <= 1.0:
            raise MoelabError(f"capacity {capacity!r} as a fraction must lie in [0, 1]; pass an int for a count "
                              f"of experts (there are {E} per MoE layer).")
        return 0 if capacity == 0 else max(1, math.floor(capacity * E + 0.5))
    if not 0 <= capacity <= E:
        raise MoelabError(f"capacity {capacity} experts per layer: expected 0..{E}, or a fraction such as 0.25.")
    return int(capacity)


def dense_weight_bytes(shape: Any) -> float:
    """Every weight but the routed experts, in the shape's dtypes (bytes)."""
    return float(shape.total_bytes() - shape.num_moe_layers * shape.num_experts * shape.expert_bytes())


def kv_bytes(shape: Any, context: int, batch: int) -> float:
    """KV cache (or linear-attention state) of ``batch`` sequences at ``context`` tokens, all layers."""
    return float(sum(shape.kv_cache_bytes(context, batch, layer=i) for i in range(shape.num_layers)))


def activation_bytes(shape: Any, batch: int) -> float:
    """A decode step's live activations: ``batch × (4 × hidden + vocab)`` fp32 values (hidden
    states, residual, attention/MLP intermediates of one token; the logits)."""
    return float(batch * (4 * shape.hidden_size + shape.vocab_size) * 4)


def memory_needs(shape: Any, profile: Any, *, capacity: float | int, context: int, batch: int = 1,
                 kv_on_host: bool = False, workspace_gb: float = WORKSPACE_GB) -> MemoryNeeds:
    """The memory ``shape`` needs on ``profile`` at ``capacity`` (a fraction of each MoE layer's
    experts, a float, or a count, an int; 0: no slots), ``batch`` sequences of ``context`` tokens.
    ``kv_on_host``: the schedule keeps the KV cache in host memory (MoE-Gen). Nothing is raised;
    see :func:`check_memory`."""
    from moelab.timing.profile import get_profile

    profile = get_profile(profile)
    for what, v, low in (("context", context, 0), ("batch", batch, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise MoelabError(f"memory check: {what} is {v!r}; expected an integer ≥ {low}.")
    E, M, eb = int(shape.num_experts), int(shape.num_moe_layers), float(shape.expert_bytes())
    slots = slots_per_layer(capacity, E)
    dt = shape.experts_dtype.upper()
    kv = MemoryTerm("KV cache", kv_bytes(shape, context, batch),
                    f"{context} tokens × batch {batch}, {shape.kv_bytes_per_token():g} B per token and layer "
                    f"({shape.attention.upper()}, {shape.kv_dtype}) × {shape.num_layers} layers")
    gpu_terms = [
        MemoryTerm("dense weights", dense_weight_bytes(shape), f"everything but the routed experts, {shape.dtype}"),
        *([] if kv_on_host else [kv]),
        MemoryTerm("expert slots", slots * M * eb, f"{slots} slots × {M} MoE layers × {eb / 1e6:.1f} MB ({dt})"),
        MemoryTerm("workspace", workspace_gb * 1e9 + activation_bytes(shape, batch),
                   f"{workspace_gb:g} GB reserve (CUDA context, workspaces) + batch-{batch} activations"),
    ]
    host_terms = [MemoryTerm("routed experts", E * M * eb, f"{E} experts × {M} MoE layers × {eb / 1e6:.1f} MB ({dt})"),
                  *([kv] if kv_on_host else [])]
    notes = []
    gpu_cap = None if profile.gpu_memory_gb is None else profile.gpu_memory_gb * 1e9
    host_cap = None if profile.host_memory_gb is None else profile.host_memory_gb * 1e9
    if profile.device_shares_host_memory:  # a CPU worker is the device: one memory for everything
        host_terms = [*gpu_terms, *host_terms]
        gpu_terms, gpu_cap = [], 0.0
        notes.append(f"{profile.name}'s device shares host memory: every term is counted against host memory")
    for pool, cap in (("gpu_memory_gb", gpu_cap), ("host_memory_gb", host_cap)):
        if cap is None:
            notes.append(f"{profile.name} does not state {pool}; that memory is not checked (add it to the "
                         f"profile or --set {pool}=SIZE)")
    gpu = Pool("GPU", tuple(gpu_terms), gpu_cap)
    host = Pool("host", tuple(host_terms), host_cap)
    max_slots = None
    if gpu_cap is not None and not profile.device_shares_host_memory:
        free = gpu_cap - (gpu.need_bytes - gpu.term("expert slots").bytes)
        max_slots = max(-1, min(E, math.floor(free / (M * eb)))) if M else E
    needs = MemoryNeeds(shape.name, profile.name, capacity, slots, gpu, host, tuple(notes), max_slots)
    problems = _problems(needs, shape, profile, context, batch, kv_on_host)
    return MemoryNeeds(**{**needs.__dict__, "problems": tuple(problems)})


def _problems(needs: MemoryNeeds, shape: Any, profile: Any, context: int, batch: int,
              kv_on_host: bool) -> list[str]:
    """The refusal text of each pool that does not fit: the terms, the size, the fix."""
    out = []
    E = int(shape.num_experts)
    dt = shape.experts_dtype.upper()
    gpu, host = needs.gpu, needs.host
    if gpu.fits is False:
        slots = gpu.term("expert slots")
        cap = _capacity_text(needs.capacity, needs.slots_per_layer, E)
        terms = ", ".join(f"{t.name} {gb(t.bytes)} ({t.detail})" for t in gpu.terms if t.bytes)
        head = (f"{cap} of {shape.name}'s {dt} experts is {gb(slots.bytes)} on {_size(gpu.capacity_bytes, 'GPU')}"
                if slots.bytes else f"{shape.name} without expert slots does not fit on "
                                    f"{_size(gpu.capacity_bytes, 'GPU')}")
        m = needs.max_slots_that_fit
        if m is not None and m >= 1:
            fix = (f"a capacity of at most {m}e ({100 * m / E:.3g} % of {E} experts per layer) fits beside the "
                   f"rest; or a smaller expert dtype (--dtype fp8 / int4), or a profile with more GPU memory")
        elif m == 0:
            fix = ("only capacity 0 (no expert slots) fits; a smaller dtype (--dtype fp8 / int4), a shorter context "
                   "or smaller batch, or a profile with more GPU memory")
        else:
            fix = ("even without expert slots the dense weights, KV cache and workspace do not fit: use a smaller "
                   "dtype (--dtype fp8 / int4), a shorter --context or smaller --batch"
                   + ("" if kv_on_host else ", the KV cache on the host (--kv-on-host)")
                   + ", or a profile with more GPU memory")
        out.append(f"{head}: the GPU needs {gb(gpu.need_bytes)} of {profile.name}'s {gpu.capacity_bytes / 1e9:g} GB "
                   f"(gpu_memory_gb) — {terms}. Fix: {fix}.")
    if host.fits is False:
        terms = ", ".join(f"{t.name} {gb(t.bytes)} ({t.detail})" for t in host.terms)
        what = (" and what the device holds (it shares host memory)" if profile.device_shares_host_memory
                else " and KV cache" if kv_on_host else "")
        out.append(f"{shape.name}'s {dt} routed experts{what} need {gb(host.need_bytes)} of host memory on "
                   f"{profile.name}'s {host.capacity_bytes / 1e9:g} GB (host_memory_gb) — {terms}. Fix: a smaller expert "
                   f"dtype (--dtype fp8 / int4), or a profile with more host memory (--set host_memory_gb=SIZE "
                   f"if the machine has it).")
    return out


def check_memory(shape: Any, profile: Any, *, capacity: float | int, context: int, batch: int = 1,
                 kv_on_host: bool = False, workspace_gb: float = WORKSPACE_GB) -> MemoryNeeds:
    """:func:`memory_needs`, raising :class:`MemoryDoesNotFit` (a :class:`~moelab.errors.MoelabError`)
    with every term and the fix when the GPU or the host memory is too small; the needs otherwise
    (``needs.notes`` says what could not be checked)."""
    needs = memory_needs(shape, profile, capacity=capacity, context=context, batch=batch, kv_on_host=kv_on_host,
                         workspace_gb=workspace_gb)
    if needs.problems:
        raise MemoryDoesNotFit(" ".join(needs.problems), needs)
    return needs


__all__ = ["WORKSPACE_GB", "MemoryDoesNotFit", "MemoryNeeds", "MemoryTerm", "Pool", "activation_bytes",
           "check_memory", "dense_weight_bytes", "gb", "kv_bytes", "memory_needs", "slots_per_layer"]
