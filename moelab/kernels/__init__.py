"""Native CPU kernels for MoE experts: a fused gate/up → activation → down operator.

``import moelab.kernels`` registers the ``moelab`` experts implementations with
transformers (see :mod:`moelab.kernels.integration`); the C++ extension itself is built
lazily on first use (:mod:`moelab.kernels.build`). Public API::

    model.set_experts_implementation("moelab")           # or "moelab_int8", "_int4", "_fp8"
    packed = pack_experts(gate, up, down, KernelSpec("int4", 64))
    out = moe_experts(x, top_k_index, top_k_weights, packed)
    with force_isa("avx2"): ...                            # or MOELAB_KERNELS_ISA=avx2

Shape legend: T tokens, K top-k, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

from moelab.kernels.backend import clear_packed, packed_for, register
from moelab.kernels.build import active_isa, cpu_features, force_isa, load_extension, supported_isas
from moelab.kernels.fp8 import (
    Fp8Weights,
    dequantize_fp8_blockwise,
    fp8_error,
    load_fp8_checkpoint,
    quantize_fp8_blockwise,
    save_fp8_checkpoint,
)
from moelab.kernels.integration import IMPLEMENTATIONS
from moelab.kernels.op import moe_experts
from moelab.kernels.packing import KernelSpec, PackedExperts, pack_experts
from moelab.kernels.quant import dequantize_groupwise, quant_error, quantize_groupwise
from moelab.kernels.reference import reference_experts

register()

__all__ = [
    "Fp8Weights",
    "dequantize_fp8_blockwise",
    "fp8_error",
    "load_fp8_checkpoint",
    "quantize_fp8_blockwise",
    "save_fp8_checkpoint",
    "IMPLEMENTATIONS",
    "KernelSpec",
    "PackedExperts",
    "active_isa",
    "clear_packed",
    "cpu_features",
    "dequantize_groupwise",
    "force_isa",
    "load_extension",
    "moe_experts",
    "pack_experts",
    "packed_for",
    "quant_error",
    "quantize_groupwise",
    "reference_experts",
    "register",
    "supported_isas",
]
