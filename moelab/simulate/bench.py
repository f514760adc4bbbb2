"""``moelab bench simulate``: simulated events per second, reference vs fast engine, and their parity.

The workload is a DeepSeek-V3-sized decode (58 MoE layers, 256 experts, top-8, one shared
expert) of ``--tokens`` steps planned by :func:`random_plans`: random routing with a
popularity skew, a per-layer LRU device cache, misses on the host (inserted into the
cache) or fetched, a share of each token's experts deferred, and a few prefetches for the
next layer. The shape is the catalog's DeepSeek-V3 (:mod:`moelab.simulate.shapes`).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

import numpy as np

from moelab.measure import measure

log = logging.getLogger(__name__)


def deepseek_v3_shape() -> Any:
    """DeepSeek-V3 from the packaged shape catalog (MLA attention, as its config.json says)."""
    from moelab.simulate.shapes import get_shape

    return get_shape("deepseek-v3")


def random_plans(*, steps: int, layers: int, experts: int, top_k: int, expert_bytes: int, capacity: float = 0.25,
                 deferred: int = 2, fetch_share: float = 0.05, insert: bool = False, prefetch: int = 2,
                 tokens: int = 1, seed: int = 0, skew: float = 1.0) -> list:
    """Decode plans of a simple planner over random routing (see the module docstring).

    Routing: each token picks ``top_k`` distinct experts with Zipf(``skew``) popularity (a
    random permutation per layer); the lowest-ranked ``deferred`` run deferred (not in the last
    layer). Device cache: ``capacity`` × experts per layer, LRU, filled at the start (a
    KTransformers-style static set when ``insert`` is False). A miss is fetched (a demand copy,
    then cached) with probability ``fetch_share``, else it runs on the host (and is cached with
    an ``insert`` copy if ``insert``). ``prefetch`` guesses per layer are copied for the next one.

    Size: the knobs of the benchmark's random plans, each with a default.
    """
    from collections import OrderedDict

    from moelab.hybrid.runtime import LayerPlan, Transfer

    rng = np.random.default_rng(seed)
    logp = -skew * np.log(np.arange(1, experts + 1))
    perms = np.stack([rng.permutation(experts) for _ in range(layers)])
    slots = min(max(int(round(capacity * experts)), 0), experts)
    # Gumbel top-k: the top_k of logp + Gumbel noise are a draw without replacement (sorted by rank)
    noise = logp + rng.gumbel(size=(steps, layers, tokens, experts))
    ranked = np.argsort(-noise, axis=-1)[..., :top_k]
    chosen = perms[np.arange(layers)[None, :, None, None], ranked].tolist()
    caches = [OrderedDict((int(e), True) for e in perms[layer][:slots]) for layer in range(layers)]
    fetch_draw = rng.random((steps, layers, top_k * tokens)).tolist()
    guesses_all = perms[np.arange(layers)[None, :, None], np.argsort(-(logp + rng.gumbel(
        size=(steps, layers, experts))), axis=-1)[..., :prefetch]].tolist() if prefetch else None
    plans = []
    pending_prefetch: dict[int, set[int]] = {}
    for step in range(steps):
        for layer in range(layers):
            lp = LayerPlan(forward=step, step=step, phase="decode", layer=layer, tokens=tokens)
            counts: dict[int, int] = {}
            deferred_counts: dict[int, int] = {}
            d = deferred if layer < layers - 1 else 0
            for row in chosen[step][layer]:
                for j, e in enumerate(row):
                    if j >= top_k - d:
                        deferred_counts[e] = deferred_counts.get(e, 0) + 1
                    else:
                        counts[e] = counts.get(e, 0) + 1
            lp.deferred = sorted(deferred_counts.items())
            cache = caches[layer]
            pf = pending_prefetch.pop(layer, set())
            draws = fetch_draw[step][layer]
            for k, (e, n) in enumerate(counts.items()):
                lp.accessed.append(e)
                if e in cache:
                    cache.move_to_end(e)
                    lp.hits.append(e)
                    lp.device.append((e, n))
                    continue
                lp.misses.append(e)
                fetch = slots > 0 and draws[k] < fetch_share
                if fetch or (insert and slots):
                    if len(cache) >= slots:
                        victim, _ = cache.popitem(last=False)
                        lp.evictions.append((layer, victim))
                    cache[e] = True
                    lp.transfers.append(Transfer(layer, e, expert_bytes, "demand" if fetch else "insert"))
                (lp.device if fetch else lp.host).append((e, n))
            lp.prefetch_hits = [e for e in lp.hits if e in pf]  # type: ignore[attr-defined]
            if guesses_all is not None and slots and layer + 1 < layers:
                nxt = caches[layer + 1]
                new = set()
                for e in guesses_all[step][layer + 1]:
                    if e in nxt:
                        continue
                    if len(nxt) >= slots:
                        victim, _ = nxt.popitem(last=False)
                        lp.evictions.append((layer + 1, victim))
                    nxt[e] = True
                    new.add(e)
                    lp.transfers.append(Transfer(layer + 1, e, expert_bytes, "prefetch"))
                pending_prefetch[layer + 1] = new
            plans.append(lp)
    return plans


def events_equal(a, b) -> bool:
    """Two event tables are equal: the same rows, discrete columns exactly, times to 1e-9 relative."""
    if len(a) != len(b):
        return False
    for c in ("run", "step", "layer", "lane", "kind", "expert", "tokens", "bytes", "cause"):
        if not (a[c].astype(str).to_numpy() == b[c].astype(str).to_numpy()).all():
            return False
    return all(np.allclose(a[c].to_numpy(), b[c].to_numpy(), rtol=1e-9, atol=1e-6) for c in ("t_start_us", "t_end_us"))


def run(tokens: int = 512, hardware: str = "ktransformers-a100", reference_tokens: int = 16, seed: int = 0,
        repeat: int = 3) -> dict:
    """Time the fast path on ``tokens`` decode steps (median of ``repeat``) and the reference on
    ``reference_tokens`` (it runs at tens of thousands of events/s), and check parity on the
    reference's plans."""
    from moelab.simulate.executor import simulate_plans

    shape = deepseek_v3_shape()
    t = time.perf_counter()
    plans = random_plans(steps=tokens, layers=len(shape.moe_layers), experts=shape.num_experts, top_k=shape.top_k,
                         expert_bytes=int(shape.expert_bytes()), seed=seed)
    plan_s = time.perf_counter() - t
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
    t, c = time.perf_counter(), time.process_time()
    ref = simulate_plans(small, shape, hardware, engine="reference", reference_graph=True)
    ref_s, ref_cpu = time.perf_counter() - t, time.process_time() - c
    fast_small = simulate_plans(small, shape, hardware, engine="fast")
    summary = fast.summary()
    return {
        "shape": getattr(shape, "name", "?"), "hardware": hardware, "decode_tokens": tokens, "plans": len(plans),
        "plan_generation_s": plan_s,
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
        f"({r['plans']} layer plans; generated in {r['plan_generation_s']:.2f} s)",
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
