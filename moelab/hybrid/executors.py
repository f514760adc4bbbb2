"""Executors: what runs a hybrid run's plans. One base class, one registry.

A :class:`~moelab.hybrid.runtime.HybridRun` plans every MoE layer of every forward (the one
planner, :mod:`moelab.hybrid.planner`); its *executor* decides what those plans do:

* ``functional`` (:class:`FunctionalExecutor`) — exact outputs, plans only (the device and host
  sides through their backends when ``device_backend`` / ``host_backend`` are set);
* ``real`` (:class:`moelab.hybrid.real.RealExecutor`) — the plans run on concurrent lanes with
  measured timestamps; on a machine with a GPU and ``device: cuda`` / ``auto`` it is
* ``cuda`` (:class:`moelab.hybrid.cuda.CudaExecutor`) — CUDA streams for the device and copy
  lanes, a GPU expert pool;
* ``simulated`` (:class:`moelab.simulate.online.SimulatedExecutor`, a lazy entry: the simulator
  builds on the hybrid package, not the other way round) — functional outputs, each forward's
  plans simulated on the configuration's hardware profile.

Add one with :func:`register_executor` (a subclass of :class:`Executor`, or a lazy
``"package.module:Class"`` string); ``HybridConfig(executor=NAME)`` then selects it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from moelab.backends import get_backend
from moelab.forward import Order
from moelab.hybrid.events import control_span
from moelab.hybrid.lanes import split_maps
from moelab.registry import Registry


class Executor:
    """Runs a hybrid run's plans. A subclass sets :attr:`name`, builds its state in ``__init__``
    (from ``run``: its config, planner, cache, event log and device) and installs its handlers on
    the model's forward seam in :meth:`install`; :meth:`close` releases what it holds (threads,
    device memory) and is called once when the run is removed, also after errors."""

    name: ClassVar[str] = ""

    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def create(cls, run: Any) -> Executor:
        """The executor for ``run`` (a subclass may pick a variant, e.g. by the run's device)."""
        return cls(run)

    def install(self, mgr: Any) -> list[Any]:
        """Add this executor's handlers to ``mgr`` (:func:`moelab.forward.forward_hooks`); return the handles."""
        return []

    def close(self) -> None:
        """Release threads and memory; the run calls it once on removal."""


class FunctionalExecutor(Executor):
    """Exact outputs through the model's own experts: the plans are only recorded. With
    ``device_backend`` / ``host_backend`` set, each layer's device experts run through the device
    backend and the rest through the host backend, summed (and deferred experts through the host
    backend)."""

    name = "functional"

    def install(self, mgr: Any) -> list[Any]:
        cfg = self.run.config
        if cfg.device_backend is None and cfg.host_backend is None:
            return []
        self._backends = (get_backend(cfg.device_backend or "reference"), get_backend(cfg.host_backend or "reference"))
        return [mgr.add("experts", self._split, order=Order.BACKEND + 50, name="functional executor")]

    def _split(self, ctx: Any, layer: Any, call: Any) -> None:
        """Device experts through the device backend, the rest through the host backend, summed."""
        lp = ctx.scratch.get(("hybrid-plan", layer.index))
        if lp is None:
            return
        dev_b, host_b = self._backends
        device = sorted({e for e, _ in lp.device})
        E = layer.num_experts

        def backend(module, hidden, ids, weights, expert_map=None):
            dmap, hmap = split_maps(E, device, ids.device)
            return dev_b(module, hidden, ids, weights, expert_map=dmap) + host_b(module, hidden, ids, weights,
                                                                               expert_map=hmap)

        call.backend = backend
        call.deferred_backend = lambda module, hidden, ids, weights, expert_map=None: host_b(module, hidden, ids,
                                                                                           weights)


class LaneExecutor(Executor):
    """What the real executors share: control-thread spans between the seam's points (dense
    parts, dispatch, planning) on the run's event log, and the ``experts`` handler that hands
    each layer's plan to :meth:`_immediate` / :meth:`_deferred` (the subclass's lanes)."""

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        self.log = run.events
        self._last_mark: dict[int, float] = {}

    def install(self, mgr: Any) -> list[Any]:
        name = f"{self.name} executor"
        handles = [mgr.add(point, fn, order=Order.OBSERVE, name=name)
                   for point, fn in (("forward", self.on_forward), ("router", self.on_router),
                                     ("output", self.on_output), ("forward_end", self.on_forward_end))]
        handles.append(mgr.add("experts", self.on_experts, order=Order.BACKEND + 50, name=name))
        return handles

    def on_forward(self, ctx: Any) -> None:
        self._last_mark[ctx.index] = self.log.now_us()

    def on_router(self, ctx: Any, layer: Any, call: Any) -> None:
        control_span(self.log, self._last_mark, ctx.index, layer.index, "dense", "attention+router")

    def on_output(self, ctx: Any, layer: Any, call: Any, out: Any) -> None:
        control_span(self.log, self._last_mark, ctx.index, layer.index, "dispatch", "merge")

    def on_forward_end(self, ctx: Any, ok: bool) -> None:
        if ok:  # the layers after the last MoE block, the final norm and the LM head
            control_span(self.log, self._last_mark, ctx.index, -1, "dense", "head")
        self._last_mark.pop(ctx.index, None)

    def on_experts(self, ctx: Any, layer: Any, call: Any) -> None:
        lp = ctx.scratch.get(("hybrid-plan", layer.index))
        if lp is None:
            return
        control_span(self.log, self._last_mark, ctx.index, layer.index, "plan", "planner")
        call.backend = self._immediate(ctx, layer, lp)
        call.deferred_backend = self._deferred(ctx, layer, lp)

    def _immediate(self, ctx: Any, layer: Any, lp: Any) -> Callable:  # pragma: no cover - abstract
        raise NotImplementedError

    def _deferred(self, ctx: Any, layer: Any, lp: Any) -> Callable:  # pragma: no cover - abstract
        raise NotImplementedError


#: Executors by name (``HybridConfig.executor``): :class:`Executor` subclasses or lazy
#: ``"module:Class"`` strings, imported when a run first uses them.
EXECUTORS: Registry[type[Executor]] = Registry("executor", base=Executor)
EXECUTORS.register("functional", FunctionalExecutor)
EXECUTORS.register("real", "moelab.hybrid.real:RealExecutor")
EXECUTORS.register("cuda", "moelab.hybrid.cuda:CudaExecutor")
EXECUTORS.register("simulated", "moelab.simulate.online:SimulatedExecutor")


def register_executor(name: str, executor: type[Executor] | str, *, overwrite: bool = False) -> None:
    """Make an executor selectable as ``HybridConfig(executor=name)``; a repeated name raises
    unless ``overwrite=True``."""
    EXECUTORS.register(name, executor, overwrite=overwrite)


def available_executors() -> list[str]:
    return EXECUTORS.names()


def get_executor(name: str) -> type[Executor]:
    """The executor class registered as ``name`` (a did-you-mean error if unknown)."""
    return EXECUTORS.get(name)


__all__ = ["EXECUTORS", "Executor", "FunctionalExecutor", "LaneExecutor", "available_executors", "get_executor",
           "register_executor"]
