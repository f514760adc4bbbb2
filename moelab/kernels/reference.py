"""Plain-torch reference of the fused experts operator, numerics included.

It reproduces what each kernel path computes, not just the ideal maths: bf16 rounds
activations (x and h) to bf16 like a bf16 model does; int8/int4 use the quantised
weights and int8 activations per (token, group). With ``spec.dtype == "fp32"`` it is
the exact fp32 MoE. Parity tests compare every kernel path against it.
"""

from __future__ import annotations

import torch

from moelab.kernels.packing import Activation, KernelSpec, _round_up
from moelab.kernels.quant import dequantize_groupwise, fake_quantize_activations, quantize_groupwise


def _weights(w: torch.Tensor, spec: KernelSpec, pad_k: int) -> torch.Tensor:
    w = torch.nn.functional.pad(w.float(), (0, pad_k - w.shape[-1]))
    if spec.dtype == "bf16":
        return w.to(torch.bfloat16).float()
    if spec.quantized:
        return dequantize_groupwise(*quantize_groupwise(w, spec.bits, spec.group_size))
    return w


def _acts(x: torch.Tensor, spec: KernelSpec) -> torch.Tensor:
    if spec.dtype == "bf16":
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
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(act(gate_e x_t, up_e x_t)) with the kernel path's numerics.

    Shapes: x (T, H), index/weights (T, K), gate/up (E, I, H), down (E, H, I).
    """
    t, h = hidden_states.shape
    e, i, _ = gate.shape
    step = {"fp32": 1, "bf16": 2}.get(spec.dtype, spec.group_size)
    kp1 = _round_up(h, step)
    ip = _round_up(i, max(32, spec.group_size) if spec.quantized else 32)
    x = _acts(torch.nn.functional.pad(hidden_states.float(), (0, kp1 - h)), spec)
    out = torch.zeros(t, h, dtype=torch.float32)
    weights = top_k_weights.float()
    for ex in range(e):
        tok, slot = torch.where(top_k_index == ex)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        g = xe @ _weights(gate[ex], spec, kp1).T
        u = xe @ _weights(up[ex], spec, kp1).T
        if gate_bias is not None:
            g = g + gate_bias[ex].float()
        if up_bias is not None:
            u = u + up_bias[ex].float()
        hid = torch.nn.functional.pad(activate(g, u, act, alpha, limit), (0, ip - i))
        hid = _acts(hid, spec)
        y = hid @ _weights(down[ex], spec, ip).T
        if down_bias is not None:
            y = y + down_bias[ex].float()
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.to(hidden_states.dtype)
