"""Throughput benchmark of the cache simulators: ``python -m moelab.caches.bench``.

Builds a synthetic access stream (``--accesses`` expert accesses, OLMoE-like shape by
default: 16 MoE layers × 64 experts, top-8), compiles the kernel once, then times each
policy's replay and prints expert accesses per second (one core; the kernel is
single-threaded). ``--reference`` also times the pure-Python reference on a slice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def run(
    accesses: int = 10_000_000,
    layers: int = 16,
    experts: int = 64,
    top_k: int = 8,
    capacities: tuple[float, ...] = (0.25,),
    scopes: tuple[str, ...] = ("layer", "global"),
    policies: tuple[str, ...] = ("lru", "lfu", "fifo", "static", "mrs", "belady", "belady-bypass"),
    reference: bool = False,
    seed: int = 0,
) -> dict:
    """Size: keyword settings of a public entry point, each with a default (the CLI's options where it has a
    command), so a call names only what it changes; a settings object would be one more thing to build.
    """
    from moelab.caches import _fast
    from moelab.caches.simulation import simulate
    from moelab.caches.synthetic import synthetic_stream

    seqs = 64
    steps = max(1, accesses // (seqs * layers * top_k))
    t0 = time.perf_counter()
    # 64 independent sequences replayed one after another (a group = one token's top-k): the
    # kernel's throughput on long per-token streams. Per forward, 64 tokens' union would be
    # nearly every expert of a layer.
    stream = synthetic_stream(
        num_layers=layers, num_experts=experts, top_k=top_k, num_seqs=seqs, steps=steps, seed=seed,
        replay="sequence",
    )
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    small = synthetic_stream(num_layers=2, num_experts=4, top_k=2, num_seqs=1, steps=4)
    for p in policies:  # compile (or load the cached compiled kernel)
        simulate(small, p, 0.5)
    compile_s = time.perf_counter() - t0
    column_bytes = sum(v.nbytes for v in vars(stream).values() if isinstance(v, np.ndarray))
    out = {
        "numba": _fast.HAVE_NUMBA,
        "accesses": stream.num_accesses,
        "stream_mb": round(column_bytes / 2**20, 1),
        "shape": {"layers": layers, "experts": experts, "top_k": top_k},
        "stream_build_s": round(build_s, 2),
        "compile_s": round(compile_s, 2),
        "runs": [],
    }
    for scope in scopes:
        for cap in capacities:
            for p in policies:
                t0, c0 = time.perf_counter(), time.process_time()
                r = simulate(stream, p, cap, scope)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                out["runs"].append(
                    dict(policy=p, scope=scope, capacity=cap, seconds=round(dt, 3), cpu_seconds=round(dc, 3),
                         accesses_per_s=round(stream.num_accesses / dt),
                         accesses_per_cpu_s=round(stream.num_accesses / max(dc, 1e-9)), hit_rate=round(r.hit_rate, 4))
                )
    out["peak_rss_mb"] = _peak_rss_mb()
    if reference:
        sub = synthetic_stream(num_layers=layers, num_experts=experts, top_k=top_k, num_seqs=4, steps=50, seed=seed)
        for p in policies:
            t0 = time.perf_counter()
            simulate(sub, p, capacities[0], scopes[0], backend="reference")
            dt = time.perf_counter() - t0
            out["runs"].append(dict(policy=p, scope=scopes[0], capacity=capacities[0], backend="reference",
                                    seconds=round(dt, 3), accesses_per_s=round(sub.num_accesses / dt)))
    return out


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory in MiB (None where ``resource`` is unavailable)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(kb / (2**20 if sys.platform == "darwin" else 2**10), 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m moelab.caches.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--accesses", type=int, default=10_000_000)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--capacity", default="0.25", help="comma-separated fractions")
    ap.add_argument("--scope", default="layer,global")
    ap.add_argument("--policy", default="lru,lfu,fifo,static,mrs,belady,belady-bypass")
    ap.add_argument("--reference", action="store_true", help="also time the pure-Python reference")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(
        a.accesses, a.layers, a.experts, a.top_k,
        tuple(float(c) for c in a.capacity.split(",")), tuple(a.scope.split(",")),
        tuple(a.policy.split(",")), a.reference,
    )
    if a.json:
        json.dump(res, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{res['accesses']:,} accesses, shape {res['shape']}, numba={res['numba']}, "
          f"stream built in {res['stream_build_s']} s, compile/load {res['compile_s']} s")
    print(f"{'policy':<13} {'backend':<9} {'scope':<7} {'cap':>5} {'seconds':>8} {'accesses/s':>13} "
          f"{'per CPU-s':>13} {'hit rate':>9}")
    total = 0.0
    for r in res["runs"]:
        hr = f"{r['hit_rate']:.2%}" if "hit_rate" in r else ""
        total += r["seconds"] if "backend" not in r else 0.0
        print(f"{r['policy']:<13} {r.get('backend', 'fast'):<9} {r['scope']:<7} {r['capacity']:>5} "
              f"{r['seconds']:>8.3f} {r['accesses_per_s']:>13,} {r.get('accesses_per_cpu_s', 0):>13,} {hr:>9}")
    print(f"total (fast runs): {total:.1f} s; stream columns {res['stream_mb']} MiB, "
          f"process peak RSS {res['peak_rss_mb']} MiB (includes building the stream)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
