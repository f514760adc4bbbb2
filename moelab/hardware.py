"""Compatibility name for :mod:`moelab.timing` (hardware profiles and expert sizes).

Hardware profiles now live in :mod:`moelab.timing.profile` as packaged YAML files; the
link model in :mod:`moelab.timing.link`; expert sizes in :mod:`moelab.timing.experts`.
This module re-exports the names it used to define; new code imports ``moelab.timing``.
"""

from moelab.timing import (
    DEFAULT_PROFILE,
    REFERENCE_EXPERT_BYTES,
    HardwareProfile,
    available_profiles,
    get_profile,
    load_profile,
    reference_expert_bytes,
    register_profile,
)

__all__ = [
    "DEFAULT_PROFILE",
    "REFERENCE_EXPERT_BYTES",
    "HardwareProfile",
    "available_profiles",
    "get_profile",
    "load_profile",
    "reference_expert_bytes",
    "register_profile",
]
