"""Prefill of one long prompt: stream-loading prefill (OSDI '26 §3.1) and the hybrid path, simulated.

>>> res = prefill(get_shape("deepseek-r1", dtype="fp8"), "osdi26-5090", PrefillConfig(prompt_tokens=8192))
>>> res.tokens_per_s, res.ring_slots, res.crossover_tokens
>>> res.events()            # loader / compute / unloader jobs and ring slots (moelab.events.COLUMNS)

**Stream-loading prefill (SLP, techniques.md §7.2).** The whole prefill runs on the GPU with every
weight streamed from host memory. The prompt's modules, in order, are: the embedding rows (gathered
on the host, copied as ``T × hidden`` activations), then per decoder layer a **dense module**
(attention + router + shared experts, or the dense MLP of a non-MoE layer) followed by the layer's
``E`` **expert modules**, then the LM head (for the last position only) in slices of at most the
dense budget. Three stages, each one stream:

* **loader** copies module ``j`` host→device (FIFO, one copy engine) and sets its ON event;
* **compute** waits on ON, runs the module and sets OFF;
* **unloader** waits on OFF and frees the module's memory (no write-back; costed 0 µs — it only
  sets a host event).

Expert modules occupy a ring of ``R`` preallocated slots shared across layers; the ``j``-th expert
module goes to slot ``j mod R`` and::

    load_start(j)    ≥ max(load_end(j−1), compute_end(j−R))
    compute_start(j) ≥ max(load_end(j),   compute_end(j−1))

(``j−1`` is the previous module of any kind on the same stream). Dense modules sit outside the ring
under a byte budget (``dense_budget_gb``, default 1 GB): the loader blocks until the dense modules
still resident, plus this one, fit. Loading does not depend on routing, so experts stream while the
layer's attention still computes.

**Costs** come from the one cost model (:class:`~moelab.timing.costs.CostModel`): an expert's copy
is :meth:`~CostModel.fetch_us`, a dense module's copy the link's latency + bytes at
:attr:`~CostModel.link_cap`; an expert's compute :meth:`~CostModel.device_us` at its tokens, the
shared experts :meth:`~CostModel.shared_us`; attention, router and dense MLPs are the simulator's
dense task (``gpu_kernels_per_attention`` launches + bytes at :meth:`~CostModel.dense_cap` of the
shape's attention bytes and FLOPs, :meth:`~CostModel.attention` with ``prefill=True``: the causal
average of half the prompt).

**Tokens per expert** (assumed unless ``tokens_per_expert`` gives a routing): uniform routing —
``a = round(E · (1 − (1 − k/E)^T))`` experts are active (the expected number hit at least once),
each with ``T·k/a`` tokens; the others are still loaded (loading ignores routing) but compute
nothing.

**Ring size.** ``R`` is a parameter; by default ``R = E`` while transfer dominates (a MoE layer's
copies take at least its compute) and ``R = 2`` (ping-pong) past that turning point, or when the
activations plus ``E`` slots overflow GPU memory. The turning point compares a MoE layer's expert
modules only — their compute against their copies (assumed reading of §3.1: past it each expert's
compute hides the next one's copy, so two slots keep both streams busy) (:func:`slp_memory`; the refusal, when even
``R = 2`` overflows, names every term).

**Hybrid path** (§3.3.1–3.3.2): dense weights resident on the GPU, attention/router/shared experts
there, routed experts on the CPU (:meth:`~CostModel.lanes_us`, one lane per NUMA node), in chunks
of ``chunk_tokens``; per chunk and layer the GPU part, the activations' copy to the host and back
and the CPU experts run one after the other (OSDI's single stream "alternates strictly, with no
overlap"). **Crossover**: the shortest prompt at which SLP is faster, found by a search over ``T``
(:func:`crossover_tokens`), not a constant; ``path="auto"`` takes SLP from there on (§3.3.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.timing.costs import CostModel, cost_model
from moelab.timing.memory import (
    WORKSPACE_GB,
    MemoryDoesNotFit,
    MemoryNeeds,
    MemoryTerm,
    Pool,
    check_memory,
    gb,
    kv_bytes,
)

#: Dense budget of OSDI '26 §3.1 ("about 1 GB"), GB.
DENSE_BUDGET_GB = 1.0
#: Chunk of the hybrid path's chunked prefill (assumed: OSDI does not state it; a common vLLM/SGLang default).
CHUNK_TOKENS = 512
PATHS = ("slp", "hybrid", "auto")
#: kinds of a streamed module
EMBED, DENSE, EXPERT, HEAD = "embed", "dense", "expert", "lm-head"


@dataclass(frozen=True)
class PrefillConfig:
    """One prefill question: a prompt of ``prompt_tokens`` on one GPU.

    ``ring_slots`` None: the rule of the module docstring. ``tokens_per_expert``: a routing, an
    array ``[MoE layers, E]`` of tokens per expert (None: uniform, expected). ``t_max``: the
    longest prompt the crossover search tries."""

    prompt_tokens: int
    path: str = "slp"
    ring_slots: int | None = None
    dense_budget_gb: float = DENSE_BUDGET_GB
    chunk_tokens: int = CHUNK_TOKENS
    tokens_per_expert: Any = None
    crossover: bool = True
    t_max: int = 1 << 20

    def __post_init__(self) -> None:
        for what, v, low in (("prompt_tokens", self.prompt_tokens, 1), ("chunk_tokens", self.chunk_tokens, 1),
                             ("t_max", self.t_max, 2)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < low:
                raise MoelabError(f"prefill: {what} is {v!r}; expected an integer ≥ {low}.")
        if self.path not in PATHS:
            raise MoelabError(f"prefill path {self.path!r}: expected one of {', '.join(PATHS)} (slp: stream-loading "
                              "on the GPU; hybrid: GPU attention + CPU experts, chunked; auto: by the crossover).")
        if self.ring_slots is not None and (isinstance(self.ring_slots, bool) or int(self.ring_slots) < 1):
            raise MoelabError(f"ring_slots {self.ring_slots!r}: expected an integer ≥ 1 (or None for the rule: "
                              "E while transfer dominates, else 2).")
        if not self.dense_budget_gb > 0:
            raise MoelabError(f"dense_budget_gb {self.dense_budget_gb!r}: expected a size > 0 in GB (OSDI: about 1).")


# ---------------------------------------------------------------------- the stream schedule
@dataclass
class StreamSchedule:
    """Per module (in stream order): kind, layer, expert, tokens, bytes, ring slot (-1: outside the
    ring), and the loader's and compute stream's start/end times (µs)."""

    kind: np.ndarray
    layer: np.ndarray
    expert: np.ndarray
    tokens: np.ndarray
    nbytes: np.ndarray
    slot: np.ndarray
    load_start: np.ndarray
    load_end: np.ndarray
    compute_start: np.ndarray
    compute_end: np.ndarray
    ring_slots: int

    @property
    def time_us(self) -> float:
        return float(self.compute_end[-1]) if len(self.compute_end) else 0.0

    def busy_us(self) -> dict[str, float]:
        """Busy time of each stage (the unloader only sets host events: 0 µs)."""
        return {"loader": float((self.load_end - self.load_start).sum()),
                "compute": float((self.compute_end - self.compute_start).sum()), "unloader": 0.0}


def stream_schedule(load_us, compute_us, ring: Any, ring_slots: int, *, budget_bytes: Any = None,
                    dense_budget: float = math.inf, gpu: Any = None) -> tuple[np.ndarray, ...]:
    """The recurrences of SLP over modules in stream order: ``load_us``/``compute_us`` per module,
    ``ring`` True where the module takes a ring slot, ``budget_bytes`` what a module outside the
    ring holds of ``dense_budget`` until its compute ends. ``gpu`` (optional): a callable
    ``gpu(j, load_end, compute_free) -> start`` when the GPU is shared with other work (it may
    run that work first, so start ≥ max(load_end, compute_free)); None: the GPU is SLP's alone.
    Returns (load_start, load_end, compute_start, compute_end, slot)."""
    load = np.asarray(load_us, dtype=np.float64)
    comp = np.asarray(compute_us, dtype=np.float64)
    ring = np.asarray(ring, dtype=bool)
    n = load.size
    held = np.zeros(n) if budget_bytes is None else np.where(ring, 0.0, np.asarray(budget_bytes, dtype=np.float64))
    if int(ring_slots) < 1:
        raise MoelabError(f"ring_slots {ring_slots}: expected ≥ 1.")
    if held.size and held.max() > dense_budget:
        i = int(held.argmax())
        raise MoelabError(f"module {i} holds {gb(held[i])} outside the ring, more than the dense budget "
                          f"{gb(dense_budget)}; raise dense_budget_gb (--dense-budget-gb) to at least "
                          f"{math.ceil(held[i] / 1e7) / 100:g}.")
    ls, le, cs, ce = ([0.0] * n for _ in range(4))  # lists: the loop reads them one by one
    slot = np.full(n, -1, np.int64)
    ring_idx = np.flatnonzero(ring)
    slot[ring_idx] = np.arange(ring_idx.size) % int(ring_slots)
    pos_a = np.full(n, -1, np.int64)
    pos_a[ring_idx] = np.arange(ring_idx.size)
    pos, ring_at = pos_a.tolist(), ring_idx.tolist()
    load, comp, ring_l, held = load.tolist(), comp.tolist(), ring.tolist(), held.tolist()
    R = int(ring_slots)
    dense_idx: list[int] = []  # modules outside the ring with bytes held, in order
    first_held, in_use = 0, 0.0
    prev_le = prev_ce = 0.0
    for j in range(n):
        start = prev_le
        if ring_l[j]:
            if pos[j] >= R:
                start = max(start, ce[ring_at[pos[j] - R]])
        elif held[j] > 0:
            while in_use + held[j] > dense_budget:  # block until the oldest resident dense module is freed
                k = dense_idx[first_held]
                start = max(start, ce[k])
                in_use -= held[k]
                first_held += 1
            dense_idx.append(j)
            in_use += held[j]
        ls[j], le[j] = start, start + load[j]
        cs[j] = max(le[j], prev_ce) if gpu is None else max(le[j], prev_ce, gpu(j, le[j], prev_ce))
        ce[j] = cs[j] + comp[j]
        prev_le, prev_ce = le[j], ce[j]
    return np.array(ls), np.array(le), np.array(cs), np.array(ce), slot


# ---------------------------------------------------------------------- costs of the modules
def expected_load(tokens: int, num_experts: int, top_k: int) -> tuple[int, float]:
    """Uniform routing of ``tokens`` tokens: (experts hit at least once, in expectation, rounded;
    tokens per such expert)."""
    E, k = int(num_experts), int(top_k)
    active = max(1, min(E, round(E * (1.0 - (1.0 - k / E) ** int(tokens)))))
    return active, tokens * k / active


def _layer_tokens(costs: CostModel, cfg: PrefillConfig, moe_ordinal: int) -> np.ndarray:
    """Tokens of each expert of one MoE layer: the routing given, or the expected uniform load."""
    E = costs.num_experts
    if cfg.tokens_per_expert is not None:
        tpe = np.asarray(cfg.tokens_per_expert, dtype=np.float64)
        if tpe.shape != (costs.num_moe_layers, E):
            raise MoelabError(f"tokens_per_expert has shape {tpe.shape}; expected (MoE layers, experts) = "
                              f"({costs.num_moe_layers}, {E}).")
        return tpe[moe_ordinal]
    a, n = expected_load(cfg.prompt_tokens, E, costs.shape.top_k)
    out = np.zeros(E)
    out[:a] = n
    return out


def dense_us(costs: CostModel, nbytes: float, flops: float, kernels: int) -> float:
    """A dense GPU task (the simulator's ``dense`` task, :mod:`moelab.simulate.executor`):
    ``kernels`` launches + bytes at :meth:`CostModel.dense_cap` of (bytes, FLOPs)."""
    if nbytes <= 0 and flops <= 0:
        return 0.0
    return kernels * costs.profile.gpu_launch_us + float(nbytes / costs.dense_cap(nbytes, flops))


def copy_us(costs: CostModel, nbytes: float) -> float:
    """One host→device copy of ``nbytes`` (the link's latency + bytes at :attr:`CostModel.link_cap`)."""
    return costs.profile.link.latency_us + nbytes / costs.link_cap


def reexpand_flops(shape: Any, cached: int) -> float:
    """FLOPs of up-projecting ``cached`` tokens' latent KV to full heads in one MLA layer
    (``2·r·h·(d_nope + d_v)`` per token; 0 for other attention): what each chunk of a chunked
    prefill pays for the prompt before it, since prefill kernels attend in the up-projected form and
    the cache holds the latent."""
    if getattr(shape, "attention", "gqa") != "mla" or cached <= 0:
        return 0.0
    return 2.0 * cached * shape.kv_lora_rank * shape.num_heads * (shape.qk_nope_head_dim + shape.v_head_dim)


def _layer_dense(costs: CostModel, layer: int, T: int, context: int, cached: int = 0) -> tuple[float, float]:
    """(weight bytes streamed, compute µs) of decoder layer ``layer``'s dense module: attention,
    then the router and shared experts (MoE layer) or the dense MLP, for ``T`` new tokens of which
    the last is at ``context``; ``cached`` tokens of the prompt are already in the KV cache (a later
    chunk of a chunked prefill), whose latent MLA re-expands (:func:`reexpand_flops`)."""
    s, hw = costs.shape, costs.profile
    is_moe = layer in costs.moe_layers
    a_b = float(s.attention_bytes(context, 1, layer=layer))
    a_f = float(s.attention_flops(max(context - T // 2, 1), T, layer=layer, prefill=True))  # causal average of the new tokens
    a_f += reexpand_flops(s, cached)
    if is_moe:
        w = float(s.attention_weight_bytes(layer)) + costs.router_bytes + costs.shared_bytes
        t = dense_us(costs, a_b + costs.router_bytes, a_f + costs.router_flops_per_token * T,
                     hw.gpu_kernels_per_attention) + costs.shared_us(T)
    else:
        w = float(s.attention_weight_bytes(layer)) + costs.dense_mlp_bytes
        t = dense_us(costs, a_b + costs.dense_mlp_bytes, a_f + costs.dense_mlp_flops_per_token * T,
                     hw.gpu_kernels_per_attention)
    return w, t


def slp_modules(costs: CostModel, cfg: PrefillConfig) -> dict[str, np.ndarray]:
    """The prompt's modules in stream order with their copy and compute costs (module docstring)."""
    s, T, E = costs.shape, cfg.prompt_tokens, costs.num_experts
    budget = cfg.dense_budget_gb * 1e9
    names = ("kind", "layer", "expert", "tokens", "bytes", "held", "load_us", "compute_us")
    blocks: list[tuple] = []  # per block of rows: the columns above, each a scalar or an array

    act = float(T * s.hidden_size * 2)  # the embedding rows, bf16, gathered on the host
    blocks.append((EMBED, -1, -1, T, act, 0.0, copy_us(costs, act), 0.0))
    moe_ord = {layer: i for i, layer in enumerate(costs.moe_layers)}
    fetch, experts = costs.fetch_us(), np.arange(E)
    for layer in range(costs.num_layers):
        w, t = _layer_dense(costs, layer, T, T)
        blocks.append((DENSE, layer, -1, T, w, w, copy_us(costs, w), t))
        if layer in moe_ord:
            n = _layer_tokens(costs, cfg, moe_ord[layer])
            uniq, inv = np.unique(n, return_inverse=True)
            t_of = np.array([costs.device_us(float(x)) if x > 0 else 0.0 for x in uniq])
            blocks.append((EXPERT, moe_ord[layer], experts, n, costs.expert_bytes, 0.0, fetch, t_of[inv]))
    pieces = max(1, math.ceil(costs.lm_head_bytes / budget))  # the LM head, vocabulary slices within the budget
    b = costs.lm_head_bytes / pieces
    blocks.append((HEAD, -1, np.arange(pieces), 1, b, b, copy_us(costs, b),
                   dense_us(costs, b, costs.lm_head_flops_per_token / pieces, 1)))
    sizes = [max(np.size(v) for v in blk) for blk in blocks]
    out = {}
    for i, k in enumerate(names):
        dt = object if k == "kind" else np.float64
        out[k] = np.concatenate([np.broadcast_to(np.asarray(blk[i], dtype=dt), (m,)) for blk, m in zip(blocks, sizes,
                                                                                                      strict=True)])
    return out


# ---------------------------------------------------------------------- memory
def prefill_activation_bytes(shape: Any, tokens: int) -> float:
    """Live activations of a prefill of ``tokens`` tokens (assumed): hidden state, residual and two
    intermediates in fp32 (``4 × hidden × 4 B`` per token), plus the tokens dispatched to the
    experts and their outputs in bf16 (``2 × k × hidden × 2 B`` per token)."""
    H, k = shape.hidden_size, max(int(shape.top_k), 1)
    return float(tokens * (16 * H + 4 * k * H))


def slp_memory(shape: Any, costs: CostModel, tokens: int, ring_slots: int, dense_budget_gb: float,
               extra_gpu: tuple[MemoryTerm, ...] = ()) -> MemoryNeeds:
    """GPU and host memory of SLP with ``ring_slots`` slots: dense budget, ring, the prompt's KV cache,
    workspace + prefill activations (+ ``extra_gpu``, other work's) on the GPU; every weight on the
    host (nothing is raised)."""
    hw, eb = costs.profile, costs.expert_bytes
    gpu_terms = (MemoryTerm("dense budget", dense_budget_gb * 1e9, "dense modules streamed (OSDI: about 1 GB)"),
                 MemoryTerm("expert ring", ring_slots * eb, f"{ring_slots} slots × {eb / 1e6:.1f} MB"),
                 MemoryTerm("KV cache", kv_bytes(shape, tokens, 1), f"{tokens} tokens"),
                 MemoryTerm("workspace", WORKSPACE_GB * 1e9 + prefill_activation_bytes(shape, tokens),
                            f"{WORKSPACE_GB:g} GB reserve + activations of {tokens} tokens"), *extra_gpu)
    host_terms = (MemoryTerm("weights", float(shape.total_bytes()), "every weight, streamed from here"),)
    gpu_cap = None if hw.gpu_memory_gb is None else hw.gpu_memory_gb * 1e9
    host_cap = None if hw.host_memory_gb is None else hw.host_memory_gb * 1e9
    gpu, host = Pool("GPU", gpu_terms, gpu_cap), Pool("host", host_terms, host_cap)
    max_slots = None
    if gpu_cap is not None:
        max_slots = max(0, min(costs.num_experts, math.floor((gpu_cap - gpu.need_bytes + ring_slots * eb) / eb)))
    problems = []
    fixes = {"gpu_memory_gb": f"a shorter prompt, fewer ring slots (at most {max_slots} fit beside the rest), a "
                              "smaller dense budget or dtype (--dtype fp8)",
             "host_memory_gb": "a smaller dtype (--dtype fp8 / int4)"}
    for pool, field_name in ((gpu, "gpu_memory_gb"), (host, "host_memory_gb")):
        if pool.fits is False:
            terms = ", ".join(f"{t.name} {gb(t.bytes)} ({t.detail})" for t in pool.terms)
            problems.append(f"stream-loading prefill of {tokens} tokens of {shape.name} with R={ring_slots} needs "
                            f"{gb(pool.need_bytes)} of {pool.name} memory, {hw.name} has {pool.capacity_bytes / 1e9:g} "
                            f"GB ({field_name}) — {terms}. Fix: {fixes[field_name]}, or more memory "
                            f"(--set {field_name}=SIZE).")
    return MemoryNeeds(shape.name, hw.name, ring_slots, ring_slots, gpu, host, (), max_slots, tuple(problems))


def choose_ring(costs: CostModel, cfg: PrefillConfig, mods: dict[str, np.ndarray],
                extra_gpu: tuple[MemoryTerm, ...] = ()) -> tuple[int, str, MemoryNeeds]:
    """(R, why, memory): ``cfg.ring_slots`` or the rule; refuses (:class:`MemoryDoesNotFit`) what does not fit."""
    shape, E, T = costs.shape, costs.num_experts, cfg.prompt_tokens
    if cfg.ring_slots is not None:
        R = min(int(cfg.ring_slots), E)
        why = "given" + (f" (capped at E={E})" if cfg.ring_slots > R else "")
    else:
        moe = mods["kind"] == EXPERT
        transfer = mods["load_us"][moe].sum() / costs.num_moe_layers
        compute = mods["compute_us"][moe].sum() / costs.num_moe_layers
        if transfer >= compute:
            R, why = E, (f"R=E: transfer dominates (experts' copies {transfer / 1e3:.3g} ms ≥ their compute "
                         f"{compute / 1e3:.3g} ms per MoE layer)")
        else:
            R, why = min(2, E), (f"R=2: past the turning point (experts' compute {compute / 1e3:.3g} ms > their "
                                 f"copies {transfer / 1e3:.3g} ms per MoE layer)")
        if R == E and R > 2 and slp_memory(shape, costs, T, R, cfg.dense_budget_gb, extra_gpu).problems:
            R, why = 2, f"R=2: activations + {E} slots overflow GPU memory"
    needs = slp_memory(shape, costs, T, R, cfg.dense_budget_gb, extra_gpu)
    if needs.problems:
        raise MemoryDoesNotFit(" ".join(needs.problems), needs)
    return R, why, needs


# ---------------------------------------------------------------------- the two paths
def slp_schedule(costs: CostModel, cfg: PrefillConfig, *, gpu: Any = None,
                 extra_gpu: tuple[MemoryTerm, ...] = ()) -> tuple[StreamSchedule, str, MemoryNeeds]:
    """The SLP schedule of ``cfg``'s prompt (the ring chosen by :func:`choose_ring`); ``gpu``: other
    work sharing the GPU (:func:`stream_schedule`), ``extra_gpu`` its GPU memory."""
    mods = slp_modules(costs, cfg)
    R, why, needs = choose_ring(costs, cfg, mods, extra_gpu)
    ring = mods["kind"] == EXPERT
    ls, le, cs, ce, slot = stream_schedule(mods["load_us"], mods["compute_us"], ring, R, budget_bytes=mods["held"],
                                           dense_budget=cfg.dense_budget_gb * 1e9, gpu=gpu)
    sched = StreamSchedule(mods["kind"].astype(str), mods["layer"].astype(np.int64), mods["expert"].astype(np.int64),
                           mods["tokens"], mods["bytes"], slot, ls, le, cs, ce, R)
    return sched, why, needs


def hybrid_time_us(costs: CostModel, cfg: PrefillConfig) -> tuple[float, dict[str, float]]:
    """The hybrid path (module docstring): (prefill µs, busy µs by stage: gpu, link, cpu)."""
    s, hw, T, C = costs.shape, costs.profile, cfg.prompt_tokens, cfg.chunk_tokens
    busy = {"gpu": 0.0, "link": 0.0, "cpu": 0.0}
    host_memo: dict[int, float] = {}
    done = 0
    while done < T:
        c = min(C, T - done)
        done += c
        if c not in host_memo:
            a, n = expected_load(c, costs.num_experts, s.top_k)
            host_memo[c] = costs.lanes_us([], [], [(e, n) for e in range(a)], tokens=c)[1]
        act = 2 * copy_us(costs, c * s.hidden_size * 2)  # activations to the host and back
        for layer in range(costs.num_layers):
            gpu = _layer_dense(costs, layer, c, done, cached=done - c)[1]
            busy["gpu"] += gpu
            if layer in costs.moe_layers:
                busy["cpu"] += host_memo[c]
                busy["link"] += act
                busy["gpu"] += hw.sync_us
    busy["gpu"] += dense_us(costs, costs.lm_head_bytes, costs.lm_head_flops_per_token, 1)
    return busy["gpu"] + busy["link"] + busy["cpu"], busy


def hybrid_memory(costs: CostModel, T: int) -> MemoryNeeds:
    """The hybrid path's memory: the simulator's model with no expert slots (dense weights and the
    prompt's KV cache on the GPU, the experts on the host); refuses what does not fit."""
    return check_memory(costs.shape, costs.profile, capacity=0, context=int(T), batch=1)


def _slp_time(costs: CostModel, cfg: PrefillConfig) -> float | None:
    try:
        return slp_schedule(costs, cfg)[0].time_us
    except MemoryDoesNotFit:
        return None


def crossover_tokens(costs: CostModel, cfg: PrefillConfig) -> int | None:
    """The shortest prompt at which SLP prefills faster than the hybrid path: a doubling scan from 16
    tokens up to ``cfg.t_max`` (or the longest prompt SLP fits), then bisection to one token, assuming
    one crossing between the bracketing lengths. None: SLP never wins within the range."""
    def slp_wins(t: int) -> bool | None:
        c = replace(cfg, prompt_tokens=t, crossover=False, path="slp")
        ts = _slp_time(costs, c)
        return None if ts is None else ts <= hybrid_time_us(costs, c)[0]

    lo, t = 0, 16
    while t <= cfg.t_max:
        w = slp_wins(t)
        if w is None:
            return None
        if w:
            break
        lo, t = t, t * 2
    else:
        return None
    hi = t
    if lo == 0:
        lo = 1
        if slp_wins(1):
            return 1
    while hi - lo > 1:  # slp loses at lo, wins at hi
        mid = (lo + hi) // 2
        if slp_wins(mid):
            hi = mid
        else:
            lo = mid
    return hi


# ---------------------------------------------------------------------- the result
@dataclass
class PrefillResult:
    """A prefill's prediction: the path taken, its time, and what it rests on."""

    shape: str
    hardware: str
    path: str
    prompt_tokens: int
    time_us: float
    slp_time_us: float | None
    hybrid_time_us: float | None
    ring_slots: int | None
    ring_reason: str
    crossover_tokens: int | None
    busy_us: dict[str, float]
    chunk_tokens: int
    schedule: StreamSchedule | None = field(default=None, repr=False)
    memory: MemoryNeeds | None = field(default=None, repr=False)
    assumptions: tuple[str, ...] = ()
    crossover_searched: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / (self.time_us * 1e-6) if self.time_us > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "hardware": self.hardware, "path": self.path, "prompt_tokens": self.prompt_tokens,
                "time_ms": self.time_us / 1e3, "tokens_per_s": self.tokens_per_s,
                "slp_time_ms": None if self.slp_time_us is None else self.slp_time_us / 1e3,
                "hybrid_time_ms": None if self.hybrid_time_us is None else self.hybrid_time_us / 1e3,
                "ring_slots": self.ring_slots, "ring_reason": self.ring_reason,
                "crossover_tokens": self.crossover_tokens, "busy_ms": {k: v / 1e3 for k, v in self.busy_us.items()},
                "chunk_tokens": self.chunk_tokens, "assumptions": list(self.assumptions),
                "memory": None if self.memory is None else self.memory.to_dict()}

    def events(self, run: str = "slp"):
        """The SLP schedule as events (:mod:`moelab.simulate.prefill_events`)."""
        from moelab.simulate.prefill_events import slp_events

        if self.schedule is None:
            raise MoelabError(f"this prefill took the {self.path} path; events are drawn for the SLP schedule "
                              "(path='slp', or 'auto' at a prompt past the crossover).")
        return slp_events(self.schedule, run=run)


ASSUMPTIONS = (
    "uniform routing: round(E·(1−(1−k/E)^T)) experts active, each with T·k/active tokens (unless a routing is given)",
    "SLP streams every weight (dense modules, experts, LM head slices) over one copy engine; the unloader costs 0 µs",
    "attention costed as the simulator's dense task at the causal average context (MLA in the up-projected form prefill kernels run)",
    "GPU expert FLOPs at the profile's gpu_peak_tflops whatever the weights' dtype",
    "hybrid path: dense weights resident on the GPU; per chunk and layer GPU work, activation copies and CPU experts "
    "run one after the other (OSDI §3.3.1: no overlap)",
    "hybrid path, MLA: each chunk up-projects the cached latent KV of the prompt before it (2·r·h·(d_nope+d_v) FLOPs "
    "per cached token and layer), as chunked-prefill kernels that attend in the up-projected form do",
    "prefill activations: T × (4·hidden fp32 + 2·k·hidden bf16) bytes; the embedding rows gathered on the host",
)


def prefill(shape: Any, profile: Any, cfg: PrefillConfig) -> PrefillResult:
    """Predict the prefill of ``cfg.prompt_tokens`` tokens of ``shape`` on ``profile`` (a profile, its
    name or a :class:`CostModel`) on ``cfg.path``; ``auto`` takes SLP from the crossover on."""
    if int(shape.num_experts) < 1 or not shape.moe_layers:
        raise MoelabError(f"{shape.name} has no MoE layers: stream-loading prefill streams experts; use a MoE shape.")
    costs = cost_model(shape, profile)
    searched = cfg.crossover or cfg.path == "auto"
    cross = crossover_tokens(costs, cfg) if searched else None
    path = cfg.path
    if path == "auto":
        path = "slp" if cross is not None and cfg.prompt_tokens >= cross else "hybrid"
    sched, why, needs, t_slp, t_hyb = None, "", None, None, None
    if path == "slp":
        sched, why, needs = slp_schedule(costs, cfg)
        t_slp = sched.time_us
        busy = sched.busy_us()
        try:
            hybrid_memory(costs, cfg.prompt_tokens)
            t_hyb = hybrid_time_us(costs, cfg)[0]
        except MemoryDoesNotFit:
            t_hyb = None
    else:
        needs = hybrid_memory(costs, cfg.prompt_tokens)
        t_hyb, busy = hybrid_time_us(costs, cfg)
        t_slp = _slp_time(costs, cfg)
    return PrefillResult(shape.name, costs.profile.name, path, cfg.prompt_tokens, t_slp if path == "slp" else t_hyb,
                         t_slp, t_hyb, None if sched is None else sched.ring_slots, why, cross, busy,
                         cfg.chunk_tokens, sched, needs, ASSUMPTIONS, searched)


def format_prefill(r: PrefillResult) -> str:
    """The CLI's text for one prediction: the path, time and rate, both paths' times, the ring, the
    crossover, stage busy time, memory, and every assumption."""
    def ms(v: float | None) -> str:
        return "does not fit" if v is None else f"{v / 1e3:,.1f} ms ({r.prompt_tokens / (v * 1e-6):,.0f} tok/s)"

    lines = [f"{r.shape} on {r.hardware}: prefill of {r.prompt_tokens} tokens on the {r.path} path: "
             f"{r.time_us / 1e3:,.1f} ms, {r.tokens_per_s:,.0f} tokens/s",
             f"  SLP (stream-loading, GPU): {ms(r.slp_time_us)}",
             f"  hybrid (GPU attention, CPU experts, chunks of {r.chunk_tokens}): {ms(r.hybrid_time_us)}"]
    if r.ring_slots is not None:
        lines.append(f"  ring: R={r.ring_slots} slots ({r.ring_reason})")
    cross = ("not searched" if not r.crossover_searched else
             "SLP never faster in the range searched" if r.crossover_tokens is None else
             f"SLP faster from {r.crossover_tokens} tokens")
    lines.append(f"  crossover (search over prompt length): {cross}")
    lines.append("  busy: " + ", ".join(f"{k} {v / 1e3:,.1f} ms" for k, v in r.busy_us.items()))
    if r.memory is not None:
        lines += ["  memory: " + m for m in r.memory.summary().splitlines()]
    lines += [f"  assumed: {a}" for a in r.assumptions]
    return "\n".join(lines)


__all__ = ["CHUNK_TOKENS", "DENSE_BUDGET_GB", "PATHS", "PrefillConfig", "PrefillResult", "StreamSchedule",
           "choose_ring", "crossover_tokens", "dense_us", "expected_load", "format_prefill", "hybrid_time_us", "prefill",
           "prefill_activation_bytes", "reexpand_flops", "slp_memory", "slp_modules", "slp_schedule",
           "stream_schedule"]
