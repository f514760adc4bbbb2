"""Models moelab can load by name: bundled trained tiny models and tiny random ones."""

from moelab.models.bundled import bundled_models, bundled_path
from moelab.models.tiny import FAMILIES, build_tiny, tiny_config

__all__ = ["FAMILIES", "build_tiny", "tiny_config", "bundled_models", "bundled_path"]
