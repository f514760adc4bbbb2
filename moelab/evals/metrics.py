"""pass@k for generated code: the unbiased estimator and the lm-eval metric that runs the tests.

The built-in lm-eval ``humaneval`` loads ``evaluate``'s ``code_eval`` from the hub when
its module is imported, which fails offline; these functions replace it. Programs run
in :mod:`moelab.evals.sandbox`, never in the evaluating process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from moelab.evals.sandbox import SandboxConfig, check_level, run_tests_many

logger = logging.getLogger(__name__)


def estimate_pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al., 2021).

    ``1 - C(n-c, k) / C(n, k)``, computed as a stable product. Needs ``1 ≤ k ≤ n``.
    """
    if not 0 <= c <= n:
        raise ValueError(f"need 0 ≤ c ≤ n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least k={k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


_DEFAULTS = SandboxConfig()


@contextmanager
def sandbox_defaults(config: SandboxConfig) -> Iterator[None]:
    """Within the block, :func:`pass_at_k` uses ``config`` for limits its caller does not set."""
    global _DEFAULTS
    previous, _DEFAULTS = _DEFAULTS, config
    try:
        yield
    finally:
        _DEFAULTS = previous


def set_min_isolation(level: str) -> None:
    """From now on, :func:`pass_at_k` refuses to run code below sandbox isolation ``level``
    (lm-eval's command line: ``--model_args ...,sandbox_isolation=rlimits``)."""
    global _DEFAULTS
    _DEFAULTS = replace(_DEFAULTS, min_isolation=check_level(level, "sandbox_isolation"))


def build_programs(candidates: Sequence[str], test: str) -> list[str]:
    """One program per candidate: the candidate (prompt + completion) followed by the tests
    (for reading; scoring runs them apart, see :func:`moelab.evals.sandbox.run_tests`)."""
    return [f"{cand}\n{test}\n" for cand in candidates]


def pass_at_k(
    references: list[str],
    predictions: list[list[str]],
    k: int | list[int] = 1,
    timeout: float | None = None,
    memory_mb: int | None = None,
) -> dict[str, float]:
    """lm-eval metric: ``{"pass@k": mean over problems}`` for each ``k``.

    lm-eval calls it once per document with ``references=[test code ending in
    check(entry_point)]`` and ``predictions=[[candidate programs]]``. Limits not given
    come from :func:`sandbox_defaults` (set by ``moelab.evals.evaluate``) or
    :class:`~moelab.evals.sandbox.SandboxConfig`'s defaults; below the isolation level it
    asks for, :class:`~moelab.evals.sandbox.SandboxUnavailable` is raised and nothing runs.
    """
    try:
        ks = [k] if isinstance(k, int) else [int(x) for x in k]
        config = _DEFAULTS
        if timeout is not None:
            config = replace(config, timeout_s=float(timeout))
        if memory_mb is not None:
            config = replace(config, memory_mb=int(memory_mb))
        if len(references) != len(predictions):
            raise ValueError(
                f"{len(references)} references but {len(predictions)} prediction lists"
            )
        scores: dict[str, list[float]] = {f"pass@{kk}": [] for kk in ks}
        for test, candidates in zip(references, predictions):
            # each candidate in its own sandbox, the tests in another: an unforgeable verdict
            results = run_tests_many([(cand, test) for cand in candidates], config)
            passed = sum(r.passed for r in results)
            for r in results:
                if not r.passed:
                    logger.debug("candidate %s: %s", r.status, r.stderr[-300:])
            for kk in ks:
                scores[f"pass@{kk}"].append(estimate_pass_at_k(len(results), passed, kk))
        return {name: float(np.mean(v)) for name, v in scores.items()}
    except TypeError as exc:
        # lm-eval retries a metric that raises TypeError with other arguments, hiding the cause.
        raise RuntimeError(f"pass_at_k failed: {exc}") from exc


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """lm-eval filter: each completion prefixed with its problem's prompt (a full function)."""
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs)]
