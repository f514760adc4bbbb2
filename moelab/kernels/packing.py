"""Pre-pack one MoE layer's expert weights into the kernels' layout (done once, at load time).

Canonical input (any family is reduced to it by :mod:`moelab.kernels.integration`):
gate and up ``(E, I, H)``, down ``(E, H, I)``, optional biases ``(E, 2, I)`` and ``(E, H)``.
The layout is documented in ``kernels/moe_kernels.h``: 16-row tiles, every 64-byte line
holding 16 rows × (1 fp32 | 2 bf16 | 4 int8 | 4 fp8 | 8 int4) reduction steps; gate and up
tiles interleaved so stage 1 reads both in one pass. Buffers are 64-byte aligned. A packed
layer holds only the packed (possibly quantised) weights — no full-precision copy.

fp8 weights are e4m3 bytes with one fp32 scale per (16-row tile, block of the reduction):
float weights are quantised per original matrix in ``spec.block`` blocks
(:func:`~moelab.kernels.fp8.quantize_fp8_blockwise`); :class:`~moelab.kernels.fp8.Fp8Weights`
(e.g. from a DeepSeek-V3 checkpoint) are packed intact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from moelab.errors import MoelabError, unknown_name
from moelab.kernels.fp8 import (
    DEFAULT_BLOCK,
    FP8_DTYPE,
    Fp8Weights,
    check_block,
    quantize_fp8_blockwise,
)
from moelab.kernels.quant import GROUP_SIZES, quantize_groupwise

KernelDtype = Literal["fp32", "bf16", "int8", "int4", "fp8"]
Activation = Literal["silu", "gpt_oss"]
DTYPE_CODES: dict[str, int] = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3, "fp8": 4}
ACT_CODES: dict[str, int] = {"silu": 0, "gpt_oss": 1}
_BYTES_PER_K: dict[str, float] = {"fp32": 64, "bf16": 32, "int8": 16, "int4": 8, "fp8": 16}  # per 16-row tile
_FP8_ORDER = [2, 0, 3, 1]  # the k offsets a packed fp8 row's 4 bytes hold (kernels/moe_kernels.h: kFp8Pos)
FP8_SCALE_FOLD = 256.0
"""The kernels decode e4m3 exactly to value / 256 (bf16) or value · 2^-120 (fp32, AVX2); packed fp8 scales carry the 256."""


@dataclass(frozen=True)
class KernelSpec:
    """How a layer is packed."""

    dtype: KernelDtype = "bf16"
    """Weight format: fp32, bf16 (fp32 accumulation), int8/int4 (group-wise symmetric) or fp8
    (e4m3 with block scales; bf16 activations, fp32 accumulation)."""
    group_size: int = 64
    """Quantisation group along the reduction dimension (int8/int4 only): 32, 64 or 128."""
    block: tuple[int, int] = DEFAULT_BLOCK
    """fp8 only: scale block (rows, reduction), multiples of 16; DeepSeek-V3 uses 128×128."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise unknown_name("kernel dtype", self.dtype, DTYPE_CODES)
        if self.quantized and self.group_size not in GROUP_SIZES:
            raise MoelabError(
                f"group_size={self.group_size!r} is not supported; expected one of {GROUP_SIZES}."
            )
        if self.dtype == "fp8":
            object.__setattr__(self, "block", check_block(self.block))

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "int4")

    @property
    def bits(self) -> int:
        return {"int8": 8, "int4": 4, "fp8": 8}.get(self.dtype, 16 if self.dtype == "bf16" else 32)

    @property
    def kernel_group(self) -> int:
        """The kernels' scale group along the reduction (int group, fp8 block length; else 0)."""
        return self.group_size if self.quantized else (self.block[1] if self.dtype == "fp8" else 0)

    def padded(self, hidden: int, intermediate: int) -> tuple[int, int, int, int]:
        """``(kp1, ip, hp, slice1)``: H padded for stage 1, I padded, H padded to 16, I rows per task."""
        if self.dtype == "fp8":
            step, slice1 = self.block[1], 32
            i_step = math.lcm(32, self.block[1])
        else:
            step = {"fp32": 1, "bf16": 2}.get(self.dtype, self.group_size)
            slice1 = 32 if not self.quantized else max(32, self.group_size)
            i_step = slice1
        return _round_up(hidden, step), _round_up(intermediate, i_step), _round_up(hidden, 16), slice1


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

    @property
    def meta_head(self) -> tuple[int, ...]:
        """The first 9 entries of the extension's ``meta`` (the layer's geometry, weight format,
        scale group and activation; :func:`moelab.kernels.op._args` adds the call's path, threads
        and stage-1 slice), worked out once per pack and kept in its ``__dict__`` (the fields are
        frozen; no ``functools.cached_property``, whose lock before Python 3.12 is shared by every
        pack and every calling thread)."""
        head = self.__dict__.get("_meta_head")
        if head is None:
            head = (self.num_experts, self.hidden, self.intermediate, self.kp1, self.ip, self.hp,
                    DTYPE_CODES[self.spec.dtype], self.spec.kernel_group or self.spec.group_size,
                    ACT_CODES[self.act])
            self.__dict__["_meta_head"] = head
        return head

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


def _fp8_rows(
    q: torch.Tensor, s: torch.Tensor, block: tuple[int, int], n_pad: int, k_pad: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One (N, K) e4m3 matrix → zero-padded bytes ``(n_pad, k_pad)`` and per-row scales ``(n_pad, G)``."""
    bn, bk = block
    n, k = q.shape
    u = q.view(torch.uint8)
    if bool(((u & 0x7F) == 0x7F).any()):
        raise MoelabError("the fp8 weights contain NaN bytes (0x7f/0xff); the checkpoint is corrupt.")
    u = torch.nn.functional.pad(u, (0, k_pad - k, 0, n_pad - n))
    rows = s.float().repeat_interleave(bn, dim=0)[:n]
    rows = torch.nn.functional.pad(rows, (0, k_pad // bk - rows.shape[1], 0, n_pad - n))
    return u, rows


def _fp8_layout(u: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bytes ``(N, Kp)`` → ``[N/16][Kp/4][16][4]``, each row's 4 bytes in the order k+2, k, k+3, k+1
    (the kernels decode the high and low bytes of its 16-bit lanes in place into the bf16 pairs
    (k, k+1) and (k+2, k+3)); per-row scales → one per (tile, block), times :data:`FP8_SCALE_FOLD`."""
    n, kp = u.shape
    b = u.reshape(n // 16, 16, kp // 4, 4)[..., _FP8_ORDER].permute(0, 2, 1, 3).contiguous()
    return b.flatten(), (rows[::16] * FP8_SCALE_FOLD).contiguous().flatten()


def _fp8_of(w: torch.Tensor | Fp8Weights, x: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Expert ``x`` of ``w`` as (e4m3 matrix, block scales, block): intact if already fp8."""
    if isinstance(w, Fp8Weights):
        q, s = w.expert(x)
        return q, s, w.block
    q, s = quantize_fp8_blockwise(w[x], block)
    return q, s, block


def _shape(w: torch.Tensor | Fp8Weights) -> tuple[int, ...]:
    return tuple(w.shape)


def _interleave_tiles(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(I', ...) gate and up → (2 I', ...) with gate tile i followed by up tile i."""
    i = g.shape[0]
    rest = g.shape[1:]
    return torch.stack([g.reshape(i // 16, 16, *rest), u.reshape(i // 16, 16, *rest)], dim=1).reshape(
        2 * i, *rest
    )


def pack_experts(
    gate: torch.Tensor | Fp8Weights,
    up: torch.Tensor | Fp8Weights,
    down: torch.Tensor | Fp8Weights,
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

    With ``spec.dtype == "fp8"`` the weights may be :class:`~moelab.kernels.fp8.Fp8Weights`
    (packed intact, their own block shape) or float tensors (quantised in ``spec.block``
    blocks). Packs expert by expert so the temporaries stay at one expert's size.

    Size: the weights and optional biases of every supported experts layout and the packing spec, as the
    native operator takes them.
    """
    fp8_given = [isinstance(w, Fp8Weights) for w in (gate, up, down)]
    if any(fp8_given) and spec.dtype != "fp8":
        raise MoelabError(f"Fp8Weights can only be packed with KernelSpec('fp8'); got dtype {spec.dtype!r}.")
    if any(isinstance(w, torch.Tensor) and w.dtype == FP8_DTYPE for w in (gate, up, down)):
        raise MoelabError("raw float8 tensors have no scales; wrap them with their scales in Fp8Weights.")
    if len(_shape(gate)) != 3 or _shape(up) != _shape(gate) or len(_shape(down)) != 3:
        raise MoelabError(
            f"expected gate/up (E, I, H) and down (E, H, I); got {_shape(gate)}, "
            f"{_shape(up)}, {_shape(down)}."
        )
    e, i, h = _shape(gate)
    if _shape(down) != (e, h, i):
        raise MoelabError(f"down has shape {_shape(down)}; expected (E, H, I) = {(e, h, i)}.")
    if act not in ACT_CODES:
        raise unknown_name("activation", act, ACT_CODES)
    if spec.dtype == "fp8":
        blocks = {w.block for w in (gate, up, down) if isinstance(w, Fp8Weights)}
        if len(blocks) > 1 or (blocks and any(not f for f in fp8_given)):
            raise MoelabError(f"gate, up and down must share one fp8 block shape; got {sorted(blocks)}.")
        spec = KernelSpec("fp8", block=blocks.pop()) if blocks else spec
    kp1, ip, hp, slice1 = spec.padded(h, i)
    tb1 = int(_BYTES_PER_K[spec.dtype] * kp1)
    tb2 = int(_BYTES_PER_K[spec.dtype] * ip)
    e1, e2 = tb1 * (2 * ip // 16), tb2 * (hp // 16)
    w1, w2 = _aligned_empty(e * e1), _aligned_empty(e * e2)
    g1 = kp1 // spec.kernel_group if spec.kernel_group else 0
    g2 = ip // spec.kernel_group if spec.kernel_group else 0
    lanes = 16 if spec.quantized else 1  # int: a scale per row; fp8: one per 16-row tile
    s1 = torch.empty(e * (2 * ip // 16) * g1 * lanes) if g1 else torch.empty(0)
    s2 = torch.empty(e * (hp // 16) * g2 * lanes) if g2 else torch.empty(0)
    with torch.no_grad():
        for x in range(e):
            if spec.dtype == "fp8":
                gq, gs, blk = _fp8_of(gate, x, spec.block)
                uq, us, _ = _fp8_of(up, x, spec.block)
                gu, gr = _fp8_rows(gq, gs, blk, ip, kp1)
                uu, ur = _fp8_rows(uq, us, blk, ip, kp1)
                b, s = _fp8_layout(_interleave_tiles(gu, uu), _interleave_tiles(gr, ur))
            else:
                gx = torch.nn.functional.pad(gate[x].float(), (0, 0, 0, ip - i))
                ux = torch.nn.functional.pad(up[x].float(), (0, 0, 0, ip - i))
                b, s = _pack_expert(_interleave_tiles(gx, ux), spec, kp1)
            w1[x * e1 : (x + 1) * e1] = b
            if s is not None:
                s1[x * s.numel() : (x + 1) * s.numel()] = s
            if spec.dtype == "fp8":
                dq, ds, blk = _fp8_of(down, x, spec.block)
                b, s = _fp8_layout(*_fp8_rows(dq, ds, blk, hp, ip))
            else:
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
