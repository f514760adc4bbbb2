"""The simulated executor **online**: ``executor: simulated`` in a :class:`~moelab.hybrid.HybridConfig`.

The model runs as usual (the functional executor's arithmetic); after each forward, its
layer plans are simulated on the configuration's hardware profile with the live model's
shape (:meth:`moelab.timing.shapes.ModelShape.from_model`) and the
simulated events are appended to the run's event log, on a clock that continues from one
forward to the next. So ``run.events_table()`` / ``run.summary()`` read as the timeline the
same plans would have on that hardware.

Each forward is simulated on its own: copies still in flight at a forward's end do not
delay the next forward (they would on real hardware; offline simulation of the whole
plan list, :func:`moelab.simulate.executor.simulate_plans`, models it).
"""

from __future__ import annotations

import logging
from typing import Any

from moelab.errors import MoelabError
from moelab.hybrid.executors import Executor
from moelab.timing import get_profile
from moelab.timing.memory import check_memory
from moelab.timing.shapes import ModelShape

log = logging.getLogger(__name__)


class SimulatedExecutor(Executor):
    """Simulates each forward's plans and writes the events into the run's log
    (``executor: simulated``, a lazy entry of :data:`moelab.hybrid.executors.EXECUTORS`)."""

    name = "simulated"

    def __init__(self, run: Any) -> None:
        if run.config.hardware is None:
            raise MoelabError("executor 'simulated' needs a hardware profile to simulate on; set hardware: to a "
                              "profile name (moelab.timing.available_profiles()) or a profile YAML file.")

        self.run = run
        self.profile = get_profile(run.config.hardware)

        self.shape = ModelShape.from_model(run.model)
        # the configuration must fit the profile's memories (weights and expert slots; the KV cache
        # grows with the run and is not known yet)
        check_memory(self.shape, self.profile, capacity=run.config.cache.capacity, context=0)
        self.clock_us = 0.0
        self.context = 0
        self._done = 0  # plans already simulated

    def install(self, mgr: Any) -> list[Any]:
        from moelab.forward import Order

        return [mgr.add("forward_end", self.on_forward_end, order=Order.OBSERVE, name="simulated executor")]

    def on_forward_end(self, ctx, ok: bool) -> None:
        from moelab.hybrid.events import Event
        from moelab.simulate.executor import simulate_plans

        plans = [p for p in self.run.plans[self._done:] if p.forward == ctx.index]
        self._done = len(self.run.plans)
        if not plans:
            return
        res = simulate_plans(plans, self.shape, self.profile, context=self.context, run=self.run.events.run,
                             copy_chunks=self.run.config.prefetch.chunks)
        p0 = plans[0]
        self.context += p0.tokens if p0.phase == "prefill" else 1
        ev = res.events
        if not len(ev):
            return
        t0 = self.clock_us
        rows = [Event(str(r.run), int(r.step), int(r.layer), str(r.lane), str(r.kind), int(r.expert), int(r.tokens),
                      int(r.bytes), float(r.t_start_us) + t0, float(r.t_end_us) + t0, str(r.cause))
                for r in ev.itertuples(index=False)]
        self.clock_us = t0 + float(ev["t_end_us"].max())
        log_ = self.run.events
        with log_._lock:
            log_.events.extend(rows)
