"""Lanes: the worker threads the real executors run work on, and the maps that split a layer's
experts between the device side and the host side.

A :class:`Lane` is one worker thread with a priority queue in front; every task it runs becomes
an event of the run's :class:`~moelab.hybrid.events.EventLog` (a CUDA lane records its own events
from CUDA events instead: ``timed=False``). The CPU real executor (:mod:`moelab.hybrid.real`), the
CUDA one (:mod:`moelab.hybrid.cuda`) and the simulator's calibration
(:mod:`moelab.simulate.calibrate`, which measures a lane's round trip) use these lanes.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from concurrent.futures import Future

import numpy as np
import torch

from moelab.hybrid.events import EventLog

log = logging.getLogger(__name__)


def tensor_piece(t: torch.Tensor, piece: int, pieces: int) -> torch.Tensor:
    """Piece ``piece`` of ``pieces`` equal runs of ``t``'s elements, the last one taking the rest (a
    view where ``t`` is contiguous): what one chunk of a chunked expert copy moves (ProMoE's
    copies, ``prefetch.chunks``)."""
    if pieces == 1:
        return t
    flat = t.reshape(-1)
    n = flat.numel() // pieces
    return flat[piece * n:] if piece == pieces - 1 else flat[piece * n:(piece + 1) * n]


def piece_bytes(total: int, piece: int, pieces: int) -> int:
    """The bytes of piece ``piece`` of ``pieces`` of a ``total``-byte copy (the last one takes the rest),
    as :func:`moelab.simulate.executor.chunk_copies` splits a copy's bytes."""
    part = total // pieces
    return total - part * (pieces - 1) if piece == pieces - 1 else part


class Lane:
    """One worker thread with a priority queue; every task becomes an event (with ``timed``; a CUDA
    lane records its own events from CUDA events instead).

    With ``helping``, a thread that waits for a task's result (``future.result()``) runs the task
    itself when the lane would run it next and is idle: its worker is not running a task and the
    task is at the head of the queue. The lane still runs one task at a time in priority order, and
    the task is still the lane's event (its ``lane`` column, its own times). A task the worker has
    taken is waited for. On a CPU-only machine the control thread, which would block on the device
    lane's worker for a layer's experts, then runs them itself: no wake-up of the worker and of the
    control thread per layer, and a fresh lane thread's first torch calls (its own OpenMP team and
    per-thread state) stay out of the first steps after a run is applied. Measured on the 2-core
    development VM (issue #26, 2026-11-28, two alternating processes each): on a tiny model whose
    experts cost microseconds, the control thread's plan + dispatch per MoE layer went from
    318-492 to 344-405 µs, its wait for the lanes from 0.99-1.30 to 0.79-0.90 ms, and the
    nothing-enabled step from 1.53-1.62x to 1.41-1.49x the plain model's; on DeepSeek-V2-Lite-shaped
    layers the side-by-side's nothing-enabled row did not move beyond its noise (0.94-1.05x the
    eager plain model either way)."""

    def __init__(self, name: str, log: EventLog, *, timed: bool = True, helping: bool = False) -> None:
        self.name = name
        self.log = log
        self.timed = timed
        self.helping = helping
        self._heap: list = []  # (priority, seq, task) — a task is [future, fn, meta]
        self._cond = threading.Condition()
        self._busy = False  # a task is running (on the worker, or on a helping thread)
        self._closed = False
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._work, name=f"moelab-{name}", daemon=True)
        self._thread.start()

    def submit(self, fn, *, priority: int = 0, step: int, layer: int, kind: str, expert: int = -1, tokens: int = 0,
               nbytes: int = 0, cause: str = "", after: list[Future] | None = None, post=None) -> Future:
        """Queue ``fn``; with ``after``, the lane first waits for those futures (a ``wait`` event);
        ``post(result)`` runs on the lane after the future is resolved, before the next task.

        Size: the task, its ordering (priority, after, post) and one keyword per column of the event it
        becomes.
        """
        if self._closed:
            raise RuntimeError(f"moelab {self.name} lane: submit after close(); the lane's worker has stopped.")
        fut: Future = _LaneFuture(self) if self.helping else Future()
        item = (priority, next(self._seq), [fut, fn, (step, layer, kind, expert, tokens, nbytes, cause, after or [],
                                                      post)])
        if self.helping:
            fut._item = item
        with self._cond:
            heapq.heappush(self._heap, item)
            self._cond.notify_all()
        return fut

    def _work(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while self._busy or not self._heap:
                    cond.wait()
                task = heapq.heappop(self._heap)[2]
                if task[0] is None:  # close()
                    return
                self._busy = True
            self._finish(task)

    def _help(self, item: tuple) -> None:
        """Run ``item`` on this thread if the lane would run it next and is idle (else leave it to the worker).

        The waiting thread may be the main one, where a KeyboardInterrupt can land between any two
        steps: the lane is freed whatever happens, and a task it took is cancelled (not started) or
        failed (cut short) rather than left pending."""
        taken = False
        try:
            with self._cond:
                if self._busy or not self._heap or self._heap[0] is not item:
                    return
                self._busy = taken = True
                heapq.heappop(self._heap)
            self._run(*item[2])
        finally:
            if taken:
                fut = item[2][0]
                if not fut.done():  # interrupted: popped and never started, or cut short
                    if fut.running():
                        fut.set_exception(RuntimeError(f"moelab {self.name} lane: interrupted while the waiting "
                                                       "thread ran this task"))
                    else:
                        fut.cancel()
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _finish(self, task: list) -> None:
        """Run one task the worker took from the queue (the lane marked busy), then free the lane."""
        try:
            self._run(*task)
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _run(self, fut: Future, fn, meta: tuple) -> None:
        if isinstance(fut, _LaneFuture):
            fut._item = None  # the queue entry refers to the future: no cycle once it runs
        if not fut.set_running_or_notify_cancel():
            return
        step, layer, kind, expert, tokens, nbytes, cause, after, post = meta
        try:
            if after:
                tw = self.log.now_us()
                for f in after:
                    f.result()
                self.log.add(step, layer, self.name, "wait", tw, self.log.now_us(), cause="copy")
            t0 = self.log.now_us()
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            fut.set_exception(e)
            return
        t1 = self.log.now_us()
        if self.timed:
            self.log.add(step, layer, self.name, kind, t0, t1, expert=expert, tokens=tokens, nbytes=nbytes,
                         cause=cause)
        fut.set_result(result)
        if post is not None:
            try:
                post(result)
            except Exception as e:  # noqa: BLE001 - the result is already handed over; say what failed
                log.warning("moelab %s lane: after-task step of layer %d failed: %s: %s", self.name, layer,
                            type(e).__name__, e)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            heapq.heappush(self._heap, (float("inf"), next(self._seq), [None, None, None]))
            self._cond.notify_all()
        self._thread.join()


class _LaneFuture(Future):
    """A helping :class:`Lane`'s future: :meth:`result` (without a timeout: running the task cannot be
    cut short) first offers to run the task on the waiting thread."""

    def __init__(self, lane: Lane) -> None:
        super().__init__()
        self._lane = lane
        self._item: tuple | None = None

    def result(self, timeout=None):
        item = self._item
        if item is not None and timeout is None and not self.done():  # a bounded wait only waits
            self._item = None
            self._lane._help(item)
        return super().result(timeout)


class NativeLane:
    """A lane whose worker is a C++ thread of the kernels extension (its ``lane`` id): an experts
    call of a native backend (:meth:`moelab.kernels.backend.KernelBackend.submit`) is checked and
    queued on the calling thread and runs without the interpreter — no Python thread, queue or
    wake-up between the control thread and the kernel. Calls run in submission order (one
    priority: the real executor's host lane has only priority-0 experts work). Each call becomes
    an event when its result is first taken, with the worker's own start and end times."""

    def __init__(self, name: str, log: EventLog, lane: int) -> None:
        from moelab.kernels.op import _check_lane_spin_env

        _check_lane_spin_env()  # the worker polls its queue this long before it sleeps (lane_spin_us)
        self.name = name
        self.log = log
        self.lane = lane

    def submit_experts(self, backend, module, hidden, ids, weights, expert_map, *, step: int, layer: int, kind: str,
                       tokens: int = 0, nbytes: int = 0, cause: str = ""):
        """Queue ``backend``'s experts call; returns the call (``result()`` waits for it).

        Size: the experts call's arguments (module, hidden, ids, weights, expert map) and one keyword per
        column of the event it becomes, as :meth:`Lane.submit` takes them.
        """
        call = backend.submit(module, hidden, ids, weights, expert_map, lane=self.lane)
        log, name, t0 = self.log, self.name, self.log.t0

        def record(c) -> None:
            _, start, end = c.times_ns()
            log.add(step, layer, name, kind, (start - t0) / 1e3, (end - t0) / 1e3, tokens=tokens, nbytes=nbytes,
                    cause=cause)

        call.on_done = record
        return call

    def close(self) -> None:
        """Nothing to stop: the extension's worker thread sleeps on its queue until the process ends."""


def native_lane_ok(backend) -> bool:
    """Whether ``backend`` can run on a :class:`NativeLane` (a native kernels backend)."""
    return callable(getattr(backend, "submit", None))


def split_maps(num_experts: int, device_experts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert maps (``-1`` = not here) of the device side (``device_experts``) and the host side
    (every other expert), as the experts backends take them (built in numpy: a few µs, where
    five small torch ops cost tens)."""
    dmap = np.full(num_experts, -1, dtype=np.int64)
    hmap = np.arange(num_experts, dtype=np.int64)
    if device_experts:
        d = np.asarray(device_experts, dtype=np.int64)
        dmap[d] = d
        hmap[d] = -1
    dm, hm = torch.from_numpy(dmap), torch.from_numpy(hmap)
    if torch.device(device).type != "cpu":
        dm, hm = dm.to(device), hm.to(device)
    return dm, hm


__all__ = ["Lane", "NativeLane", "native_lane_ok", "split_maps"]
