"""Explain what a routing change did: teacher-forced comparison per token and layer, and
capture / patch of tensors at named points of the forward pass.

>>> att = moelab.attribution.compare(model, "deferral:deferred=2", prompts, tokenizer=tok)
>>> att.tokens.kl.mean(), att.top1_agreement
>>> with moelab.attribution.capture(model, points=("resid_post",)) as cap:
...     model(**batch)

See :mod:`moelab.attribution.compare` and :mod:`moelab.attribution.capture`.
"""

from moelab.attribution.capture import POINTS, Capture, capture, patch
from moelab.attribution.compare import (
    Attribution,
    PolicySpec,
    Sequences,
    as_policy,
    compare,
    compare_many,
    sequences,
    sequences_from_task,
    sequences_from_trace,
)

__all__ = [
    "POINTS", "Attribution", "Capture", "PolicySpec", "Sequences", "as_policy", "capture", "compare",
    "compare_many", "patch", "sequences", "sequences_from_task", "sequences_from_trace",
]
