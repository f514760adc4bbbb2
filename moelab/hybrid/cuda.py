"""The CUDA lanes of the real executor (``executor: real`` with ``device: cuda``, or ``auto`` on a GPU).

On apply, the model (loaded on the CPU) is split: its non-expert parts (embeddings,
attention, norms, routers, shared experts, the LM head) move to the GPU, every routed
expert's weights stay on the host as the *masters*, in pinned memory, and a resident
expert pool is allocated on the GPU (one slot per device-cache entry plus one layer's
worth of scratch slots for fetched misses the cache does not keep). Leaving the run puts
every parameter and buffer back exactly (the same tensors, so the same storage), also on
exceptions.

Lanes:

* ``device`` — a CUDA stream. A worker thread launches each layer's device experts on it
  with the device backend, reading the pool through an expert map (expert id → pool
  slot, :mod:`moelab.backends.base`); the stream waits on the CUDA events of the copies
  that filled those slots, so a fetched expert's compute starts after its copy.
* ``copy`` — a second CUDA stream fed by a host-side priority queue: demand copies first,
  inserts and prefetches behind them. One copy is in flight at a time, so a demand copy
  pre-empts every prefetch still queued. Each copy is ``copy_(non_blocking=True)`` from the
  pinned masters into a pool slot, after the last compute that read the slot.
* ``host`` — a worker thread running host experts (native kernels release the GIL) on the
  hidden states copied device→host into pinned buffers; results go back on a third small
  stream. Deferred experts of layer ``l`` run there while the control thread launches
  layer ``l + 1``'s attention on the GPU; the next MoE layer waits for them.

Device and copy events are timed with CUDA events and put on the run's clock (an event
recorded at the start, ``elapsed_time`` from it); host and control events use the host
clock, as on the CPU. The event schema is unchanged (:mod:`moelab.hybrid.events`).
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch

from moelab.backends import get_backend
from moelab.backends.base import Routing
from moelab.errors import MoelabError
from moelab.hybrid.events import control_span
from moelab.hybrid.executors import LaneExecutor
from moelab.hybrid.lanes import Lane, piece_bytes, split_maps, tensor_piece


class DeviceSplit:
    """Moves a model's non-expert parts to ``device`` and pins its routed experts; :meth:`restore` undoes it."""

    def __init__(self, model: torch.nn.Module, layers, device: torch.device) -> None:
        self.model, self.layers, self.device = model, layers, device
        self._params: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self._buffers: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def apply(self) -> None:
        experts = {id(layer.experts) for layer in self.layers}
        masters = {id(p) for layer in self.layers for p in layer.experts.parameters()}
        try:
            for m in self.model.modules():
                for p in m._parameters.values():
                    if p is None or id(p) in self._params:
                        continue
                    self._params[id(p)] = (p, p.data)
                    p.data = p.data.pin_memory() if id(p) in masters else p.data.to(self.device)
                if id(m) in experts:
                    continue
                for name, b in list(m._buffers.items()):
                    if b is not None:
                        self._buffers.append((m, name, b))
                        m._buffers[name] = b.to(self.device)
        except BaseException:
            self.restore()
            raise

    def restore(self) -> None:
        for p, data in self._params.values():
            p.data = data
        for m, name, b in reversed(self._buffers):
            m._buffers[name] = b
        self._params.clear()
        self._buffers.clear()


class Pool:
    """The resident expert pool on the GPU: one stack per expert parameter, ``slots`` deep.

    Slots are assigned on the control thread only (in plan order); ``owner`` lets the copy
    lane skip a queued copy whose slot was given to another expert meanwhile.
    """

    def __init__(self, layers, resident: int, device: torch.device) -> None:
        sig = [_signature(layer) for layer in layers]
        if len(set(sig)) != 1:
            raise MoelabError(
                "the CUDA expert pool needs every MoE layer's routed experts to have the same parameter shapes "
                "(this model mixes several); use device: cpu."
            )
        e0 = layers[0].experts
        self.size = resident + max(layer.num_experts for layer in layers)
        self.stacks = {n: torch.empty((self.size, *p.shape[1:]), dtype=p.dtype, device=device)
                       for n, p in e0._parameters.items()}
        self.free = list(range(self.size - 1, -1, -1))
        self.where: dict[tuple[int, int], int] = {}
        self.owner: dict[int, object] = {}
        self.ready: dict[int, Future] = {}
        self.last_read: dict[int, torch.cuda.Event] = {}

    def alloc(self) -> int:
        if not self.free:
            raise MoelabError(
                f"the CUDA expert pool ({self.size} slots) is full; this is a bug in the executor's slot "
                "bookkeeping (report it with the config), use device: cpu meanwhile."
            )
        return self.free.pop()

    def view(self, experts: torch.nn.Module) -> torch.nn.Module:
        """A shallow copy of ``experts`` whose weight stacks are the pool's (index = slot)."""
        v = copy.copy(experts)
        v.__dict__["_parameters"] = {}
        v.__dict__.update(self.stacks)
        if "num_experts" in v.__dict__:
            v.__dict__["num_experts"] = self.size
        return v


def _signature(layer) -> tuple:
    e = layer.experts
    params = dict(e._parameters)
    if any(p is None or p.dim() < 1 or p.shape[0] != layer.num_experts for p in params.values()) or \
            sum(1 for _ in e.parameters()) != len(params):
        raise MoelabError(
            f"{type(e).__name__} holds parameters other than (num_experts, ...) stacks; the CUDA executor copies "
            "experts stack by stack. Use device: cpu for this model."
        )
    return tuple((n, tuple(p.shape[1:]), p.dtype) for n, p in params.items())


class _EventDone:
    """A future-like wait for a CUDA event (what the host lane waits for before reading a copy)."""

    def __init__(self, ev: torch.cuda.Event) -> None:
        self.ev = ev

    def result(self) -> None:
        self.ev.synchronize()


class _Arrival:
    """A host lane result as the control thread receives it: on the GPU, ordered after its copy."""

    def __init__(self, fut: Future) -> None:
        self.fut, self.value = fut, None

    def result(self) -> torch.Tensor:
        if self.value is None:
            y, done = self.fut.result()
            cur = torch.cuda.current_stream()
            cur.wait_event(done)
            y.record_stream(cur)
            self.value = y
        return self.value


class _Later:
    """A layer computed before its plan (:meth:`CudaExecutor.plan_later`): the columns of its device
    event, filled in when the plan is made."""

    __slots__ = ("kw",)

    def __init__(self) -> None:
        self.kw: dict[str, Any] = {"tokens": 0, "nbytes": 0, "cause": "hit"}


def _timed(stream: torch.cuda.Stream) -> torch.cuda.Event:
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev


class CudaExecutor(LaneExecutor):
    """The real executor with CUDA lanes (see the module docstring); ``executor: real`` picks it
    on a GPU (:meth:`moelab.hybrid.real.RealExecutor.create`), ``executor: cuda`` asks for it."""

    name = "cuda"

    def __init__(self, run: Any) -> None:
        if not torch.cuda.is_available():
            raise MoelabError("executor 'cuda' needs a CUDA GPU, and none is available here; use executor: real "
                              "(its device lane is a CPU worker without a GPU) or functional.")
        super().__init__(run)
        cfg = run.config
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.device_backend = get_backend(cfg.device_backend or "reference")
        self.host_backend = get_backend(cfg.host_backend or "reference")
        self.split = DeviceSplit(run.model, run.layers, self.device)
        self.lanes: dict[str, Lane] = {}
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._total = sum(layer.num_experts for layer in run.layers)
        self._smaps: dict[int, torch.Tensor] | None = None  # expert -> slot per layer, once every expert is resident
        self._resident_off = False  # a synchronous plan moved experts after all: plans are made before compute
        # plan_later's pinned routing copies and their events, one set per layer, reused forward after forward
        # (plan_pending reads a forward's copies before the next forward queues new ones)
        self._pins: dict[tuple[int, str], torch.Tensor] = {}
        self._ready: dict[int, torch.cuda.Event] = {}
        self.split.apply()
        try:
            resident = 0 if run.cache is None else int(sum(run.cache.slots_))
            self.pool = Pool(run.layers, resident, self.device)
            self.views = {layer.index: self.pool.view(layer.experts) for layer in run.layers}
            self._preload()
            self.streams = {n: torch.cuda.Stream(self.device) for n in ("device", "copy", "back")}
            torch.cuda.synchronize(self.device)
            self._t0_host = self.log.now_us()
            self._t0 = _timed(torch.cuda.current_stream(self.device))
            self._t0.synchronize()
            self.lanes = {"device": Lane("device", self.log, timed=False), "host": Lane("host", self.log),
                          "copy": Lane("copy", self.log, timed=False)}
        except BaseException:
            self.close()
            raise

    def _preload(self) -> None:
        """Copy what a warm cache holds (``cache.warm``) into the pool before the first forward: those
        experts are resident from the start, as a static placement loaded with the model, so no step pays
        their copies (load time, not on the run's clock)."""
        cache, pool = self.run.cache, self.pool
        if cache is None:
            return
        for layer in self.run.layers:
            L, masters = layer.index, layer.experts._parameters
            keys = cache.partition_keys(L)
            for e in range(layer.num_experts):
                if cache.key(L, e) in keys:
                    s = pool.alloc()
                    pool.where[(L, e)] = s
                    for n, dst in pool.stacks.items():
                        dst[s].copy_(masters[n].data[e], non_blocking=True)

    def close(self) -> None:
        try:
            for lane in self.lanes.values():
                lane.close()
            torch.cuda.synchronize(self.device)
            self._flush(block=True)
        finally:
            self.split.restore()

    # ------------------------------------------------------------------ events
    def _gpu_event(self, step, layer, lane, kind, a, b, **kw) -> None:
        with self._lock:
            self._pending.append((step, layer, lane, kind, a, b, kw))

    def _flush(self, block: bool) -> None:
        """Put finished GPU events on the run's clock (all of them with ``block``)."""
        with self._lock:
            items, self._pending = self._pending, []
        keep = []
        for step, layer, lane, kind, a, b, kw in items:
            if not block and not b.query():
                keep.append((step, layer, lane, kind, a, b, kw))
                continue
            b.synchronize()
            t = self._t0_host
            self.log.add(step, layer, lane, kind, t + 1e3 * self._t0.elapsed_time(a), t + 1e3 * self._t0.elapsed_time(b),
                         **kw)
        with self._lock:
            self._pending = keep + self._pending

    # ------------------------------------------------------------------ handlers
    def on_forward_end(self, ctx, ok: bool) -> None:
        if not self.run._later:
            super().on_forward_end(ctx, ok)
            self._flush(block=False)
            return
        try:  # layers computed before their plans (plan_later): the head's span, then the plans'
            if ok:
                control_span(self.log, self._last_mark, ctx.index, -1, "dense", "head")
            self.run.plan_pending(drop=not ok)
            if ok:
                control_span(self.log, self._last_mark, ctx.index, -1, "plan", "after-forward")
        finally:
            self._last_mark.pop(ctx.index, None)
            self._flush(block=False)

    def on_experts(self, ctx, layer, call) -> None:
        later = ctx.scratch.get(("hybrid-plan", layer.index))
        if type(later) is not _Later:
            super().on_experts(ctx, layer, call)
            return
        control_span(self.log, self._last_mark, ctx.index, layer.index, "plan", "planner")
        call.backend = self._resident(ctx.index, layer.index, later.kw)

    # ------------------------------------------------------------------ every expert resident
    def plan_later(self, ctx, layer, call) -> tuple | None:
        """The run's hook for computing a layer before its plan (:meth:`HybridRun.plan_pending`).

        Once every expert of every layer is resident in the pool and no copy is still landing, no
        plan can do anything but compute the layer's experts on the GPU from their slots: every
        access is a hit, so nothing is evicted, copied or sent to the host (and the run takes this
        path only with a placement that keeps hits on the device, no prefetch, no routing policy).
        The layer then runs at once on the current stream through its fixed expert → slot map, with
        no wait for the routing on the host (the one thing that made each layer a GPU
        synchronisation); its routing is copied asynchronously into pinned memory, and its plan is
        made at the forward's end from that copy, by the same planner calls in the same order. The
        plan is checked to be what the compute assumed (all hits on the device), and fills in the
        device event's tokens and bytes. None (plan now) while some expert is not resident."""
        if self._smaps is None and (self._resident_off or not self._every_expert_resident()):
            return None
        ids, w = call.experts, call.weights
        if ids.dim() != 2:
            ids = ids.reshape(-1, ids.shape[-1])
            w = w.reshape(ids.shape)
        if ids.dtype != torch.long:
            ids = ids.long()
        L, ebytes = layer.index, self.run.expert_bytes[layer.index]
        ih = self._pinned(L, "ids", ids)
        ih.copy_(ids, non_blocking=True)
        wh = None  # one token's plan reads no weights (plan_pending)
        if ids.shape[0] > 1:
            wh = self._pinned(L, "weights", w)
            wh.copy_(w, non_blocking=True)
        ready = self._ready.get(L)
        if ready is None:
            ready = self._ready[L] = torch.cuda.Event()
        ready.record()
        later = _Later()
        ctx.scratch[("hybrid-plan", layer.index)] = later

        def received(lp) -> None:
            if lp.host or lp.deferred or lp.transfers or lp.evictions or lp.misses:
                raise MoelabError(
                    f"MoE layer {L} of forward {lp.forward} ran every expert from the GPU pool before its plan "
                    f"(every expert was resident), but the plan made afterwards differs: host {lp.host}, deferred "
                    f"{lp.deferred}, misses {lp.misses}, {len(lp.transfers)} transfers, {len(lp.evictions)} "
                    "evictions. This is a bug in the executor's residency check; report it with the config, and "
                    "use device: cpu meanwhile.")
            later.kw["tokens"] = sum(n for _, n in lp.device)
            later.kw["nbytes"] = ebytes * len(lp.device)

        return ih, wh, ready, received

    def _pinned(self, L: int, kind: str, like: torch.Tensor) -> torch.Tensor:
        """Layer ``L``'s pinned host buffer for its routing ``kind`` in the shape and dtype of
        ``like``: one per layer and kind, grown when a forward needs more (a longer prompt), reused
        otherwise. Allocating pinned memory each layer cost the control thread microseconds per MoE
        layer; reuse is safe because :meth:`HybridRun.plan_pending` reads a forward's copies (after
        their event) before the next forward queues its own, and no plan keeps the arrays."""
        buf, n = self._pins.get((L, kind)), like.numel()
        if buf is None or buf.dtype != like.dtype or buf.numel() < n:
            buf = torch.empty(max(n, 64), dtype=like.dtype, pin_memory=True)
            self._pins[(L, kind)] = buf
        return buf[:n].view(like.shape)

    def _every_expert_resident(self) -> bool:
        """Whether the pool holds every expert of every layer, with its copy landed (and the placement
        keeps hits on the device); if so, the fixed expert → slot maps :meth:`plan_later` computes with."""
        pool = self.pool
        if self.run.placement.steal or len(pool.where) != self._total:
            return False
        for f in pool.ready.values():
            if not f.done() or f.exception() is not None or (f.result() is not None and not f.result().query()):
                return False
        pool.ready.clear()
        maps = {}
        for layer in self.run.layers:
            m = torch.tensor([pool.where[(layer.index, e)] for e in range(layer.num_experts)], dtype=torch.long)
            maps[layer.index] = m.to(self.device)
        self._smaps = maps
        return True

    def _leave_resident(self) -> None:
        """A plan made synchronously moves experts after all (a cache policy that evicts on hits, a
        cache changed from outside): no layer computes before its plan any more, and a copy into any
        slot first waits for every read the resident path has queued on the current stream (those
        reads left no per-slot record)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for s in self.pool.where.values():
            self.pool.last_read[s] = ev
        self._smaps = None
        self._resident_off = True

    def _resident(self, step: int, L: int, kw: dict[str, Any]):
        """The experts backend of a layer computed before its plan: the device backend on the pool's
        slots through the layer's fixed map, on the current stream, timed with CUDA events. Every slot
        is computed, as the plain model computes them (no routing policy runs on this path, so no
        slot is masked; a router's ids are in range, and a zero weight multiplies a finite output)."""
        view, smap, backend, log, marks = self.views[L], self._smaps[L], self.device_backend, self.log, self._last_mark

        def run(module, hidden, ids, weights, expert_map=None):
            cur = torch.cuda.current_stream()
            a = _timed(cur)
            out = backend.compute(view, hidden, Routing(smap[ids], weights, None, True))
            b = _timed(cur)
            with self._lock:
                self._pending.append((step, L, "device", "expert-device", a, b, kw))
            control_span(log, marks, step, L, "dispatch", "launch")
            return out

        return run

    # ------------------------------------------------------------------ slots and copies
    def _copy(self, step: int, layer: int, expert: int, slot: int, priority: str) -> Future:
        """Queue the copy of ``expert`` into ``slot`` on the copy lane: whole for a demand copy, in
        ``prefetch.chunks`` pieces otherwise (ProMoE's chunked copies: a demand copy queued meanwhile
        goes before the next piece); the slot is ready when its last piece has landed."""
        pool, stream = self.pool, self.streams["copy"]
        token = object()
        pool.owner[slot] = token
        after = pool.last_read.get(slot)
        masters = self.run.layers[layer].experts._parameters
        total = self.run.expert_bytes[layer]
        pieces = 1 if priority == "demand" else self.run.config.prefetch.chunks

        def fn(piece: int):
            if pool.owner.get(slot) is not token:  # the slot went to another expert: a cancelled prefetch
                return None
            with torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)  # the last compute that read this slot
                a = _timed(stream)
                for n, dst in pool.stacks.items():
                    tensor_piece(dst[slot], piece, pieces).copy_(tensor_piece(masters[n].data[expert], piece, pieces),
                                                                 non_blocking=True)
                b = _timed(stream)
            self._gpu_event(step, layer, "copy", f"transfer-{priority}", a, b, expert=expert,
                            nbytes=piece_bytes(total, piece, pieces), cause=priority)
            return b

        for piece in range(pieces):
            fut = self.lanes["copy"].submit(
                lambda piece=piece: fn(piece), priority={"demand": 0, "prefetch": 1}.get(priority, 2), step=step,
                layer=layer, kind=f"transfer-{priority}", expert=expert, nbytes=piece_bytes(total, piece, pieces),
                cause=priority, post=lambda ev: ev is not None and ev.synchronize())  # one copy in flight
        pool.ready[slot] = fut
        return fut

    def _prepare(self, ctx, lp) -> tuple[dict[int, int], list[Future], list[int]]:
        """Apply the plan's evictions and transfers to the pool; the device experts' slots, the copies
        their compute waits for, and the slots to free once it is launched."""
        pool, cache, L = self.pool, self.run.cache, lp.layer
        if self._smaps is not None and (lp.evictions or lp.transfers):
            self._leave_resident()
        needed = [e for e, _ in lp.device]
        slot_of = {e: pool.where[(L, e)] for e in needed if (L, e) in pool.where}
        held, release = set(slot_of.values()), []
        for key in lp.evictions:
            s = pool.where.pop((int(key[0]), int(key[1])), None)
            if s is not None:
                (release if s in held else pool.free).append(s)
        keys: dict[int, set[int]] = {}

        def cached(layer: int, expert: int) -> bool:
            if cache is None:
                return False
            if layer not in keys:
                keys[layer] = cache.partition_keys(layer)
            return cache.key(layer, expert) in keys[layer]

        def place(layer: int, expert: int, priority: str) -> int:
            s = pool.alloc()
            if cached(layer, expert):
                pool.where[(layer, expert)] = s
            else:  # a fetched miss the cache does not keep: a scratch slot for this call
                release.append(s)
            self._copy(ctx.index, layer, expert, s, priority)
            return s

        for t in lp.transfers:
            if (t.layer, t.expert) in pool.where or (t.layer == L and t.expert in slot_of):
                continue
            s = place(t.layer, t.expert, t.priority)
            if t.layer == L and t.expert in needed:
                slot_of[t.expert] = s
        for e in needed:  # cached but never copied (a warm cache): a cold demand copy
            if e not in slot_of:
                slot_of[e] = place(L, e, "demand")
        waits = []
        for s in set(slot_of.values()):
            f = pool.ready.get(s)
            if f is None:
                continue
            if f.done() and f.exception() is None and (f.result() is None or f.result().query()):
                del pool.ready[s]  # copied long ago
                continue
            waits.append(f)
        return slot_of, waits, release

    # ------------------------------------------------------------------ work
    def _host(self, ctx, layer, module, hidden, ids, weights, emap, *, kind: str, cause: str, tokens: int,
              nbytes: int) -> _Arrival:
        """Size: what one layer's host task closes over (the module, its inputs, the expert map) and the columns
        of the event it records; called per layer on the decode path, where a parameter object per call would
        cost time.
        """
        hb = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
        hb.copy_(hidden, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        backend, back, device = self.host_backend, self.streams["back"], self.device

        def fn():
            y = backend(module, hb, ids, weights, expert_map=emap)
            y = y if y.is_pinned() else y.pin_memory()
            with torch.cuda.stream(back):
                yd = y.to(device, non_blocking=True)
                done = torch.cuda.Event()
                done.record(back)
            return yd, done

        fut = self.lanes["host"].submit(fn, step=ctx.index, layer=layer.index, kind=kind, tokens=tokens,
                                        nbytes=nbytes, cause=cause, after=[_EventDone(ready)])
        return _Arrival(fut)

    def _immediate(self, ctx, layer, lp):
        E, L = layer.num_experts, layer.index
        ebytes = self.run.expert_bytes[L]

        def backend(module, hidden, ids, weights, expert_map=None):
            log = self.log
            t_wait = control_span(log, self._last_mark, ctx.index, L, "dispatch", "submit")
            slot_of, waits, release = self._prepare(ctx, lp)
            ids_c, w_c = ids.cpu(), weights.cpu()
            dmap, hmap = split_maps(E, sorted(slot_of), "cpu")
            active = w_c != 0
            dev_pairs = int((active & (dmap[ids_c] >= 0)).sum())
            host_pairs = int(active.sum()) - dev_pairs
            host = None
            if host_pairs:  # bytes: the distinct host experts the plan reads, as the CPU lanes count them
                host = self._host(ctx, layer, module, hidden, ids_c, w_c, hmap, kind="expert-host", cause="miss",
                                  tokens=host_pairs, nbytes=ebytes * len({e for e, _ in lp.host}))
            parts = []
            if dev_pairs:
                smap = torch.full((E,), -1, dtype=torch.long)
                for e, s in slot_of.items():
                    smap[e] = s
                fut = self.lanes["device"].submit(
                    self._device_work(ctx.index, L, hidden, ids, weights, smap.to(self.device), waits,
                                      sorted(set(slot_of.values())), dev_pairs, ebytes * len(slot_of)),
                    step=ctx.index, layer=L, kind="expert-device")
                out, done = fut.result()
                cur = torch.cuda.current_stream()
                cur.wait_event(done)
                out.record_stream(cur)
                parts.append(out)
            self.pool.free.extend(release)  # the device work that reads them is launched
            if host is not None:
                parts.append(host.result())
            t_done = (time.perf_counter_ns() - log.t0) / 1e3  # log.now_us() inline (one call less per layer)
            log.add(ctx.index, L, "control", "wait", t_wait, t_done, cause="lanes")
            self._last_mark[ctx.index] = t_done
            if not parts:
                return torch.zeros_like(hidden)
            out = parts[0]
            for p in parts[1:]:
                out = out + p
            return out

        return backend

    def _device_work(self, step, L, hidden, ids, weights, smap, waits, slots, tokens, nbytes):
        """Size: the inputs of one layer's device-stream work and the columns of its event; called per layer on
        the decode path.
        """
        inputs = torch.cuda.Event()
        inputs.record()  # on the control stream: hidden states, ids and weights are ready
        stream, view, backend, pool = self.streams["device"], self.views[L], self.device_backend, self.pool

        def fn():
            with torch.cuda.stream(stream):
                stream.wait_event(inputs)
                tw = _timed(stream) if waits else None
                for f in waits:
                    ev = f.result()
                    if ev is not None:
                        stream.wait_event(ev)  # a fetched expert's compute waits for its copy
                a = _timed(stream)
                out = backend(view, hidden, ids, weights, expert_map=smap)
                b = _timed(stream)
            for s in slots:
                pool.last_read[s] = b
            if tw is not None:
                self._gpu_event(step, L, "device", "wait", tw, a, cause="copy")
            self._gpu_event(step, L, "device", "expert-device", a, b, tokens=tokens, nbytes=nbytes, cause="hit+fetch")
            return out, b

        return fn

    def _deferred(self, ctx, layer, lp):
        ebytes = self.run.expert_bytes[layer.index]

        def backend(module, hidden, ids, weights, expert_map=None):
            w_c = weights.cpu()
            return self._host(ctx, layer, module, hidden, ids.cpu(), w_c, None, kind="expert-deferred",
                              cause="deferred", tokens=int((w_c != 0).sum()),
                              nbytes=ebytes * len({e for e, _ in lp.deferred}))

        return backend
