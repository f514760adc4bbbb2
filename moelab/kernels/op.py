"""The fused MoE experts operator (Python entry point to the native kernels)."""

from __future__ import annotations

import torch

from moelab.errors import MoelabError
from moelab.kernels.build import ISA_CODES, Isa, _validate, active_isa, load_extension
from moelab.kernels.packing import ACT_CODES, DTYPE_CODES, PackedExperts


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    packed: PackedExperts,
    *,
    isa: Isa | None = None,
    num_threads: int | None = None,
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(act(gate_e x_t, up_e x_t)) for one layer's tokens.

    ``hidden_states`` (T, H) float32/bfloat16 (other float types run in fp32),
    ``top_k_index``/``top_k_weights`` (T, K). Runs on ``isa`` (default: :func:`active_isa`)
    with ``num_threads`` OpenMP threads (default ``torch.get_num_threads()``); releases
    the GIL while it runs. Forward only (no autograd).
    """
    if hidden_states.device.type != "cpu":
        raise MoelabError(
            f"hidden states are on {hidden_states.device}; moelab's native kernels run on the CPU. "
            "Move the experts to the CPU or use another experts implementation."
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != packed.hidden:
        raise MoelabError(
            f"hidden states have shape {tuple(hidden_states.shape)}; expected (T, {packed.hidden})."
        )
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:1] != hidden_states.shape[:1]:
        raise MoelabError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
            f"must both be (T, K) with T = {hidden_states.shape[0]}."
        )
    ext = load_extension()
    isa = active_isa() if isa is None else _validate(isa, "isa=")
    dtype = hidden_states.dtype
    x = hidden_states if dtype in (torch.float32, torch.bfloat16) else hidden_states.float()
    meta = [
        packed.num_experts, packed.hidden, packed.intermediate, packed.kp1, packed.ip, packed.hp,
        DTYPE_CODES[packed.spec.dtype], packed.spec.kernel_group or packed.spec.group_size,
        ACT_CODES[packed.act],
        ISA_CODES[isa], num_threads or torch.get_num_threads(), packed.slice1,
    ]
    out = ext.moe_forward(
        x.contiguous(), top_k_index, top_k_weights, packed.w1, packed.s1, packed.b1,
        packed.w2, packed.s2, packed.b2, meta, packed.alpha, packed.limit,
    )
    return out if out.dtype == dtype else out.to(dtype)
