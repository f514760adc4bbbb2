"""Plain-torch reference of the fused experts operator, numerics included.

It reproduces what each kernel path computes, not just the ideal maths: bf16 rounds
activations (x and h) to bf16 like a bf16 model does; int8/int4 use the quantised
weights and int8 activations per (token, group); fp8 dequantises the e4m3 block-scaled
weights (quantising float weights per matrix first, like packing) and rounds activations
to bf16. With ``spec.dtype == "fp32"`` it is the exact fp32 MoE. Parity tests compare every kernel path against it.
"""

from __future__ import annotations

import torch

from moelab.kernels.fp8 import Fp8Weights, dequantize_fp8_blockwise, quantize_fp8_blockwise
from moelab.kernels.packing import Activation, KernelSpec
from moelab.kernels.quant import dequantize_groupwise, fake_quantize_activations, quantize_groupwise


def _weights(w: torch.Tensor, spec: KernelSpec, pad_k: int, stored: bool = False) -> torch.Tensor:
    if stored:
        return torch.nn.functional.pad(w.float(), (0, pad_k - w.shape[-1]))
    if spec.dtype == "fp8":  # quantise the unpadded matrix (its blocks start at 0)
        w = dequantize_fp8_blockwise(*quantize_fp8_blockwise(w, spec.block), spec.block)
        return torch.nn.functional.pad(w, (0, pad_k - w.shape[-1]))
    w = torch.nn.functional.pad(w.float(), (0, pad_k - w.shape[-1]))
    if spec.dtype == "bf16":
        return w.to(torch.bfloat16).float()
    if spec.quantized:
        return dequantize_groupwise(*quantize_groupwise(w, spec.bits, spec.group_size))
    return w


def _acts(x: torch.Tensor, spec: KernelSpec) -> torch.Tensor:
    if spec.dtype in ("bf16", "fp8"):
        return x.to(torch.bfloat16).float()
    if spec.quantized:
        return fake_quantize_activations(x, spec.group_size)
    return x


def activate(gate: torch.Tensor, up: torch.Tensor, act: Activation, alpha: float, limit: float) -> torch.Tensor:
    """The gated activation: SiLU(gate)·up, or gpt_oss's clamped SwiGLU."""
    if act == "silu":
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


@torch.no_grad()
def reference_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
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
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(act(gate_e x_t, up_e x_t)) with the kernel path's numerics.

    Shapes: x (T, H), index/weights (T, K), gate/up (E, I, H), down (E, H, I);
    :class:`~moelab.kernels.fp8.Fp8Weights` are dequantised as stored (fp8 spec only).

    Size: the inputs, weights and optional biases of every supported experts layout, as the native operator
    takes them (the reference mirrors its signature).
    """
    t, h = hidden_states.shape
    e, i, _ = gate.shape
    kp1, ip, _, _ = spec.padded(h, i)
    stored = isinstance(gate, Fp8Weights)
    if stored:  # e4m3 as stored: dequantise once, no re-quantisation below
        gate, up, down = (w.dequantize() for w in (gate, up, down))  # type: ignore[union-attr]
    x = _acts(torch.nn.functional.pad(hidden_states.float(), (0, kp1 - h)), spec)
    out = torch.zeros(t, h, dtype=torch.float32)
    weights = top_k_weights.float()
    for ex in range(e):
        tok, slot = torch.where(top_k_index == ex)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        g = xe @ _weights(gate[ex], spec, kp1, stored).T
        u = xe @ _weights(up[ex], spec, kp1, stored).T
        if gate_bias is not None:
            g = g + gate_bias[ex].float()
        if up_bias is not None:
            u = u + up_bias[ex].float()
        hid = torch.nn.functional.pad(activate(g, u, act, alpha, limit), (0, ip - i))
        hid = _acts(hid, spec)
        y = hid @ _weights(down[ex], spec, ip, stored).T
        if down_bias is not None:
            y = y + down_bias[ex].float()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.to(hidden_states.dtype)
