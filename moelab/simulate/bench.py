"""``moelab bench simulate``: simulated events per second, reference vs fast engine, and their parity.

The workload is a DeepSeek-V3-sized decode (58 MoE layers, 256 experts, top-8, one shared
expert) of ``--tokens`` steps of random routing with a popularity skew (:func:`random_routing`),
planned by the hybrid planner itself (:func:`moelab.hybrid.offline.plan_routing`, as a running
model plans) under :func:`bench_config`: a per-layer LRU device cache of 25 %, misses run on
the host (and inserted into the cache), two of each token's experts deferred, and two
prefetches per layer for the next one (the ``repeat`` predictor). The shape is the catalog's
DeepSeek-V3 (:mod:`moelab.timing.shapes`).

The plans come from the compiled planner where numba is installed (:func:`bench_planner`; the
planner of a running model's real executor), whose plans keep packed records that the encoder
reads with numpy (:mod:`moelab.simulate.records`); ``planner="reference"`` times the encoder on
the Python planner's lists instead. Either way the plans are equal field by field, and the
reference engine runs on the plans' lists, so the parity covers both readings.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Any

import numpy as np

from moelab.errors import MoelabError
from moelab.measure import measure
from moelab.routing import ForwardRouting
from moelab.timing.shapes import get_shape

log = logging.getLogger(__name__)


def deepseek_v3_shape() -> Any:
    """DeepSeek-V3 from the packaged shape catalog (MLA attention, as its config.json says)."""

    return get_shape("deepseek-v3")


def bench_config(*, capacity: float = 0.25, policy: str = "lru", placement: str = "host-misses", deferred: int = 2,
                 prefetch: int = 2, predictor: str = "repeat", hardware: str = "pcie4-x16") -> dict:
    """The hybrid configuration the benchmark plans with (:class:`moelab.hybrid.config.HybridConfig`
    as a dict): a ``policy`` device cache of ``capacity`` per MoE layer (none at 0), misses placed by
    ``placement`` (its cost model on ``hardware`` where it has one), ``deferred`` experts of each
    token deferred, and up to ``prefetch`` experts per layer prefetched for the next one by
    ``predictor`` (``repeat``: what that layer needed at the previous step; ``oracle``: what it
    needs now; none without a cache)."""
    config: dict = {"cache": {"capacity": capacity, "policy": policy}, "placement": placement, "hardware": hardware,
                    "routing": {"deferred": deferred, "min_immediate": 1}}
    if prefetch and capacity:
        config["prefetch"] = {"predictor": predictor, "distance": 1, "budget": prefetch}
    return config


def random_routing(*, steps: int, layers: int, experts: int, top_k: int, tokens: int = 1, seed: int = 0,
                   skew: float = 1.0) -> list:
    """Decode forwards (:class:`moelab.routing.ForwardRouting`) of random routing: each of ``tokens``
    tokens picks ``top_k`` distinct experts per MoE layer with Zipf(``skew``) popularity (a random
    permutation of the experts per layer), in descending weight (the softmax of their perturbed
    logits)."""
    rng = np.random.default_rng(seed)
    logp = -skew * np.log(np.arange(1, experts + 1))
    perms = np.stack([rng.permutation(experts) for _ in range(layers)])
    # Gumbel top-k: the top_k of logp + Gumbel noise are a draw without replacement (sorted by rank)
    noise = logp + rng.gumbel(size=(steps, layers, tokens, experts))
    ranked = np.argsort(-noise, axis=-1)[..., :top_k]
    ids = perms[np.arange(layers)[None, :, None, None], ranked]
    logits = np.take_along_axis(noise, ranked, axis=-1)
    weights = np.exp(logits - logits[..., :1])
    weights = (weights / weights.sum(axis=-1, keepdims=True)).astype(np.float32)
    return [ForwardRouting(forward=step, step=step, phase="decode", tokens=tokens,
                           ids=list(ids[step].astype(np.int64)), weights=list(weights[step]))
            for step in range(steps)]


def random_plans(shape: Any, config: dict, *, steps: int, tokens: int = 1, seed: int = 0) -> list:
    """Decode plans of the hybrid planner over :func:`random_routing` for ``shape`` (a
    :class:`~moelab.timing.shapes.ModelShape`) under ``config`` (:func:`bench_config`): the
    plans :func:`moelab.hybrid.offline.plan_routing` makes, the planner of a running model."""
    from moelab.hybrid.offline import plan_routing

    L = len(shape.moe_layers)
    routing = random_routing(steps=steps, layers=L, experts=shape.num_experts, top_k=shape.top_k, tokens=tokens,
                             seed=seed)
    return plan_routing(routing, config, num_experts=[shape.num_experts] * L, top_k=[shape.top_k] * L,
                        expert_bytes=int(shape.expert_bytes()), shape=shape)


def events_equal(a, b) -> bool:
    """Two event tables are equal: the same rows, discrete columns exactly, times to 1e-9 relative."""
    if len(a) != len(b):
        return False
    for c in ("run", "step", "layer", "lane", "kind", "expert", "tokens", "bytes", "cause"):
        if not (a[c].astype(str).to_numpy() == b[c].astype(str).to_numpy()).all():
            return False
    return all(np.allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=1e-9, atol=1e-6) for c in ("t_start_us", "t_end_us"))


def bench_planner(planner: str = "auto") -> str:
    """The planner the benchmark plans with: ``compiled`` (:mod:`moelab.hybrid._compiled`, whose plans
    keep packed records the simulator's encoder reads directly: the planner a running model's real
    executor uses) or ``reference`` (the Python planner: plain lists, which the encoder reads
    instead); ``auto``: compiled where numba is installed. ``$MOELAB_PLANNER`` still overrides."""
    from moelab.hybrid.config import PLANNERS

    if planner not in PLANNERS:
        raise MoelabError(f"bench planner {planner!r}: expected one of {', '.join(PLANNERS)}.")
    from moelab.hybrid._compiled import ENV

    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("compiled", "reference"):
        return forced
    if planner != "auto":
        return planner
    from moelab.caches._fast import HAVE_NUMBA

    return "compiled" if HAVE_NUMBA else "reference"


def run(tokens: int = 512, hardware: str = "ktransformers-a100", reference_tokens: int = 16, seed: int = 0,
        repeat: int = 3, planner: str = "auto") -> dict:
    """Time the fast path on ``tokens`` decode steps (median of ``repeat``) and the reference on
    ``reference_tokens`` (it runs at tens of thousands of events/s), and check parity on the
    reference's plans. ``planner``: :func:`bench_planner` (the plans' content is the same either
    way; what differs is whether the encoder reads packed records or Python lists)."""
    from moelab.simulate.executor import simulate_plans
    from moelab.simulate.records import plan_columns

    shape = deepseek_v3_shape()
    t = time.perf_counter()
    config = {**bench_config(hardware=hardware), "planner": bench_planner(planner)}
    plans = random_plans(shape, config, steps=tokens, seed=seed)
    plan_s = time.perf_counter() - t
    records = plan_columns(plans[:1]) is not None  # the encoder reads packed records (else lists)
    simulate_plans(plans[: len(shape.moe_layers)], shape, hardware, engine="fast")  # build + warm up
    cpu: list[float] = []
    box: dict = {}

    def fast_path() -> None:
        c = time.process_time()
        box["fast"] = simulate_plans(plans, shape, hardware, engine="fast")
        cpu.append(time.process_time() - c)

    m = measure(fast_path, warmup=0, repeat=repeat)  # the median of ``repeat``, its spread and the load
    fast, fast_s, fast_cpu = box["fast"], m.median, statistics.median(cpu)
    small = plans[: reference_tokens * len(shape.moe_layers)]
    fast_small = simulate_plans(small, shape, hardware, engine="fast")
    # the reference on the plans' lists (reading them drops a compiled plan's record): the parity
    # covers the encoder's two readings too
    small = [p.plain() if hasattr(p, "plain") else p for p in small]
    t, c = time.perf_counter(), time.process_time()
    ref = simulate_plans(small, shape, hardware, engine="reference", reference_graph=True)
    ref_s, ref_cpu = time.perf_counter() - t, time.process_time() - c
    summary = fast.summary()
    return {
        "shape": getattr(shape, "name", "?"), "hardware": hardware, "decode_tokens": tokens, "plans": len(plans),
        "plan_generation_s": plan_s, "planner": config["planner"], "plans_from": "records" if records else "lists",
        "fast": {"repeat": repeat, "events": len(fast.events), "tasks": fast.graph.n, "engine_events": fast.schedule.events,
                 "seconds": fast_s, "spread": m.spread, "load": m.load_after.get("load1"), "busy": m.reason,
                 "cpu_seconds": fast_cpu, "events_per_s": len(fast.events) / fast_s,
                 "events_per_cpu_s": len(fast.events) / max(fast_cpu, 1e-9)},
        "reference": {"decode_tokens": reference_tokens, "events": len(ref.events), "seconds": ref_s,
                      "cpu_seconds": ref_cpu, "events_per_s": len(ref.events) / ref_s,
                      "events_per_cpu_s": len(ref.events) / max(ref_cpu, 1e-9)},
        "parity": events_equal(ref.events, fast_small.events),
        "simulated": {k: summary.get(k) for k in ("decode_tokens_per_s", "decode_step_us", "busy_pct",
                                                   "overlap_pct", "stall_us")},
    }


def format_result(r: dict) -> str:
    f, ref = r["fast"], r["reference"]
    lines = [
        f"simulate bench: {r['shape']} decode of {r['decode_tokens']} tokens on {r['hardware']} "
        f"({r['plans']} layer plans of the {r['planner']} planner, read from {r['plans_from']}; generated in "
        f"{r['plan_generation_s']:.2f} s)",
        f"  fast path : {f['events']:>9,d} events in {f['seconds']:.3f} s wall ({f['cpu_seconds']:.3f} s CPU) = "
        f"{f['events_per_s'] / 1e6:.2f} M events/s ({f['events_per_cpu_s'] / 1e6:.2f} M per CPU-second; "
        f"{f['tasks']:,d} tasks, {f['engine_events']:,d} engine steps; plans → events, all included; median of "
        f"{f['repeat']}, spread ±{f['spread']:.0%}, load {f['load'] if f['load'] is None else round(f['load'], 1)})"
        + (f" — BUSY: {f['busy']}" if f["busy"] else ""),
        f"  reference : {ref['events']:>9,d} events ({ref['decode_tokens']} tokens) in {ref['seconds']:.3f} s wall = "
        f"{ref['events_per_s'] / 1e3:.1f} k events/s ({ref['events_per_cpu_s'] / 1e3:.1f} k per CPU-second)",
        f"  parity (reference vs fast, {ref['decode_tokens']} tokens): {'equal' if r['parity'] else 'DIFFERENT'}",
    ]
    s = r["simulated"]
    if s.get("decode_tokens_per_s"):
        busy = ", ".join(f"{k} {v:.0f}%" for k, v in sorted((s.get("busy_pct") or {}).items()))
        stalls = ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted((s.get("stall_us") or {}).items()))
        lines.append(f"  simulated : {s['decode_tokens_per_s']:.2f} tokens/s, step {s['decode_step_us'] / 1e3:.1f} ms; "
                     f"busy {busy}; overlap {s['overlap_pct']:.0f}%; stalls {stalls}")
    return "\n".join(lines)
