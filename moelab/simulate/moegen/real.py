"""The simulation a real module-batched run on this machine corresponds to (:mod:`moelab.hybrid.throughput`).

A CPU stand-in makes none of MoE-Gen's copies (the "device" is host memory): the real run's
configuration is MoE-Gen's with ``ω = 0`` and every routed expert and dense module resident, and
its DAG's copy jobs cost 0 (:class:`InPlaceCosts`). ``moelab bench throughput``
(:mod:`moelab.simulate.moegen.bench`) compares the two.
"""

from __future__ import annotations

from typing import Any

from moelab.simulate.moegen.schedule import LayerCosts, ThroughputConfig, step_time
from moelab.simulate.moegen.search import schedule_memory
from moelab.timing.costs import CostModel
from moelab.timing.profile import get_profile


class InPlaceCosts(LayerCosts):
    """MoE-Gen's costs where the device shares host memory and nothing is copied: every copy job
    (KV, hidden states, FFN chunks' tokens and outputs, expert weights, dense modules) costs 0."""

    def __init__(self, lc: LayerCosts) -> None:
        self.__dict__.update(lc.__dict__)
        self._memo = {}

    def copy_us(self, nbytes: float) -> float:
        return 0.0

    def kv_copy_us(self, nbytes: float) -> float:
        return 0.0


def real_config(model_shape: Any, batch: int, micro_batch: int, expert_batch: int, prompt: int,
                steps: int) -> ThroughputConfig:
    """The :class:`~moelab.simulate.moegen.ThroughputConfig` a real run on this machine corresponds to:
    ``ω = 0``, every routed expert and dense module pinned (resident), decode of ``steps`` tokens after
    a ``prompt``-token prompt."""
    return ThroughputConfig(phase="decode", batch=batch, micro_batch=micro_batch, expert_batch=expert_batch,
                            cpu_attention=0.0, expert_slots=1,
                            pinned_experts=model_shape.num_moe_layers * model_shape.num_experts, pin_dense=True,
                            prompt=prompt, generate=steps)


def simulated_step(model_shape: Any, profile: Any, batch: int, micro_batch: int, expert_batch: int, prompt: int,
                   steps: int):
    """(the simulator's :class:`~moelab.simulate.moegen.StepTime`, its memory needs) of the configuration
    :func:`real_config` — MoE-Gen's DAG with the copies a CPU stand-in does not make costed at 0."""
    hw = get_profile(profile)
    lc = InPlaceCosts(LayerCosts(CostModel.of(model_shape, hw)))
    cfg = real_config(model_shape, batch, micro_batch, expert_batch, prompt, steps)
    return step_time(lc, cfg), schedule_memory(lc, cfg)


def offloaded_config(model_shape: Any, batch: int, micro_batch: int, expert_batch: int, prompt: int, steps: int,
                     expert_slots: int, pinned_experts: int, pin_dense: bool = False) -> ThroughputConfig:
    """The :class:`~moelab.simulate.moegen.ThroughputConfig` of a real run of
    :class:`moelab.hybrid.throughput_offload.OffloadedDecoder` on a GPU: ``ω = 0``, ``expert_slots``
    slots in ``S_Expert``, ``pinned_experts`` resident, the dense modules streamed (or resident,
    ``pin_dense``).

    Size: the configuration's fields one to one."""
    return ThroughputConfig(phase="decode", batch=batch, micro_batch=micro_batch, expert_batch=expert_batch,
                            cpu_attention=0.0, expert_slots=expert_slots, pinned_experts=pinned_experts,
                            pin_dense=pin_dense, prompt=prompt, generate=steps)


def simulated_offloaded_step(model_shape: Any, profile: Any, cfg: ThroughputConfig):
    """(:class:`~moelab.simulate.moegen.StepTime`, memory needs) of ``cfg`` (an :func:`offloaded_config`)
    on ``profile`` with every copy at the profile's link rates (MoE-Gen's DAG as the simulator builds it:
    it also charges the hidden-state copies the real decoder does not make)."""
    lc = LayerCosts(CostModel.of(model_shape, get_profile(profile)))
    return step_time(lc, cfg), schedule_memory(lc, cfg)


__all__ = ["InPlaceCosts", "offloaded_config", "real_config", "simulated_offloaded_step", "simulated_step"]
