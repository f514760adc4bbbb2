"""The one cost model: what each unit of work of a model shape costs on a hardware profile.

:class:`CostModel` is built from a :class:`~moelab.timing.shapes.ModelShape` and a
:class:`~moelab.timing.profile.HardwareProfile` (``CostModel.of(shape, profile)``) and is read by
everyone who needs a time: the placement policies (:mod:`moelab.hybrid.placement`) and so the
planner, prefetch budgets, and the simulator (:mod:`moelab.simulate.executor`), which charges
every task it schedules from the same methods. So an expert's *planned* cost equals its
*simulated* time when it runs alone (tests/test_timing_costs.py checks it for every shipped
profile).

Each kernel is a roofline ``max(bytes / (bandwidth × efficiency), FLOPs / (peak × efficiency))``
plus its fixed costs:

============================ =================================================================
:meth:`CostModel.device_us`  one routed expert on the device: ``gpu_kernels_per_expert`` launches
                             + the roofline of its weights and ``tokens`` rows
:meth:`CostModel.host_us`    one routed expert on the host: ``cpu_dispatch_us`` + the roofline at
                             one NUMA node's bandwidth (``numa_node_bandwidth_gbs ×
                             cpu_memory_efficiency``) and that node's share of the peak
:meth:`CostModel.fetch_us`   one expert host→device: the profile's :class:`~moelab.timing.link.Link`
:meth:`CostModel.shared_us`  the layer's shared experts on the device
``device_call_us``           once per MoE layer with device work (``gpu_call_us`` +
                             ``runtime_call_us``)
``host_call_us``             once per MoE layer and host lane with host work (``cpu_call_us`` +
                             ``runtime_call_us``)
``control_layer_us``         the executor's control thread per MoE layer (``runtime_layer_us``)
============================ =================================================================

The host has ``host_lanes`` lanes (one per NUMA node; expert ``e`` runs on node
``e % numa_nodes``); :meth:`CostModel.lanes_us` gives a layer's (device, host) finish times
for a split of its experts, the quantity the cost-aware placements minimise.

With ``device_shares_host_memory`` (a CPU-only machine) the simulator time-shares the cores
between lanes; a task *alone* still takes exactly the time given here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moelab.timing.profile import HardwareProfile, get_profile


@dataclass(frozen=True)
class CostModel:
    """Per-kernel costs of one model shape on one profile (times in µs, rates in bytes/µs)."""

    profile: HardwareProfile
    num_experts: int
    num_moe_layers: int
    moe_layers: tuple[int, ...]
    num_layers: int
    expert_bytes: float
    expert_flops_per_token: float
    shared_bytes: float
    shared_flops_per_token: float
    dense_mlp_bytes: float
    dense_mlp_flops_per_token: float
    router_bytes: float
    router_flops_per_token: float
    lm_head_bytes: float
    lm_head_flops_per_token: float
    shape: Any = field(repr=False, compare=False, default=None)

    @classmethod
    def of(cls, shape: Any, profile: HardwareProfile | str) -> CostModel:
        """The cost model of ``shape`` (a :class:`~moelab.timing.shapes.ModelShape`) on ``profile``
        (a profile, its registered name or a YAML path)."""
        hw = get_profile(profile)
        # the LM head is read in the activation dtype: 2 bytes for bf16/fp16, 4 for fp32, else the
        # shape's bytes per parameter
        bpp_act = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0}.get(shape.dtype, float(shape.bytes_per_param()))
        shared_b = float(shape.shared_bytes()) if shape.num_shared_experts else 0.0
        shared_f = float(shape.shared_flops(1))
        dense_b = float(shape.dense_mlp_bytes())
        dense_f = float(shape.dense_mlp_flops(1))
        router_b = float(shape.router_bytes())
        return cls(
            profile=hw, num_experts=int(shape.num_experts), num_moe_layers=len(shape.moe_layers),
            moe_layers=tuple(int(x) for x in shape.moe_layers), num_layers=int(shape.num_layers),
            expert_bytes=float(shape.expert_bytes()), expert_flops_per_token=float(shape.expert_flops(1)),
            shared_bytes=shared_b, shared_flops_per_token=shared_f if shared_b else 0.0,
            dense_mlp_bytes=dense_b, dense_mlp_flops_per_token=dense_f if dense_b else 0.0,
            router_bytes=router_b, router_flops_per_token=2.0 * shape.num_experts * shape.hidden_size,
            lm_head_bytes=float(shape.vocab_size * shape.hidden_size * bpp_act),
            lm_head_flops_per_token=2.0 * shape.vocab_size * shape.hidden_size,
            shape=shape,
        )

    # ------------------------------------------------------------------ rates (bytes per µs)
    # a kernel reading ``nbytes`` with ``flops`` runs at ``nbytes / roofline time``
    def _cap(self, nbytes, flops, bw_gbs, eff, tflops, ceff):
        t_mem = np.asarray(nbytes, dtype=np.float64) / (bw_gbs * 1e3 * eff)
        t_cmp = np.asarray(flops, dtype=np.float64) / (tflops * 1e6 * ceff)
        t = np.maximum(t_mem, t_cmp)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(t > 0, np.asarray(nbytes, dtype=np.float64) / np.where(t > 0, t, 1.0), 1.0)

    def device_cap(self, nbytes, flops):
        hw = self.profile
        return self._cap(nbytes, flops, hw.gpu_memory_bandwidth_gbs, hw.gpu_memory_efficiency,
                         hw.gpu_peak_tflops, hw.gpu_compute_efficiency)

    def dense_cap(self, nbytes, flops):
        """Rate of the dense work between MoE blocks (``gpu_dense_efficiency`` × an expert kernel's)."""
        hw = self.profile
        return self._cap(nbytes, flops, hw.gpu_memory_bandwidth_gbs,
                         hw.gpu_memory_efficiency * hw.gpu_dense_efficiency, hw.gpu_peak_tflops,
                         hw.gpu_compute_efficiency)

    def host_cap(self, nbytes, flops):
        hw = self.profile
        return self._cap(nbytes, flops, hw.numa_node_bandwidth_gbs, hw.cpu_memory_efficiency,
                         hw.cpu_peak_tflops / hw.numa_nodes, 1.0)

    @property
    def link_cap(self) -> float:
        """Bytes per µs of one host→device copy: the profile's :class:`~moelab.timing.link.Link`,
        at most what its NUMA node's memory gives (a copy reads host memory)."""
        return min(self.profile.link.bandwidth_gbs, self.profile.numa_node_bandwidth_gbs) * 1e3

    @property
    def node_cap(self) -> float:
        """Bytes per µs one NUMA node's memory gives its readers together (host experts and copies)."""
        return self.profile.numa_node_bandwidth_gbs * 1e3

    # ------------------------------------------------------------------ fixed costs
    @property
    def device_expert_fixed_us(self) -> float:
        """Launches of one routed (or the shared) expert on the device."""
        return self.profile.gpu_kernels_per_expert * self.profile.gpu_launch_us

    @property
    def host_expert_fixed_us(self) -> float:
        return self.profile.cpu_dispatch_us

    @property
    def device_call_us(self) -> float:
        """Once per MoE layer that has device work (the experts call's hand-off; with a calibrated
        ``runtime_call_us``, moelab's executor's lane hand-off too — :mod:`moelab.simulate.runtime`)."""
        return self.profile.gpu_call_us + self.profile.runtime_call_us

    @property
    def host_call_us(self) -> float:
        """Once per MoE layer and host lane that has host work (+ ``runtime_call_us``)."""
        return self.profile.cpu_call_us + self.profile.runtime_call_us

    @property
    def control_layer_us(self) -> float:
        """The control thread's own cost per MoE layer in moelab's executor (``runtime_layer_us``;
        0 on a profile of the hardware alone)."""
        return self.profile.runtime_layer_us

    @property
    def host_lanes(self) -> int:
        """Host lanes: one per NUMA node; expert ``e`` runs on lane ``e % host_lanes``."""
        return int(self.profile.numa_nodes)

    # ------------------------------------------------------------------ one unit of work, alone
    # (scalar forms of the rates above, memoised per token count: the placements ask them for
    # every split they weigh)
    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})

    def _roofline_us(self, nbytes: float, flops: float, bw_gbs: float, eff: float, tflops: float,
                     ceff: float) -> float:
        return max(nbytes / (bw_gbs * 1e3 * eff), flops / (tflops * 1e6 * ceff))

    def _memoised(self, key: tuple, fn) -> float:
        memo = self._memo
        v = memo.get(key)
        if v is None:
            v = memo[key] = fn()
        return v

    def device_us(self, tokens: int) -> float:
        """One routed expert with ``tokens`` rows on the device (launches + roofline)."""
        hw = self.profile
        return self._memoised(("d", tokens), lambda: self.device_expert_fixed_us + self._roofline_us(
            self.expert_bytes, self.expert_flops_per_token * tokens, hw.gpu_memory_bandwidth_gbs,
            hw.gpu_memory_efficiency, hw.gpu_peak_tflops, hw.gpu_compute_efficiency))

    def host_us(self, tokens: int) -> float:
        """One routed expert with ``tokens`` rows on its host lane (dispatch + roofline)."""
        hw = self.profile
        return self._memoised(("h", tokens), lambda: self.host_expert_fixed_us + self._roofline_us(
            self.expert_bytes, self.expert_flops_per_token * tokens, hw.numa_node_bandwidth_gbs,
            hw.cpu_memory_efficiency, hw.cpu_peak_tflops / hw.numa_nodes, 1.0))

    def fetch_us(self) -> float:
        """One expert over the host→device link (latency + bytes at :attr:`link_cap`)."""
        return self._memoised(("f",), lambda: self.profile.link.latency_us + self.expert_bytes / self.link_cap)

    def shared_us(self, tokens: int) -> float:
        """The layer's shared experts on the device (0 without shared experts)."""
        if not self.shared_bytes:
            return 0.0
        hw = self.profile
        return self._memoised(("s", tokens), lambda: self.device_expert_fixed_us + self._roofline_us(
            self.shared_bytes, self.shared_flops_per_token * tokens, hw.gpu_memory_bandwidth_gbs,
            hw.gpu_memory_efficiency, hw.gpu_peak_tflops, hw.gpu_compute_efficiency))

    def device_finish_us(self, device: Sequence[tuple[int, int]], fetch: Sequence[tuple[int, int]], *,
                         tokens: int = 1) -> float:
        """When the device lane finishes a MoE layer (0: no device work): its call, the shared
        experts, the ``device`` (resident) experts, then each ``fetch`` expert once its copy (FIFO
        on the link) and the device are both free."""
        dev, paid = 0.0, False  # the device call's fixed cost is paid by the layer's first device task
        if device or self.shared_bytes:
            dev = self.device_call_us + self.shared_us(tokens) + sum(self.device_us(n) for _, n in device)
            paid = True
        link = 0.0
        for _, n in fetch:
            link += self.fetch_us()
            dev = max(dev, link) + self.device_us(n) + (0.0 if paid else self.device_call_us)
            paid = True
        return dev

    def lanes_us(self, device: Sequence[tuple[int, int]], fetch: Sequence[tuple[int, int]],
                 host: Sequence[tuple[int, int]], *, tokens: int = 1) -> tuple[float, float]:
        """(device finish, host finish) of one MoE layer, from the layer's start, as the control
        thread learns them: :meth:`device_finish_us`; each host lane runs its ``host`` experts (a
        node's host lane no faster than the bytes it and its copies read over the node's
        bandwidth); when the device worked, the control thread synchronises with it (``sync_us``)
        after both, so each finish carries the sync. The layer's time is the larger of the two.
        Pairs are ``(expert, tokens)``; ``tokens`` is the layer's real tokens (shared experts)."""
        dev = self.device_finish_us(device, fetch, tokens=tokens)
        lanes = [0.0] * self.host_lanes
        for e, n in host:
            lane = e % self.host_lanes
            lanes[lane] += (self.host_call_us if lanes[lane] == 0.0 else 0.0) + self.host_us(n)
        if fetch and host and not self.profile.device_shares_host_memory:
            # the copies read their NUMA node's memory too: a node's host experts and copies
            # together cannot read faster than the node gives
            read = [0.0] * self.host_lanes
            for e, _ in host:
                read[e % self.host_lanes] += self.expert_bytes
            for e, _ in fetch:
                read[e % self.host_lanes] += self.expert_bytes
            lanes = [max(t, r / self.node_cap) if t else t for t, r in zip(lanes, read)]
        host_end = max(lanes)
        if dev:
            sync = self.profile.sync_us
            return dev + sync, host_end + sync
        return dev, host_end

    def attention(self, context: float, batch: int, prefill: bool) -> tuple[float, float]:
        """(bytes, FLOPs) of one decoder layer's attention at ``context`` for ``batch`` rows."""
        s = self.shape
        if prefill:  # one sequence of ``batch`` tokens; each attends to half the context on average
            return float(s.attention_bytes(int(context), 1)), float(s.attention_flops(max(int(context) // 2, 1), batch,
                                                                               prefill=True))
        return float(s.attention_bytes(int(context), batch)), float(s.attention_flops(int(context), batch))


def cost_model(shape: Any, profile: HardwareProfile | str | CostModel) -> CostModel:
    """``profile`` as a :class:`CostModel` of ``shape`` (a cost model is returned as is)."""
    if isinstance(profile, CostModel):
        return profile
    return CostModel.of(shape, profile)


__all__ = ["CostModel", "cost_model"]
