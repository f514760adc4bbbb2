"""OSDI '26's prefill on its machine, predicted: the rows ``moelab simulate validate`` prints.

DeepSeek-R1 (FP8 weights, the paper's setting) on ``osdi26-5090`` (one RTX 5090 over PCIe 5.0 x16,
2× EPYC 9355): stream-loading prefill (SLP) at 2K–32K prompts, tokens/s, and the prompt length
from which SLP beats the hybrid path (GPU attention, CPU experts, chunked), found by
:func:`moelab.simulate.prefill.crossover_tokens`.

techniques.md §9 lists no published prefill number for OSDI '26, so these rows are **predictions
only**: their reference is empty and no error is computed. Nothing is fitted: every input is the
profile's spec-sheet value or an assumption stated in the row (:data:`ASSUMED`).
"""

from __future__ import annotations

from typing import Any

from moelab.simulate.prefill import (
    ASSUMPTIONS,
    CHUNK_TOKENS,
    PrefillConfig,
    crossover_tokens,
    prefill,
)
from moelab.timing.costs import CostModel
from moelab.timing.profile import get_profile, pool_numa
from moelab.timing.shapes import get_shape

SHAPE, DTYPE, PROFILE = "deepseek-r1", "fp8", "osdi26-5090"
PROMPTS = (2048, 4096, 8192, 16384, 32768)
SOURCE = ("OSDI '26 §3.1 (SLP), §3.3.2 (path choice by the simulated CPU-vs-SLP crossover), §4.1 machine; "
          "no published prefill number in techniques.md §9")
ASSUMED = (f"one GPU (no DSLP); uniform routing; hybrid path in chunks of {CHUNK_TOKENS} tokens; link at the "
           "theoretical 63 GB/s (link_efficiency 1.0); " + "; ".join(ASSUMPTIONS[1:4]))


def _profile(numa: str, **changes: Any):
    hw = get_profile(PROFILE)
    hw = hw.with_changes(**changes) if changes else hw
    return pool_numa(hw) if numa == "pooled" else hw


def _row(case: str, metric: str, value: float | None, unit: str, sensitivity: str, hw) -> dict:
    from moelab.simulate.runtime import prediction_label

    return {"group": "predictions", "case": case, "metric": metric, "reference": None,
            "reference_kind": "not published", "simulated": value, "prediction": prediction_label(hw),
            "error": None, "error_unit": "", "target": "prediction only", "ok": None, "unit": unit,
            "assumed": ASSUMED, "sensitivity": sensitivity, "source": SOURCE}


def osdi_prefill_rows(*, quick: bool = False, numa: str = "pooled") -> list[dict]:
    """One row per prompt length (SLP tokens/s, beside the hybrid path's and at 75 % link
    efficiency) and one for the crossover length (``quick``: 2K and 32K only)."""
    shape = get_shape(SHAPE, dtype=DTYPE)
    hw, slow = _profile(numa), _profile(numa, link_efficiency=0.75)
    rows = []
    for T in (PROMPTS[0], PROMPTS[-1]) if quick else PROMPTS:
        cfg = PrefillConfig(prompt_tokens=T, path="slp", crossover=False)
        r, r75 = prefill(shape, hw, cfg), prefill(shape, slow, cfg)
        hyb = "does not fit" if r.hybrid_time_us is None else f"{T / (r.hybrid_time_us * 1e-6):.0f} tok/s"
        rows.append(_row(f"osdi26-slp-prefill-{T // 1024}k", "prefill_tokens_per_s", r.tokens_per_s, "tokens/s",
                         f"R={r.ring_slots} ({r.ring_reason.split(':')[0]}); hybrid path {hyb}; "
                         f"link efficiency 0.75: {r75.tokens_per_s:.0f} tok/s", hw))
    base = PrefillConfig(prompt_tokens=1)
    cross = crossover_tokens(CostModel.of(shape, hw), base)
    cross75 = "not in --quick" if quick else crossover_tokens(CostModel.of(shape, slow), base)
    rows.append(_row("osdi26-slp-crossover", "crossover_tokens", None if cross is None else float(cross), "tokens",
                     f"link efficiency 0.75: {cross75 if cross75 is not None else 'none'} tokens; hybrid chunk "
                     f"{CHUNK_TOKENS}", hw))
    return rows


__all__ = ["ASSUMED", "PROMPTS", "osdi_prefill_rows"]
