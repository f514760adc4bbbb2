"""Benchmark: the Ray sweep backend against the local one on a CPU-bound spec.

    python -m moelab.sweeps.bench [--cells 8] [--limit 8] [--max-gen-toks 32] [--workers 2]

Runs the same cells (``tiny-random-mixtral`` on ``arith``, one per seed) three ways: local
with one torch thread, local with torch's default threads (all cores), and Ray with
``--workers`` actors of one thread each. Both sides are timed warm: the model loaded and one
untimed cell run first (locally, and on every actor), since a sweep pays those costs once per
worker and then runs its cells (the shipped spec: 44 cells, an hour). The one-time Ray costs
(cluster start, actor start, each actor's first cell) are printed beside.

Per run it prints the wall time, each cell's wall and CPU time (their ratio: the cores a cell
got), the driver's own CPU use besides the cells, the Ray processes' (raylet, GCS, agents) and
the rest of the machine's (other users: on a shared machine the workers do not get a core
each, and the speed-up measures the machine, not the backend). Then the speed-up and the
scheduling overhead per cell on Ray: the time from handing a cell to an actor to having its
result in the driver, minus the time the actor spent running it. Targets (issue #15): ≥ 1.6×
with 2 workers on 2 cores; overhead ≤ 1 s per cell.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from moelab.measure import from_samples, machine_load
from moelab.sweeps.spec import EvalSettings, ModelSpec, PolicySpec, SweepSpec, TaskSpec, expand


def bench_spec(cells: int, limit: int, max_gen_toks: int) -> SweepSpec:
    return SweepSpec(name="bench", models=[ModelSpec("tiny-random-mixtral")], policies=[PolicySpec("none")],
                     tasks=[TaskSpec("arith", limit=limit)], seeds=list(range(1, cells + 1)),
                     eval=EvalSettings(max_gen_toks=max_gen_toks))


def _cpu_snapshot() -> dict[str, float]:
    """CPU seconds so far: this process (``driver``), the Ray processes it started other than
    workers (``ray system``: raylet, GCS, agents), and the whole machine (``machine``)."""
    out = {"driver": sum(os.times()[:2])}
    try:
        import psutil
    except ImportError:  # psutil comes with ray; without it only the driver is measured
        return out
    system = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if "default_worker.py" in cmd or child.name().startswith("ray::"):
                continue
            t = child.cpu_times()
            system += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    t = psutil.cpu_times()
    out["ray system"] = system
    out["machine"] = t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
    return out


def _run(executor, cells) -> dict[str, Any]:
    starts: dict[str, float] = {}
    overhead: list[float] = []
    walls: list[float] = []
    cpus: list[float] = []
    failed: list[str] = []
    first: list[float] = []

    def on_start(cell) -> None:
        starts[cell.hash] = time.perf_counter()
        if not first:
            first.append(starts[cell.hash])

    def on_done(cell, out) -> None:
        span = time.perf_counter() - starts[cell.hash]
        walls.append(out["record"]["wall_s"])
        cpus.append(out["record"]["cpu_s"])
        overhead.append(span - out["record"]["wall_s"])

    def on_failed(cell, attempt, error, final) -> None:
        failed.append(error)

    before = _cpu_snapshot()
    t0 = time.perf_counter()
    executor.run(cells, 0, on_start, on_done, on_failed)
    end = time.perf_counter()
    after = _cpu_snapshot()
    if failed:
        raise RuntimeError(f"{len(failed)} cell(s) failed: {failed[0][-500:]}")
    return {"wall": end - t0, "cells_wall": end - first[0], "cell_walls": walls, "cell_cpus": cpus,
            "overhead": overhead, "cpu": {k: after[k] - before[k] for k in after if k in before}}


def _describe(name: str, r: dict[str, Any], own_cell_cpu: bool) -> str:
    """One line: wall, mean cell wall and CPU, cores per cell, where else the CPU went."""
    wall, cw, cc = r["wall"], statistics.mean(r["cell_walls"]), statistics.mean(r["cell_cpus"])
    cpu = r["cpu"]
    cells_cpu = sum(r["cell_cpus"])
    driver = cpu["driver"] - (cells_cpu if own_cell_cpu else 0.0)
    parts = [f"{name}: {wall:.1f} s", f"cell {cw:.2f} s wall / {cc:.2f} s CPU ({cc / cw:.2f} cores per cell)",
             f"driver {driver / wall:.2f} cores besides the cells"]
    if "ray system" in cpu and not own_cell_cpu:
        parts.append(f"ray processes {cpu['ray system'] / wall:.2f} cores")
    other = _other_cores(r, own_cell_cpu)
    if other is not None:
        parts.append(f"other processes on the machine {other:.2f} cores")
    return "; ".join(parts)


def _other_cores(r: dict[str, Any], own_cell_cpu: bool) -> float | None:
    """Cores the rest of the machine used during a run (None without psutil): the machine's CPU
    time less the driver's, the cells' and Ray's own processes'. (The load average cannot say
    this here: the Ray actors running the cells are processes of their own.)"""
    cpu = r["cpu"]
    if "machine" not in cpu:
        return None
    ours = cpu["driver"] + (0.0 if own_cell_cpu else sum(r["cell_cpus"]) + cpu.get("ray system", 0.0))
    return max(cpu["machine"] - ours, 0.0) / r["wall"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelab.sweeps.bench", description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--limit", type=int, default=8, help="arith documents per cell")
    p.add_argument("--max-gen-toks", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--skip-local-default", action="store_true", help="skip the all-threads local run")
    p.add_argument("--repeat", type=int, default=3, help="paired local/Ray runs (the speed-up is their median)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: expected at least 1 paired run")

    from moelab import load
    from moelab.sweeps.backends import LocalBackend, RayBackend

    load_before = machine_load()

    spec = bench_spec(args.cells + args.workers, args.limit, args.max_gen_toks)
    every = expand(spec, {"tiny-random-mixtral": "bench"})
    cells, warmup = every[:args.cells], every[args.cells:]  # warm-up cells: other seeds, never timed
    print(f"{len(cells)} cells: tiny-random-mixtral · arith limit {args.limit} · max_gen_toks {args.max_gen_toks}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    # warm on both sides: the local runner gets the loaded model and one untimed cell (first-use
    # costs); each Ray actor runs one untimed cell (its model load, its first evaluation)
    preload = {cells[0].resource(): load("tiny-random-mixtral")}
    _run(LocalBackend(threads=None, preload=preload), warmup[:1])
    results = {}
    if not args.skip_local_default:  # first: a 1-thread runner pins this process's torch threads
        results["local, default threads"] = r = _run(LocalBackend(threads=None, preload=preload), cells)
        print(_describe("local, default threads", r, True), flush=True)
    ray_ex = RayBackend(workers=args.workers, threads=1)
    ray_ex.keep = True
    t0 = time.perf_counter()
    ray_ex._init()
    init_s = time.perf_counter() - t0
    local_runs, ray_runs = [], []
    try:
        ray_ex.start()
        first = _run(ray_ex, warmup)
        for i in range(args.repeat):  # paired: local 1 thread, then Ray (its actors idle meanwhile)
            local_runs.append(_run(LocalBackend(threads=1, preload=preload), cells))
            print(_describe(f"local, 1 thread (run {i + 1})", local_runs[-1], True), flush=True)
            ray_runs.append(_run(ray_ex, cells))
            print(_describe(f"ray, {args.workers} workers × 1 thread, warm (run {i + 1})", ray_runs[-1], False),
                  flush=True)
    finally:
        ray_ex.close()
        ray_ex.ray.shutdown()
    r = sorted(ray_runs, key=lambda x: x["wall"])[len(ray_runs) // 2]  # the median Ray run (by wall time)
    print(f"  once per Ray run (amortised over a sweep's cells): {init_s:.1f} s starting the local cluster, "
          f"{ray_ex.actors_start_s:.1f} s starting the actors (import torch, transformers, lm-eval), "
          f"{first['wall']:.1f} s for each actor's first cell (model load, first evaluation: "
          f"{statistics.mean(first['cell_cpus']):.1f} s CPU against {statistics.mean(r['cell_cpus']):.1f} s "
          "for a warm cell)")
    others = [x for x in ([_other_cores(lo, True) for lo in local_runs] + [_other_cores(ra, False) for ra in ray_runs])
              if x is not None]
    cpus = load_before["cpus"]
    other = max(others) if others else load_before["other"]  # the busiest run's other work, in cores
    load = {**load_before, "other": other, "other_per_cpu": None if other is None else other / cpus}
    speedup = from_samples([lo["wall"] / ra["wall"] for lo, ra in zip(local_runs, ray_runs, strict=True)],
                           load_before=load)
    speedup.load_after = load
    print(f"SPEED-UP, warm (target ≥ 1.6×): {speedup.median:.2f}× against local with 1 thread (median of "
          f"{args.repeat} paired runs, spread ±{speedup.spread:.0%}; other processes used at most "
          f"{other if other is not None else float('nan'):.2f} of {cpus} cores during a run)", end="")
    if "local, default threads" in results:
        print(f", {results['local, default threads']['wall'] / r['wall']:.2f}× against local with all threads "
              "(one run)", end="")
    ov = [x for run in ray_runs for x in run["overhead"]]
    print(f"\nray scheduling overhead per cell (target ≤ 1 s): median {statistics.median(ov):.3f} s, "
          f"max {max(ov):.3f} s over {len(ov)} cells (submit→result in the driver minus the actor's run time)")
    if speedup.busy:
        print(f"BUSY machine: {speedup.reason} — the speed-up measures the machine, not the backend")
    print(f"load average after: {os.getloadavg()[0]:.1f}; a quiet machine has 'other processes' near 0 above "
          "(otherwise the workers shared their cores and the speed-up is not the backend's)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
