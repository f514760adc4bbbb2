"""Fit several predictor kinds at several distances and collect their scores in one table.

>>> reports = compare(train_trace, test_trace, kinds=["frequency", "token", "skip", "learned"], distances=[1, 2])
>>> frame(reports)            # tidy DataFrame: kind, distance, phase, target_layer, accuracy, ...
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from moelab.predictors.base import as_trace_data
from moelab.predictors.metrics import PredictionReport, evaluate
from moelab.predictors.registry import make_predictor

log = logging.getLogger(__name__)


def compare(
    train,
    test=None,
    *,
    kinds: Sequence[str] = ("frequency", "token", "skip", "learned", "oracle"),
    distances: Sequence[int] = (1, 2),
    params: dict[str, dict[str, Any]] | None = None,
    model: Any = None,
    **evaluate_kwargs: Any,
) -> dict[tuple[str, int], tuple[Any, PredictionReport]]:
    """``{(kind, d): (fitted predictor, report)}``; fitted on ``train``, scored on ``test``
    (default: the held-out sequences of ``train``). ``params[kind]`` adds hyperparameters."""
    train = as_trace_data(train)
    test = as_trace_data(test) if test is not None else train
    out = {}
    for d in distances:
        if d > train.trace.num_moe_layers - 1:
            log.warning("skipping distance %d: the model has %d MoE layers", d, train.trace.num_moe_layers)
            continue
        for kind in kinds:
            p = make_predictor(kind, distance=d, **(params or {}).get(kind, {})).fit(train, model=model)
            out[(kind, d)] = (p, evaluate(p, test, model=model, **evaluate_kwargs))
    return out


def frame(reports: dict[tuple[str, int], tuple[Any, PredictionReport]], per_layer: bool = True):
    """A tidy pandas DataFrame of the reports: one row per (kind, distance, phase[, layer])."""
    import pandas as pd

    rows = []
    for (kind, d), (_, rep) in reports.items():
        if per_layer:
            for r in rep.per_layer:
                rows.append({"kind": kind, "distance": d, "latency_us": rep.latency_us, **r})
        else:
            for phase, o in rep.overall.items():
                rows.append({"kind": kind, "distance": d, "phase": phase, "latency_us": rep.latency_us, **o})
    return pd.DataFrame(rows)
