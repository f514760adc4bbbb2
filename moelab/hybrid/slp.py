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
caller's. On CUDA the same structure runs with CUDA streams and events — not built here.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from moelab.backends.reference import expert_forward
from moelab.errors import MoelabError
from moelab.hybrid.events import EventLog


class _Ring:
    """``R`` preallocated slots, each holding one expert's stacks; a view of the experts module
    whose expert ``s`` is slot ``s``, so :func:`expert_forward` runs from the slot."""

    STACKS = ("gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias")

    def __init__(self, module: torch.nn.Module, slots: int) -> None:
        self._module = module
        self._bufs: dict[str, torch.Tensor] = {}
        for name in self.STACKS:
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor):
                self._bufs[name] = torch.zeros((slots, *t.shape[1:]), dtype=t.dtype, device=t.device)
        if "down_proj" not in self._bufs:
            raise MoelabError(f"{type(module).__name__} has no stacked down_proj: stream-loading needs the fused "
                              "experts layout of transformers (gate_up_proj/up_proj and down_proj stacks).")
        self.bytes_per_expert = sum(b[0].numel() * b.element_size() for b in self._bufs.values())

    def load(self, slot: int, expert: int) -> None:
        for name, buf in self._bufs.items():
            buf[slot].copy_(getattr(self._module, name)[expert].detach())

    def __getattr__(self, name: str) -> Any:  # the module's attributes, with the stacks replaced by the slots
        bufs = self.__dict__.get("_bufs", {})
        if name in bufs:
            return bufs[name]
        return getattr(self.__dict__["_module"], name)


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


__all__ = ["slp_layer"]
