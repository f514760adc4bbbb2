"""The reference experts backend: transformers' eager experts maths in plain torch, any device.

It runs the operations of the families' eager ``forward`` in the same order and dtype —
per expert (ascending), the expert's tokens in slot-major order, ``linear`` (``x @ W``
for transposed stacks), bias added after, the module's own ``_apply_gate`` (SiLU·up on
concatenated stacks, gpt_oss's clamped SwiGLU on interleaved ones, any custom gate) or
``act_fn`` for ungated experts, the optional post-expert norm, the routing weight, then
``index_add_`` in the hidden states' dtype. With every slot active the result equals the
module's eager forward bit for bit (``tests/test_backends.py`` checks every family in
fp32, bf16 and fp16). Skipped slots (expert not here, weight 0) change an expert's row
count, and CPU BLAS picks a different fp32 kernel for a different row count, so fp32
results can then differ from eager-with-zero-weights by an ulp; bf16/fp16 stay exact.
"""

from __future__ import annotations

import torch

from moelab.backends.base import ExpertsBackend, Routing


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    y = x @ w if transposed else torch.nn.functional.linear(x, w)
    return y if b is None else y + b


def expert_forward(module: torch.nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    """Expert ``e`` of ``module`` on rows ``x`` ``(n, H)``, as the eager forward computes it."""
    transposed = getattr(module, "is_transposed", False)
    bias = getattr(module, "has_bias", False)
    if getattr(module, "has_gate", True) and hasattr(module, "gate_up_proj"):
        b = module.gate_up_proj_bias[e] if bias else None
        h = module._apply_gate(_linear(x, module.gate_up_proj[e], b, transposed))
    else:
        b = module.up_proj_bias[e] if bias else None
        h = module.act_fn(_linear(x, module.up_proj[e], b, transposed))
    y = _linear(h, module.down_proj[e], module.down_proj_bias[e] if bias else None, transposed)
    if getattr(module, "has_post_expert_norm", False):
        y = module.post_expert_norm(y)
    return y


class ReferenceBackend(ExpertsBackend):
    """Plain torch on any device; computes only the active (token, slot) pairs."""

    name = "reference"
    devices = None

    def compute(self, module: torch.nn.Module, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        index, weights = routing.index, routing.weights
        experts = torch.unique(index[routing.active]).tolist()  # ascending, like eager's expert_hit
        for e in experts:
            slot, tok = torch.where(((index == e) & routing.active).T)  # slot-major, like eager
            y = expert_forward(module, e, hidden_states[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


REFERENCE = ReferenceBackend()
