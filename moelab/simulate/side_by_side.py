"""``moelab bench hybrid --side-by-side``: plain transformers vs moelab's real executor vs the
simulator's prediction of the same run, on DeepSeek-V2-Lite-shaped layers (issue #26 item 6).

In one run, each figure the median of ``--repeats`` (≥ 7) decode loops with its spread and the
machine's load: plain transformers with each of its ``eager``, ``batched_mm`` and ``grouped_mm``
experts (the fastest is the baseline), moelab's real executor with nothing enabled (every expert
resident: capacity 1.0, no deferral, no prefetch) and with the full configuration (LRU at 25 %,
both caches warmed by frequency over a trace of the same decode loop as the realistic grid's,
``greedy-hss`` placement with the host stealing, deferral 2; no prefetch: a live run needs a
fitted predictor, and this model's weights are random), and, for both runs, the simulator's
prediction of the same plans on the calibrated profile of this machine (``--profile PROFILE`` from
``moelab calibrate``, or calibrated now with ``moelab calibrate --quick``'s settings); and what
recording the runs' events costs. Targets (issue #26): nothing enabled within 3 % of the plain
model; full configuration within 1.25x of its prediction; recording ≤ 5 % of a step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from moelab.errors import MoelabError
from moelab.forward.bench import decode_loop as _decode
from moelab.hybrid.bench import _stat, realistic_model, warm_cache
from moelab.hybrid.events import EventLog
from moelab.hybrid.runtime import HybridRun
from moelab.measure import Measurement, from_samples
from moelab.simulate.executor import simulate_plans
from moelab.simulate.validate import profile_or_calibrated
from moelab.timing.shapes import ModelShape

#: the plain model's experts implementations the side-by-side table measures (transformers 5)
PLAIN_EXPERTS: tuple[str, ...] = ("eager", "batched_mm", "grouped_mm")

#: ``device_backend`` of :func:`side_by_side` meaning "the plain experts implementation that is
#: fastest here" (:func:`fastest_plain`), so "nothing enabled" computes the resident experts as the
#: best plain row does and the two rows differ by moelab's runtime only
AUTO = "auto"


def fastest_plain(model: Any, ids: torch.Tensor, steps: int, rounds: int = 3) -> tuple[str, dict[str, float]]:
    """The plain experts implementation (:data:`PLAIN_EXPERTS`, each a registered experts backend)
    whose decode loops of ``steps`` steps on ``model`` have the lowest median over ``rounds``
    interleaved rounds (after a warm-up loop each), and each one's median seconds. The model's
    experts implementation is left as it was."""
    before = getattr(model.config, "_experts_implementation", None)
    times: dict[str, list[float]] = {impl: [] for impl in PLAIN_EXPERTS}
    try:
        _plain_warmup(model, ids)
        for _ in range(rounds):
            _plain_round(model, ids, steps, times)
    finally:
        model.config._experts_implementation = before
    med = {impl: statistics.median(t) for impl, t in times.items()}
    return min(med, key=med.__getitem__), med


def _plain_warmup(model: Any, ids: torch.Tensor) -> None:
    """A short decode loop of every plain experts implementation: packing, first copies, allocator."""
    for impl in PLAIN_EXPERTS:
        model.set_experts_implementation(impl)
        _decode(model, ids, 2)


def _plain_round(model: Any, ids: torch.Tensor, steps: int, loops: dict[str, list[float]]) -> None:
    """One timed decode loop of ``steps`` steps of every plain experts implementation, in
    :data:`PLAIN_EXPERTS` order, each appended to ``loops[impl]`` (seconds)."""
    for impl in PLAIN_EXPERTS:
        model.set_experts_implementation(impl)
        loops[impl].append(_decode(model, ids, steps))


def side_configs(profile_path: str, cache: Callable[[float], dict[str, Any]] | None = None,
                 device_backend: str = "reference") -> dict[str, dict[str, Any]]:
    """The two moelab configurations of :func:`side_by_side`: nothing enabled, and everything on.

    ``cache(capacity)`` gives each one's cache section (:func:`side_by_side` warms it by frequency
    over a trace of its own decode loop, :func:`moelab.hybrid.bench.warm_cache`, so capacity 1.0
    holds every expert from the first step); default: an empty LRU cache, which under ``host-misses``
    never fills (a miss the host computes is not copied in)."""
    cache = cache or (lambda c: {"capacity": c, "policy": "lru"})
    base = {"executor": "real", "device_backend": device_backend, "host_backend": "moelab_bf16", "device": "cpu"}
    nothing = {**base, "cache": cache(1.0), "placement": "host-misses", "routing": {"deferred": 0}}
    full = {**base, "cache": cache(0.25), "placement": "greedy-hss", "hardware": profile_path,
            "routing": {"deferred": 2, "min_immediate": 0}}
    return {"nothing enabled": nothing, "full": full}


def device_share(plans: list) -> float:
    """% of the decode plans' (expert, tokens) work on the device side (hits and fetched misses)."""
    dev = sum(n for p in plans if p.phase == "decode" for _, n in p.device)
    host = sum(n for p in plans if p.phase == "decode" for _, n in p.host)
    return 100.0 * dev / (dev + host) if dev + host else 0.0


def _loops(model, ids, steps: int, repeats: int) -> Measurement:
    _decode(model, ids, 2)  # warm-up: packing, first copies, allocator
    return from_samples([_decode(model, ids, steps) for _ in range(repeats)], warmup=0)


def event_record_us(n: int = 20000) -> float:
    """µs to record one event (:meth:`moelab.hybrid.events.EventLog.add`, its lock included), the
    median of 5 batches of ``n``: what the events of a step cost its lanes and control thread."""
    times = []
    for _ in range(5):
        log = EventLog("bench")
        t0 = time.perf_counter()
        for i in range(n):
            log.add(1, i & 7, "host", "expert-host", 1.0, 2.0, expert=3, tokens=1, nbytes=10, cause="miss")
        times.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(times)


def side_by_side(layers: int = 3, steps: int = 8, repeats: int = 7, profile: Any = None, *,
                 allow_busy: bool = False, model: Any = None, device_backend: str = AUTO) -> dict[str, Any]:
    """Plain transformers (each experts implementation) vs moelab's real executor (nothing enabled,
    full configuration) vs the simulator's prediction of those runs, on :func:`realistic_model`.

    The rows' decode loops are interleaved: each of the ``repeats`` rounds runs one loop of every
    row in turn, so a drift of the machine's speed (this project's VMs swing up to 2× between
    minutes) touches every row alike, and each row's ratio to the best plain row is also taken
    round by round (``ratio``: the median and quartiles of ``row loop / best plain loop`` over the
    rounds). A moelab run is applied for its loop only (its warm-up and set-up, a fresh warmed
    cache each time, outside the timed loop).

    ``profile``: a calibrated profile file (``moelab calibrate --out``) or a profile's name, or None
    to calibrate now (``--quick`` settings; refused on a busy machine unless ``allow_busy``).
    ``model``: another model to measure instead of ``realistic_model(layers)``. ``device_backend``: the
    experts backend of both runs' device lane: ``auto`` (default), the plain experts implementation
    that ran fastest in a short probe before anything else (:func:`fastest_plain`; the plain rows are
    still measured in the rounds), so the resident experts are computed as the best plain row
    computes them; or a backend's name (``reference``: eager maths in torch). A profile calibrated
    now measures the same backend (a given one should have: ``moelab calibrate --device-backend``).
    Returns the rows (``label``, ``measurement``, ``step_ms``, ``ratio``, ``sim_step_ms`` for
    moelab's runs), the profile used, the device lane's backend and, for ``auto``, the probe's
    median seconds per implementation (``device_backend_probe``).
    """
    if repeats < 1 or steps < 1:
        raise MoelabError(f"repeats={repeats}, steps={steps}: both must be ≥ 1 (issue #26 asks for ≥ 7 repeats).")
    from moelab.backends import get_backend

    if device_backend != AUTO:
        get_backend(device_backend)  # a did-you-mean error before anything runs
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    probe = None
    if device_backend == AUTO:  # (else the model is built once the profile is there: a refusal comes first)
        model = realistic_model(layers) if model is None else model
        device_backend, probe = fastest_plain(model, ids, steps)
    prof, path = profile_or_calibrated(profile, allow_busy=allow_busy, device_backend=device_backend)
    model = realistic_model(layers) if model is None else model
    shape = ModelShape.from_model(model, name="v2-lite-shaped")
    add_us = event_record_us()
    memo: dict = {}  # the warm-start trace, recorded once
    runs = {label: HybridRun(model, cfg)
            for label, cfg in side_configs(path, lambda c: warm_cache(c, model, ids, steps, memo),
                                           device_backend).items()}
    loops: dict[str, list[float]] = {impl: [] for impl in PLAIN_EXPERTS} | {label: [] for label in runs}
    plans: dict[str, list[list]] = {label: [] for label in runs}  # each loop's plans
    events = dict.fromkeys(runs, 0)
    before = getattr(model.config, "_experts_implementation", None)
    try:
        _plain_warmup(model, ids)
        for _ in range(repeats):
            _plain_round(model, ids, steps, loops)
            model.config._experts_implementation = before
            for label, run in runs.items():
                with run:
                    _decode(model, ids, 2)
                    n0, e0 = len(run.plans), len(run.events)
                    loops[label].append(_decode(model, ids, steps))
                    plans[label].append(run.plans[n0:])
                    events[label] += len(run.events) - e0
    finally:
        model.config._experts_implementation = before
    rows: list[dict[str, Any]] = []
    for impl in PLAIN_EXPERTS:
        m = from_samples(loops[impl], warmup=0)
        rows.append({"label": f"plain transformers, {impl} experts", "kind": "plain", "key": impl,
                     "measurement": m, "step_ms": m.median * 1e3})
    for label in runs:
        m = from_samples(loops[label], warmup=0)
        # each loop's plans are one applied run's (forward numbers restart): simulated loop by loop
        sim_us = statistics.median(simulate_plans(p, shape, prof, context=ids.shape[1] + steps // 2).summary()
                                   ["decode_step_us"] for p in plans[label])
        every = [p for loop in plans[label] for p in loop]
        per_step = events[label] / (repeats * (steps + 1))  # each loop: a prefill and its steps
        rows.append({"label": f"moelab real executor, {label}", "kind": label, "key": label, "measurement": m,
                     "step_ms": m.median * 1e3, "sim_step_ms": sim_us / 1e3,
                     "events_per_step": per_step, "recording_pct": 100 * per_step * add_us / (m.median * 1e6),
                     "device_pct": device_share(every), "device_backend": runs[label].config.device_backend})
    best = min((r for r in rows if r["kind"] == "plain"), key=lambda r: r["step_ms"])
    for row in rows:
        row["ratio"] = _ratio(loops[row["key"]], loops[best["key"]])
    return {"rows": rows, "best_plain": best, "profile": path, "layers": layers, "steps": steps, "repeats": repeats,
            "event_record_us": add_us, "device_backend": device_backend, "device_backend_probe": probe}


def _ratio(a: list[float], b: list[float]) -> dict[str, float]:
    """The median and quartiles of ``a[i] / b[i]`` over the rounds ``i``."""
    import numpy as np

    r = np.asarray(a) / np.asarray(b)
    return {"median": float(np.median(r)), "q25": float(np.percentile(r, 25)), "q75": float(np.percentile(r, 75))}


def side_table(out, layers: int, steps: int, repeats: int, profile: Any, allow_busy: bool,
               flagged: list, device_backend: str = AUTO) -> None:  # pragma: no cover - prints
    r = side_by_side(layers, steps, repeats, profile, allow_busy=allow_busy, device_backend=device_backend)
    out(f"side by side, DeepSeek-V2-Lite MoE shapes x {layers} layers, bf16, decode batch 1, "
        f"{torch.get_num_threads()} torch threads; median of {repeats} loops of {steps} steps, the rows' loops "
        f"interleaved, each ratio to the best plain row taken loop by loop (simulator: {r['profile']}):")
    out(f"  {'':44}  {'step ms':>8}  {'spread, load':>18}  {'vs best plain (quartiles)':>25}  {'simulated ms':>12}  "
        f"{'real/sim':>8}")
    for row in r["rows"]:
        flagged.append(row["measurement"])
        sim = row.get("sim_step_ms")
        tail = f"{sim:12.2f}  {row['step_ms'] / sim:8.2f}" if sim else f"{'':12}  {'':8}"
        q = row["ratio"]
        out(f"  {row['label']:44}  {row['step_ms']:8.2f}  {_stat(row['measurement']):>18}  "
            f"{q['median']:12.2f}x ({q['q25']:.2f}-{q['q75']:.2f})  {tail}")
    if r["device_backend_probe"] is not None:
        out(f"  device lane: {r['device_backend']} experts (auto: the fastest plain experts in a probe of 3 loops "
            "each before the rounds, median ms: "
            + ", ".join(f"{impl} {t * 1e3:.2f}" for impl, t in r["device_backend_probe"].items()) + ")")
    for row in r["rows"]:
        if "device_pct" in row:
            out(f"  {row['kind']}: {row['device_pct']:.0f} % of the decode steps' expert work on the device lane "
                f"({row['device_backend']} experts; a CPU worker on a machine without a GPU)")
    for row in r["rows"]:
        if "events_per_step" in row:
            out(f"  events, {row['kind']}: {row['events_per_step']:.0f} per step, recording "
                f"{row['recording_pct']:.2f} % of the step (at {r['event_record_us']:.2f} µs an event)")
    out("  targets (issue #26): nothing enabled within 3 % of the best plain (or within the spreads); "
        "full configuration within 1.25x of its simulated step; recording events ≤ 5 % of a step.")


__all__ = ["AUTO", "PLAIN_EXPERTS", "device_share", "event_record_us", "fastest_plain", "side_by_side", "side_configs",
           "side_table"]
