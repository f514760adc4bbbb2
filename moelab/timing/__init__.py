"""Timing: hardware profiles, the one link model, and expert sizes.

* :mod:`moelab.timing.profile` — :class:`HardwareProfile`, loaded from packaged YAML files
  (``moelab/timing/profiles/*.yaml``; every number marked *stated* with its source or
  *assumed* with why), the :data:`PROFILES` registry, :func:`get_profile`,
  :func:`load_profile` for your own file, :data:`DEFAULT_PROFILE`.
* :mod:`moelab.timing.link` — :class:`Link`: ``latency + bytes / bandwidth`` on a FIFO
  queue; GoodPred and cache prefetch budgets both use it.
* :mod:`moelab.timing.shapes` — :class:`ModelShape`, a model's bytes and FLOPs without its
  weights (:func:`get_shape` by name, ``config.json`` or live model).
* :mod:`moelab.timing.experts` — :func:`expert_bytes_of` (a model's expert size) and
  reference expert sizes of real models.
* :mod:`moelab.timing.memory` — what a configuration keeps on the GPU (dense weights, KV cache,
  expert slots, workspace) and the host (routed experts), and
  :func:`~moelab.timing.memory.check_memory`, which refuses one that does not fit, with the numbers.

>>> from moelab.timing import get_profile
>>> hw = get_profile("promoe-4090")
>>> hw.provenance["link_bandwidth_gbs"]
'stated: ProMoE §7.1: PCIe 4.0, 32 GB/s one way'
>>> hw.link.bandwidth_gbs                      # 32 GB/s nominal × link_efficiency 0.747
23.904
>>> round(hw.link.transfer_us(17_301_504), 1)  # one DeepSeek-V2-Lite expert, µs
733.8
"""

from moelab.timing.experts import REFERENCE_EXPERT_BYTES, expert_bytes_of, reference_expert_bytes
from moelab.timing.link import EPS_US, Link, LinkQueue, fifo_schedule
from moelab.timing.profile import (
    DEFAULT_PROFILE,
    FIELDS,
    PROFILES,
    HardwareProfile,
    available_profiles,
    get_profile,
    load_profile,
    parse_profile,
    register_profile,
)
from moelab.timing.shapes import SHAPES, ModelShape, available_shapes, get_shape, register_shape

__all__ = [
    "DEFAULT_PROFILE",
    "EPS_US",
    "FIELDS",
    "PROFILES",
    "SHAPES",
    "REFERENCE_EXPERT_BYTES",
    "HardwareProfile",
    "Link",
    "ModelShape",
    "LinkQueue",
    "available_profiles",
    "available_shapes",
    "expert_bytes_of",
    "fifo_schedule",
    "get_profile",
    "get_shape",
    "load_profile",
    "parse_profile",
    "reference_expert_bytes",
    "register_profile",
    "register_shape",
]
