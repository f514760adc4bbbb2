"""One forward pass's routing as plain arrays: what the offline planner reads and the synthetic
routing generator writes (numpy only, so neither side needs torch to exchange it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class ForwardRouting:
    """The routing of one forward pass (real tokens only), per MoE layer."""

    forward: int
    step: int
    phase: str
    """``prefill`` or ``decode``."""
    tokens: int
    """Real tokens in the forward."""
    ids: list[np.ndarray]
    """Per MoE layer: int64 (tokens, K) expert ids, ``-1`` = none."""
    weights: list[np.ndarray]
    """Per MoE layer: float32 (tokens, K) combine weights, descending per row."""
    scores: list[np.ndarray] | None = None
    """Per MoE layer: float32 (tokens, E) router probabilities (score-aware caches), or None."""
    hidden: list[Any] | None = None
    """Per MoE layer: (tokens, H) router inputs (for predictors that read them), or None."""
    token_ids: np.ndarray | None = None
    """(tokens,) int64 input token ids, or None."""


__all__ = ["ForwardRouting"]
