"""Symmetric group-wise weight quantisation (int8 / int4) and its error.

A row of the reduction dimension is split into groups of ``group_size`` values; each
group gets one fp32 scale ``s = max|w| / qmax`` (qmax 127 for int8, 7 for int4) and
integer values ``q = round(w / s)`` in ``[-qmax, qmax]``. Scales are stored separately
from the values. Activations are quantised the same way at run time (int8, per token
and group) so the kernels can use integer dot products (VNNI).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moelab.errors import MoelabError

GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
QMAX: dict[int, int] = {8: 127, 4: 7}


def _check(bits: int, group_size: int, last_dim: int) -> None:
    if bits not in QMAX:
        raise MoelabError(f"bits={bits!r} is not supported; expected 8 or 4.")
    if group_size not in GROUP_SIZES:
        raise MoelabError(f"group_size={group_size!r} is not supported; expected one of {GROUP_SIZES}.")
    if last_dim % group_size:
        raise MoelabError(
            f"the last dimension ({last_dim}) must be a multiple of group_size={group_size}; "
            "zero-pad it first (packing does this for you)."
        )


def quantize_groupwise(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: int8 values of ``w``'s shape and fp32 scales ``(..., last // group_size)``."""
    _check(bits, group_size, w.shape[-1])
    qmax = QMAX[bits]
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    amax = g.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(g / scales.unsqueeze(-1)).clamp_(-qmax, qmax).to(torch.int8)
    return q.reshape(w.shape), scales


def dequantize_groupwise(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 values ``q * scale`` (inverse of :func:`quantize_groupwise`)."""
    groups = scales.shape[-1]
    g = q.float().reshape(*q.shape[:-1], groups, q.shape[-1] // groups)
    return (g * scales.unsqueeze(-1)).reshape(q.shape)


def fake_quantize_activations(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """What the kernels see of fp32 activations: int8 per (row, group), dequantised."""
    g = x.float().reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv)
    return (q * (amax / 127.0)).reshape(x.shape)


@dataclass(frozen=True)
class QuantError:
    """Error of a quantised tensor against a reference."""

    rel_fro: float
    """‖q − ref‖ / ‖ref‖ (Frobenius)."""
    max_abs: float
    """max |q − ref|."""
    cosine: float
    """Cosine similarity of the flattened tensors."""


def quant_error(approx: torch.Tensor, ref: torch.Tensor) -> QuantError:
    """Compare ``approx`` with ``ref`` (e.g. int4 layer output vs the bf16 one)."""
    a, r = approx.double().flatten(), ref.double().flatten()
    diff = a - r
    denom = r.norm().item() or 1.0
    cos = torch.nn.functional.cosine_similarity(a, r, dim=0).item() if r.numel() else 1.0
    return QuantError(diff.norm().item() / denom, diff.abs().max().item() if r.numel() else 0.0, cos)
