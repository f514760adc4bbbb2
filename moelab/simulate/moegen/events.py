"""MoE-Gen's simulated schedule as events of the project's one schema (:data:`moelab.events.COLUMNS`),
so :class:`moelab.timeline.Timeline` reads, summarises and draws it like any run.

Each job of :func:`~moelab.simulate.moegen.schedule.step_jobs` becomes one event at its DAG times.
Engines map onto the schema's lane prefixes so the timeline's groups keep their meaning: ``gpu`` →
``device``, ``cpu`` → ``host``, ``htod`` → ``copy-htod``, ``dtoh`` → ``copy-dtoh``. ``kind``:
``dense`` (attention projections and core, router, dense MLP, LM head on the GPU),
``expert-device`` (an expert chunk; ``shared-experts`` for shared ones), ``attention-host`` (the CPU
share's attention core), ``transfer-prefetch`` (an expert copied into an ``S_Expert`` slot),
``transfer-kv`` / ``transfer-dense`` / ``transfer-activations`` (KV of a micro-batch, the next layer's
dense modules, the CPU share's Q or output) and ``writeback-kv`` (new K/V to host). The module
batch is in ``tokens`` (rows of the job) and ``cause`` (the job's name: ``GPUAttn[3]`` is micro-batch 3,
``Expert[5][1]`` expert 5's second ``b_e`` chunk). ``layer`` is the decoder layer; ``step`` the step.
"""

from __future__ import annotations

from typing import Any

from moelab.events import COLUMNS
from moelab.simulate.moegen.schedule import LayerCosts, ThroughputConfig, step_jobs
from moelab.timing.costs import CostModel
from moelab.timing.profile import get_profile
from moelab.timing.shapes import get_shape

LANES = {"gpu": "device", "cpu": "host", "htod": "copy-htod", "dtoh": "copy-dtoh"}


def _kind(name: str, engine: str) -> str:
    if engine == "cpu":
        return "attention-host"
    if engine == "dtoh":
        return "writeback-kv" if name.startswith("KV") else "transfer-activations"
    if engine == "htod":
        return ("transfer-prefetch" if name.startswith("Wcopy") else "transfer-kv" if name.startswith("KV")
                else "transfer-dense" if name.startswith("Dense") else "transfer-activations")
    if name.startswith("Expert"):
        return "expert-device"
    if name.startswith("Shared"):
        return "shared-experts"
    return "dense"


def schedule_events(shape: Any, profile: Any, config: ThroughputConfig, *, steps: int = 1, run: str = "moegen-sim"):
    """The events (a DataFrame in :data:`~moelab.events.COLUMNS`) of ``steps`` simulated steps of
    ``config`` on ``shape`` and ``profile`` (each step after the previous one)."""
    import pandas as pd

    s = get_shape(shape) if not hasattr(shape, "num_experts") else shape
    lc = LayerCosts(CostModel.of(s, get_profile(profile)))
    jobs = [j for j in step_jobs(lc, config) if j.cost_us > 0]
    span = max(j.finish_us for j in jobs)
    eb = float(s.expert_bytes())
    rows = []
    for step in range(steps):
        t0 = step * span
        for j in jobs:
            kind = _kind(j.name, j.engine)
            rows.append((run, step, j.fields.get("layer", -1), LANES[j.engine], kind, j.fields.get("expert", -1),
                         int(j.fields.get("rows", 0)), int(eb) if kind in ("transfer-prefetch", "expert-device") else 0,
                         t0 + j.start_us, t0 + j.finish_us, j.name))
    return pd.DataFrame(rows, columns=list(COLUMNS))


__all__ = ["LANES", "schedule_events"]
