"""Benchmark: the Ray executor against the local one on a CPU-bound spec.

    python -m moelab.sweeps.bench [--cells 8] [--limit 8] [--max-gen-toks 32] [--workers 2]

Runs the same cells (``tiny-random-mixtral`` on ``arith``, one per seed) three ways: local
with one torch thread, local with torch's default threads (all cores), and Ray with
``--workers`` actors of one thread each. Prints wall times, the speed-ups, and the scheduling
overhead per cell on Ray: the time from handing a cell to an actor to having its result in
the driver, minus the time the actor spent running it. The Ray wall time is given with and
without starting the local cluster (``ray.init``), which on a loaded machine takes tens of
seconds. Targets (issue #15): ≥ 1.6× with 2 workers on 2 cores; overhead ≤ 1 s per cell.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from moelab.sweeps.spec import EvalSettings, ModelSpec, PolicySpec, SweepSpec, TaskSpec, expand


def bench_spec(cells: int, limit: int, max_gen_toks: int) -> SweepSpec:
    return SweepSpec(name="bench", models=[ModelSpec("tiny-random-mixtral")], policies=[PolicySpec("none")],
                     tasks=[TaskSpec("arith", limit=limit)], seeds=list(range(1, cells + 1)),
                     eval=EvalSettings(max_gen_toks=max_gen_toks))


def _run(executor, cells) -> dict[str, Any]:
    starts: dict[str, float] = {}
    overhead: list[float] = []
    walls: list[float] = []
    failed: list[str] = []

    def on_start(cell) -> None:
        starts[cell.hash] = time.perf_counter()

    def on_done(cell, out) -> None:
        span = time.perf_counter() - starts[cell.hash]
        walls.append(out["record"]["wall_s"])
        overhead.append(span - out["record"]["wall_s"])

    def on_failed(cell, attempt, error, final) -> None:
        failed.append(error)

    t0 = time.perf_counter()
    executor.run(cells, 0, on_start, on_done, on_failed)
    if failed:
        raise RuntimeError(f"{len(failed)} cell(s) failed: {failed[0][-500:]}")
    return {"wall": time.perf_counter() - t0, "cell_walls": walls, "overhead": overhead}


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m moelab.sweeps.bench", description=__doc__.split("\n")[0])
    p.add_argument("--cells", type=int, default=8)
    p.add_argument("--limit", type=int, default=8, help="arith documents per cell")
    p.add_argument("--max-gen-toks", type=int, default=32)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--skip-local-default", action="store_true", help="skip the all-threads local run")
    args = p.parse_args(argv)

    from moelab.sweeps.executors import LocalExecutor, RayExecutor

    spec = bench_spec(args.cells, args.limit, args.max_gen_toks)
    cells = expand(spec, {"tiny-random-mixtral": "bench"})
    print(f"{len(cells)} cells: tiny-random-mixtral · arith limit {args.limit} · max_gen_toks {args.max_gen_toks}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}", flush=True)
    import lm_eval.tasks  # noqa: F401 - imports out of the timings (Ray actors pay theirs in their run)

    import moelab.evals.api  # noqa: F401

    _run(LocalExecutor(threads=None), cells[:1])  # warm-up: first-use costs out of the timings
    results = {}
    if not args.skip_local_default:  # first: a 1-thread runner pins this process's torch threads
        results["local, default threads"] = _run(LocalExecutor(threads=None), cells)
        print(f"local, default threads: {results['local, default threads']['wall']:.1f} s", flush=True)
    results["local, 1 thread"] = _run(LocalExecutor(threads=1), cells)
    print(f"local, 1 thread: {results['local, 1 thread']['wall']:.1f} s", flush=True)
    ray_ex = RayExecutor(workers=args.workers, threads=1)
    t0 = time.perf_counter()
    ray_ex._init()
    init_s = time.perf_counter() - t0
    try:
        r = _run(ray_ex, cells)
    finally:
        ray_ex.ray.shutdown()
    results["ray"] = r
    ray_total = init_s + r["wall"]
    print(f"ray, {args.workers} workers × 1 thread: {ray_total:.1f} s ({init_s:.1f} s starting the local cluster, "
          f"{ray_ex.actors_start_s:.1f} s starting the actors, {r['wall'] - ray_ex.actors_start_s:.1f} s running "
          "the cells incl. one model load per actor)")
    for name, res in results.items():
        if name == "ray":
            continue
        print(f"speed-up vs {name}: {res['wall'] / ray_total:.2f}× end to end, "
              f"{res['wall'] / r['wall']:.2f}× with the cluster already up")
    means = {name: statistics.mean(res["cell_walls"]) for name, res in results.items()}
    print("mean time per cell, as the worker measured it: " + ", ".join(f"{k} {v:.2f} s" for k, v in means.items())
          + " (Ray cells slower than local 1-thread cells: the workers did not get a core each)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    ov = r["overhead"]
    print(f"ray scheduling overhead per cell: median {statistics.median(ov):.3f} s, max {max(ov):.3f} s "
          f"(submit→result in the driver minus the actor's run time)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
