"""The fused MoE experts operator (Python entry point to the native kernels)."""

from __future__ import annotations

import os

import torch

from moelab.errors import MoelabError
from moelab.kernels import build as _build
from moelab.kernels.build import (
    ISA_CODES,
    ISA_ENV,
    Isa,
    _validate,
    active_isa,
    env_value,
    load_extension,
)
from moelab.kernels.packing import PackedExperts

#: Environment variable: the kernels' OpenMP threads per call when a call names none (default: torch's
#: ``torch.get_num_threads()``). A hybrid run on a GPU box may want fewer than every core, leaving one
#: to the control thread and the CUDA lanes' threads (``scripts/gpu_check.sh`` ``THREADS=...``).
THREADS_ENV = "MOELAB_KERNELS_THREADS"


LANE_SPIN_ENV = "MOELAB_LANE_SPIN_US"
#: How long an idle thread of the extension polls before it sleeps, µs (kDefaultSpinUs in kernels/pool.h).
DEFAULT_LANE_SPIN_US = 0
#: The longest polling time accepted, µs (one second: beyond any gap between a decode step's calls).
MAX_LANE_SPIN_US = 1_000_000


def lane_spin_us() -> int:
    """How long (µs) an idle thread of the kernels extension polls before it sleeps: a C++ lane
    worker its queue, a worker of the kernels' pool its jobs, a ``result()`` of a queued call its
    call. ``$MOELAB_LANE_SPIN_US`` when the extension first needed it (default
    :data:`DEFAULT_LANE_SPIN_US`: sleep at once), or the last :func:`set_lane_spin_us`. Polling spares
    a hand-off the wake-up of a sleeping thread (a system call, and where that thread's CPU went idle,
    the CPU's wake-up: ~96 µs on the 2-vCPU development VM against ~11 µs to a worker still polling)
    at the cost of a CPU for the spin time after each call (yielding to any thread ready to run
    there). It pays where spare cores are; on that 2-vCPU VM the pollers crowded the control thread
    (a tiny model's decode step 3.6-3.8 ms without polling, 7-9 ms with 5000 µs)."""
    _check_lane_spin_env()
    return int(load_extension().get_lane_spin_us())


def set_lane_spin_us(us: int) -> None:
    """Set :func:`lane_spin_us` for every lane (0: sleep at once, as a plain condition-variable queue)."""
    if isinstance(us, bool) or not isinstance(us, int) or not 0 <= us <= MAX_LANE_SPIN_US:
        raise MoelabError(f"lane spin {us!r}: expected a non-negative integer of microseconds up to "
                          f"{MAX_LANE_SPIN_US} (0 sleeps at once; the default is {DEFAULT_LANE_SPIN_US}).")
    load_extension().set_lane_spin_us(us)


def _check_lane_spin_env() -> None:
    """Refuse a ``$MOELAB_LANE_SPIN_US`` the extension would ignore (it reads it at its first lane)."""
    v = env_value(LANE_SPIN_ENV)
    if v is not None and not (v.isascii() and v.isdigit() and int(v) <= MAX_LANE_SPIN_US):
        raise MoelabError(f"{LANE_SPIN_ENV}={v!r}: expected a non-negative integer up to {MAX_LANE_SPIN_US} (µs an "
                          f"idle lane worker polls its queue before it sleeps; 0 sleeps at once); unset it for the "
                          f"default ({DEFAULT_LANE_SPIN_US}).")


def default_threads() -> int:
    """Threads of a call that names none: ``$MOELAB_KERNELS_THREADS`` if set (a positive integer),
    else ``torch.get_num_threads()``."""
    v = env_value(THREADS_ENV)
    if not v:
        return torch.get_num_threads()
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise MoelabError(f"{THREADS_ENV}={v!r}: expected a positive integer (threads per kernel call); "
                          "unset it to use torch.get_num_threads().")
    return n


def _checked_input(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   hidden: int) -> torch.Tensor:
    """The hidden states as the extension takes them (float32 or bfloat16, contiguous), after the
    checks that name a bad call's shapes before C++ does."""
    if not hidden_states.is_cpu:
        raise MoelabError(
            f"hidden states are on {hidden_states.device}; moelab's native kernels run on the CPU. "
            "Move the experts to the CPU or use another experts implementation."
        )
    if hidden_states.dim() != 2 or hidden_states.shape[1] != hidden:
        raise MoelabError(
            f"hidden states have shape {tuple(hidden_states.shape)}; expected (T, {hidden})."
        )
    if top_k_index.shape != top_k_weights.shape or top_k_index.shape[:1] != hidden_states.shape[:1]:
        raise MoelabError(
            f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
            f"must both be (T, K) with T = {hidden_states.shape[0]}."
        )
    x = hidden_states if hidden_states.dtype in KERNEL_INPUT_DTYPES else hidden_states.float()
    return x.contiguous()


#: Hidden-state dtypes the extension takes as they are (a call in another float type runs in fp32).
KERNEL_INPUT_DTYPES = (torch.float32, torch.bfloat16)
#: The extension's lane workers: a queued call's ``lane`` is 0 .. LANES - 1.
LANES = 8


def call_config() -> tuple[Isa, int]:
    """(path, threads) of a call that names neither: :func:`active_isa`, :func:`default_threads`."""
    return active_isa(), default_threads()


def config_token() -> tuple:
    """What :func:`call_config` is a function of, read as it stands and unvalidated: the path
    :func:`~moelab.kernels.build.force_isa` forces, the detected CPU features, both settings as the
    environment holds them, torch's threads. Equal tokens give the same ``call_config()``, so a
    prepared call (:meth:`moelab.kernels.backend.KernelBackend.submit`) compares this, one call,
    instead of deriving the config again, six calls, on every experts call between a forward's
    layers; a different token re-derives it (and raises for a bad setting, as before)."""
    forced = _build._forced
    data = getattr(os.environ, "_data", None)
    if data is None:  # another Python's os.environ
        return (forced[-1] if forced else None, _build._features, os.environ.get(ISA_ENV),
                os.environ.get(THREADS_ENV), torch.get_num_threads())
    return (forced[-1] if forced else None, _build._features, data.get(_ENV_KEYS[0]), data.get(_ENV_KEYS[1]),
            torch.get_num_threads())


#: The two settings' keys in ``os.environ``'s underlying mapping (:func:`config_token`).
_ENV_KEYS = (os.environ.encodekey(ISA_ENV), os.environ.encodekey(THREADS_ENV)) \
    if hasattr(os.environ, "encodekey") else (ISA_ENV, THREADS_ENV)


def prepared_call(packed: PackedExperts, isa: Isa, num_threads: int):
    """The extension's ``Prepared`` of ``packed`` on ``isa`` with ``num_threads``: a layer's call
    tail (:func:`call_tail`) held in C++, whose ``forward(x, ids, weights, expert_map)`` and
    ``submit(x, ids, weights, expert_map, lane)`` pass only the call's own tensors (the binding
    converts every argument on every call: nine fewer, the nine that stay the same). They check
    what :func:`moe_experts` checks and return an error's message instead of raising
    (:func:`_raised`)."""
    return load_extension().Prepared(*call_tail(packed, isa, num_threads))


def call_tail(packed: PackedExperts, isa: Isa, num_threads: int) -> tuple:
    """The extension's arguments of a call after (x, ids, weights): the pack's tensors and the meta
    row for ``isa`` and ``num_threads`` (what a prepared call keeps, :meth:`KernelBackend.submit`)."""
    meta = [*packed.meta_head, ISA_CODES[isa], num_threads, packed.slice1]
    return (packed.w1, packed.s1, packed.b1, packed.w2, packed.s2, packed.b2, meta, packed.alpha, packed.limit)


def _args(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, packed: PackedExperts,
          isa: Isa | None, num_threads: int | None) -> tuple:
    """The extension's positional arguments of one call, checked (clear errors before C++)."""
    x = _checked_input(hidden_states, top_k_index, top_k_weights, packed.hidden)
    isa = active_isa() if isa is None else _validate(isa, "isa=")
    return (x, top_k_index, top_k_weights, *call_tail(packed, isa, num_threads or default_threads()))


def moe_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    packed: PackedExperts,
    *,
    isa: Isa | None = None,
    num_threads: int | None = None,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_k w[t,k] · down_e(act(gate_e x_t, up_e x_t)) for one layer's tokens.

    ``hidden_states`` (T, H) float32/bfloat16 (other float types run in fp32),
    ``top_k_index``/``top_k_weights`` (T, K). Runs on ``isa`` (default: :func:`active_isa`)
    with ``num_threads`` OpenMP threads (default ``torch.get_num_threads()``); releases
    the GIL while it runs. Forward only (no autograd). ``expert_map`` (vLLM's convention):
    ``(E,)`` integers over the router's ids, ``-1`` = the expert is not here (its slots add 0
    and are not computed), otherwise its index among the packed experts. A slot of weight exactly
    0 is not computed either (the backends' contract, :mod:`moelab.backends.base`): an expert runs
    only for its slots of non-zero weight.
    """
    ext = load_extension()
    args = _args(hidden_states, top_k_index, top_k_weights, packed, isa, num_threads)
    out = _raised(ext.moe_forward(*args, expert_map=expert_map))
    return out if out.dtype == hidden_states.dtype else out.to(hidden_states.dtype)


def _raised(result):
    """The extension's result, or its error raised here: the bindings that take tensors return an
    error's message (a ``str``) instead of throwing a C++ exception through them, which killed the
    interpreter on torch 2.11 (kernels/moe_op.cpp, ``MOELAB_REQUIRE``)."""
    if isinstance(result, str):
        raise RuntimeError(result)
    return result


class NativeCall:
    """One experts call queued on a C++ lane worker (:func:`moe_experts_submit`): ``result()``
    blocks (the GIL released) until it ran and returns its output, once computed; ``times_ns()``
    is (submitted, started, ended) on ``time.perf_counter_ns``'s clock."""

    __slots__ = ("_dtype", "_out", "_ticket", "on_done")

    def __init__(self, ticket, dtype: torch.dtype, on_done=None) -> None:
        self._ticket = ticket
        self._dtype = dtype
        self._out: torch.Tensor | None = None
        self.on_done = on_done
        """Called once with this call when its result is first taken (e.g. to record its event)."""

    def done(self) -> bool:
        return self._out is not None or self._ticket.done()

    def times_ns(self) -> tuple[int, int, int]:
        return tuple(self._ticket.times_ns())

    def result(self) -> torch.Tensor:
        if self._out is None:
            out = self._ticket.wait()
            if isinstance(out, str):
                raise MoelabError(out)
            self._out = out if out.dtype == self._dtype else out.to(self._dtype)
            if self.on_done is not None:
                self.on_done(self)
        return self._out


def moe_experts_submit(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    packed: PackedExperts,
    *,
    lane: int = 0,
    expert_map: torch.Tensor | None = None,
    isa: Isa | None = None,
    num_threads: int | None = None,
) -> NativeCall:
    """:func:`moe_experts` queued on C++ lane worker ``lane`` (0..7): checked and prepared on the
    calling thread, run by a worker thread of the extension without the interpreter; calls on one
    lane run in submission order. Returns a :class:`NativeCall` (``result()`` waits for it)."""
    args = _args(hidden_states, top_k_index, top_k_weights, packed, isa, num_threads)
    return submit_args(args, expert_map, lane, hidden_states.dtype)


def submit_args(args: tuple, expert_map: torch.Tensor | None, lane: int, dtype: torch.dtype) -> NativeCall:
    """Queue a call of checked extension arguments (:func:`_args`) on lane ``lane``."""
    if not 0 <= int(lane) < LANES:
        raise MoelabError(f"lane={lane!r}: the extension has lanes 0..{LANES - 1}.")
    return NativeCall(_raised(load_extension().moe_submit(*args, expert_map=expert_map, lane=int(lane))), dtype)
