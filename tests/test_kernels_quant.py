"""Group-wise quantisation utilities and packing invariants."""

from __future__ import annotations

import pytest
import torch

from moelab.errors import MoelabError
from moelab.kernels import (
    KernelSpec,
    dequantize_groupwise,
    pack_experts,
    quant_error,
    quantize_groupwise,
)


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_quantize_roundtrip_error_is_within_half_a_step(bits, qmax, group):
    w = torch.randn(6, 256)
    q, s = quantize_groupwise(w, bits, group)
    assert q.dtype == torch.int8 and s.shape == (6, 256 // group)
    assert q.abs().max() <= qmax
    err = (dequantize_groupwise(q, s) - w).abs().reshape(6, -1, group)
    assert (err <= s.unsqueeze(-1) / 2 + 1e-6).all()


def test_int4_error_exceeds_int8_error():
    w = torch.randn(64, 512)
    e8 = quant_error(dequantize_groupwise(*quantize_groupwise(w, 8, 64)), w)
    e4 = quant_error(dequantize_groupwise(*quantize_groupwise(w, 4, 64)), w)
    assert e8.rel_fro < 0.01 < e4.rel_fro < 0.2 and e8.cosine > 0.9999


def test_bad_group_size_and_unpadded_length_are_refused():
    with pytest.raises(MoelabError, match="group_size"):
        quantize_groupwise(torch.randn(4, 64), 8, 48)
    with pytest.raises(MoelabError, match="multiple of group_size"):
        quantize_groupwise(torch.randn(4, 65), 8, 32)
    with pytest.raises(MoelabError, match="group_size"):
        KernelSpec("int4", 16)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "int8", "int4"])
def test_packed_buffers_are_64_byte_aligned_and_hold_no_full_precision_copy(dtype):
    e, h, i = 4, 70, 50
    packed = pack_experts(torch.randn(e, i, h), torch.randn(e, i, h), torch.randn(e, h, i), KernelSpec(dtype, 32))
    assert packed.w1.data_ptr() % 64 == 0 and packed.w2.data_ptr() % 64 == 0
    assert packed.w1.dtype == torch.uint8
    bytes_per_weight = {"fp32": 4, "bf16": 2, "int8": 1, "int4": 0.5}[dtype]
    padded_weights = e * (2 * packed.ip * packed.kp1 + packed.hp * packed.ip)  # zero padding only
    assert packed.w1.numel() + packed.w2.numel() == padded_weights * bytes_per_weight


def test_pack_rejects_mismatched_shapes():
    with pytest.raises(MoelabError, match="expected"):
        pack_experts(torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16), KernelSpec("fp32"))
