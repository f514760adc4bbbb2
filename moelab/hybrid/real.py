"""The *real* executor: runs each layer's plan on lanes with real concurrency and measured times.

Lanes (one worker thread each, a priority queue in front):

* ``device`` — computes the experts the plan puts on the device (cache hits and fetched
  misses) with the device backend. On a machine without a GPU this is a CPU worker that
  stands in for the device: it shares the host's cores and memory bandwidth, which is
  exactly what makes CPU-only hybrid timings differ from a GPU box's (the simulator
  models the difference). The lanes are *helping* (:class:`~moelab.hybrid.lanes.Lane`): the
  control thread, which would only block until the device lane has computed the layer's
  experts, runs them itself when the lane is idle (still one device-lane task at a time, its
  event the device lane's); a layer's deferred device work and everything queued behind a
  running task stay on the worker. A native kernels device backend runs on a C++ worker of the
  extension instead (lane 1, as the host side below on lane 0): the control thread queues it once
  the layer's demand copies are done, and records that wait as its own (cause ``copy``);
* ``host`` — computes host-placed misses and the deferred slots of host experts with the host
  backend. A native kernels backend (``moelab``, ``moelab_bf16`` ...) runs on a C++ worker thread
  of the extension (:class:`~moelab.hybrid.lanes.NativeLane`: the call is checked and queued on
  the control thread and runs without the interpreter); another backend on a Python worker
  thread (the native kernels release the GIL, so either runs beside the control thread); the
  deferred slots of experts the device computes run on the device in the same layer (their sum
  is still added at the next MoE layer);
* ``copy`` — copies fetched, inserted and prefetched experts' weights into a
  preallocated resident pool (a real ``copy_`` of the expert's gate/up and down stacks).
  Demand copies go first; queued prefetches wait behind every demand copy (a demand
  pre-empts queued prefetches). The device lane starts a fetched expert's compute only
  after its copy has finished.

The control thread (the model's own Python code: attention, norms, routers) waits for
the immediate experts of a layer, adds the two lanes' partial sums, and goes on; a
layer's deferred experts run on the host lane while the control thread computes the
next layer's attention, and are awaited only where the next MoE layer adds them.

Outputs equal the functional executor's up to floating-point rounding: the device and
host parts are summed separately (two partial sums instead of one), so the result is
``allclose``, not bit-identical. Device compute reads the module's own weights, not the
pool copy (same bytes, so the same memory traffic on a CPU stand-in).

Every unit of work is an event (:mod:`moelab.hybrid.events`).

With ``device: cuda`` (or ``auto`` on a machine with a GPU) :meth:`RealExecutor.create` builds the
CUDA version instead (:mod:`moelab.hybrid.cuda`): a CUDA stream for the device lane, a copy
stream from pinned masters into a GPU pool, host experts on hidden states copied back and forth.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from moelab.backends import get_backend
from moelab.forward.plan import SMALL
from moelab.hybrid.cuda import CudaExecutor
from moelab.hybrid.events import control_span
from moelab.hybrid.executors import LaneExecutor
from moelab.hybrid.lanes import (
    Lane,
    NativeLane,
    native_lane_ok,
    piece_bytes,
    split_maps,
    tensor_piece,
)

log = logging.getLogger(__name__)


class ExpertPool:
    """A preallocated resident pool: one slot per device-cache entry, filled by real copies."""

    def __init__(self, layers, slots: int, device: torch.device) -> None:
        self.layers = layers
        self.where: dict[tuple[int, int], int] = {}
        self.free = list(range(slots))
        e0 = layers[0].experts
        self.gu = torch.empty((slots, *e0.gate_up_proj.shape[1:]), dtype=e0.gate_up_proj.dtype, device=device)
        self.dn = torch.empty((slots, *e0.down_proj.shape[1:]), dtype=e0.down_proj.dtype, device=device)
        self._lock = threading.Lock()

    def fits(self, layer) -> bool:
        e = layer.experts
        return tuple(e.gate_up_proj.shape[1:]) == tuple(self.gu.shape[1:]) and \
            tuple(e.down_proj.shape[1:]) == tuple(self.dn.shape[1:])

    def copy_in(self, layer_index: int, expert: int, piece: int = 0, pieces: int = 1) -> None:
        """Copy expert ``expert`` of layer ``layer_index`` into its slot (taken by its first piece),
        or piece ``piece`` of ``pieces`` of it: that share of each weight stack's elements (ProMoE's
        chunked copies, ``prefetch.chunks``)."""
        layer = self.layers[layer_index]
        gu, dn = layer.experts.gate_up_proj[expert].detach(), layer.experts.down_proj[expert].detach()
        if not self.fits(layer):  # layers of another shape: copy into a scratch tensor of its own
            tensor_piece(gu, piece, pieces).clone()
            tensor_piece(dn, piece, pieces).clone()
            return
        with self._lock:
            slot = self.where.get((layer_index, expert))
            if slot is None and piece > 0:  # evicted after its first piece: the rest of the copy is moot
                return
            if slot is None:
                # the plan evicts before it inserts, so a slot is free; if not (a prefetch racing a
                # demand copy), the oldest resident expert gives up its slot
                slot = self.free.pop() if self.free else self.where.pop(next(iter(self.where)))
                self.where[(layer_index, expert)] = slot
        tensor_piece(self.gu[slot], piece, pieces).copy_(tensor_piece(gu, piece, pieces))
        tensor_piece(self.dn[slot], piece, pieces).copy_(tensor_piece(dn, piece, pieces))

    def evict(self, layer_index: int, expert: int) -> None:
        with self._lock:
            slot = self.where.pop((layer_index, expert), None)
            if slot is not None:
                self.free.append(slot)


class RealExecutor(LaneExecutor):
    """Runs a :class:`~moelab.hybrid.HybridRun`'s plans on real lanes (the device lane a CPU
    worker; :mod:`moelab.hybrid.cuda` has the CUDA lanes, which :meth:`create` picks on a GPU)."""

    name = "real"

    @classmethod
    def create(cls, run: Any) -> LaneExecutor:
        """The real executor for the run's device: CUDA lanes on ``cuda``, CPU lanes otherwise."""
        if run.device_ == "cuda":
            return CudaExecutor(run)
        return cls(run)

    def __init__(self, run: Any) -> None:
        super().__init__(run)
        cfg = run.config
        self.device_backend = get_backend(cfg.device_backend or "reference")
        self.host_backend = get_backend(cfg.host_backend or "reference")
        # a native backend runs on a C++ worker of the kernels extension: no Python thread between
        # the control thread and the kernel (issue #26: lanes without the GIL), so a side's Python
        # lane is started only for another backend (it would sit idle). The device side's worker is
        # its own (lane 1): both sides run side by side, as they do on a GPU box
        self.native_host = NativeLane("host", self.log, lane=0) if native_lane_ok(self.host_backend) else None
        self.native_device = NativeLane("device", self.log, lane=1) if native_lane_ok(self.device_backend) else None
        names = tuple(name for name, native in (("device", self.native_device), ("host", self.native_host))
                      if native is None) + ("copy",)
        #: the Python lanes this executor started (their threads are joined by :meth:`close`)
        self.lanes: dict[str, Lane] = {}
        try:
            for name in names:  # a thread that waits on a lane runs its next task if the lane is idle (Lane)
                self.lanes[name] = Lane(name, self.log, helping=True)
            slots = 0 if run.cache is None else int(sum(run.cache.slots_))
            self.pool = ExpertPool(run.layers, max(slots, 1), torch.device("cpu"))
            if run.cache is not None:  # a warm start: its experts are resident before the first forward
                for key in run.cache.eviction_order():
                    self.pool.copy_in(*run.cache.layer_expert(key))
        except BaseException:  # the run never gets this executor to close: join what was started
            self.close()
            raise

    def close(self) -> None:
        """Join the Python lanes' threads (the native lanes' workers belong to the extension)."""
        while self.lanes:
            self.lanes.popitem()[1].close()

    # ------------------------------------------------------------------ work
    def _submit_transfers(self, ctx, lp) -> dict[int, Future]:
        demand: dict[int, Future] = {}
        copy = self.lanes["copy"]
        for layer_index, expert in lp.evictions:
            self.pool.evict(layer_index, expert)
        chunks = self.run.config.prefetch.chunks
        for t in lp.transfers:
            prio = {"demand": 0, "prefetch": 1}.get(t.priority, 2)  # inserts last
            # low-priority copies in chunks (ProMoE's), so a demand copy waits for one chunk at most
            n = 1 if t.priority == "demand" else chunks
            for i in range(n):
                fut = copy.submit(lambda t=t, i=i, n=n: self.pool.copy_in(t.layer, t.expert, i, n), priority=prio,
                                  step=ctx.index, layer=t.layer, kind=f"transfer-{t.priority}", expert=t.expert,
                                  nbytes=piece_bytes(t.bytes, i, n), cause=t.priority)
            if t.priority == "demand" and t.layer == lp.layer:
                demand[t.expert] = fut
        return demand

    def _immediate(self, ctx, layer, lp):
        device = _experts(lp.device)
        n_host = len(_experts(lp.host))
        log = self.log

        def backend(module, hidden, ids, weights, expert_map=None):
            demand = self._submit_transfers(ctx, lp)
            t_wait = control_span(log, self._last_mark, ctx.index, layer.index, "dispatch", "submit")
            # everything not on the device runs on the host: its misses, and padding rows' experts
            futs, t_copied = self._submit_sides(ctx, layer, (module, hidden, ids, weights), device, n_host,
                                                device_event=("expert-device", "hit+fetch"),
                                                host_event=("expert-host", "miss"),
                                                after=list(demand.values()))  # a fetched expert runs after its copy
            if not futs:
                return torch.zeros_like(hidden)
            parts = list(map(_RESULT, futs))  # no comprehension: a call less per layer before Python 3.12
            t_done = (time.perf_counter_ns() - log.t0) / 1e3  # log.now_us() inline (one call less per layer)
            if t_copied is not None:  # this thread waited for the copies (a native device lane): a copy stall
                log.add(ctx.index, layer.index, "control", "wait", t_wait, t_copied, cause="copy")
                t_wait = t_copied
            log.add(ctx.index, layer.index, "control", "wait", t_wait, t_done, cause="lanes")
            self._last_mark[ctx.index] = t_done
            out = parts[0]
            for p in parts[1:]:
                out = out + p
            return out

        return backend

    def _submit_sides(self, ctx, layer, call: tuple, device: list[int], n_host: int, *,
                      device_event: tuple[str, str], host_event: tuple[str, str],
                      after: list | None = None) -> tuple[list, float | None]:
        """Submit one experts call ``(module, hidden, ids, weights)`` split in two: ``device`` experts
        on the device lane, every other one (``n_host`` distinct) on the host lane; each side only if
        it has a slot with a non-zero weight. Returns the futures and when this thread finished
        waiting for ``after`` (None: it did not wait; only a native device lane makes it wait);
        events are (kind, cause)."""
        module, hidden, ids, weights = call
        dmap, hmap, dev_pairs, host_pairs = _split(layer.num_experts, device, ids, weights)
        ebytes = self.run.expert_bytes[layer.index]
        dev_backend, host_backend = self.device_backend, self.host_backend
        futs, t_copied = [], None
        native_dev = dev_pairs and self.native_device is not None
        if dev_pairs and not native_dev:
            futs.append(self.lanes["device"].submit(
                lambda: dev_backend(module, hidden, ids, weights, expert_map=dmap), step=ctx.index, layer=layer.index,
                kind=device_event[0], tokens=dev_pairs, nbytes=ebytes * len(device), cause=device_event[1],
                after=after or []))
        if host_pairs and self.native_host is not None:
            futs.append(self.native_host.submit_experts(
                host_backend, module, hidden, ids, weights, hmap, step=ctx.index, layer=layer.index,
                kind=host_event[0], tokens=host_pairs, nbytes=ebytes * n_host, cause=host_event[1]))
        elif host_pairs:
            futs.append(self.lanes["host"].submit(
                lambda: host_backend(module, hidden, ids, weights, expert_map=hmap), step=ctx.index, layer=layer.index,
                kind=host_event[0], tokens=host_pairs, nbytes=ebytes * n_host, cause=host_event[1]))
        if native_dev:  # after the host side is queued: it runs while this thread waits for the copies
            # a fetched expert runs after its copy: the device side is queued once the copies are
            # done (the caller records this thread's wait as a wait of cause copy; the C++ worker
            # itself never waits, so its lane records only its compute, as the native host lane does)
            if after:
                for f in after:
                    f.result()
                t_copied = (time.perf_counter_ns() - self.log.t0) / 1e3
            futs.insert(0, self.native_device.submit_experts(
                dev_backend, module, hidden, ids, weights, dmap, step=ctx.index, layer=layer.index,
                kind=device_event[0], tokens=dev_pairs, nbytes=ebytes * len(device), cause=device_event[1]))
        return futs, t_copied

    def _deferred(self, ctx, layer, lp):
        def backend(module, hidden, ids, weights, expert_map=None):
            # deferral is a host technique: the deferred slots of experts the device computes run on
            # the device now (their sum is still added at the next MoE layer), the host's overlap
            # the next layer (as the simulator models it)
            deferred = _experts(lp.deferred)
            on_dev = sorted(set(deferred).intersection(_experts(lp.device)))
            parts, _ = self._submit_sides(ctx, layer, (module, hidden, ids, weights), on_dev,
                                          len(deferred) - len(on_dev),
                                          device_event=("expert-device", "deferred"),
                                          host_event=("expert-deferred", "deferred"))
            if not parts:
                return torch.zeros_like(hidden)
            return parts[0] if len(parts) == 1 else _Sum(parts)

        return backend


def _experts(pairs: list[tuple[int, int]]) -> list[int]:
    """The distinct experts of a plan's (expert, tokens) pairs, sorted: built in C (``map`` of an
    ``itemgetter``), not by a comprehension, which is a function call before Python 3.12; these
    run per MoE layer on the control thread, where every call costs microseconds."""
    return sorted(set(map(_FIRST, pairs)))


_FIRST = operator.itemgetter(0)
_RESULT = operator.methodcaller("result")


#: Expert maps by (experts, device experts): a run's decode steps keep asking for the same few
#: splits, and building a pair costs several library calls on the control thread (bounded: cleared
#: when full). The maps are read, never written, by the backends.
_MAPS: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
_MAPS_MAX = 1024


def _split(num_experts: int, device: list[int], ids, weights):
    """``(device map, host map, device pairs, host pairs)`` of one experts call: ``device`` experts
    run on the device, every other one (and padding rows' experts) on the host; pairs count the
    (token, slot)s with a non-zero weight on each side (counted in numpy: CPU tensors; on lists for
    a decode-sized call, :data:`moelab.forward.plan.SMALL` slots)."""
    key = (num_experts, tuple(device))
    maps = _MAPS.get(key)
    if maps is None:
        if len(_MAPS) >= _MAPS_MAX:
            _MAPS.clear()
        maps = _MAPS[key] = split_maps(num_experts, device, "cpu")
    dmap, hmap = maps
    if ids.numel() <= SMALL:
        on_dev = [-1] * num_experts
        for e in device:
            on_dev[e] = e
        dev = host = 0
        for irow, wrow in zip(ids.tolist(), weights.tolist(), strict=True):
            for e, w in zip(irow, wrow, strict=True):
                if w != 0:
                    if on_dev[e] >= 0:
                        dev += 1
                    else:
                        host += 1
        return dmap, hmap, dev, host
    w = weights.detach()
    active = (w if w.dtype in (torch.float32, torch.float64) else w.float()).numpy() != 0
    dev_pairs = int(np.count_nonzero(active & (dmap.numpy()[ids.numpy()] >= 0)))
    return dmap, hmap, dev_pairs, int(np.count_nonzero(active)) - dev_pairs


class _Sum:
    """The sum of several lanes' futures, for the forward seam's ``result()``."""

    def __init__(self, parts: list[Future]) -> None:
        self.parts = parts

    def result(self) -> torch.Tensor:
        out = self.parts[0].result()
        for p in self.parts[1:]:
            out = out + p.result()
        return out
