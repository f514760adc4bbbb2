"""transformers integration: the ``moelab`` experts implementations.

``import moelab.kernels`` registers these names with
``transformers.integrations.moe.ExpertsInterface``:

=====================  ==============================================================
``moelab``             weights in their own precision (fp32 → fp32, bf16 → bf16;
                       fp16 weights are packed as fp32)
``moelab_bf16``        bf16 weights, fp32 accumulation, whatever the model dtype
``moelab_int8``        int8 group-wise weights, group 64 (``moelab_int8_g32``/``_g128``)
``moelab_int4``        int4 group-wise weights, group 64 (``moelab_int4_g32``/``_g128``)
``moelab_fp8``         e4m3 weights with 128×128 block scales (DeepSeek-V3's format);
                       a module loaded from an fp8 checkpoint
                       (:func:`~moelab.kernels.fp8.load_fp8_checkpoint`) runs its
                       stored e4m3 weights intact, others are quantised at packing
=====================  ==============================================================

Select one with ``model.set_experts_implementation("moelab_int4")``. Each name runs the
default experts backend for its spec (:mod:`moelab.kernels.backend`, also reachable as
``moelab.backends.get_backend("moelab_int4")``). The backend packs a module the first
time it runs it and owns the pack (a weak-keyed table, not the module's ``__dict__``),
keyed by the spec; a pack is invalidated when a weight tensor is replaced, modified in
place (its version counter changes) or changes dtype. The module keeps its own
parameters, so other implementations keep working: a cached bf16 pack costs as much
memory as the weights, int8 about half, int4 about a quarter. :func:`moelab.kernels.backend.clear_packed`
frees the packs.

Supported experts modules: gated (``has_gate``), with or without biases, plain or
transposed, concatenated or interleaved gate/up, SiLU activation or gpt_oss's clamped
SwiGLU. Anything else (no gate, post-expert norm, expert parallelism, another
activation) is refused with a :class:`~moelab.errors.MoelabError` naming the reason.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.kernels.fp8 import Fp8Weights, store_fp8_pack
from moelab.kernels.packing import Activation, KernelSpec, PackedExperts, pack_experts

logger = logging.getLogger(__name__)

#: implementation name → spec (``None`` dtype: follow the weights' dtype).
IMPLEMENTATIONS: dict[str, KernelSpec | None] = {
    "moelab": None,
    "moelab_bf16": KernelSpec("bf16"),
    "moelab_int8": KernelSpec("int8", 64),
    "moelab_int8_g32": KernelSpec("int8", 32),
    "moelab_int8_g128": KernelSpec("int8", 128),
    "moelab_int4": KernelSpec("int4", 64),
    "moelab_int4_g32": KernelSpec("int4", 32),
    "moelab_int4_g128": KernelSpec("int4", 128),
    "moelab_fp8": KernelSpec("fp8"),
}


def _name(module: torch.nn.Module) -> str:
    return type(module).__name__


def canonical_experts(module: torch.nn.Module) -> dict[str, Any]:
    """The module's weights as gate/up ``(E, I, H)``, down ``(E, H, I)``, biases, activation.

    Raises :class:`MoelabError` for layouts the kernels do not support.
    """
    from transformers.integrations.moe import _default_apply_gate

    name = _name(module)
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        raise MoelabError(
            f"{name} has no fused gate_up_proj (has_gate=False); moelab kernels support gated "
            "experts only. Use the 'eager' or 'grouped_mm' experts implementation for this model."
        )
    if getattr(module, "has_post_expert_norm", False):
        raise MoelabError(f"{name} applies a post-expert norm, which moelab kernels do not fuse; use 'eager'.")
    if getattr(module, "_is_expert_parallel", False):
        raise MoelabError(f"{name} is expert-parallel; moelab kernels need all experts local. Use 'grouped_mm'.")
    apply_gate = getattr(type(module), "_apply_gate", _default_apply_gate)
    act: Activation
    if apply_gate is _default_apply_gate:
        act_fn = getattr(module, "act_fn", None)
        if not isinstance(act_fn, torch.nn.SiLU) and type(act_fn).__name__ != "SiLUActivation":
            raise MoelabError(
                f"{name} uses activation {type(act_fn).__name__}; moelab kernels implement SiLU-gated "
                "experts and gpt_oss's clamped SwiGLU. Use 'eager' for this model."
            )
        act, interleaved = "silu", False
    elif apply_gate.__qualname__ == "GptOssExperts._apply_gate":
        act, interleaved = "gpt_oss", True
    else:
        raise MoelabError(
            f"{name} has a custom gate function {apply_gate.__qualname__}; moelab kernels implement "
            "SiLU-gated experts and gpt_oss's clamped SwiGLU. Use 'eager' for this model."
        )
    gu, dn = module.gate_up_proj.detach(), module.down_proj.detach()
    if getattr(module, "is_transposed", False):
        gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)  # (E, 2I, H), (E, H, I)
    gate, up = (gu[:, 0::2], gu[:, 1::2]) if interleaved else gu.chunk(2, dim=1)
    out: dict[str, Any] = dict(gate=gate, up=up, down=dn, act=act)
    if getattr(module, "has_bias", False):
        b = module.gate_up_proj_bias.detach()
        out["gate_bias"], out["up_bias"] = (b[:, 0::2], b[:, 1::2]) if interleaved else b.chunk(2, dim=1)
        out["down_bias"] = module.down_proj_bias.detach()
    if act == "gpt_oss":
        out["alpha"], out["limit"] = float(module.alpha), float(module.limit)
    return out


def cache_key(module: torch.nn.Module) -> tuple:
    """What a pack of ``module`` depends on: each parameter's (name, data_ptr, version, dtype, shape).

    The module's own parameters as ``named_parameters(recurse=False)`` lists them (a parameter
    registered under two names counts once), read from its parameter table directly: every
    experts call computes this key, and the generator cost several µs a call."""
    key, seen = [], set()
    for n, p in module._parameters.items():
        if p is None or id(p) in seen:
            continue
        seen.add(id(p))
        key.append((n, p.data_ptr(), p._version, p.dtype, tuple(p.shape)))
    return tuple(key)


#: The spec of each weight dtype a ``None`` spec follows (made once: a call resolves it every time).
_FOLLOW = {torch.bfloat16: KernelSpec("bf16")}
_FP32 = KernelSpec("fp32")


def resolve_spec(module: torch.nn.Module, spec: KernelSpec | None) -> KernelSpec:
    """``spec``, or for None the spec the module's weights follow: bf16 for bf16 weights, else fp32."""
    if spec is not None:
        return spec
    return _FOLLOW.get(module.gate_up_proj.dtype, _FP32)


def install_fp8(module: torch.nn.Module, gate: Fp8Weights, up: Fp8Weights, down: Fp8Weights) -> PackedExperts:
    """Give a SiLU-gated experts module stored e4m3 weights: gate/up ``(E, I, H)``, down ``(E, H, I)``.

    The module's parameters get the dequantised values (in their dtype and layout) so every
    implementation runs; ``moelab_fp8`` uses the e4m3 bytes and scales intact until a
    parameter changes (then it re-quantises the parameters like any module).
    """
    canon = canonical_experts(module)  # refuses unsupported layouts
    if canon["act"] != "silu" or "gate_bias" in canon:
        raise MoelabError(f"{_name(module)} is not a bias-free SiLU-gated experts module; cannot install fp8 weights.")
    e, i, h = canon["gate"].shape
    for name, w, want in (("gate", gate, (e, i, h)), ("up", up, (e, i, h)), ("down", down, (e, h, i))):
        if tuple(w.shape) != want:
            raise MoelabError(f"fp8 {name} weights have shape {tuple(w.shape)}; {_name(module)} needs {want}.")
    with torch.no_grad():
        gu = torch.cat([gate.dequantize(), up.dequantize()], dim=1)  # (E, 2I, H)
        dn = down.dequantize()  # (E, H, I)
        if getattr(module, "is_transposed", False):
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        module.gate_up_proj.copy_(gu.to(module.gate_up_proj.dtype))
        module.down_proj.copy_(dn.to(module.down_proj.dtype))
    packed = pack_experts(gate, up, down, KernelSpec("fp8", block=gate.block))
    store_fp8_pack(module, cache_key(module), packed)
    return packed
