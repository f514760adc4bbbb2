"""One request prefills (stream-loading) while others decode, sharing one GPU.

>>> m = mixed_prefill_decode(shape, "osdi26-5090", PrefillConfig(prompt_tokens=8192), decode_batch=4)
>>> m.prefill_us / m.prefill_alone_us, m.decode_tokens_per_s, m.decode_tokens_per_s_alone

OSDI '26 §3.3.2 runs SLP on one GPU while the other GPU and the CPU decode. A profile here models
one GPU, so the two share it; the model (assumed where the paper is silent):

* **GPU** — one lane, non-preemptive, switching between work at SLP module boundaries: SLP's
  compute stream (:func:`moelab.simulate.prefill.stream_schedule` with a shared GPU) and decode's
  GPU jobs. A decode job goes first when it is ready no later than SLP's next module (decode's
  latency target; the paper serves prefill FCFS and batches decode up to ``Y``).
* **decode** (§3.3.1) — ``decode_batch`` sequences at ``decode_context`` tokens; per decoder layer
  a GPU job (attention, router, shared experts or the dense MLP: the simulator's dense task, from
  the one cost model) then, in MoE layers, a CPU job (the routed experts of the batch,
  :meth:`~moelab.timing.costs.CostModel.lanes_us`, uniform routing), strictly alternating; the LM
  head on the GPU ends a step. Dense weights and KV cache resident on the GPU.
* **DRAM** — the one host copy of the weights is shared zero-copy, so SLP's copies and the CPU
  experts read the same memory: during the prefill a CPU job reads at ``numa bandwidth ×
  cpu_memory_efficiency − link rate / numa_nodes`` (the copies spread over the nodes; applied for
  the whole prefill, an upper bound on the contention when the loader idles).
* **memory** — decode's dense weights, KV cache and activations on the GPU beside SLP's terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moelab.errors import MoelabError
from moelab.simulate.prefill import (
    PrefillConfig,
    StreamSchedule,
    dense_us,
    expected_load,
    slp_schedule,
)
from moelab.timing.costs import CostModel, cost_model
from moelab.timing.memory import (
    MemoryNeeds,
    MemoryTerm,
    activation_bytes,
    dense_weight_bytes,
    kv_bytes,
)


@dataclass
class MixedResult:
    """SLP of one prompt with ``decode_batch`` sequences decoding beside it on the same GPU."""

    prompt_tokens: int
    decode_batch: int
    decode_context: int
    prefill_us: float
    prefill_alone_us: float
    decode_step_alone_us: float
    decode_steps: int
    """Decode steps completed while the prefill ran."""
    gpu_busy_us: dict[str, float]
    ring_slots: int
    cpu_slowdown: float
    """Factor on a CPU expert job's memory-bound time while SLP streams (DRAM contention)."""
    schedule: StreamSchedule | None = field(default=None, repr=False)
    memory: MemoryNeeds | None = field(default=None, repr=False)

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode tokens/s while the prefill runs (steps finished within it × batch)."""
        return self.decode_steps * self.decode_batch / (self.prefill_us * 1e-6)

    @property
    def decode_tokens_per_s_alone(self) -> float:
        return self.decode_batch / (self.decode_step_alone_us * 1e-6)

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "decode_batch": self.decode_batch,
                "decode_context": self.decode_context, "prefill_ms": self.prefill_us / 1e3,
                "prefill_alone_ms": self.prefill_alone_us / 1e3, "decode_steps": self.decode_steps,
                "decode_tokens_per_s": self.decode_tokens_per_s,
                "decode_tokens_per_s_alone": self.decode_tokens_per_s_alone,
                "gpu_busy_ms": {k: v / 1e3 for k, v in self.gpu_busy_us.items()}, "ring_slots": self.ring_slots,
                "cpu_slowdown": self.cpu_slowdown, "memory": None if self.memory is None else self.memory.to_dict()}


def decode_jobs(costs: CostModel, batch: int, context: int, cpu_slowdown: float = 1.0) -> list[tuple[float, float]]:
    """(GPU µs, CPU µs) per decoder layer of one decode step, then the LM head (module docstring)."""
    hw = costs.profile
    a_b, a_f = costs.attention(context, batch, False)
    a, n = expected_load(batch, costs.num_experts, costs.shape.top_k)
    cpu = costs.lanes_us([], [], [(e, n) for e in range(a)], tokens=batch)[1] * cpu_slowdown
    jobs = []
    for layer in range(costs.num_layers):
        if layer in costs.moe_layers:
            g = dense_us(costs, a_b + costs.router_bytes, a_f + costs.router_flops_per_token * batch,
                         hw.gpu_kernels_per_attention) + costs.shared_us(batch) + hw.sync_us
            jobs.append((g, cpu))
        else:
            jobs.append((dense_us(costs, a_b + costs.dense_mlp_bytes, a_f + costs.dense_mlp_flops_per_token * batch,
                                  hw.gpu_kernels_per_attention), 0.0))
    jobs.append((dense_us(costs, costs.lm_head_bytes, costs.lm_head_flops_per_token * batch, 1), 0.0))
    return jobs


class _DecodeLane:
    """Decode as the GPU's other work: runs its GPU jobs on the shared GPU before SLP's next module
    whenever they are ready no later than it (the ``gpu`` callable of :func:`stream_schedule`)."""

    def __init__(self, jobs: list[tuple[float, float]]) -> None:
        self.jobs, self.i, self.ready, self.busy = jobs, 0, 0.0, 0.0
        self.step_ends: list[float] = []

    def __call__(self, j: int, load_end: float, free: float) -> float:
        t = free
        while self.ready <= max(load_end, t):
            g, c = self.jobs[self.i]
            t = max(t, self.ready) + g
            self.busy += g
            self.ready = t + c
            self.i += 1
            if self.i == len(self.jobs):
                self.i = 0
                self.step_ends.append(self.ready)
        return max(load_end, t)


def cpu_slowdown(costs: CostModel) -> float:
    """A memory-bound CPU job's slowdown while SLP's copies read the same DRAM (module docstring)."""
    hw = costs.profile
    bw = hw.numa_node_bandwidth_gbs * 1e3 * hw.cpu_memory_efficiency
    left = bw - costs.link_cap / hw.numa_nodes
    if left <= 0:
        raise MoelabError(f"{hw.name}: the link ({costs.link_cap / 1e3:g} GB/s) would take all of a NUMA node's "
                          f"{bw / 1e3:g} GB/s; CPU decode cannot run beside stream-loading prefill on this profile.")
    return bw / left


def mixed_prefill_decode(shape: Any, profile: Any, cfg: PrefillConfig, *, decode_batch: int,
                         decode_context: int = 1024) -> MixedResult:
    """SLP of ``cfg.prompt_tokens`` while ``decode_batch`` sequences at ``decode_context`` decode on
    the same GPU (module docstring); refuses (``MemoryDoesNotFit``) what does not fit."""
    for what, v, low in (("decode_batch", decode_batch, 1), ("decode_context", decode_context, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise MoelabError(f"mixed prefill + decode: {what} is {v!r}; expected an integer ≥ {low}.")
    costs = cost_model(shape, profile)
    extra = (MemoryTerm("decode dense weights", dense_weight_bytes(shape), "resident for decode (§3.3.1)"),
             MemoryTerm("decode KV cache", kv_bytes(shape, decode_context, decode_batch),
                        f"{decode_batch} sequences × {decode_context} tokens"),
             MemoryTerm("decode activations", activation_bytes(shape, decode_batch), f"batch {decode_batch}"))
    alone, _, _ = slp_schedule(costs, cfg, extra_gpu=extra)
    slow = cpu_slowdown(costs)
    lane = _DecodeLane(decode_jobs(costs, decode_batch, decode_context, slow))
    sched, _, needs = slp_schedule(costs, cfg, gpu=lane, extra_gpu=extra)
    step_alone = sum(g + c for g, c in decode_jobs(costs, decode_batch, decode_context))
    end = sched.time_us
    return MixedResult(cfg.prompt_tokens, decode_batch, decode_context, end, alone.time_us, step_alone,
                       sum(t <= end for t in lane.step_ends), {"slp": sched.busy_us()["compute"], "decode": lane.busy},
                       sched.ring_slots, slow, sched, needs)


def format_mixed(m: MixedResult) -> str:
    """The CLI's text for :func:`mixed_prefill_decode`."""
    return "\n".join([
        f"prefill of {m.prompt_tokens} tokens (SLP, R={m.ring_slots}) beside {m.decode_batch} decoding sequence(s) "
        f"at context {m.decode_context}, one GPU shared:",
        f"  prefill: {m.prefill_us / 1e3:,.1f} ms ({m.prefill_alone_us / 1e3:,.1f} ms alone, "
        f"×{m.prefill_us / m.prefill_alone_us:.3f})",
        f"  decode during the prefill: {m.decode_steps} steps, {m.decode_tokens_per_s:,.1f} tokens/s "
        f"({m.decode_tokens_per_s_alone:,.1f} tokens/s alone)",
        f"  GPU busy: SLP {m.gpu_busy_us['slp'] / 1e3:,.1f} ms, decode {m.gpu_busy_us['decode'] / 1e3:,.1f} ms; "
        f"CPU experts ×{m.cpu_slowdown:.3f} slower while SLP streams (DRAM shared)",
        *(f"  memory: {line}" for line in (m.memory.summary().splitlines() if m.memory else [])),
        "  assumed: one GPU shared at module boundaries, decode first; decode GPU/CPU alternate per layer "
        "(OSDI §3.3.1); uniform routing; DRAM contention for the whole prefill",
    ])


__all__ = ["MixedResult", "cpu_slowdown", "decode_jobs", "format_mixed", "mixed_prefill_decode"]
