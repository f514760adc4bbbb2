"""Physical bounds on calibrated values: what ``moelab calibrate`` refuses to write.

A calibration on a loaded or odd machine can fit numbers no hardware has (a 0.56 GB/s "link", a
dense-work efficiency of 0.0118, a 0.84 s decoder layer) and every simulation built on them is
wrong without a word. Each fitted or measured value is checked here **before** it is written:

* :data:`BOUNDS` — per profile field, the range a real machine can have and why (a PCIe x16 link is
  not slower than 1 GB/s nor faster than PCIe 6.0's 121 GB/s; an efficiency is in (0, 1]; a host's
  memory is not faster than 2 TB/s), and the fix when a value falls outside;
* :func:`check_fit` — a least-squares fit behind a value: a term the fit had to drop because it came
  out negative (a negative slope has no bandwidth; a negative intercept no fixed cost), or a poor
  R² (the model ``fixed + bytes / rate`` does not describe the points).

:func:`enforce` turns the violations into a :class:`OutOfBoundsError` naming each value, its bound
and the fix — or, with ``allow=True`` (``--allow-out-of-bounds``), writes them anyway with the
warning put into the field's provenance (``stated: OUT OF BOUNDS …``) and the description, and logs
it. The bounds are physical limits, not expectations: a value inside them can still be wrong.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from moelab.errors import MoelabError

log = logging.getLogger(__name__)

#: A fit whose weighted R² is below this does not describe its points.
MIN_R2 = 0.8
#: A negative fitted term that takes at most this % off every point's time is a zero measured
#: with noise (dropped, not refused): far below the run-to-run spread calibration tolerates.
NEGLIGIBLE_PCT = 2.0
#: ...and one within this many standard errors of zero is one the points cannot tell from zero.
ZERO_SE = 2.0


class OutOfBoundsError(MoelabError):
    """A calibrated value outside its physical bounds (see :mod:`moelab.simulate.bounds`)."""


@dataclass(frozen=True)
class Bound:
    """The range ``[lo, hi]`` (``lo`` excluded with ``lo_open``) a field can physically have."""

    lo: float
    hi: float
    unit: str
    why: str
    """The physical reason for the range."""
    fix: str
    """What to do when a calibrated value falls outside it."""
    lo_open: bool = False

    def holds(self, value: float) -> bool:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            return False
        return (value > self.lo if self.lo_open else value >= self.lo) and value <= self.hi

    def text(self) -> str:
        lo = f"{'(' if self.lo_open else '['}{self.lo:g}"
        return f"in {lo}, {self.hi:g}]{' ' + self.unit if self.unit else ''}"


_QUIET = ("calibrate on a quiet machine (moelab calibrate refuses a busy one; see its load line) with more "
          "--repeat")
_FIT = ("look at the fit's points in the raw measurements (PROFILE.raw.json, or PROFILE.rejected.raw.json when "
        "refused: a point far off the line is a disturbed measurement); " + _QUIET)

BOUNDS: dict[str, Bound] = {
    "link_bandwidth_gbs": Bound(1.0, 128.0, "GB/s", "no PCIe x16 link of generation 3 or later moves less than "
                                "1 GB/s, and PCIe 6.0 x16 moves at most 121 GB/s one way", _QUIET),
    "link_latency_us": Bound(0.0, 1000.0, "µs", "one copy's set-up costs microseconds, not milliseconds", _QUIET),
    "gpu_memory_bandwidth_gbs": Bound(1.0, 10_000.0, "GB/s", "an experts kernel streaming weights reads at least "
                                      "1 GB/s; HBM3e peaks at 8 TB/s", _FIT),
    "cpu_memory_bandwidth_gbs": Bound(1.0, 2_000.0, "GB/s", "one DDR4 channel reads ≥ 12 GB/s; two sockets of "
                                      "12-channel DDR5 about 1.2 TB/s", _QUIET),
    "numa_node_bandwidth_gbs": Bound(1.0, 2_000.0, "GB/s", "as cpu_memory_bandwidth_gbs, per NUMA node", _QUIET),
    "decode_layer_time_us": Bound(1.0, 200_000.0, "µs", "the estimated DeepSeek-V2-Lite-shaped layer reads "
                                  "~140 MB (dense weights and 6 experts): 0.14 s even at the 1 GB/s floor of any "
                                  "memory",
                                  "it is estimated from the fits: " + _FIT),
    "attention_fraction": Bound(0.0, 1.0, "", "a share of the layer's time", _FIT, lo_open=True),
    "gpu_peak_tflops": Bound(1e-4, 5_000.0, "TFLOP/s", "a B200's dense bf16 peak is 2.25 PFLOP/s; below "
                             "0.1 GFLOP/s is not a processor at work", _FIT),
    "cpu_peak_tflops": Bound(1e-4, 200.0, "TFLOP/s", "a 2-socket AMX server peaks near 100 TFLOP/s bf16", _FIT),
    "gpu_memory_efficiency": Bound(0.0, 1.0, "", "a share of a bandwidth", _FIT, lo_open=True),
    "gpu_compute_efficiency": Bound(0.0, 1.0, "", "a share of a peak", _FIT, lo_open=True),
    "cpu_memory_efficiency": Bound(0.0, 1.0, "", "a share of a bandwidth", _FIT, lo_open=True),
    "gpu_dense_efficiency": Bound(0.05, 1.0, "", "the dense work (norms, attention, router) streams its weights "
                                  "at a rate comparable to an experts kernel's; below 5 % the dense fit's slope "
                                  "has taken what is really a fixed cost (or the machine was busy)", _FIT),
    "gpu_launch_us": Bound(0.1, 100.0, "µs", "a kernel launch or a small torch op costs 1-20 µs", _QUIET),
    "gpu_kernels_per_attention": Bound(1, 2_000, "launches", "a decoder layer's dense work is tens to hundreds "
                                       "of kernels", _FIT),
    "gpu_kernels_per_expert": Bound(1, 500, "launches", "an expert is a few kernels on a GPU (gate/up, "
                                    "activation, down); the torch reference backend standing in for one on a CPU "
                                    "runs tens of ops per expert", _FIT),
    "gpu_call_us": Bound(0.0, 10_000.0, "µs", "one experts call's fixed cost is microseconds", _FIT),
    "cpu_call_us": Bound(0.0, 10_000.0, "µs", "one experts call's fixed cost is microseconds", _FIT),
    "cpu_dispatch_us": Bound(0.0, 1_000.0, "µs", "per expert of a call: a few µs of bookkeeping", _FIT),
    "sync_us": Bound(0.0, 1_000.0, "µs", "one synchronisation costs microseconds", _QUIET),
    "runtime_layer_us": Bound(0.0, 100_000.0, "µs", "moelab's executor plans and dispatches one MoE layer in "
                              "microseconds to milliseconds of Python", _QUIET),
    "runtime_call_us": Bound(0.0, 10_000.0, "µs", "handing one task to a lane thread and its result back is "
                             "microseconds", _QUIET),
}


@dataclass(frozen=True)
class Violation:
    """One value outside its bound (or one bad fit)."""

    what: str
    value: float
    bound: str
    why: str
    fix: str

    def __str__(self) -> str:
        v = f"{self.value:.4g}" if isinstance(self.value, (int, float)) else repr(self.value)
        return f"{self.what} = {v}, expected {self.bound} ({self.why})"


def check_bounds(profile: dict[str, Any], bounds: dict[str, Bound] | None = None) -> list[Violation]:
    """The fields of ``profile`` (a profile file's data: ``{field: {"value": ...}}`` or plain values)
    outside :data:`BOUNDS`."""
    out = []
    for name, b in (bounds or BOUNDS).items():
        if name not in profile:
            continue
        entry = profile[name]
        value = entry.get("value") if isinstance(entry, dict) else entry
        if not b.holds(value):
            out.append(Violation(name, value, b.text(), b.why, b.fix))
    return out


def fit_r2(fit: dict) -> float:
    """R² of a :func:`moelab.simulate.calibrate.fit_fixed_per_byte` fit, weighted as the fit is
    (by ``1 / time``: on relative errors); 1.0 for a fit whose points do not vary."""
    pts = fit.get("points", [])
    if len(pts) < 2:
        return 1.0
    ys = [p["us"] for p in pts if p["us"] > 0]
    rel = [p["residual_us"] / p["us"] for p in pts if p["us"] > 0]
    # the weighted total: each point's deviation, relative to itself, from the constant that fits best
    # on relative errors (minimises Σ((y - c) / y)²)
    mean = sum(1 / y for y in ys) / sum(1 / (y * y) for y in ys)
    ss_tot = sum(((y - mean) / y) ** 2 for y in ys)
    ss_res = sum(r * r for r in rel)
    return 1.0 if ss_tot <= 0 else 1.0 - ss_res / ss_tot


def zero_within_noise(fit: dict, term: str) -> bool:
    """Whether the negative ``term`` a fit dropped is a zero measured with noise: it took at most
    :data:`NEGLIGIBLE_PCT` off every point's time (e.g. -0.04 µs per expert on 100 µs calls), or it
    is within :data:`ZERO_SE` standard errors of zero (the points cannot tell it from zero)."""
    raw = fit.get(f"raw_{term}", float("-inf"))
    return (fit.get(f"raw_{term}_max_pct", float("inf")) <= NEGLIGIBLE_PCT
            or raw + ZERO_SE * fit.get(f"raw_{term}_se", 0.0) >= 0)


def check_fit(name: str, fit: dict, *, min_r2: float = MIN_R2, need_slope: bool = True) -> list[Violation]:
    """A fit's problems: a slope (per-byte term) that came out ≤ 0 (no bandwidth can be read off it),
    an intercept or per-expert term the fit dropped because it came out negative, unless that is a
    zero measured with noise (:func:`zero_within_noise`), an R² below ``min_r2``. ``fit``: what
    :func:`~moelab.simulate.calibrate.fit_fixed_per_byte` returns."""
    out = []
    dropped = fit.get("dropped", [])
    if need_slope and fit.get("us_per_byte", 0.0) <= 0:
        out.append(Violation(f"fit {name}: per-byte slope", fit.get("us_per_byte", 0.0), "> 0",
                             "a time that does not grow with the bytes read has no bandwidth", _FIT))
    for term in dropped:
        if term == "bytes":
            continue  # reported as the slope above
        if zero_within_noise(fit, term):
            continue
        out.append(Violation(f"fit {name}: {term} term", fit.get(f"raw_{term}", float("nan")), "≥ 0",
                             f"the least-squares {term} came out negative and was dropped: a call cannot take "
                             "negative time", _FIT))
    r2 = fit_r2(fit)
    if r2 < min_r2:
        out.append(Violation(f"fit {name}: R²", round(r2, 3), f"≥ {min_r2:g}", "the fit does not describe its points "
                             f"(median residual {fit.get('median_abs_residual_pct', 0):.0f} %)", _FIT))
    return out


def enforce(profile: dict[str, Any], violations: list[Violation], *, allow: bool = False) -> dict[str, Any]:
    """Raise :class:`OutOfBoundsError` listing ``violations``; or, with ``allow``, log them loudly and
    return ``profile`` with each out-of-bounds field's provenance and the description saying so."""
    if not violations:
        return profile
    listing = "\n  ".join(str(v) for v in violations)
    fixes = "\n  ".join(dict.fromkeys(v.fix for v in violations))
    if not allow:
        raise OutOfBoundsError(
            f"calibration produced {len(violations)} value(s) outside physical bounds; nothing was written:\n  "
            f"{listing}\nTo fix:\n  {fixes}\nOr pass --allow-out-of-bounds to write them anyway (each marked in the "
            "profile's provenance).")
    log.warning("moelab calibrate: writing %d value(s) outside physical bounds (--allow-out-of-bounds):\n  %s",
                len(violations), listing)
    out = dict(profile)
    for v in violations:
        entry = out.get(v.what)
        if isinstance(entry, dict) and "value" in entry:
            basis = "stated" if "stated" in entry else "assumed"
            out[v.what] = {"value": entry["value"], basis: f"OUT OF BOUNDS (written with --allow-out-of-bounds): "
                                                            f"expected {v.bound}, {v.why}. {entry[basis]}"}
    names = ", ".join(v.what for v in violations)
    out["description"] = f"WARNING: {len(violations)} value(s) outside physical bounds ({names}). " + str(
        profile.get("description", ""))
    return out


__all__ = ["BOUNDS", "MIN_R2", "Bound", "OutOfBoundsError", "Violation", "check_bounds", "check_fit", "enforce",
           "fit_r2"]
