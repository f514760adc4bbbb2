"""Stream-loading prefill of one MoE layer, for real: loader, compute and unloader threads over a
ring of preallocated expert slots (OSDI '26 §3.1; the schedule :mod:`moelab.simulate.prefill` predicts).

>>> out, log = slp_layer(layer, hidden, ring_slots=2)     # layer: moelab.adapters.moe_layers(model)[i]
>>> torch.equal(out, layer.experts(hidden, *routing))     # the plain layer's experts, bit for bit

This is the CPU stand-in of the executor: the "device" is this process's memory, a copy is a
``Tensor.copy_`` into a ring slot, and the three stages are threads that synchronise exactly as
the paper's CUDA streams do, through one ON and one OFF event per module (``threading.Event``,
standing in for the CUDA-event + host-event pair):

* **loader** — for expert ``j`` (ascending), waits until slot ``j mod R`` is free (the unloader
  released expert ``j − R``), copies the expert's weights into it and sets ``ON[j]``. Loading
  does not look at the routing: every expert streams, hit or not.
* **compute** — waits on ``ON[j]``, runs expert ``j`` on its tokens from the slot's weights
  (:func:`moelab.backends.reference.expert_forward`, the eager maths, tokens slot-major,
  ``index_add_`` in the hidden states' dtype, as the reference backend does) and sets ``OFF[j]``.
* **unloader** — waits on ``OFF[j]`` and frees the slot (no write-back).

Events (:class:`~moelab.hybrid.events.EventLog`, the one schema) use the lanes and kinds of the
simulated schedule (:mod:`moelab.simulate.prefill_events`): ``copy`` / ``device`` / ``unloader``
and one ``slot{i}`` lane per ring slot, so a timeline draws real and simulated side by side.
Only the routed experts stream here; the dense module (attention, router, shared experts) is the
caller's.

**On CUDA** (:func:`slp_layer_cuda`: hidden states on the GPU, the experts' stacks in host memory)
the same ring runs on two CUDA streams with one CUDA event pair per module, and no host thread
waits: the copy stream waits on ``OFF[j − R]`` before it copies expert ``j`` from pinned host
memory into slot ``j mod R`` and records ``ON[j]``; the compute stream waits on ``ON[j]``, runs the
expert and records ``OFF[j]`` (the unloader's release *is* that wait: freeing a slot needs no
write-back). Timing events on both streams become the same events as above.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from moelab.backends.reference import expert_forward
from moelab.errors import MoelabError
from moelab.hybrid.events import EventLog

#: the weight stacks of a transformers experts module that hold one slice per expert (those it has)
STACKS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")


class StackView:
    """An experts module whose weight stacks are replaced by ``stacks`` (a ring of slots, resident
    experts on a GPU), so :func:`~moelab.backends.reference.expert_forward` runs from them; every other
    attribute is the module's."""

    def __init__(self, module: torch.nn.Module, stacks: dict[str, torch.Tensor]) -> None:
        self.__dict__["_module"], self.__dict__["_stacks"] = module, stacks

    def __getattr__(self, name: str) -> Any:
        stacks = self.__dict__.get("_stacks", {})
        return stacks[name] if name in stacks else getattr(self.__dict__["_module"], name)


class _Ring(StackView):
    """``R`` preallocated slots, each holding one expert's stacks; a view of the experts module
    whose expert ``s`` is slot ``s``, so :func:`expert_forward` runs from the slot."""

    def __init__(self, module: torch.nn.Module, slots: int) -> None:
        bufs = {name: torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device) for name in STACKS
                if isinstance(t := getattr(module, name, None), torch.Tensor)}
        if "down_proj" not in bufs:
            raise MoelabError(f"{type(module).__name__} has no stacked down_proj: stream-loading needs the fused "
                              "experts layout of transformers (gate_up_proj/up_proj and down_proj stacks).")
        super().__init__(module, bufs)
        self.bytes_per_expert = sum(b[0].numel() * b.element_size() for b in bufs.values())

    def load(self, slot: int, expert: int) -> None:
        for name, buf in self._stacks.items():
            buf[slot].copy_(getattr(self._module, name)[expert].detach())


def slp_layer(layer: Any, hidden: torch.Tensor, *, ring_slots: int = 2, log: EventLog | None = None,
              step: int = 0) -> tuple[torch.Tensor, EventLog]:
    """The routed experts' output of ``layer`` (a :class:`~moelab.adapters.MoELayer`) on ``hidden``
    (``T × H``, routed by the layer's own router), computed by stream-loading every expert through a
    ring of ``ring_slots`` slots (module docstring); returns (output, event log)."""
    E = int(layer.num_experts)
    R = int(ring_slots)
    if isinstance(ring_slots, bool) or R < 1:
        raise MoelabError(f"ring_slots {ring_slots!r}: expected an integer ≥ 1 (at most {E} are used).")
    R = min(R, E)
    h = hidden.reshape(-1, hidden.shape[-1])
    routing = layer.route(h)
    log = log or EventLog("slp")
    ring = _Ring(layer.experts, R)
    on, off = [threading.Event() for _ in range(E)], [threading.Event() for _ in range(E)]
    free = [threading.Event() for _ in range(R)]
    for f in free:
        f.set()
    out = torch.zeros_like(h)
    index, weights = routing.experts, routing.weights
    loaded_at: dict[int, tuple[float, float]] = {}
    errors: list[BaseException] = []

    def loader() -> None:
        for j in range(E):
            s = j % R
            free[s].wait()
            free[s].clear()
            t0 = log.now_us()
            ring.load(s, j)
            t1 = log.now_us()
            loaded_at[j] = (t0, t1)
            log.add(step, layer.index, "copy", "transfer-prefetch", t0, t1, expert=j, nbytes=ring.bytes_per_expert,
                    cause="stream")
            log.add(step, layer.index, f"slot{s}", "slot", t0, t1, expert=j, cause="loading")
            on[j].set()

    def compute() -> None:
        for j in range(E):
            on[j].wait()
            s = j % R
            t0 = log.now_us()
            log.add(step, layer.index, f"slot{s}", "slot", loaded_at[j][1], t0, expert=j, cause="ready")
            slot_idx, tok = torch.where((index == j).T)  # slot-major, as the eager forward orders them
            if tok.numel():
                y = expert_forward(ring, s, h[tok]) * weights[tok, slot_idx, None]
                out.index_add_(0, tok, y.to(out.dtype))
            t1 = log.now_us()
            log.add(step, layer.index, "device", "expert-device", t0, t1, expert=j, tokens=int(tok.numel()),
                    nbytes=ring.bytes_per_expert, cause="stream")
            log.add(step, layer.index, f"slot{s}", "slot", t0, t1, expert=j, tokens=int(tok.numel()),
                    cause="computing")
            off[j].set()

    def unloader() -> None:
        for j in range(E):
            off[j].wait()
            t = log.now_us()
            free[j % R].set()
            log.add(step, layer.index, "unloader", "release", t, t, expert=j, cause="ring")

    def guarded(fn):
        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                for ev in (*on, *off, *free):
                    ev.set()  # wake the other stages so that they end
        return run

    threads = [threading.Thread(target=guarded(f), name=f"slp-{f.__name__}", daemon=True)
               for f in (loader, compute, unloader)]
    with torch.no_grad():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return out.reshape(hidden.shape), log


_PINNED: Any = None


def _pinned_stacks(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Pinned host copies of ``module``'s expert stacks (made once per module and weight version)."""
    import weakref

    global _PINNED
    if _PINNED is None:
        _PINNED = weakref.WeakKeyDictionary()
    key = tuple((n, t.data_ptr(), t._version) for n in STACKS
                if isinstance(t := getattr(module, n, None), torch.Tensor))
    hit = _PINNED.get(module)
    if hit is None or hit[0] != key:
        stacks = {n: getattr(module, n).detach().cpu().pin_memory() for n, *_ in key}
        _PINNED[module] = hit = (key, stacks)
    return hit[1]


def slp_layer_cuda(layer: Any, hidden: torch.Tensor, *, ring_slots: int = 2, log: EventLog | None = None,
                   step: int = 0) -> tuple[torch.Tensor, EventLog]:
    """:func:`slp_layer` on a GPU (module docstring, "On CUDA"): ``hidden`` and the layer's router on
    CUDA, its experts' stacks in host memory; every expert streams host → GPU through a ring of
    ``ring_slots`` slots on a copy stream while the compute stream runs the ones already loaded."""
    if not torch.cuda.is_available() or hidden.device.type != "cuda":
        raise MoelabError(f"slp_layer_cuda needs hidden states on a CUDA GPU (got {hidden.device}); use slp_layer for "
                          "the CPU stand-in.")
    E = int(layer.num_experts)
    if isinstance(ring_slots, bool) or int(ring_slots) < 1:
        raise MoelabError(f"ring_slots {ring_slots!r}: expected an integer ≥ 1 (at most {E} are used).")
    R = min(int(ring_slots), E)
    device = hidden.device
    h = hidden.reshape(-1, hidden.shape[-1])
    log = log or EventLog("slp")
    host = _pinned_stacks(layer.experts)
    ring = _Ring(layer.experts, R)
    ring._stacks = {n: torch.empty((R, *t.shape[1:]), dtype=t.dtype, device=device) for n, t in host.items()}
    ring.bytes_per_expert = sum(b[0].numel() * b.element_size() for b in ring._stacks.values())
    compute = torch.cuda.current_stream(device)
    copy = torch.cuda.Stream(device)
    on = [torch.cuda.Event() for _ in range(E)]
    off = [torch.cuda.Event() for _ in range(E)]
    timed = []  # (lane, kind, expert, start event, end event, tokens, cause)

    def stamp(stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream)
        return ev

    with torch.no_grad():
        routing = layer.route(h)
        weights = routing.weights
        # each expert's (slot, token) pairs on the host first, once: a data-dependent size read inside
        # the loop would make the host wait for the compute stream and stop the loader running ahead
        index = routing.experts.cpu()
        pairs = []
        for j in range(E):
            slot_idx, tok = torch.where((index == j).T)  # slot-major, as the eager forward orders them
            pairs.append((slot_idx.to(device), tok.to(device), int(tok.numel())))
        out = torch.zeros_like(h)
        base = stamp(compute)
        base.synchronize()
        t_base = log.now_us()
        for j in range(E):  # enqueue only: the streams and events order the work
            s = j % R
            with torch.cuda.stream(copy):
                if j >= R:
                    copy.wait_event(off[j - R])  # the slot is free once expert j - R computed
                a = stamp(copy)
                for n, buf in ring._stacks.items():
                    buf[s].copy_(host[n][j], non_blocking=True)
                b = stamp(copy)
                on[j].record(copy)
            timed.append(("copy", "transfer-prefetch", j, a, b, 0, "stream"))
            compute.wait_event(on[j])
            a = stamp(compute)
            slot_idx, tok, n = pairs[j]
            if n:
                y = expert_forward(ring, s, h[tok]) * weights[tok, slot_idx, None]
                out.index_add_(0, tok, y.to(out.dtype))
            b = stamp(compute)
            off[j].record(compute)
            timed.append(("device", "expert-device", j, a, b, n, "stream"))
        torch.cuda.synchronize(device)
    for lane, kind, j, a, b, tokens, cause in timed:
        t0, t1 = t_base + base.elapsed_time(a) * 1e3, t_base + base.elapsed_time(b) * 1e3
        log.add(step, layer.index, lane, kind, t0, t1, expert=j, tokens=tokens, nbytes=ring.bytes_per_expert,
                cause=cause)
        log.add(step, layer.index, f"slot{j % R}", "slot", t0, t1, expert=j, tokens=tokens,
                cause="loading" if lane == "copy" else "computing")
        if lane == "device":
            log.add(step, layer.index, "unloader", "release", t1, t1, expert=j, cause="ring")
    return out.reshape(hidden.shape), log


__all__ = ["STACKS", "StackView", "slp_layer", "slp_layer_cuda"]
