"""Pre-pack one MoE layer's expert weights into the kernels' layout (done once, at load time).

Canonical input (any family is reduced to it by :mod:`moelab.kernels.integration`):
gate and up ``(E, I, H)``, down ``(E, H, I)``, optional biases ``(E, 2, I)`` and ``(E, H)``.
The layout is documented in ``kernels/moe_kernels.h``: 16-row tiles, every 64-byte line
holding 16 rows × (1 fp32 | 2 bf16 | 4 int8 | 8 int4) reduction steps; gate and up tiles
interleaved so stage 1 reads both in one pass. Buffers are 64-byte aligned. A packed
layer holds only the packed (possibly quantised) weights — no full-precision copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from moelab.errors import MoelabError
from moelab.kernels.quant import GROUP_SIZES, quantize_groupwise

KernelDtype = Literal["fp32", "bf16", "int8", "int4"]
Activation = Literal["silu", "gpt_oss"]
DTYPE_CODES: dict[str, int] = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
ACT_CODES: dict[str, int] = {"silu": 0, "gpt_oss": 1}
_BYTES_PER_K: dict[str, float] = {"fp32": 64, "bf16": 32, "int8": 16, "int4": 8}  # per 16-row tile


@dataclass(frozen=True)
class KernelSpec:
    """How a layer is packed."""

    dtype: KernelDtype = "bf16"
    """Weight format: fp32, bf16 (fp32 accumulation) or int8/int4 (group-wise symmetric)."""
    group_size: int = 64
    """Quantisation group along the reduction dimension (int8/int4 only): 32, 64 or 128."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            from moelab.errors import unknown_name

            raise unknown_name("kernel dtype", self.dtype, DTYPE_CODES)
        if self.quantized and self.group_size not in GROUP_SIZES:
            raise MoelabError(
                f"group_size={self.group_size!r} is not supported; expected one of {GROUP_SIZES}."
            )

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "int4")

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4}.get(self.dtype, 16 if self.dtype == "bf16" else 32)


@dataclass(frozen=True)
class PackedExperts:
    """One layer's experts in the kernels' layout. Shapes: see the module docstring."""

    spec: KernelSpec
    num_experts: int
    hidden: int
    intermediate: int
    act: Activation
    alpha: float
    limit: float
    kp1: int
    """H padded to the stage-1 reduction step."""
    ip: int
    """I padded to the stage-1 slice (``slice1``)."""
    hp: int
    """H padded to 16 (stage-2 output rows)."""
    slice1: int
    """Intermediate rows per stage-1 task."""
    w1: torch.Tensor = field(repr=False)
    s1: torch.Tensor = field(repr=False)
    b1: torch.Tensor = field(repr=False)
    w2: torch.Tensor = field(repr=False)
    s2: torch.Tensor = field(repr=False)
    b2: torch.Tensor = field(repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes the kernels stream per full pass over all experts (weights + scales + biases)."""
        return sum(t.numel() * t.element_size() for t in (self.w1, self.s1, self.b1, self.w2, self.s2, self.b2))

    def expert_nbytes(self) -> int:
        """Bytes read for one expert (weights + scales)."""
        return (self.w1.numel() + self.w2.numel() + 4 * (self.s1.numel() + self.s2.numel())) // self.num_experts


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _aligned_empty(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose data pointer is 64-byte aligned."""
    raw = torch.empty(nbytes + 64, dtype=torch.uint8)
    shift = (-raw.data_ptr()) % 64
    return raw[shift : shift + nbytes]


def _pack_expert(w: torch.Tensor, spec: KernelSpec, kp: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack one expert's ``(N, Kd)`` matrix (N a multiple of 16): bytes and optional scales."""
    n, kd = w.shape
    if kp != kd:
        w = torch.nn.functional.pad(w, (0, kp - kd))
    nt = n // 16
    if spec.dtype == "fp32":
        b = w.float().reshape(nt, 16, kp).permute(0, 2, 1).contiguous()
        return b.view(torch.uint8).flatten(), None
    if spec.dtype == "bf16":
        b = w.to(torch.bfloat16).reshape(nt, 16, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
        return b.view(torch.uint8).flatten(), None
    bits = 8 if spec.dtype == "int8" else 4
    q, scales = quantize_groupwise(w, bits, spec.group_size)
    g = kp // spec.group_size
    s = scales.reshape(nt, 16, g).permute(0, 2, 1).contiguous().flatten()
    if bits == 8:
        u = (q.to(torch.int16) + 128).to(torch.uint8)
        b = u.reshape(nt, 16, kp // 4, 4).permute(0, 2, 1, 3).contiguous()
    else:
        u = (q + 8).to(torch.uint8).reshape(nt, 16, kp // 8, 2, 4)
        nib = u[..., 0, :] | (u[..., 1, :] << 4)
        b = nib.permute(0, 2, 1, 3).contiguous()
    return b.flatten(), s


def _interleave_tiles(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(I', ...) gate and up → (2 I', ...) with gate tile i followed by up tile i."""
    i = g.shape[0]
    rest = g.shape[1:]
    return torch.stack([g.reshape(i // 16, 16, *rest), u.reshape(i // 16, 16, *rest)], dim=1).reshape(
        2 * i, *rest
    )


def pack_experts(
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    spec: KernelSpec,
    *,
    gate_bias: torch.Tensor | None = None,
    up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    act: Activation = "silu",
    alpha: float = 1.702,
    limit: float = 7.0,
) -> PackedExperts:
    """Pack a layer: gate/up ``(E, I, H)``, down ``(E, H, I)``, biases ``(E, I)``/``(E, H)``.

    Packs expert by expert so the temporaries stay at one expert's size.
    """
    if gate.dim() != 3 or up.shape != gate.shape or down.dim() != 3:
        raise MoelabError(
            f"expected gate/up (E, I, H) and down (E, H, I); got {tuple(gate.shape)}, "
            f"{tuple(up.shape)}, {tuple(down.shape)}."
        )
    e, i, h = gate.shape
    if tuple(down.shape) != (e, h, i):
        raise MoelabError(f"down has shape {tuple(down.shape)}; expected (E, H, I) = {(e, h, i)}.")
    if act not in ACT_CODES:
        from moelab.errors import unknown_name

        raise unknown_name("activation", act, ACT_CODES)
    step = {"fp32": 1, "bf16": 2}.get(spec.dtype, spec.group_size)
    slice1 = 32 if not spec.quantized else max(32, spec.group_size)
    kp1, ip, hp = _round_up(h, step), _round_up(i, slice1), _round_up(h, 16)
    tb1 = int(_BYTES_PER_K[spec.dtype] * kp1)
    tb2 = int(_BYTES_PER_K[spec.dtype] * ip)
    e1, e2 = tb1 * (2 * ip // 16), tb2 * (hp // 16)
    w1, w2 = _aligned_empty(e * e1), _aligned_empty(e * e2)
    g1 = kp1 // spec.group_size if spec.quantized else 0
    g2 = ip // spec.group_size if spec.quantized else 0
    s1 = torch.empty(e * (2 * ip // 16) * g1 * 16) if spec.quantized else torch.empty(0)
    s2 = torch.empty(e * (hp // 16) * g2 * 16) if spec.quantized else torch.empty(0)
    with torch.no_grad():
        for x in range(e):
            gx = torch.nn.functional.pad(gate[x].float(), (0, 0, 0, ip - i))
            ux = torch.nn.functional.pad(up[x].float(), (0, 0, 0, ip - i))
            b, s = _pack_expert(_interleave_tiles(gx, ux), spec, kp1)
            w1[x * e1 : (x + 1) * e1] = b
            if s is not None:
                s1[x * s.numel() : (x + 1) * s.numel()] = s
            dx = torch.nn.functional.pad(down[x].float(), (0, ip - i, 0, hp - h))
            b, s = _pack_expert(dx, spec, ip)
            w2[x * e2 : (x + 1) * e2] = b
            if s is not None:
                s2[x * s.numel() : (x + 1) * s.numel()] = s
        b1 = torch.empty(0)
        if gate_bias is not None or up_bias is not None:
            zeros = torch.zeros(e, i)
            gb = (gate_bias if gate_bias is not None else zeros).float()
            ub = (up_bias if up_bias is not None else zeros).float()
            gb = torch.nn.functional.pad(gb, (0, ip - i))
            ub = torch.nn.functional.pad(ub, (0, ip - i))
            b1 = torch.stack([_interleave_tiles(gb[x], ub[x]) for x in range(e)]).contiguous()
        b2 = torch.empty(0)
        if down_bias is not None:
            b2 = torch.nn.functional.pad(down_bias.float(), (0, hp - h)).contiguous()
    return PackedExperts(
        spec=spec, num_experts=e, hidden=h, intermediate=i, act=act, alpha=float(alpha),
        limit=float(limit), kp1=kp1, ip=ip, hp=hp, slice1=slice1,
        w1=w1, s1=s1, b1=b1, w2=w2, s2=s2, b2=b2,
    )
