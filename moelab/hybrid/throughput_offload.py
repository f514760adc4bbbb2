"""MoE-Gen's module-based batching with weights and KV cache in host memory, run for real on a GPU
(techniques.md §7.1, Figs. 2, 4, 6): :class:`OffloadedDecoder`.

:class:`~moelab.hybrid.throughput.ModuleBatchedDecoder` runs the schedule with everything in one
memory (the CPU worker as the device, no copies). This decoder keeps what MoE-Gen keeps in host
memory there, and copies what MoE-Gen copies, on separate streams:

* **KV cache in host memory** (pinned), one store per attention micro-batch and layer, laid out
  sequence-major so each copy is contiguous. Before micro-batch ``j``'s attention its KV goes
  host → device into one of two staging buffers (``S_KV-GPU(b_a)``, ``transfer-kv``
  ``KV HtoD[j]``; the copy of ``j`` waits until micro-batch ``j − 2`` released the buffer); the
  attention appends the new K/V there, and they go back device → host (``writeback-kv``
  ``KV DtoH[j]``) on a second copy stream.
* **Dense modules streamed** (``S_Dense``, double-buffered): one layer's attention, norms, router
  and shared experts (a dense layer's MLP) are copied into one of two buffers
  (``transfer-dense``); layer ``i + 1``'s copy is issued after layer ``i``'s expert copies, into
  the buffer layer ``i − 1`` released (the last layer prefetches layer 0 for the next step). The
  modules run from those buffers through :func:`torch.func.functional_call`. Each buffer keeps one
  set of tensors per layer kind (a dense layer's and a MoE layer's differ), which
  :attr:`~OffloadedDecoder.device_bytes` counts; the simulator charges two of the larger.
* **Routed experts streamed through ``S_Expert``**: a ring of ``expert_slots`` slots. The layer's
  first ``expert_slots`` streamed experts (ascending id) are copied as soon as the attention's
  copies are issued, before the router has run (MoE-Gen fills ``S_Expert`` whenever the link is
  idle; at its batch sizes every expert is active); after the router the rest of the layer's
  *active* experts follow in ascending id, expert ``q`` of the ring waiting until expert
  ``q − expert_slots`` computed (``transfer-prefetch`` ``Wcopy[e]``). Each expert then runs over
  all of its routed tokens in ``b_e``-row chunks, as on the CPU worker.
* **``S_Params``**: ``pinned_experts`` routed experts resident on the device (spread over the MoE
  layers as the simulator spreads them, the lowest ids of each layer; they run first, with no
  copy), every layer's dense modules with ``pin_dense`` (no ``S_Dense`` copies), and the
  embedding, final norm, LM head and rotary embedding (resident; stated).
  :meth:`OffloadedDecoder.from_config` builds the decoder of a searched configuration.

Left out, and stated: the CPU attention share (``ω``; this decoder runs ``ω = 0``); the ``B × H``
hidden states stay on the device between modules (Fig. 2 collects them in host memory to free
``S_IS`` at batch sizes where they would not fit; the simulator charges those copies); the prompt
is prefilled by the plain model where the weights are (host memory), one micro-batch at a time,
and its KV filled into the host store — the decode is what the bench measures.

``device="cuda"``: three CUDA streams (compute, host → device, device → host) ordered by CUDA
events, pinned host memory, spans timed by CUDA timing events. ``device="cpu"``: the stand-in, the
same code with every copy a ``Tensor.copy_`` between separate host buffers and spans timed by the
wall clock — what the test suite runs where no GPU is. With ``defer_copies=True`` the stand-in checks
every wait between streams without a GPU: it runs each copy only when an event after it is waited for
(as late as CUDA may run it), so a read that did not wait for its copy sees stale data; and it records
the memory each compute op touches, so a copy that touches it without having waited for that op (a
slot refilled while a kernel may read it, a write-back before the kernel that wrote its data, a new
buffer written before the kernels queued on its recycled memory) is refused. On CUDA the test
(``@pytest.mark.cuda``) checks the waits' effect on the events' times. A step that raises leaves no per-step state behind (the next
decode reloads every buffer it needs). Events are the simulated schedule's
(:mod:`moelab.simulate.moegen.events`): lanes ``device``, ``copy-htod``, ``copy-dtoh``.

>>> dec = OffloadedDecoder(model, micro_batch=8, expert_batch=64, device="cuda", expert_slots=2)
>>> out = dec.generate(input_ids, steps=8)          # model on the host, input_ids (B, P)
>>> out.tokens_per_s, dec.device_bytes, moelab.Timeline(dec.log)
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from typing import Any

import torch
from torch.func import functional_call
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from moelab.compat import cache_kwargs
from moelab.errors import MoelabError
from moelab.hybrid.events import EventLog
from moelab.hybrid.slp import STACKS, StackView
from moelab.hybrid.throughput import (
    LANES,
    Generation,
    ModuleBatchedDecoder,
    WallClock,
    _Active,
    _check_ids,
    _chunked,
    _greedy_steps,
    num_experts,
    run_expert_chunks,
    slot_major,
)

#: the decoder layer's submodules that run from the ``S_Dense`` buffer
SUBMODULES = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


class CudaClock:
    """Spans timed by CUDA timing events on the step's streams; they become events of ``log`` when
    the step ends (:meth:`flush`, which waits for the device)."""

    def __init__(self, log: EventLog, device: torch.device) -> None:
        self.log, self.device = log, device
        self.streams = {"compute": torch.cuda.current_stream(device), "htod": torch.cuda.Stream(device),
                        "dtoh": torch.cuda.Stream(device)}
        self._pending: list[tuple] = []
        self._base: Any = None
        self._t_base = 0.0

    def begin(self) -> None:
        self.streams["compute"] = torch.cuda.current_stream(self.device)  # the caller's stream of this step
        self._pending.clear()
        self._base = self.mark()
        self._base.synchronize()
        self._t_base = self.log.now_us()

    def mark(self, stream: str = "compute") -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.streams[stream])
        return ev

    def span(self, start: Any, end: Any, step: int, layer: int, stream: str, kind: str, **fields: Any) -> None:
        self._pending.append((start, end, step, layer, stream, kind, fields))

    def flush(self) -> None:
        torch.cuda.synchronize(self.device)
        base, t = self._base, self._t_base
        for a, b, step, layer, stream, kind, fields in self._pending:
            self.log.add(step, layer, LANES[stream], kind, t + base.elapsed_time(a) * 1e3,
                         t + base.elapsed_time(b) * 1e3, **fields)
        self._pending.clear()


class _HostStreams:
    """The CPU stand-in's streams: one thread, so a copy is done when issued and nothing waits."""

    cuda = False

    def __init__(self, log: EventLog) -> None:
        self.clock = WallClock(log)

    def on(self, stream: str):
        return contextlib.nullcontext()

    def signal(self, stream: str) -> Any:
        return None

    def wait(self, stream: str, ev: Any) -> None:
        return None

    def host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone()

    def run(self, stream: str, fn, tensors: tuple = ()) -> None:
        """Issue ``fn`` (a copy of ``tensors``) on ``stream``."""
        fn()

    def begin(self) -> None:
        return None

    def flush(self) -> None:
        return None

    def abandon(self) -> None:
        """Drop what a step that raised left queued."""
        return None


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes ``[start, end)`` a tensor's elements span in memory (None when it has none)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type != "cpu" or t.is_sparse:
        return None
    span = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + span * t.element_size()


_NO_DATA = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided}


class _ComputeAccesses(TorchDispatchMode):
    """Records the memory every compute op touches (its tensors' extents) with the op's position."""

    def __init__(self, owner: _DeferredStreams) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        o = self.owner
        # views and allocations read and write no element: only the ops that do count
        if not o._in_copy and not func.is_view and func.overloadpacket not in _NO_DATA:
            for t in tree_flatten((args, kwargs, out))[0]:
                if (ext := _extent(t)) is not None:
                    o._acc.append((o._pos, *ext))
            o._pos += 1
        return out


class _DeferredStreams(_HostStreams):
    """The stand-in with its copy streams late, and every copy checked against the compute stream.

    * A copy runs only when an event recorded after it is waited for (by the compute stream, or by
      the other copy stream's next copy), or when the step ends — as late as CUDA may run it; the
      compute stream runs at once. A read of a buffer that did not wait for its copy sees the
      buffer's old contents, and a copy that did not wait for the other copy stream (a staging buffer
      refilled before its write-back) copies the wrong data: the parity tests fail.
    * Every compute op's memory is recorded (a dispatch mode over the step) with its position in the
      compute stream; a copy that touches memory a compute op touched must have waited — directly or
      through the other copy stream — for an event recorded after that op, or it raises: a buffer
      refilled while a kernel may still read it, a write-back before the kernel that wrote its data,
      a new buffer's memory (which the allocator may hand back from a tensor queued kernels still
      use, :meth:`OffloadedDecoder.allocated`) written without waiting.

    (``defer_copies=True``; copy events are stamped when issued, so this mode's times mean nothing.)"""

    def __init__(self, log: EventLog) -> None:
        super().__init__(log)
        self._queue: dict[str, list] = {"htod": [], "dtoh": []}
        self._done = {"htod": 0, "dtoh": 0}
        self._after: dict[str, list] = {"htod": [], "dtoh": []}  # the other copy stream's events waited for
        self._pos = 0  # compute ops so far
        self._acc: list[tuple[int, int, int]] = []  # (compute position, start, end), positions ascending
        self._horizon = {"htod": 0, "dtoh": 0}  # compute ops every later copy of the stream comes after
        self._op_horizon: dict[str, list[int]] = {"htod": [], "dtoh": []}  # each issued copy's
        self._in_copy = False
        self._mode: Any = None

    def begin(self) -> None:
        self._mode = _ComputeAccesses(self)
        self._mode.__enter__()

    def run(self, stream: str, fn, tensors: tuple = ()) -> None:
        if stream == "compute":
            fn()
            return
        h = self._horizon[stream]
        i = bisect.bisect_left(self._acc, (h, -1, -1))
        for t in tensors:
            if (ext := _extent(t)) is None:
                continue
            for pos, start, end in self._acc[i:]:
                if start < ext[1] and ext[0] < end:
                    raise MoelabError(f"a copy on the {stream} stream touches memory that compute op #{pos} touched, "
                                      f"but its stream waited only for compute ops before #{h}: on a GPU it may run "
                                      "before that op (a missing wait).")
        self._queue[stream].append((list(self._after[stream]), fn))
        self._op_horizon[stream].append(h)

    def signal(self, stream: str) -> Any:
        if stream == "compute":
            return ("compute", self._pos)
        return (stream, self._done[stream] + len(self._queue[stream]))

    def wait(self, stream: str, ev: Any) -> None:
        if ev is None:
            return
        src, n = ev
        if stream == "compute":
            if src != "compute":
                self._drain(src, n)
        elif src == "compute":
            self._horizon[stream] = max(self._horizon[stream], n)
        elif src != stream:
            self._after[stream].append(ev)
            if n:
                self._horizon[stream] = max(self._horizon[stream], self._op_horizon[src][n - 1])
        low = min(self._horizon.values())
        if self._acc and self._acc[0][0] < low:  # accesses every stream has waited past: no copy can race them
            self._acc = self._acc[bisect.bisect_left(self._acc, (low, -1, -1)):]

    def _drain(self, stream: str, upto: int) -> None:
        while self._done[stream] < upto:
            after, fn = self._queue[stream].pop(0)
            for ev in after:
                self._drain(*ev)
            self._in_copy = True
            try:
                fn()
            finally:
                self._in_copy = False
            self._done[stream] += 1

    def flush(self) -> None:
        for stream in self._queue:
            self._drain(stream, self._done[stream] + len(self._queue[stream]))
        self._after = {"htod": [], "dtoh": []}
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    def abandon(self) -> None:
        self.flush()  # what was queued runs, as a CUDA stream's queued copies do; positions stay valid


class _CudaStreams(_HostStreams):
    """Compute, host → device and device → host CUDA streams ordered by CUDA events; host copies pinned."""

    cuda = True

    def __init__(self, log: EventLog, device: torch.device) -> None:
        self.clock = CudaClock(log, device)

    def on(self, stream: str):
        return torch.cuda.stream(self.clock.streams[stream])

    def signal(self, stream: str) -> Any:
        ev = torch.cuda.Event()
        ev.record(self.clock.streams[stream])
        return ev

    def wait(self, stream: str, ev: Any) -> None:
        if ev is not None:
            self.clock.streams[stream].wait_event(ev)

    def host(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().cpu().pin_memory()

    def begin(self) -> None:
        self.clock.begin()

    def flush(self) -> None:
        self.clock.flush()

    def abandon(self) -> None:
        torch.cuda.synchronize(self.clock.device)
        self.clock._pending.clear()


class _StagedCache:
    """One micro-batch's KV of one layer in a staging buffer on the device (``S_KV-GPU``): the cache
    object the attention module updates (``(L, b, heads, d)`` buffers, handed out as ``(b, heads, L, d)``)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self.keys, self.values, self.length, self.new = keys, values, length, 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        L, q = self.length, key.shape[-2]
        self.keys[L:L + q].copy_(key.permute(2, 0, 1, 3))
        self.values[L:L + q].copy_(value.permute(2, 0, 1, 3))
        self.new = q
        return self.keys[:L + q].permute(1, 2, 0, 3), self.values[:L + q].permute(1, 2, 0, 3)


class _HostKV:
    """The KV cache of every micro-batch and layer in host memory, filled from the prefill's caches,
    and the two staging buffers its micro-batches take turns in."""

    def __init__(self, dec: OffloadedDecoder, caches: list[Any], sizes: list[int], prompt: int, steps: int) -> None:
        self.dec, self.length, self.capacity = dec, prompt, prompt + steps
        self.host: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        for cache, b in zip(caches, sizes, strict=True):
            per_layer = []
            for layer in cache.layers:
                pair = []
                for t in (layer.keys, layer.values):  # (b, heads, P, d) -> (capacity, b, heads, d)
                    buf = torch.zeros((self.capacity, b, *t.shape[1:2], t.shape[3]), dtype=t.dtype)
                    buf[:prompt].copy_(t.permute(2, 0, 1, 3))
                    pair.append(dec.streams.host(buf))
                per_layer.append((pair[0], pair[1]))
            self.host.append(per_layer)
        self._stage: dict[tuple, torch.Tensor] = {}
        self.free: list[Any] = [None, None]

    def _staging(self, slot: int, role: int, like: torch.Tensor) -> torch.Tensor:
        """Staging buffer ``slot`` for keys (``role`` 0) or values (1), viewed in ``like``'s shape."""
        cap, b, *rest = like.shape
        key = (slot, role, tuple(rest), like.dtype)
        need = cap * self.dec.micro_batch * math.prod(rest)
        flat = self._stage.get(key)
        if flat is None:
            flat = self._stage[key] = torch.empty(need, dtype=like.dtype, device=self.dec.device)
            self.dec.allocated()
        return flat[:like.numel()].view(like.shape)

    def stage_in(self, j: int, i: int, step: int) -> _StagedCache:
        """Issue micro-batch ``j``'s layer-``i`` KV host → device into its staging buffer; the compute
        stream waits for it."""
        dec, S, L = self.dec, self.dec.streams, self.length
        if self.length >= self.capacity:
            raise MoelabError(f"KV cache of micro-batch {j} is full ({self.capacity} positions): more decode steps "
                              "than generate() was asked for.")
        K, V = self.host[j][i]
        ks, vs = self._staging(j % 2, 0, K), self._staging(j % 2, 1, V)
        S.wait("htod", self.free[j % 2])
        dec.copy("htod", "transfer-kv", f"KV HtoD[{j}]", [(ks[:L], K[:L]), (vs[:L], V[:L])], step, i,
                 tokens=K.shape[1])
        S.wait("compute", S.signal("htod"))
        return _StagedCache(ks, vs, L)

    def write_back(self, j: int, i: int, cache: _StagedCache, step: int) -> None:
        """Issue the new K/V of micro-batch ``j``, layer ``i`` device → host after the attention; the
        staging buffer is free when that copy is done."""
        dec, S = self.dec, self.dec.streams
        K, V = self.host[j][i]
        L, q = cache.length, cache.new
        S.wait("dtoh", S.signal("compute"))
        dec.copy("dtoh", "writeback-kv", f"KV DtoH[{j}]", [(K[L:L + q], cache.keys[L:L + q]),
                                                              (V[L:L + q], cache.values[L:L + q])], step, i,
                 tokens=K.shape[1])
        self.free[j % 2] = S.signal("dtoh")


class OffloadedDecoder(ModuleBatchedDecoder):
    """MoE-Gen's decode with weights and KV in host memory (module docstring) on ``device``
    (``"cuda"``, ``"cuda:N"`` or ``"cpu"`` for the stand-in): attention micro-batches of
    ``micro_batch`` sequences, expert chunks of ``expert_batch`` rows, an ``S_Expert`` ring of
    ``expert_slots`` slots and ``pinned_experts`` routed experts resident (over all MoE layers).
    ``defer_copies`` (stand-in only): run each copy as late as CUDA may, to check the waits."""

    def __init__(self, model: Any, micro_batch: int, expert_batch: int, *, device: str | torch.device = "cuda",
                 expert_slots: int = 2, pinned_experts: int = 0, log: EventLog | None = None,
                 pin_dense: bool = False, run: str = "moegen-offloaded", defer_copies: bool = False) -> None:
        """Check the settings, copy the weights to host buffers, place the resident ones on ``device``.

        Size: MoE-Gen's buffer settings one to one (b_a, b_e, S_Expert slots, S_Params experts and
        dense modules) beside the device, the log and the check mode."""
        super().__init__(model, micro_batch, expert_batch, log=log, run=run)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MoelabError(f"device {device!r}: this machine has no CUDA GPU. Fix: device='cpu' runs the stand-in "
                              "(the same schedule, every copy a host memcpy).")
        if self.device.type not in ("cuda", "cpu"):
            raise MoelabError(f"device {device!r}: expected 'cuda', 'cuda:N' or 'cpu'.")
        on = {p.device.type for p in model.parameters()}
        if on != {"cpu"}:
            raise MoelabError(f"the model's weights are on {sorted(on)}: the offloaded decoder keeps them in host memory "
                              "and copies what it runs. Fix: load the model on the CPU (model.to('cpu')).")
        moe_layers = [i for i, moe in enumerate(self.moe) if moe]
        for name, v, low in (("expert_slots", expert_slots, 1), ("pinned_experts", pinned_experts, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise MoelabError(f"{name}={v!r}: expected an integer ≥ {low}.")
        self.expert_slots = expert_slots
        if self.device.type == "cuda":
            self.streams: _HostStreams = _CudaStreams(self.log, self.device)
        else:
            self.streams = _DeferredStreams(self.log) if defer_copies else _HostStreams(self.log)
        self.pin_dense = bool(pin_dense)
        self._host_weights(moe_layers, pinned_experts)
        self._dense_bufs: list[dict[tuple, dict[str, torch.Tensor]]] = [{}, {}]
        self._dense_free: list[Any] = [None, None]
        self._dense_at: dict[int, tuple[int, Any, dict]] = {}  # layer -> (buffer, ready signal, its tensors)
        self._last_step = -1  # the generate's last step: its last layer prefetches nothing
        self._next_buf = 0
        self._ring: dict[tuple, dict[str, torch.Tensor]] = {}
        self._slot_free: dict[tuple, list[Any]] = {}  # ring -> each slot's "its last expert computed"
        self._slot_ready: dict[tuple, list[Any]] = {}  # ring -> each slot's "its expert is copied"
        self._queued: list[int] = []

    @classmethod
    def from_config(cls, model: Any, config: Any, *, device: str | torch.device = "cuda",
                    **kwargs: Any) -> OffloadedDecoder:
        """The decoder of a :class:`~moelab.simulate.moegen.ThroughputConfig` (e.g. the best configuration
        :func:`~moelab.simulate.moegen.plan_throughput` found): its ``b_a``, ``b_e``, ``S_Expert`` slots,
        pinned experts and dense modules; :meth:`generate` then takes ``config.batch`` prompts. Refuses
        what this decoder does not run: prefill schedules and a CPU attention share."""
        if getattr(config, "phase", "decode") != "decode":
            raise MoelabError(f"config phase {config.phase!r}: the offloaded decoder runs MoE-Gen's decode schedule; "
                              "the prompt is prefilled by the plain model. Fix: search with phase='decode'.")
        if getattr(config, "cpu_attention", 0.0):
            raise MoelabError(f"config cpu_attention (ω) = {config.cpu_attention}: the offloaded decoder runs every "
                              "sequence's attention on the GPU (ω = 0). Fix: search with cpu_attention=0.")
        return cls(model, config.micro_batch, config.expert_batch, device=device, expert_slots=config.expert_slots,
                   pinned_experts=config.pinned_experts, pin_dense=config.pin_dense, **kwargs)

    # ------------------------------------------------------------------ memory
    def _host_weights(self, moe_layers: list[int], pinned: int) -> None:
        """Host copies of every layer's dense modules and expert stacks (pinned on CUDA), the resident
        modules and pinned experts on the device; under ``pin_dense`` the dense modules go to the device
        only (``S_Params``: resident, never copied, so no host copy)."""
        S, layers = self.streams, self.model.model.layers
        total = len(moe_layers) * (num_experts(layers[moe_layers[0]].mlp.experts) if moe_layers else 0)
        if pinned > total:
            raise MoelabError(f"pinned_experts={pinned}: the model has {total} routed experts ({len(moe_layers)} MoE "
                              "layers); expected at most that many.")
        place = (lambda t: t.detach().to(self.device, copy=True)) if self.pin_dense else S.host
        with self._installed(_Active(self.expert_batch, None)):  # names as the schedule's wrappers make them
            dense = [{n: place(t) for n, t in (*layer.named_parameters(), *layer.named_buffers())
                      if not n.startswith("mlp.experts.")} for layer in layers]
        self._dense, self._pinned_dense = (None, dense) if self.pin_dense else (dense, None)
        self._experts_host = {i: {n: S.host(t) for n in STACKS if isinstance(t := getattr(layers[i].mlp.experts, n,
                                                                                             None), torch.Tensor)}
                              for i in moe_layers}
        m = self.model.model
        res = {"embed": m.embed_tokens, "norm": m.norm, "lm_head": self.model.lm_head, "rotary": m.rotary_emb}
        self._res = {k: {n: t.detach().to(self.device, copy=True) for n, t in (*mod.named_parameters(),
                                                                                *mod.named_buffers())}
                     for k, mod in res.items()}
        p, r = divmod(pinned, max(len(moe_layers), 1))
        self.pinned = {i: p + (1 if k < r else 0) for k, i in enumerate(moe_layers)}
        self._resident = {i: {n: t[:self.pinned[i]].to(self.device, copy=True) for n, t in
                              self._experts_host[i].items()} for i in moe_layers}

    @property
    def device_bytes(self) -> dict[str, int]:
        """Bytes this decoder holds on its device, by MoE-Gen's buffer: ``S_Params`` (resident modules and
        pinned experts), ``S_Dense``, ``S_Expert`` and ``S_KV-GPU`` (of the last generate)."""
        def size(ts) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        kv = getattr(self, "_kv", None)
        return {"S_Params": size(t for d in self._res.values() for t in d.values())
                + size(t for d in self._resident.values() for t in d.values())
                + size(t for d in self._pinned_dense or [] for t in d.values()),
                "S_Dense": size(t for b in self._dense_bufs for d in b.values() for t in d.values()),
                "S_Expert": size(t for d in self._ring.values() for t in d.values()),
                "S_KV-GPU": size(kv._stage.values()) if kv is not None else 0}

    def allocated(self) -> None:
        """After a device buffer was allocated (on the compute stream): the copy stream waits for the compute
        work queued so far, since the caching allocator may have handed out memory that queued kernels still
        use, and a copy into it must not overtake them."""
        self.streams.wait("htod", self.streams.signal("compute"))

    def _reset(self) -> None:
        """Forget the per-step state (an S_Dense buffer's layer, the queued ring, pending spans) after a
        step that raised, so the next decode does not run a layer from a buffer holding another."""
        self._dense_at.clear()
        self._dense_free = [None, None]
        self._next_buf = 0
        self._queued = []
        for sig in self._slot_free:
            self._slot_free[sig] = [None] * self.expert_slots
            self._slot_ready[sig] = [None] * self.expert_slots
        self.streams.abandon()

    def copy(self, stream: str, kind: str, cause: str, pairs: list[tuple[torch.Tensor, torch.Tensor]], step: int,
             layer: int, **fields: Any) -> None:
        """Copy each ``(destination, source)`` on ``stream`` as one event (``bytes``: their sum)."""
        S = self.streams
        with S.on(stream):
            a = S.clock.mark(stream)
            for dst, src in pairs:
                S.run(stream, lambda dst=dst, src=src: dst.copy_(src, non_blocking=S.cuda), (dst, src))
            S.clock.span(a, S.clock.mark(stream), step, layer, stream, kind, cause=cause,
                         nbytes=sum(s.numel() * s.element_size() for _, s in pairs), **fields)

    # ------------------------------------------------------------------ S_Dense
    def _load_dense(self, i: int, step: int, cause: str) -> None:
        buf = self._next_buf
        self._next_buf = 1 - buf
        host = self._dense[i]
        sig = tuple((n, tuple(t.shape), t.dtype) for n, t in host.items())
        dst = self._dense_bufs[buf].get(sig)
        if dst is None:
            dst = self._dense_bufs[buf][sig] = {n: torch.empty_like(t, device=self.device) for n, t in host.items()}
            self.allocated()
        self.streams.wait("htod", self._dense_free[buf])
        self.copy("htod", "transfer-dense", cause, [(dst[n], t) for n, t in host.items()], step, i)
        self._dense_at[i] = (buf, self.streams.signal("htod"), dst)

    def _dense_views(self, i: int, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """Layer ``i``'s modules' parameters in their ``S_Dense`` buffer (loaded now if not prefetched),
        or resident under ``pin_dense``, by submodule; the compute stream waits for the copy."""
        if self._pinned_dense is not None:
            dst = self._pinned_dense[i]
        else:
            if i not in self._dense_at:
                self._load_dense(i, step, "Dense load")
            buf, ready, dst = self._dense_at[i]
            self.streams.wait("compute", ready)
        views: dict[str, dict[str, torch.Tensor]] = {s: {} for s in SUBMODULES}
        for n, t in dst.items():
            sub, _, rest = n.partition(".")
            if sub in views:
                views[sub][rest] = t
        return views

    def _dense_done(self, i: int, step: int) -> None:
        """Layer ``i`` ran: its buffer is free once the compute stream gets here; prefetch the next layer
        (layer 0 of the next step after the last) into the other buffer."""
        if self._pinned_dense is not None:
            return
        buf = self._dense_at.pop(i)[0]
        self._dense_free[buf] = self.streams.signal("compute")
        nxt = (i + 1) % len(self.moe)
        if nxt not in self._dense_at and not (nxt == 0 and step >= self._last_step):
            self._load_dense(nxt, step, "Dense prefetch[next layer]")

    # ------------------------------------------------------------------ S_Expert
    def _ring_for(self, i: int) -> tuple[tuple, dict[str, torch.Tensor]]:
        host = self._experts_host[i]
        sig = tuple((n, tuple(t.shape[1:]), t.dtype) for n, t in host.items())
        if sig not in self._ring:
            R = self.expert_slots
            self._ring[sig] = {n: torch.empty((R, *t.shape[1:]), dtype=t.dtype, device=self.device)
                               for n, t in host.items()}
            self.allocated()
            self._slot_free[sig], self._slot_ready[sig] = [None] * R, [None] * R
        return sig, self._ring[sig]

    def _load_slot(self, i: int, e: int, s: int, step: int) -> None:
        """Issue expert ``e`` of layer ``i`` host → device into slot ``s`` once its last user computed."""
        sig, ring = self._ring_for(i)
        self.streams.wait("htod", self._slot_free[sig][s])
        host = self._experts_host[i]
        self.copy("htod", "transfer-prefetch", f"Wcopy[{e}]", [(ring[n][s], t[e]) for n, t in host.items()], step, i,
                  expert=e)
        self._slot_ready[sig][s] = self.streams.signal("htod")

    def _prefetch_experts(self, i: int, step: int) -> None:
        """The layer's first ``expert_slots`` streamed experts (ascending id), before the router ran."""
        E = num_experts(self.model.model.layers[i].mlp.experts)
        self._queued = list(range(self.pinned[i], min(E, self.pinned[i] + self.expert_slots)))
        for s, e in enumerate(self._queued):
            self._load_slot(i, e, s, step)

    def _run_experts(self, module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, st: _Active) -> torch.Tensor:
        """The routed experts of layer ``st.layer``: pinned ones from their resident stacks, then the
        streamed ones through the ring, each over its tokens in ``b_e``-row chunks."""
        i, E, R = st.layer, num_experts(module), self.expert_slots
        tok_all, w_all, counts = slot_major(top_k_index, top_k_weights, E)
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        out = torch.zeros_like(hidden)

        def run(weights: Any, e: int, slot: int) -> None:
            a, b = starts[e], starts[e + 1]
            if b > a:
                run_expert_chunks(weights, e, hidden, tok_all[a:b], w_all[a:b], out, self.expert_batch, st, slot)

        resident = StackView(module, self._resident[i])
        for e in range(self.pinned[i]):
            run(resident, e, e)
        sig, ring = self._ring_for(i)
        view = StackView(module, ring)
        queued = self._queued
        order = queued + [e for e in range(self.pinned[i], E) if counts[e] and e not in queued]
        for q, e in enumerate(order):
            s = q % R
            if q >= len(queued):
                self._load_slot(i, e, s, st.step)
            self.streams.wait("compute", self._slot_ready[sig][s])
            run(view, e, s)
            self._slot_free[sig][s] = self.streams.signal("compute")
        self._queued = []
        return out

    # ------------------------------------------------------------------ the decode
    def _attention(self, layer: Any, i: int, views: dict, h: torch.Tensor, kv: _HostKV, position: int,
                   st: _Active) -> torch.Tensor:
        m, clock, parts = self.model.model, self.streams.clock, []
        for j, j0 in enumerate(range(0, h.shape[0], self.micro_batch)):
            x = h[j0:j0 + self.micro_batch]
            cache = kv.stage_in(j, i, st.step)
            t0 = clock.mark()
            pos = torch.full((x.shape[0], 1), position, dtype=torch.long, device=self.device)
            pe = functional_call(m.rotary_emb, self._res["rotary"], (x, pos))
            xn = functional_call(layer.input_layernorm, views["input_layernorm"], (x,))
            a = functional_call(layer.self_attn, views["self_attn"], (), dict(
                hidden_states=xn, attention_mask=None, position_ids=pos, position_embeddings=pe, use_cache=True,
                **cache_kwargs(cache, layer.self_attn)))
            parts.append(x + (a[0] if isinstance(a, tuple) else a))
            clock.span(t0, clock.mark(), st.step, i, "compute", "dense", tokens=int(x.shape[0]),
                       cause=f"Attention[{j}]")
            kv.write_back(j, i, cache, st.step)
        return torch.cat(parts, 0)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, caches: Any, position: int, step: int = 0) -> torch.Tensor:
        """One decode step of ``tokens`` ``(B,)`` at ``position`` over the host KV store ``caches``
        (a :meth:`generate`'s); returns logits ``(B, V)`` on the device."""
        S = self.streams
        S.begin()
        try:
            logits = self._step(tokens, caches, position, step)
        except BaseException:
            self._reset()
            raise
        caches.length += 1
        S.flush()
        return logits

    def _step(self, tokens: torch.Tensor, kv: _HostKV, position: int, step: int) -> torch.Tensor:
        m = self.model.model
        st = _Active(self.expert_batch, self.log, step, clock=self.streams.clock, streamer=self._run_experts)
        with self._installed(st):
            h = functional_call(m.embed_tokens, self._res["embed"], (tokens.to(self.device)[:, None],))
            for i, layer in enumerate(m.layers):
                st.layer = i
                views = self._dense_views(i, step)
                h = self._attention(layer, i, views, h, kv, position, st)
                if self.moe[i]:
                    self._prefetch_experts(i, step)
                y = functional_call(layer.post_attention_layernorm, views["post_attention_layernorm"], (h,))
                if self.moe[i]:
                    y = functional_call(layer.mlp, views["mlp"], (y,))
                    y = y[0] if isinstance(y, tuple) else y
                else:
                    y = _chunked(lambda x, layer=layer, v=views["mlp"]: functional_call(layer.mlp, v, (x,)), y, st,
                                 "dense", "DenseMLP")
                h = h + y
                self._dense_done(i, step)
            st.layer = -1
            h = functional_call(m.norm, self._res["norm"], (h,))
            logits = _chunked(lambda x: functional_call(self.model.lm_head, self._res["lm_head"], (x,)), h, st,
                              "dense", "LMHead")
        return logits[:, -1, :]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, steps: int, *, keep_logits: bool = True) -> Generation:
        """Greedy decode of ``steps`` steps after the host-side prefill (module docstring); tokens and
        logits come back on the CPU."""
        ids = _check_ids(input_ids, steps)
        t0 = time.perf_counter()
        caches, logits = self.prefill(ids)
        sizes = [int(ids[j0:j0 + self.micro_batch].shape[0]) for j0 in range(0, ids.shape[0], self.micro_batch)]
        self._reset()
        self._kv = kv = _HostKV(self, caches, sizes, int(ids.shape[1]), steps)
        self._last_step = steps - 1
        t1 = time.perf_counter()
        P = ids.shape[1]
        toks, kept, step_s = _greedy_steps(logits.to(self.device), steps, keep_logits,
                                           lambda s, tok: self.step(tok, kv, P + s, step=s))
        t2 = time.perf_counter()
        return Generation(torch.stack(toks, 1).cpu(), [k.cpu() for k in kept], t1 - t0, t2 - t1, steps,
                          int(ids.shape[0]), step_s)


__all__ = ["SUBMODULES", "CudaClock", "OffloadedDecoder"]
