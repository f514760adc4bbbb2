"""Uncertainty of the accuracies moelab reports: standard errors and intervals.

* :func:`clustered_stderr` — the standard error of a mean of per-item scores when items come
  in correlated groups (token-level predictions grouped by the sequence they belong to). It
  is the cluster-robust (Liang–Zeger) estimator that Miller, *Adding Error Bars to Evals*
  (2024, arXiv:2411.00640) recommends for evals whose questions are not independent:
  ``SE = sqrt(Σ_g (Σ_{i∈g} (x_i − x̄))²) / n``. With one item per group it reduces to the
  ordinary standard error ``sqrt(Σ (x_i − x̄)² ) / n``; with fewer than two groups it is
  undefined (NaN).
* :func:`iid_stderr` — ``sqrt(s² / n)`` (sample variance): what treating every item as an
  independent draw gives; for correlated items it is a lower bound.
* :func:`wilson_interval` — the Wilson score interval of a proportion ``k / n``. Unlike
  ``p ± z·SE`` it stays informative at ``k = 0`` or ``k = n``, where the standard error is
  0 (0 of 3 correct: SE 0, Wilson 95 % interval [0, 0.56]).
"""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054


def iid_stderr(x) -> float:
    """Standard error of the mean of ``x`` treating items as independent (NaN for n < 2)."""
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    return float(np.sqrt(x.var(ddof=1) / n)) if n > 1 else float("nan")


def clustered_stderr(x, clusters) -> float:
    """Cluster-robust standard error of the mean of ``x`` with items grouped by ``clusters``.

    ``SE = sqrt(Σ_g (Σ_{i∈g} (x_i − x̄))²) / n`` (Miller 2024); NaN with fewer than
    two clusters (the spread between groups cannot be estimated).
    """
    x = np.asarray(x, dtype=np.float64)
    n = len(x)
    if n == 0:
        return float("nan")
    _, inv = np.unique(np.asarray(clusters), return_inverse=True)
    groups = int(inv.max()) + 1
    if groups < 2:
        return float("nan")
    sums = np.bincount(inv, weights=x - x.mean(), minlength=groups)
    return float(np.sqrt(np.sum(sums**2)) / n)


def wilson_interval(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion ``p`` observed on ``n`` items (95 % by default).

    ``p`` may be a mean of 0/1 scores (``k / n``); NaN bounds when ``n`` is 0 or ``p`` is not
    a proportion.
    """
    if n <= 0 or p is None or not 0.0 <= p <= 1.0:
        return float("nan"), float("nan")
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    lo = 0.0 if p == 0.0 else max(0.0, centre - half)
    hi = 1.0 if p == 1.0 else min(1.0, centre + half)
    return lo, hi


def degenerate(p: float | None, stderr: float | None) -> bool:
    """True when a proportion's standard error is 0 only because ``p`` is 0 or 1."""
    return p is not None and stderr is not None and stderr == 0.0 and p in (0.0, 1.0)


def format_score(p: float, stderr: float | None, n: int, *, digits: int = 3, sep: str = "±") -> str:
    """``0.650±0.109 (n=20)``; at ``p`` = 0 or 1 with a zero standard error, also the Wilson
    95 % interval: ``0.000±0.000 [95% CI 0.000–0.561] (n=3)``."""
    se = "n/a" if stderr is None or stderr != stderr else f"{stderr:.{digits}f}"
    text = f"{p:.{digits}f}{sep}{se}"
    if degenerate(p, stderr):
        lo, hi = wilson_interval(p, n)
        text += f" [95% CI {lo:.{digits}f}–{hi:.{digits}f}]"
    return f"{text} (n={n})"


def mcnemar_exact(n01: int, n10: int) -> float:
    """Two-sided exact McNemar p-value: under no difference the ``n01 + n10`` discordant documents
    split like fair coin flips (1.0 when there are none)."""
    n, k = n01 + n10, min(n01, n10)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_difference(base: dict, other: dict) -> dict:
    """``other − base`` over the documents both scored (dicts ``doc id → score``): the mean
    difference, its paired standard error (sd of the per-document differences / √n), the
    unpaired one for comparison, and for 0/1 scores the discordant counts and McNemar's p."""
    docs = sorted(set(base) & set(other), key=str)
    n = len(docs)
    if n == 0:
        return {"n": 0, "diff": None, "paired_se": None, "unpaired_se": None, "n01": 0, "n10": 0, "mcnemar_p": None}
    d = [float(other[k]) - float(base[k]) for k in docs]
    mean = sum(d) / n
    paired = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1 else 0.0
    a = [float(base[k]) for k in docs]
    b = [float(other[k]) for k in docs]
    unpaired = math.sqrt(iid_stderr(a) ** 2 + iid_stderr(b) ** 2) if n > 1 else 0.0
    binary = all(x in (0.0, 1.0) for x in a + b)
    n01 = sum(1 for x, y in zip(a, b) if x == 0 and y == 1) if binary else 0
    n10 = sum(1 for x, y in zip(a, b) if x == 1 and y == 0) if binary else 0
    return {"n": n, "diff": mean, "paired_se": paired, "unpaired_se": unpaired, "n01": n01, "n10": n10,
            "mcnemar_p": mcnemar_exact(n01, n10) if binary else None}
