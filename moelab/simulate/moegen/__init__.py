"""MoE-Gen's throughput schedule (module-based batching, techniques.md §7.1) on the simulator.

* :mod:`~moelab.simulate.moegen.dag` — jobs on the ``gpu``/``cpu``/``htod``/``dtoh`` engines with
  same-engine issue-order edges; ``T`` = the longest path;
* :mod:`~moelab.simulate.moegen.schedule` — one decoder layer's jobs (Fig. 6) for a
  :class:`ThroughputConfig` (``B``, ``b_a``, ``b_e``, ``ω``, ``S_Expert``, ``S_Params``), costed by the
  one cost model; a step's time and tokens/s;
* :mod:`~moelab.simulate.moegen.search` — Eqs. 1–3: the best configuration under GPU and host memory,
  and the on-demand offloading baseline;
* :mod:`~moelab.simulate.moegen.events` — a simulated step as events of the project's schema, for
  :class:`moelab.timeline.Timeline`;
* :mod:`~moelab.simulate.moegen.validate` — the validation page's rows for MoE-Gen's settings.

>>> plan = plan_throughput("mixtral-8x7b", "moegen-a5000")     # decode, prompt 512 + generate 256
>>> plan.tokens_per_s, plan.best.config, plan.baseline.tokens_per_s
"""

from moelab.simulate.moegen.dag import ENGINES, Dag, Job
from moelab.simulate.moegen.schedule import (
    ASSUMPTIONS,
    LayerCosts,
    StepTime,
    ThroughputConfig,
    layer_busy_us,
    layer_dag,
    step_jobs,
    step_lower_bound_us,
    step_time,
)
from moelab.simulate.moegen.search import (
    OMEGAS,
    Evaluated,
    ThroughputPlan,
    evaluate,
    max_batch,
    on_demand_baseline,
    plan_throughput,
    schedule_memory,
)

__all__ = ["ASSUMPTIONS", "ENGINES", "OMEGAS", "Dag", "Evaluated", "Job", "LayerCosts", "StepTime", "ThroughputConfig",
           "ThroughputPlan", "evaluate", "layer_busy_us", "layer_dag", "max_batch", "on_demand_baseline",
           "plan_throughput", "schedule_memory", "step_jobs", "step_lower_bound_us", "step_time"]
