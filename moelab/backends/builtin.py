"""transformers' own experts implementations as experts backends (any torch device).

``TransformersBackend("grouped_mm")`` runs the function registered under that name in
``transformers.integrations.moe.ExpertsInterface`` (``batched_mm``, ``grouped_mm``, and
on CUDA ``deepgemm``/``sonicmoe`` where installed); ``"eager"`` runs the experts class's
own forward (the one ``use_experts_implementation`` wraps), whatever implementation the
model is set to.

With every slot active the call is the built-in's, unchanged. With skipped slots (expert
not here, weight 0) the built-in runs on the active (token, slot) pairs only, each as one
row with top-k 1, and the rows are summed per token the way the built-in sums its top-k:
``eager`` adds them in the hidden dtype, one ``index_add_`` per expert (its loop), the
others in fp32 in slot order, cast once (their ``view(T, K, H).sum(1)``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from moelab.backends.base import ExpertsBackend, Routing
from moelab.errors import MoelabError, unknown_name


def builtin_function(name: str, module: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The transformers experts function ``name`` for ``module`` (``eager``: the class's own forward)."""
    if name == "eager":
        fwd = type(module).forward
        return getattr(fwd, "__wrapped__", fwd)
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if name not in ALL_EXPERTS_FUNCTIONS:
        raise unknown_name("transformers experts implementation", name, ["eager", *ALL_EXPERTS_FUNCTIONS])
    return ALL_EXPERTS_FUNCTIONS[name]


class TransformersBackend(ExpertsBackend):
    """One of transformers' experts implementations behind the backend interface."""

    devices = None

    def __init__(self, impl: str) -> None:
        if impl.startswith("moelab"):
            raise MoelabError(
                f"{impl!r} is moelab's own kernels, not a transformers built-in; use get_backend({impl!r})."
            )
        self.impl = impl
        self.name = impl

    def compute(self, module: torch.nn.Module, hidden_states: torch.Tensor, routing: Routing) -> torch.Tensor:
        fn = builtin_function(self.impl, module)
        if routing.all_active:
            return fn(module, hidden_states, routing.index, routing.weights)
        order = "expert" if self.impl == "eager" else "token"
        tok, slot, exp = routing.pairs(order)
        y = fn(module, hidden_states[tok], exp[:, None], routing.weights[tok, slot, None])  # (S, H)
        if self.impl == "eager":  # one index_add_ per expert, as eager's loop (bf16 adds round each time)
            out = torch.zeros_like(hidden_states)
            y = y.to(out.dtype)
            bounds = torch.cumsum(torch.unique_consecutive(exp, return_counts=True)[1], 0).tolist()
            start = 0
            for end in bounds:
                out.index_add_(0, tok[start:end], y[start:end])
                start = end
            return out
        out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
        return out.index_add_(0, tok, y.float()).to(hidden_states.dtype)


#: The registry's built-in entries: the implementations that run on the CPU too.
DEFAULTS = SimpleNamespace(**{n: TransformersBackend(n) for n in ("eager", "batched_mm", "grouped_mm")})
