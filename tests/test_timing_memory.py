"""moelab.timing.memory: GPU and host memory of a configuration, hand-computed, and the refusal."""

from __future__ import annotations

import pytest

from moelab.errors import MoelabError
from moelab.timing import get_profile, get_shape
from moelab.timing.memory import WORKSPACE_GB, MemoryDoesNotFit, check_memory, memory_needs

# Mixtral-8x7B (its public config.json): 32 layers, all MoE, 8 experts, hidden 4096, expert
# intermediate 14336, GQA with 8 KV heads of 128, vocabulary 32000, untied embeddings, bf16.
MIX_EXPERT = 3 * 4096 * 14336 * 2  # gate + up + down, 2 B each = 352,321,536
MIX_ATTN = 4096 * (4096 + 1024 + 1024 + 4096)  # q, k, v, o per layer = 41,943,040 params
MIX_DENSE = 2 * (32 * (MIX_ATTN + 8 * 4096 + 2 * 4096) + 2 * 32000 * 4096 + 4096)  # + router, norms; embed + head
MIX_KV_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # layers × (k + v) × heads × head_dim × 2 B = 131,072


def _box(**sizes):
    return get_profile("h100-pcie5-ddr5").with_changes(**sizes)


def test_mixtral_needs_are_the_hand_computed_sum():
    shape = get_shape("mixtral-8x7b")
    n = memory_needs(shape, _box(gpu_memory_gb=80.0, host_memory_gb=512.0), capacity=2, context=1000, batch=2)
    assert n.slots_per_layer == 2
    assert n.gpu.term("dense weights").bytes == MIX_DENSE == 3_211_272_192
    assert n.gpu.term("KV cache").bytes == MIX_KV_PER_TOKEN * 1000 * 2 == 262_144_000
    assert n.gpu.term("expert slots").bytes == 2 * 32 * MIX_EXPERT == 22_548_578_304
    assert n.gpu.term("workspace").bytes == WORKSPACE_GB * 1e9 + 2 * (4 * 4096 + 32000) * 4
    assert n.gpu.need_bytes == pytest.approx(3_211_272_192 + 262_144_000 + 22_548_578_304 + 1_000_387_072)
    assert n.host.need_bytes == 8 * 32 * MIX_EXPERT == 90_194_313_216
    assert n.fits is True and not n.problems


def test_a_fraction_resolves_to_slots_as_the_caches_do():
    shape = get_shape("mixtral-8x7b")
    assert memory_needs(shape, _box(), capacity=0.25, context=0).slots_per_layer == 2  # round(0.25 × 8)
    assert memory_needs(shape, _box(), capacity=0.1, context=0).slots_per_layer == 1  # at least one
    assert memory_needs(shape, _box(), capacity=0, context=0).gpu.term("expert slots").bytes == 0


@pytest.mark.parametrize("E", [8, 64, 256])
@pytest.mark.parametrize("capacity", [0.01, 0.1, 0.125, 0.25, 0.3, 0.5, 0.99, 1.0, 1, 2, 8])
def test_slots_follow_the_caches_rule(capacity, E):
    from moelab.caches.base import resolve_capacity
    from moelab.timing.memory import slots_per_layer

    assert slots_per_layer(capacity, E) == int(resolve_capacity(capacity, [E], "layer")[0])


def test_mla_caches_the_compressed_latent():
    # DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 values per token and layer, bf16, 61 layers.
    n = memory_needs(get_shape("deepseek-v3"), _box(), capacity=0, context=4096, batch=3)
    assert n.gpu.term("KV cache").bytes == (512 + 64) * 2 * 61 * 4096 * 3


def test_deepseek_v3_bf16_at_25_percent_is_refused_on_an_80_gb_gpu_with_the_numbers():
    with pytest.raises(MemoryDoesNotFit) as info:
        check_memory(get_shape("deepseek-v3"), "h100-pcie5-ddr5", capacity=0.25, context=1024)
    msg = str(info.value)
    # 64 of 256 experts × 58 MoE layers × 3 × 7168 × 2048 × 2 B = 327 GB
    assert msg.startswith("25 % of deepseek-v3's BF16 experts is 327 GB on an 80 GB GPU: the GPU needs ")
    for part in ("dense weights 34.2 GB", "KV cache", "expert slots 327 GB (64 slots × 58 MoE layers × 88.1 MB",
                 "workspace", "gpu_memory_gb", "Fix: a capacity of at most 8e"):
        assert part in msg, part
    assert "\n" not in msg and isinstance(info.value, MoelabError)
    # the fix it names is right: 8 slots per layer fit, 9 do not
    assert check_memory(get_shape("deepseek-v3"), "h100-pcie5-ddr5", capacity=8, context=1024).fits
    with pytest.raises(MemoryDoesNotFit):
        check_memory(get_shape("deepseek-v3"), "h100-pcie5-ddr5", capacity=9, context=1024)


def test_host_memory_too_small_is_refused_with_its_fix():
    with pytest.raises(MemoryDoesNotFit, match=r"routed experts need 1308 GB of host memory on promoe-4090's "
                                               r"128 GB \(host_memory_gb\).*--set host_memory_gb"):
        check_memory(get_shape("deepseek-v3"), "promoe-4090", capacity=0, context=16)


def test_dense_weights_that_do_not_fit_say_so():
    with pytest.raises(MemoryDoesNotFit, match=r"without expert slots does not fit on a 24 GB GPU.*"
                                               r"even without expert slots"):
        check_memory(get_shape("deepseek-v3"), _box(gpu_memory_gb=24.0), capacity=0, context=16)


def test_kv_on_host_moves_the_kv_cache_to_host_memory():
    shape = get_shape("mixtral-8x7b")
    on_gpu = memory_needs(shape, _box(), capacity=1, context=8192, batch=4)
    on_host = memory_needs(shape, _box(), capacity=1, context=8192, batch=4, kv_on_host=True)
    kv = MIX_KV_PER_TOKEN * 8192 * 4
    assert on_gpu.gpu.need_bytes - on_host.gpu.need_bytes == kv
    assert on_host.host.need_bytes - on_gpu.host.need_bytes == kv


def test_a_cpu_only_device_counts_everything_against_host_memory():
    hw = _box(device_shares_host_memory=True, host_memory_gb=200.0)
    n = memory_needs(get_shape("mixtral-8x7b"), hw, capacity=2, context=0)
    assert n.gpu.terms == () and n.gpu.fits is True
    assert n.host.need_bytes == pytest.approx(MIX_DENSE + 2 * 32 * MIX_EXPERT + 1e9 + (4 * 4096 + 32000) * 4
                                              + 8 * 32 * MIX_EXPERT)
    assert n.fits is True
    with pytest.raises(MemoryDoesNotFit, match=r"routed experts and what the device holds .* need 117 GB of host"):
        check_memory(get_shape("mixtral-8x7b"), hw.with_changes(host_memory_gb=100.0), capacity=2, context=0)


def test_sizes_a_profile_does_not_state_are_not_checked_and_say_so():
    hw = _box(gpu_memory_gb=None, host_memory_gb=None)
    n = check_memory(get_shape("deepseek-v3"), hw, capacity=1.0, context=1024)
    assert n.fits is None and not n.problems
    assert any("does not state gpu_memory_gb" in note for note in n.notes)


@pytest.mark.parametrize("kw, match", [({"context": -1}, "context is -1"), ({"batch": 0}, "batch is 0"),
                                       ({"capacity": 1.5}, "fraction must lie in"),
                                       ({"capacity": 9}, "expected 0..8")])
def test_bad_arguments_are_refused(kw, match):
    args = {"capacity": 0.25, "context": 16, "batch": 1, **kw}
    with pytest.raises(MoelabError, match=match):
        memory_needs(get_shape("mixtral-8x7b"), "h100-pcie5-ddr5", **args)
