"""``moelab bench hybrid``: what the hybrid runtime costs, and what deferral gains on this machine.

Measurements, printed as tables:

1. **Planner cost** on the bundled models (batch 1 decode): time spent in the planner's
   handlers (the tensors-to-arrays adapter, routing slots, cache access, placement, prefetch
   issue) per MoE layer and decode step — the median of every layer plan, with the compiled
   planner (``planner: compiled``, :mod:`moelab.hybrid._compiled`) and, alternating in the same
   run, the Python reference planner on the caches' plain reference definitions — with an MRS
   cache at 25 %, a learned-predictor prefetch (the bundled
   ``learned-d1`` predictor when present) and deferral on; the predictor's own inference
   is reported beside it. Target ≤ 30 µs per layer.
2. **Control thread of the real executor** per MoE layer (:func:`control_overhead`: its ``plan``
   and ``dispatch`` events on a tiny model whose experts cost microseconds; target ≤ 50 µs), and the
   **functional executor with nothing enabled** (no cache, no routing change, no prefetch) against
   the plain model, A/B interleaved.
3. **Real executor on realistic layer shapes**: a model built from a config with random
   weights and DeepSeek-V2-Lite's MoE layers (hidden 2048, 64 routed experts of
   intermediate 1408, top-6, 2 shared experts; ``--layers`` MoE layers, bf16; attention
   dimensions stay tiny), decode step time under ``host-misses`` for deferral 0..4 and
   device capacity 0/25/50 % (an LRU cache warmed by frequency over a trace of the same decode
   loop, :func:`warm_cache`), with lane busy % and host/device overlap from the events.
   The device lane is a CPU worker here, so both lanes share this machine's cores and
   memory bandwidth.
4. The side-by-side table (plain transformers vs the real executor vs the simulator's prediction)
   is :mod:`moelab.simulate.side_by_side` (it simulates, so it sits above the hybrid package).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moelab.caches.base import ExpertCache
from moelab.errors import MoelabError
from moelab.forward.bench import decode_loop as _decode
from moelab.measure import BusyMachineError, Measurement, from_samples, spread_of


def planner_cost(model_name: str, steps: int = 64, repeats: int = 3) -> dict[str, Any]:
    """The planner's time per MoE layer and decode step (batch 1) on a bundled model.

    Runs with the caches' streamlined paths (``fast``) and with their plain reference
    definitions (``ExpertCache.fast = False``: what every policy did before the fast paths),
    alternating ``repeats`` times in this one process, so their ratio holds on a noisy
    machine. Reports per-layer-plan medians (and the mean) of the decode steps.
    """
    from moelab.adapters import moe_layers
    from moelab.hybrid.runtime import HybridRun
    from moelab.loading import load

    model, tok = load(model_name)
    ids = tok("Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:", return_tensors="pt").input_ids
    pred_dir = Path(__file__).resolve().parents[2] / "predictors" / model_name / "learned-d1"
    moe = moe_layers(model)
    layers, k = len(moe), min(layer.top_k for layer in moe)
    cfg: dict[str, Any] = {"cache": {"capacity": 0.25, "policy": "mrs"}, "placement": "greedy-hss",
                           "hardware": "pcie4-x16",
                           "routing": {"deferred": 1 if k <= 2 else 2, "min_immediate": 1}}
    if pred_dir.is_dir():
        cfg["prefetch"] = {"predictor": str(pred_dir), "distance": 1}
    samples: dict[bool, list[int]] = {True: [], False: []}
    per_repeat: dict[bool, list[float]] = {True: [], False: []}  # each repeat's median plan (s): the spread
    timing: dict[bool, dict[str, int]] = {True: {}, False: {}}
    replay: list[int] = []
    cold: list[int] = []
    evict = _evictor()
    try:
        for _ in range(repeats):
            for fast in (True, False):
                ExpertCache.fast = fast
                run = HybridRun(model, {**cfg, "planner": "compiled" if fast else "reference"})
                calls: list[tuple] = []
                copy_ns: list[int] = []
                with run:
                    _record_calls(run.planner, calls, copy_ns)
                    _decode(model, ids, 4)
                    run.timing_reset()
                    run.planner_samples = []
                    copy_ns.clear()
                    _decode(model, ids, steps)
                # the plans' own time: less what recording their inputs cost inside the timed call
                run.planner_samples = [t - c for t, c in zip(run.planner_samples, copy_ns, strict=True)]
                samples[fast] += run.planner_samples
                per_repeat[fast].append(statistics.median(run.planner_samples) / 1e9)
                for key, v in run.timing.items():
                    timing[fast][key] = timing[fast].get(key, 0) + v
                if fast:
                    replay += _replay(run, calls)
                    cold += _replay(run, calls, evict)
                    path = run.planner.path
                    compiled = run.planner._compiled
                    entry = "native entry" if compiled is not None and compiled.entry() is not None else \
                        "numba dispatcher" if compiled is not None else "python"
    finally:
        ExpertCache.fast = True
    med = {f: statistics.median(samples[f]) / 1e3 for f in (True, False)}
    n = max(timing[True]["plans"], 1)
    m = from_samples(per_repeat[True], warmup=4)
    return {
        "model": model_name, "moe_layers": layers, "prefetch": "prefetch" in cfg,
        "planner_us_per_layer": med[True], "planner_us_reference": med[False], "measurement": m,
        "planner_mean_us": timing[True]["planner_ns"] / n / 1e3,
        "planner_alone_us": statistics.median(replay) / 1e3,
        "planner_alone_cold_us": statistics.median(cold) / 1e3, "evict_mib": evict.nbytes / 2**20,
        "predictor_us_per_layer": timing[True]["predictor_ns"] / n / 1e3,
        "plans": len(samples[True]), "path": path, "entry": entry,
    }


def _kept(args: tuple) -> tuple:
    """``args`` with copies of its arrays and tensors (the planner edits a deferral's slot states in place)."""
    return tuple(a.copy() if isinstance(a, np.ndarray) else a.clone() if isinstance(a, torch.Tensor) else a
                 for a in args)


def _record_calls(planner, calls: list, copy_ns: list[int]) -> None:
    """Keep the arguments of every plan call of ``planner`` (``plan_layer``, and the compiled
    path's native entry ``plan_tensors`` where it planned): copies of its arrays and tensors (the
    runtime hands the planner the model's own tensors, which later layers and steps may reuse, and
    a deferral edits the slot states in place), the lists as they are (the adapter makes them
    afresh for the call). ``calls`` gets ``(native, args)``; ``copy_ns`` the ns each decode-step
    plan spent recording (inside the timed plan: the caller subtracts it)."""
    import time

    plan_layer, carry = planner.plan_layer, [0]  # carry: a native try's recording, when it did not plan

    def recorded(*args):
        t0 = time.perf_counter_ns()
        calls.append((False, _kept(args)))
        if args[2] == "decode":
            copy_ns.append(time.perf_counter_ns() - t0 + carry[0])
            carry[0] = 0
        return plan_layer(*args)

    planner.plan_layer = recorded
    compiled = getattr(planner, "_compiled", None)
    if compiled is None:
        return
    plan_tensors = compiled.plan_tensors

    def recorded_tensors(*args):
        t0 = time.perf_counter_ns()
        got = _kept(args)
        dt = time.perf_counter_ns() - t0
        lp = plan_tensors(*args)
        if lp is not None:
            calls.append((True, got))
        if args[2] == "decode":
            if lp is not None:
                copy_ns.append(dt)
            else:
                carry[0] += dt
        return lp

    compiled.plan_tensors = recorded_tensors


def _evictor(cache_dir: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> np.ndarray:
    """A buffer twice this machine's largest CPU cache (at least 8 MiB, at most 256 MiB; Linux's
    sysfs says the size (``cache_dir``), 16 MiB assumed where it does not): reading it evicts what
    the planner's code and state left in the caches, as a forward's dense layers do between two
    plans."""
    sizes = []
    for f in Path(cache_dir).glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 2**10, "M": 2**20, "G": 2**30}[text[-1]] if text[-1] in "KMG"
                         else int(text))
        except (OSError, ValueError, KeyError, IndexError):  # unreadable, empty or another notation
            continue
    n = min(max(2 * max(sizes, default=16 * 2**20), 8 * 2**20), 256 * 2**20)
    return np.ones(n, dtype=np.uint8)


def _replay(run, calls: list, evict: np.ndarray | None = None) -> list[int]:
    """ns of each decode-step plan when ``calls`` are replayed through a fresh planner of the
    same configuration outside the model (the planner alone: no tensors, no forward around
    it), each through the entry the run planned it with; checks that it plans exactly what
    the run planned. Each call gets copies of the recorded arguments (a deferral made in the
    planner's call edits the slot states in place), made outside its time. With ``evict``
    (:func:`_evictor`), every line of that buffer is read before each decode-step plan, outside its
    time: the planner alone with cold caches, which is how a forward's layers leave them (on the
    development VM the same calls took 13-14 µs one after another and 60-85 µs each after 4 MiB
    were read, 2026-11-29)."""
    import time

    from moelab.hybrid.planner import Planner, make_cache

    p = run.planner
    fresh = Planner(run.config, num_experts=p.num_experts, top_k=p.top_k, expert_bytes=p.expert_bytes, cost=p.cost,
                    cache=make_cache(run.config, p.num_experts, p.top_k, max(p.expert_bytes)))
    if p.deferral is not None:  # the run's deferral, handed to its planner
        fresh.defer_with(*p.deferral)
    out, dts = [], []
    for native, recorded in calls:
        args = _kept(recorded)
        if evict is not None and args[2] == "decode":
            evict[::64].sum()  # one byte a cache line: the lines are read, nothing is written
        t0 = time.perf_counter_ns()
        out.append(fresh._compiled.plan_tensors(*args) if native else fresh.plan_layer(*args))
        if args[2] == "decode":
            dts.append(time.perf_counter_ns() - t0)
    if out != run.plans:
        raise AssertionError("a replay of the run's planner inputs planned differently from the run")
    return dts


def functional_overhead(model_name: str, steps: int = 128, repeats: int = 5) -> dict[str, Any]:
    from moelab.hybrid.runtime import HybridRun
    from moelab.loading import load

    model, tok = load(model_name)
    ids = tok("Question: Tom has 3 apples and buys 5 more. How many?\nAnswer:", return_tensors="pt").input_ids
    plain, hyb = [], []
    _decode(model, ids, 4)
    for _ in range(repeats):
        plain.append(_decode(model, ids, steps))
        with HybridRun(model, {"cache": {"capacity": 0}}):
            hyb.append(_decode(model, ids, steps))
    mp, mh = from_samples(plain, warmup=1), from_samples(hyb, warmup=1)
    p, h = mp.median, mh.median
    return {"model": model_name, "plain_ms": p * 1e3, "functional_ms": h * 1e3, "overhead_pct": (h / p - 1) * 100,
            "plain": mp, "functional": mh}


def measure_executor_overhead(*, host_backend: str = "reference", device_backend: str = "reference",
                              steps: int = 6, warmup: int = 2) -> dict:
    """The real executor's control-thread cost per MoE layer, measured on a tiny model (random
    weights, 3 MoE layers, hidden 32: its experts and attention cost microseconds, so the control
    thread's ``plan`` and ``dispatch`` events are the executor's own work): host-misses with a quarter
    of the experts cached (LRU warmed by frequency over the same decode loop, :func:`warm_cache`: an
    empty cache never fills under host-misses), one deferred expert per token, ``steps`` decode
    steps after ``warmup``.
    Returns ``layer_us`` (the median over steps × MoE layers of plan + dispatch µs), its spread, the
    points, and the median of the other control-thread spans for reference."""
    from moelab.hybrid.runtime import HybridRun
    from moelab.models.tiny import build_tiny

    model = build_tiny("deepseek_v2", seed=0, dtype=torch.bfloat16)
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    memo: dict = {}  # holds the warm-start trace's directory until the run is over
    cfg = {"cache": warm_cache(0.25, model, ids, warmup + steps, memo), "placement": "host-misses",
           "executor": "real", "device_backend": device_backend, "host_backend": host_backend, "device": "cpu",
           "routing": {"deferred": 1, "min_immediate": 1}}
    run = HybridRun(model, cfg)
    with run, torch.no_grad():
        _decode(model, ids, warmup)
        first = int(run.events_table()["step"].max()) + 1
        _decode(model, ids, steps)
        ev = run.events_table()
    ev = ev[(ev["step"] > first) & (ev["lane"].astype(str) == "control") & (ev["layer"] >= 0)]  # > : no prefill
    ev = ev.assign(us=ev["t_end_us"] - ev["t_start_us"], kind=ev["kind"].astype(str))
    own = ev[ev["kind"].isin(["plan", "dispatch"])].groupby(["step", "layer"])["us"].sum()
    if not len(own):
        raise MoelabError("the real executor recorded no plan/dispatch events on the tiny model; cannot measure "
                          "its runtime overhead.")
    other = {k: float(g.groupby(["step", "layer"])["us"].sum().median()) for k, g in ev.groupby("kind")
             if k not in ("plan", "dispatch")}
    vals = own.tolist()
    return {"layer_us": float(statistics.median(vals)), "spread": spread_of(vals), "points": vals,
            "moe_layers": int(own.index.get_level_values("layer").nunique()), "steps": steps,
            "other_control_us": other, "config": cfg}


def control_overhead(repeats: int = 3, steps: int = 12, device_backend: str = "moelab") -> dict[str, Any]:
    """The real executor's control-thread cost per MoE layer (:func:`measure_executor_overhead` with
    the native host lane, ``moelab`` backend, and a device lane on ``device_backend``), ``repeats``
    times in this process: the median of the runs' medians, and each run's median for the spread
    (issue #26's target: ≤ 50 µs). Where no GPU is, the device lane is a CPU worker that runs
    "through the same compiled path" (issue #26, item 4): the native kernels on the extension's C++
    lane 1 (``moelab``, the default here); ``reference`` puts torch's reference experts on a Python
    lane thread instead, which holds the GIL between its operators and runs them on an OpenMP team
    of its own beside the control thread's."""
    runs = [measure_executor_overhead(host_backend="moelab", device_backend=device_backend, steps=steps)
            for _ in range(repeats)]
    m = from_samples([r["layer_us"] for r in runs])
    return {"layer_us": m.median, "measurement": m, "runs": [r["layer_us"] for r in runs],
            "other_control_us": runs[-1]["other_control_us"], "config": runs[-1]["config"],
            "device_backend": device_backend}


def realistic_model(layers: int = 3, dtype: torch.dtype = torch.bfloat16):
    """DeepSeek-V2-Lite's MoE layer shapes with tiny attention, random weights, ``layers`` MoE layers."""
    from moelab.models.tiny import build_tiny

    return build_tiny(
        "deepseek_v2", seed=0, dtype=dtype, hidden_size=2048, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, num_hidden_layers=layers + 1, first_k_dense_replace=1,
        intermediate_size=2816, n_group=1, topk_group=1, topk_method="greedy", num_attention_heads=4,
        num_key_value_heads=4,
    )


def warm_cache(capacity: float, model: Any, ids: torch.Tensor, steps: int, memo: dict) -> dict[str, Any]:
    """The grid's cache at ``capacity``: LRU, warmed by frequency over a routing trace of the bench's
    own decode loop (recorded once per ``memo``, into a temporary directory that lives as long as
    ``memo`` does), so a capacity means that many experts resident from the first step (1.0: every
    one), as KTransformers' static placement by frequency. An empty cache under ``host-misses`` would
    stay empty: a miss computed on the host is not copied (``cache.admission: placement``)."""
    if not capacity:
        return {"capacity": 0}
    if "trace" not in memo:
        import tempfile

        from moelab.trace.recorder import record

        memo["dir"] = tempfile.TemporaryDirectory(prefix="moelab-bench-trace-")
        with record(model, Path(memo["dir"].name) / "trace") as rec:
            _decode(model, ids, steps)
        memo["trace"] = str(rec.path)
    return {"capacity": capacity, "policy": "lru", "warm": "frequency", "warm_from": memo["trace"]}


def real_executor_grid(layers: int = 3, steps: int = 8, deferred=(0, 1, 2, 3, 4), capacity=(0.0, 0.25, 0.5),
                       host_backend: str = "moelab_bf16", repeats: int = 3) -> list[dict[str, Any]]:
    """Decode step time of each (capacity, deferred) point: the median of ``repeats`` loops of
    ``steps`` steps after a warm-up loop, with its spread and the machine's load."""
    from moelab.hybrid.runtime import HybridRun

    model = realistic_model(layers)
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    rows, memo = [], {}
    for cap in capacity:
        for d in deferred:
            cfg = {"cache": warm_cache(cap, model, ids, steps, memo), "placement": "host-misses", "executor": "real",
                   "device_backend": "reference", "host_backend": host_backend, "device": "cpu",
                   "routing": {"deferred": d, "min_immediate": 0}}
            run = HybridRun(model, cfg)
            with run:
                _decode(model, ids, 2)  # warm-up (packing, first copies)
                m = from_samples([_decode(model, ids, steps) for _ in range(repeats)], warmup=1)
            s = run.summary()
            rows.append({"capacity": cap, "deferred": d, "step_ms": m.median * 1e3, "measurement": m,
                         **{f"busy_{k}": v for k, v in s["busy_pct"].items()}, "overlap_pct": s["overlap_pct"]})
    return rows


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - a benchmark
    import argparse

    p = argparse.ArgumentParser(prog="moelab bench hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["moelab-tiny-mixtral", "moelab-tiny-qwen2moe"])
    p.add_argument("--layers", type=int, default=3, help="MoE layers of the realistic model (default 3)")
    p.add_argument("--steps", type=int, default=8, help="decode steps per point of the realistic grid")
    p.add_argument("--skip-realistic", action="store_true", help="only the planner and functional checks")
    p.add_argument("--allow-busy", action="store_true", help="report figures measured on a busy machine (flagged)")
    args = p.parse_args(argv)
    try:
        run(args.models, args.layers, args.steps, not args.skip_realistic, allow_busy=args.allow_busy)
    except BusyMachineError as exc:
        print(f"moelab bench hybrid: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _stat(m: Measurement) -> str:
    """``spread ±3 %, load 0.4`` (and BUSY with the reason) of one figure."""
    load = m.load_after.get("load1")
    text = f"±{m.spread:.0%}, load {load:.1f}" if load is not None else f"±{m.spread:.0%}"
    return text + (" BUSY" if m.busy else "") + (" unstable" if m.unstable else "")


def run(models, layers: int, steps: int, realistic: bool, allow_busy: bool = False, *, planner: bool = True,
        check_busy: bool = True) -> list[Measurement]:  # pragma: no cover
    """Print the tables; every figure is a median with its spread and the load (``_stat``).
    Returns the figures' measurements; with ``check_busy``, raises :class:`BusyMachineError` after
    printing when one was measured on a busy machine, unless ``allow_busy``. (The side-by-side
    table, which also simulates, is :mod:`moelab.simulate.side_by_side`'s.)"""
    out = print
    flagged: list[Measurement] = []
    if planner:
        _planner_tables(out, models, flagged)
    if realistic:
        _realistic_table(out, layers, steps, flagged)
    if check_busy:
        raise_if_busy(flagged, allow_busy)
    return flagged


def raise_if_busy(flagged: list[Measurement], allow_busy: bool) -> None:
    """:class:`BusyMachineError` when one of ``flagged`` was measured on a busy machine, unless ``allow_busy``."""
    busy = [m for m in flagged if m.busy]
    if busy and not allow_busy:
        raise BusyMachineError(f"{len(busy)} of the figures above were measured on a busy machine ({busy[0].reason}); "
                               "rerun on a quiet machine, or pass --allow-busy.")


def _planner_tables(out, models, flagged: list) -> None:  # pragma: no cover - prints
    out("planner cost (batch 1 decode; MRS 25 %, greedy-hss, deferral, learned-d1 prefetch when bundled;")
    out("median per MoE layer and decode step; the compiled planner vs the Python reference planner on the caches'")
    out("reference definitions, alternating in one run):")
    for m in models:
        r = planner_cost(m)
        flagged.append(r["measurement"])
        out(f"  {m}: planner ({r['path']}, {r['entry']}) {r['planner_us_per_layer']:.1f} µs [{_stat(r['measurement'])}] (reference "
            f"{r['planner_us_reference']:.1f} µs, x{r['planner_us_reference'] / r['planner_us_per_layer']:.2f}; "
            f"mean {r['planner_mean_us']:.1f} µs; the planner alone, replayed outside the model: "
            f"{r['planner_alone_us']:.1f} µs, {r['planner_alone_cold_us']:.1f} µs with {r['evict_mib']:.0f} MiB read "
            f"before each plan to evict the caches), predictor {r['predictor_us_per_layer']:.1f} µs "
            f"({r['plans']} layer plans; prefetch {r['prefetch']})")
    r = control_overhead()
    ref = control_overhead(device_backend="reference")
    flagged += [r["measurement"], ref["measurement"]]
    from moelab.kernels.op import lane_spin_us

    out(f"real executor, control thread per MoE layer (plan + dispatch events: planner, policies, submitting, merging; "
        f"tiny DeepSeek-V2, LRU 25 %, host-misses, deferral 1, native host and device lanes, lane spin "
        f"{lane_spin_us()} µs): {r['layer_us']:.0f} µs [{_stat(r['measurement'])}] (runs "
        f"{', '.join(f'{v:.0f}' for v in r['runs'])}; target ≤ 50 µs); with torch's reference experts on a "
        f"Python device lane: {ref['layer_us']:.0f} µs [{_stat(ref['measurement'])}]")
    out("functional executor, nothing enabled, vs the plain model (median of 5 A/B pairs):")
    for m in models:
        r = functional_overhead(m)
        flagged += [r["plain"], r["functional"]]
        out(f"  {m}: plain {r['plain_ms']:.3f} ms [{_stat(r['plain'])}], functional {r['functional_ms']:.3f} ms "
            f"[{_stat(r['functional'])}] per step ({r['overhead_pct']:+.1f} %)")


def _realistic_table(out, layers: int, steps: int, flagged: list) -> None:  # pragma: no cover - prints
    out(f"real executor, DeepSeek-V2-Lite MoE shapes x {layers} layers, bf16, host-misses, "
        f"{torch.get_num_threads()} torch threads:")
    out("  capacity  deferred  step ms (median of 3, spread, load)  busy device/host/copy/control %  overlap %")
    for r in real_executor_grid(layers, steps):
        flagged.append(r["measurement"])
        out(f"  {r['capacity']:>8.2f}  {r['deferred']:>8d}  {r['step_ms']:7.1f} [{_stat(r['measurement']):>17}]  "
            f"{r.get('busy_device', 0):5.0f}/{r.get('busy_host', 0):4.0f}/{r.get('busy_copy', 0):4.0f}/"
            f"{r.get('busy_control', 0):4.0f}  {r['overlap_pct']:9.0f}")
