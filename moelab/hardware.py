"""Hardware profiles: the numbers that turn bytes and layers into microseconds.

A :class:`HardwareProfile` describes one host + accelerator pair as far as expert
offloading cares: the host→device link (bandwidth and per-transfer latency), memory
bandwidths, CPU cores, and the *assumed* time of one decoder layer at batch 1. The
predictor metrics (GoodPred), the cache simulator and the hybrid runtime/simulator all
read the same profiles, so an experiment says "on pcie4-x16" once.

Every number is an assumption, documented on its field and per profile; none is
measured by moelab. Change one with :func:`dataclasses.replace` or register your own::

    from moelab.hardware import get_profile, register_profile
    hw = dataclasses.replace(get_profile("pcie4-x16"), decode_layer_time_us=800.0)
    register_profile(hw, name="my-box")

Units: bandwidths in GB/s (10^9 bytes per second), times in microseconds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moelab.errors import MoelabError, unknown_name


@dataclass(frozen=True)
class HardwareProfile:
    """One host/accelerator pair, as seen by expert offloading."""

    name: str
    """Registry name, e.g. ``"pcie4-x16"``."""
    description: str = ""
    """Free text: what machine the numbers stand for and where they come from."""
    link_bandwidth_gbs: float = 25.0
    """Effective host→device copy bandwidth of the link (pinned memory, large copies)."""
    link_latency_us: float = 10.0
    """Fixed cost of one transfer (launch + DMA set-up), added to every expert copy."""
    gpu_memory_bandwidth_gbs: float = 2000.0
    """Device memory bandwidth (decode at batch 1 is bound by it)."""
    cpu_memory_bandwidth_gbs: float = 60.0
    """Host memory read bandwidth (bounds CPU expert execution at batch 1)."""
    cpu_cores: int = 16
    """Host cores available for CPU experts and predictors."""
    decode_layer_time_us: float = 500.0
    """Assumed wall time of one decoder layer (attention + MoE) at batch 1 during decode,
    i.e. the time between two consecutive MoE routers. It is the lead-time unit of
    layer-wise prediction: a prediction made at layer l for layer l+d has about
    ``d × decode_layer_time_us`` to complete its transfers."""
    attention_fraction: float = 0.5
    """Share of a layer's time spent before its MoE block (attention, norms). The token
    id of a decode step is known this long before MoE layer 0 routes."""

    def __post_init__(self) -> None:
        for f in ("link_bandwidth_gbs", "gpu_memory_bandwidth_gbs", "cpu_memory_bandwidth_gbs", "decode_layer_time_us"):
            if not getattr(self, f) > 0:
                raise MoelabError(f"HardwareProfile.{f} must be > 0, got {getattr(self, f)!r}.")
        if self.link_latency_us < 0:
            raise MoelabError(f"HardwareProfile.link_latency_us must be ≥ 0, got {self.link_latency_us!r}.")
        if not 0.0 <= self.attention_fraction <= 1.0:
            raise MoelabError(f"HardwareProfile.attention_fraction must be in [0, 1], got {self.attention_fraction!r}.")

    def transfer_time_us(self, nbytes: float) -> float:
        """Time to copy ``nbytes`` host→device as one transfer: latency + bytes / bandwidth."""
        return self.link_latency_us + nbytes / (self.link_bandwidth_gbs * 1e3)

    def cpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from host memory (a CPU GEMV)."""
        return nbytes / (self.cpu_memory_bandwidth_gbs * 1e3)

    def gpu_read_time_us(self, nbytes: float) -> float:
        """Lower bound of the time to stream ``nbytes`` from device memory."""
        return nbytes / (self.gpu_memory_bandwidth_gbs * 1e3)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_PROFILES: dict[str, HardwareProfile] = {}


def register_profile(profile: HardwareProfile, *, name: str | None = None, overwrite: bool = False) -> HardwareProfile:
    """Add ``profile`` to the registry (under ``name`` if given)."""
    if name is not None:
        profile = dataclasses.replace(profile, name=name)
    if profile.name in _PROFILES and not overwrite:
        raise MoelabError(f"hardware profile {profile.name!r} is already registered; pass overwrite=True to replace it.")
    _PROFILES[profile.name] = profile
    return profile


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """The profile called ``name`` (a profile instance is returned as is)."""
    if isinstance(name, HardwareProfile):
        return name
    if name not in _PROFILES:
        raise unknown_name("hardware profile", name, _PROFILES)
    return _PROFILES[name]


def available_profiles() -> list[str]:
    """Names of the registered profiles."""
    return list(_PROFILES)


# Effective bandwidths are ~75-80 % of the PCIe theoretical rate (x16: gen3 15.8, gen4
# 31.5, gen5 63 GB/s) as pinned-memory cudaMemcpy reaches in practice. Layer times are
# order-of-magnitude decode times of a 7B-57B-class MoE layer at batch 1 whose active
# weights are resident; replace them for your model.
for _p in (
    HardwareProfile(
        name="pcie3-x16",
        description="PCIe 3.0 x16 workstation GPU (V100/T4 class): 12 GB/s effective link.",
        link_bandwidth_gbs=12.0,
        link_latency_us=10.0,
        gpu_memory_bandwidth_gbs=900.0,
        cpu_memory_bandwidth_gbs=40.0,
        cpu_cores=16,
        decode_layer_time_us=800.0,
    ),
    HardwareProfile(
        name="pcie4-x16",
        description="PCIe 4.0 x16 (RTX 4090 / A100-PCIe class, ProMoE's and HybriMoE's setting): 25 GB/s effective.",
        link_bandwidth_gbs=25.0,
        link_latency_us=10.0,
        gpu_memory_bandwidth_gbs=1000.0,
        cpu_memory_bandwidth_gbs=60.0,
        cpu_cores=16,
        decode_layer_time_us=500.0,
    ),
    HardwareProfile(
        name="pcie5-x16",
        description="PCIe 5.0 x16 (H100-PCIe / RTX 5090 class): 50 GB/s effective.",
        link_bandwidth_gbs=50.0,
        link_latency_us=8.0,
        gpu_memory_bandwidth_gbs=2000.0,
        cpu_memory_bandwidth_gbs=120.0,
        cpu_cores=32,
        decode_layer_time_us=400.0,
    ),
    HardwareProfile(
        name="nvlink-c2c",
        description="Grace-Hopper NVLink-C2C: 450 GB/s effective CPU↔GPU link.",
        link_bandwidth_gbs=450.0,
        link_latency_us=5.0,
        gpu_memory_bandwidth_gbs=4000.0,
        cpu_memory_bandwidth_gbs=500.0,
        cpu_cores=72,
        decode_layer_time_us=300.0,
    ),
):
    register_profile(_p)

#: Bytes of one routed expert (gate, up and down projections, bf16) of reference models,
#: for projecting GoodPred of a small model to a real model's transfer sizes:
#: ``3 × hidden × expert_intermediate × 2 bytes``.
REFERENCE_EXPERT_BYTES: dict[str, int] = {
    "mixtral-8x7b": 3 * 4096 * 14336 * 2,
    "qwen2-57b-a14b": 3 * 3584 * 2560 * 2,
    "deepseek-v2-lite": 3 * 2048 * 1408 * 2,
    "qwen1.5-moe-a2.7b": 3 * 2048 * 1408 * 2,
    "olmoe-1b-7b": 3 * 2048 * 1024 * 2,
}


def reference_expert_bytes(name: str | int) -> int:
    """Expert bytes of a reference model by name, or an integer byte count as is."""
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        value = int(name)
        if value <= 0:
            raise MoelabError(f"expert bytes must be > 0, got {value}.")
        return value
    if name not in REFERENCE_EXPERT_BYTES:
        raise unknown_name("reference model (expert bytes)", name, REFERENCE_EXPERT_BYTES)
    return REFERENCE_EXPERT_BYTES[name]


__all__ = [
    "REFERENCE_EXPERT_BYTES",
    "HardwareProfile",
    "available_profiles",
    "get_profile",
    "reference_expert_bytes",
    "register_profile",
]
