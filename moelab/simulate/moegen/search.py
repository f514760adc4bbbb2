"""MoE-Gen's search (Eqs. 1–3) and the on-demand offloading baseline it is compared with.

:func:`plan_throughput` maximises ``B / T(B, S_Expert, S_Params, b_a, b_e, ω)`` subject to

* host memory (Eq. 2): ``S_KV-CPU(B) + S_Model ≤ m_c`` — every weight and the whole KV cache;
* GPU memory (Eq. 3): ``S_Params + S_Expert + S_Dense + S_KV-GPU(b_a) + S_IS(B, b_a, b_e) ≤ m_g``,

by enumeration: ``b_a`` and ``b_e`` over powers of two, ``ω ∈ {0, 0.1, …, 1}`` (decode), the
expert slots over ``1, 2, 4, …`` up to the experts per layer, the dense modules pinned or
prefetched, and then as many routed experts pinned as the GPU holds beside the rest (pinning
never slows a layer). Decode fixes ``B`` at the host-memory maximum (:func:`max_batch`);
prefill searches ``B`` over powers of two too. Every candidate's memory is counted with
:mod:`moelab.timing.memory`'s terms (:func:`schedule_memory`), and only candidates that fit
are evaluated; a configuration the caller pins that does not fit raises
:class:`~moelab.timing.memory.MemoryDoesNotFit` with every term.

The **baseline** (:func:`on_demand_baseline`) is on-demand offloading as MoE-Gen compares
against it: the KV cache on the GPU (so ``B`` is what GPU memory holds), attention over the
whole batch, every active expert copied when its layer needs it into one slot and computed
after its copy, with nothing prefetched.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Any

from moelab.errors import MoelabError
from moelab.simulate.moegen.schedule import (
    ASSUMPTIONS,
    LayerCosts,
    StepTime,
    ThroughputConfig,
    step_lower_bound_us,
    step_time,
)
from moelab.timing.costs import CostModel
from moelab.timing.memory import (
    WORKSPACE_GB,
    MemoryDoesNotFit,
    MemoryNeeds,
    MemoryTerm,
    Pool,
    activation_bytes,
    gb,
    kv_bytes,
)
from moelab.timing.profile import get_profile
from moelab.timing.shapes import get_shape

log = logging.getLogger(__name__)

OMEGAS: tuple[float, ...] = tuple(i / 10 for i in range(11))


def _terms(lc: LayerCosts, cfg: ThroughputConfig, *, kv_on_gpu: bool = False,
           workspace_gb: float = WORKSPACE_GB) -> tuple[list[MemoryTerm], list[MemoryTerm]]:
    """(GPU terms, host terms) of ``cfg`` (Eqs. 2–3). ``kv_on_gpu``: the baseline's placement."""
    s, c = lc.shape, lc.costs
    M, E, eb = s.num_moe_layers, s.num_experts, float(s.expert_bytes())
    B, ba, be = cfg.batch, cfg.micro_batch, cfg.expert_batch
    ctx = cfg.memory_context
    model = float(s.total_bytes())
    kv_all = kv_bytes(s, ctx, B)
    dense_all = float(sum(lc.dense_module_bytes(i in s.moe_layers) for i in range(s.num_layers)))
    dense_one = max(lc.dense_module_bytes(True), lc.dense_module_bytes(False) if s.num_layers > M else 0.0)
    rows = cfg.tokens_per_step
    ba_rows = min(ba, B) * (1 if cfg.phase == "decode" else cfg.prompt)
    # activations of every row but logits of one b_e chunk (the LM head runs in chunks)
    inter = activation_bytes(s, rows) - rows * s.vocab_size * 4.0 + min(be, B) * s.vocab_size * 4.0 + ba_rows * (lc.q_dim + s.num_heads * lc.v_dim) * lc.act_bytes
    inter += min(be, rows) * 2 * max(s.expert_intermediate, s.shared_intermediate * max(s.num_shared_experts, 1),
                                     s.dense_intermediate) * 4.0
    att_ctx = ctx if cfg.phase == "decode" else cfg.prompt
    inter += min(ba, B) * s.num_heads * att_ctx * 4.0 * (1 if cfg.phase == "decode" else cfg.prompt)  # scores, fp32
    if lc.mla:
        inter += min(ba, B) * att_ctx * s.num_heads * (s.qk_nope_head_dim + s.qk_rope_head_dim + s.v_head_dim) \
            * lc.act_bytes
    gpu = []
    if kv_on_gpu:
        gpu.append(MemoryTerm("KV cache (on the GPU)", kv_all, f"batch {B} × {ctx} tokens, {s.num_layers} layers"))
    else:
        kv_stage = 2 * min(ba, B) * ctx * lc.kv_tok
        gpu.append(MemoryTerm("S_KV-GPU", kv_stage, f"2 staging buffers × b_a {min(ba, B)} × {ctx} tokens × "
                              f"{lc.kv_tok:g} B (one layer)"))
    gpu += [
        MemoryTerm("S_Params (dense)" if cfg.pin_dense else "S_Dense", dense_all if cfg.pin_dense else 2 * dense_one,
                   "every layer's attention, router, shared experts, dense MLP" if cfg.pin_dense else
                   "two layers' dense modules (the current and the prefetched next)"),
        MemoryTerm("S_Params (experts)", cfg.pinned_experts * eb, f"{cfg.pinned_experts} of {M} × {E} routed experts"),
        MemoryTerm("S_Expert", cfg.expert_slots * eb, f"{cfg.expert_slots} expert slots × {eb / 1e6:.1f} MB"),
        MemoryTerm("LM head", float(c.lm_head_bytes), "resident (the embedding stays on the host)"),
        MemoryTerm("S_IS", inter, f"batch-{rows} activations, one chunk's logits, one micro-batch's Q/O, scores"
                   + (" and up-projected MLA KV" if lc.mla else "") + f", one b_e-{be} expert chunk"),
        MemoryTerm("workspace", workspace_gb * 1e9, "CUDA context, library workspaces (moelab.timing.memory)"),
    ]
    host = [MemoryTerm("S_Model", model, f"every weight of {s.name} ({s.dtype})")]
    if not kv_on_gpu:
        host.append(MemoryTerm("S_KV-CPU", kv_all, f"batch {B} × {ctx} tokens × {lc.kv_tok:g} B × {s.num_layers} "
                               "layers"))
    return gpu, host


def schedule_memory(lc: LayerCosts, cfg: ThroughputConfig, *, kv_on_gpu: bool = False,
                    workspace_gb: float = WORKSPACE_GB) -> MemoryNeeds:
    """The GPU and host memory ``cfg`` needs (:class:`~moelab.timing.memory.MemoryNeeds`; ``problems``
    names every term of a pool that does not fit)."""
    hw = lc.hw
    gpu_t, host_t = _terms(lc, cfg, kv_on_gpu=kv_on_gpu, workspace_gb=workspace_gb)
    gcap = None if hw.gpu_memory_gb is None else hw.gpu_memory_gb * 1e9
    hcap = None if hw.host_memory_gb is None else hw.host_memory_gb * 1e9
    notes = tuple(f"{hw.name} does not state {k}; not checked" for k, v in
                  (("gpu_memory_gb", gcap), ("host_memory_gb", hcap)) if v is None)
    if hw.device_shares_host_memory:  # a CPU worker is the device: one memory holds every term
        host_t, gpu_t, gcap = gpu_t + host_t, [], 0.0
        notes += (f"{hw.name}'s device shares host memory: every term is counted against host memory",)
    gpu, host = Pool("GPU", tuple(gpu_t), gcap), Pool("host", tuple(host_t), hcap)
    problems = []
    for pool, fld in ((gpu, "gpu_memory_gb"), (host, "host_memory_gb")):
        if pool.fits is False:
            terms = ", ".join(f"{t.name} {gb(t.bytes)} ({t.detail})" for t in pool.terms if t.bytes)
            problems.append(f"{lc.shape.name} at batch {cfg.batch}, b_a {cfg.micro_batch}, b_e {cfg.expert_batch}: the "
                            f"{pool.name} needs {gb(pool.need_bytes)} of {hw.name}'s {pool.capacity_bytes / 1e9:g} GB "
                            f"({fld}) — {terms}.")
    return MemoryNeeds(lc.shape.name, hw.name, cfg.pinned_experts, cfg.expert_slots, gpu, host, notes,
                       problems=tuple(problems))


def max_batch(lc: LayerCosts, context: int) -> int:
    """Eq. 2's largest ``B``: ``(m_c − S_Model) // (KV bytes of one sequence at context)``; raises
    :class:`MemoryDoesNotFit` when not even one sequence fits."""
    s, hw = lc.shape, lc.hw
    if hw.host_memory_gb is None:
        raise MoelabError(f"{hw.name} does not state host_memory_gb; MoE-Gen's B is set by host memory: add it "
                          f"(--set host_memory_gb=SIZE).")
    per_seq = kv_bytes(s, context, 1)
    free = hw.host_memory_gb * 1e9 - float(s.total_bytes())
    B = int(free // per_seq) if per_seq > 0 else 0
    if B < 1:
        cfg = ThroughputConfig(batch=1, prompt=max(context, 1), generate=0)
        needs = schedule_memory(lc, cfg)
        raise MemoryDoesNotFit(f"{s.name}'s weights ({gb(float(s.total_bytes()))}) and one sequence's KV cache at "
                               f"{context} tokens ({gb(per_seq)}) need more than {hw.name}'s {hw.host_memory_gb:g} GB "
                               f"host memory (host_memory_gb). Fix: a smaller dtype (--dtype fp8 / int4), a shorter "
                               f"context, or more host memory (--set host_memory_gb=SIZE).", needs)
    return B


@dataclass(frozen=True)
class Evaluated:
    """One configuration, its step time and its memory."""

    config: ThroughputConfig
    step: StepTime
    memory: MemoryNeeds

    @property
    def tokens_per_s(self) -> float:
        return self.step.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {**self.config.to_dict(), "tokens_per_s": self.tokens_per_s, "step_ms": self.step.step_us / 1e3,
                "moe_layer_ms": self.step.moe_layer_us / 1e3, "dense_layer_ms": self.step.dense_layer_us / 1e3,
                "memory": {"gpu": {t.name: t.bytes / 1e9 for t in self.memory.gpu.terms},
                           "host": {t.name: t.bytes / 1e9 for t in self.memory.host.terms},
                           **self.memory.to_dict()}}


@dataclass(frozen=True)
class ThroughputPlan:
    """The search's answer: the best configuration, its tokens/s and memory, the baseline, what was assumed."""

    shape: str
    profile: str
    phase: str
    best: Evaluated
    baseline: Evaluated | None
    candidates: int
    """Configurations that fit and were evaluated."""
    refused: int
    """Configurations the memory limits ruled out."""
    assumptions: tuple[str, ...] = field(default=ASSUMPTIONS)

    @property
    def tokens_per_s(self) -> float:
        return self.best.tokens_per_s

    @property
    def speedup(self) -> float | None:
        """Best tokens/s over the baseline's (None without a baseline)."""
        if self.baseline is None or not self.baseline.tokens_per_s:
            return None
        return self.best.tokens_per_s / self.baseline.tokens_per_s

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "profile": self.profile, "phase": self.phase, "tokens_per_s": self.tokens_per_s,
                "best": self.best.to_dict(), "baseline": None if self.baseline is None else self.baseline.to_dict(),
                "speedup": self.speedup, "candidates": self.candidates, "refused": self.refused,
                "assumptions": list(self.assumptions)}


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    if hi >= lo and hi not in out:
        out.append(hi)
    return out


def _max_pinned(lc: LayerCosts, cfg: ThroughputConfig) -> int:
    """The most routed experts the GPU holds beside ``cfg``'s other terms (−1: not even none fits)."""
    s, hw = lc.shape, lc.hw
    needs = schedule_memory(lc, replace(cfg, pinned_experts=0))
    pool = needs.host if hw.device_shares_host_memory else needs.gpu
    if pool.capacity_bytes is None:
        return s.num_moe_layers * s.num_experts
    free = pool.capacity_bytes - pool.need_bytes
    if free < 0 or (not hw.device_shares_host_memory and needs.host.fits is False):
        return -1
    return min(s.num_moe_layers * s.num_experts, int(free // float(s.expert_bytes())))


def _largest_fitting_batch(lc: LayerCosts, phase: str, prompt: int, generate: int, hi: int) -> int:
    """Where the device shares host memory (Eq. 2 and Eq. 3 count against one memory): the largest ``B ≤ hi``
    at which the smallest configuration (``b_a = b_e = 1``, one slot, nothing pinned) fits."""
    def fits(B: int) -> bool:
        cfg = ThroughputConfig(phase=phase, batch=B, prompt=prompt, generate=generate)  # type: ignore[arg-type]
        return schedule_memory(lc, cfg).fits is not False

    if not fits(1):
        needs = schedule_memory(lc, ThroughputConfig(phase=phase, batch=1, prompt=prompt,  # type: ignore[arg-type]
                                                     generate=generate))
        raise MemoryDoesNotFit(" ".join(needs.problems) + " Fix: a smaller dtype (--dtype fp8 / int4), a shorter "
                               "context, or more memory.", needs)
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def evaluate(lc: LayerCosts, cfg: ThroughputConfig) -> Evaluated:
    return Evaluated(cfg, step_time(lc, cfg), schedule_memory(lc, cfg))


def plan_throughput(shape: Any, profile: Any, *, phase: str = "decode", prompt: int = 512, generate: int = 256,
                    batch: int | None = None, micro_batch: int | None = None, expert_batch: int | None = None,
                    cpu_attention: float | None = None, expert_slots: int | None = None,
                    baseline: bool = True, slots_per_token: float | None = None) -> ThroughputPlan:
    """Search MoE-Gen's configuration of ``phase`` for ``shape`` on ``profile`` (names or objects) with
    ``prompt`` + ``generate`` tokens per sequence (MoE-Gen's setting: 512 + 256). A value given for
    ``batch``, ``micro_batch``, ``expert_batch``, ``cpu_attention`` or ``expert_slots`` pins that
    axis; the others are searched. ``slots_per_token``: routed experts a token runs on average (default
    the shape's top-k; a sweep passes its routing policy's, e.g. fewer under skipping). Raises
    :class:`MemoryDoesNotFit` when nothing fits.

    Size: one keyword per axis of Eqs. 1–3 a caller may pin (the CLI's options); the body is the
    branch-and-bound over the candidates in order of their lower bound, with its memory refusals.
    """
    s = get_shape(shape) if not hasattr(shape, "num_experts") else shape
    hw = get_profile(profile)
    lc = LayerCosts(CostModel.of(s, hw), slots_per_token)
    if phase not in ("decode", "prefill"):
        raise MoelabError(f"phase {phase!r}: expected decode or prefill.")
    if phase == "prefill" and cpu_attention:
        raise MoelabError(f"prefill is GPU-only in MoE-Gen: --cpu-attention must be 0, got {cpu_attention!r}.")
    ctx = prompt + (generate if phase == "decode" else 0)
    b_host = max_batch(lc, ctx)
    if batch is not None and batch > b_host:
        cfg = ThroughputConfig(phase=phase, batch=batch, prompt=prompt, generate=generate)  # type: ignore[arg-type]
        needs = schedule_memory(lc, cfg)
        raise MemoryDoesNotFit(" ".join(needs.problems) + f" Fix: a batch of at most {b_host} fits host memory "
                               f"(Eq. 2).", needs)
    if hw.device_shares_host_memory and batch is None:
        b_host = _largest_fitting_batch(lc, phase, prompt, generate, b_host)
    if batch is not None:
        batches = [batch]
    elif phase == "decode":
        batches = [b_host]
    else:
        batches = _pow2(1, min(b_host, 1024))
    E = s.num_experts
    slots = [expert_slots] if expert_slots else [v for v in _pow2(1, E) if v in (1, 2, 4, 8, E)] or [1]
    omegas = ([float(cpu_attention)] if cpu_attention is not None else
              (list(OMEGAS) if phase == "decode" else [0.0]))
    best: Evaluated | None = None
    n_bad = 0
    cands: list[tuple[float, ThroughputConfig]] = []
    first_refusal: MemoryNeeds | None = None
    for B in batches:
        tokens = B if phase == "decode" else B * prompt
        _, n_e = lc.expert_tokens(tokens)
        bas = [micro_batch] if micro_batch else _pow2(max(1, B // 512), B)
        bes = [expert_batch] if expert_batch else _pow2(min(64, n_e), 1 << max(0, math.ceil(math.log2(max(n_e, 1)))))
        for ba in bas:
            for be in bes:
                for sl in slots:
                    for pin_dense in (False, True):
                        base = ThroughputConfig(phase=phase, batch=B, micro_batch=ba, expert_batch=be,  # type: ignore[arg-type]
                                                expert_slots=sl, pin_dense=pin_dense, prompt=prompt, generate=generate)
                        p = _max_pinned(lc, base)
                        if p < 0:
                            n_bad += len(omegas)
                            if first_refusal is None:
                                first_refusal = schedule_memory(lc, base)
                            continue
                        for w in omegas:
                            cfg = replace(base, cpu_attention=w, pinned_experts=p)
                            cands.append((cfg.tokens_per_step / step_lower_bound_us(lc, cfg) * 1e6, cfg))
    # branch and bound: evaluate in order of the bound (the busiest engine's sum); once a candidate's bound
    # cannot beat the best found, no later one can — the answer is that of evaluating every candidate
    cands.sort(key=lambda x: -x[0])
    for bound, cfg in cands:
        if best is not None and bound <= best.step.tokens_per_s:
            break
        st = step_time(lc, cfg)
        if best is None or st.tokens_per_s > best.step.tokens_per_s:
            best = Evaluated(cfg, st, None)  # type: ignore[arg-type]
    n_ok = len(cands)
    if best is None:
        needs = first_refusal
        raise MemoryDoesNotFit("no MoE-Gen configuration of " + s.name + f" fits {hw.name}: "
                               + " ".join(needs.problems if needs else ())
                               + " Fix: a smaller dtype (--dtype fp8 / int4), a smaller --micro-batch or "
                               "--expert-batch, a shorter context, or more GPU memory (--set gpu_memory_gb=SIZE).",
                               needs)  # type: ignore[arg-type]
    best = Evaluated(best.config, best.step, schedule_memory(lc, best.config))
    if best.memory.fits is False:  # the candidates were built to fit: a broken invariant, not bad input
        raise MoelabError("internal error: the MoE-Gen search chose a configuration that does not fit: "
                          + " ".join(best.memory.problems))
    base_eval = on_demand_baseline(s, hw, phase=phase, prompt=prompt, generate=generate,
                                   slots_per_token=slots_per_token) if baseline else None
    log.info("MoE-Gen %s search of %s on %s: %d configurations, %d refused by memory", phase, s.name, hw.name,
             n_ok, n_bad)
    return ThroughputPlan(s.name, hw.name, phase, best, base_eval, n_ok, n_bad)


def on_demand_baseline(shape: Any, profile: Any, *, phase: str = "decode", prompt: int = 512,
                       generate: int = 256, slots_per_token: float | None = None) -> Evaluated | None:
    """On-demand offloading (see the module docstring) at the largest power-of-two ``B`` whose KV cache
    fits on the GPU beside the resident dense weights and one expert slot; None if not even ``B = 1`` fits."""
    s = get_shape(shape) if not hasattr(shape, "num_experts") else shape
    hw = get_profile(profile)
    lc = LayerCosts(CostModel.of(s, hw), slots_per_token)
    best = None
    B = 1
    while B <= 1 << 16:
        tokens = B if phase == "decode" else B * prompt
        _, n_e = lc.expert_tokens(tokens)
        cfg = ThroughputConfig(phase=phase, batch=B, micro_batch=B, expert_batch=max(n_e, 1), expert_slots=1,  # type: ignore[arg-type]
                               pin_dense=True, prompt=prompt, generate=generate)
        mem = schedule_memory(lc, cfg, kv_on_gpu=True)
        if mem.fits is False:
            break
        best = Evaluated(cfg, _baseline_step(lc, cfg), mem)
        B *= 2
    return best


def _baseline_step(lc: LayerCosts, cfg: ThroughputConfig) -> StepTime:
    """The baseline's step: KV on the GPU, so no KV copies — :func:`step_time` of the same DAG with the
    KV copies and CPU attention removed (a profile copy whose KV reads cost no link time)."""
    from moelab.simulate.moegen.schedule import layer_dag

    s = lc.shape
    kv_free = _NoKvCopy(lc)
    M, D = s.num_moe_layers, s.num_layers - s.num_moe_layers
    t_moe = layer_dag(kv_free, cfg, moe=True, pinned=0, record=False).T
    t_dense = layer_dag(kv_free, cfg, moe=False, record=False).T if D else 0.0
    lm = lc.lm_head_us(cfg)
    return StepTime(M * t_moe + D * t_dense + lm, cfg.tokens_per_step, t_moe, t_dense, lm, M, D)


class _NoKvCopy(LayerCosts):
    """The baseline's costs: the KV cache lives on the GPU, so a micro-batch's "KV HtoD" moves nothing
    (the copy job costs 0: the DAG is otherwise MoE-Gen's with ``b_a = B``, one slot, ω = 0)."""

    def __init__(self, lc: LayerCosts) -> None:
        self.__dict__.update(lc.__dict__)
        self._memo = {}

    def kv_copy_us(self, nbytes: float) -> float:
        return 0.0


__all__ = ["OMEGAS", "Evaluated", "ThroughputPlan", "evaluate", "max_batch", "on_demand_baseline", "plan_throughput",
           "schedule_memory"]
