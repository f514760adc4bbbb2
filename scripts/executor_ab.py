"""The CPU real executor's decode step and control-thread cost, for an A/B of two source trees.

One process per run (the lanes' threads and OpenMP teams live as long as the process, so two
trees cannot share one); alternate the trees' processes and compare their lines:

    git worktree add /tmp/base <rev>
    for i in 1 2 3; do
      (cd /tmp/base && TORCH_EXTENSIONS_DIR=/tmp/ext_base PYTHONPATH=/tmp/base python <repo>/scripts/executor_ab.py base)
      TORCH_EXTENSIONS_DIR=/tmp/ext_new PYTHONPATH=. python scripts/executor_ab.py new
    done

Each run: a tiny DeepSeek-V2 (random weights, bf16), LRU 25 % warmed by frequency, host-misses,
one deferred expert per token, both lanes on the native kernels (``moelab``); ``--runs`` hybrid
runs of 24 decode steps after 2 warm-up steps, then the plain model (no moelab) ``--runs`` times in
the same process, after the runs. Prints the medians (min/max) of the step times, the median over
runs of the control thread's plan + dispatch µs per MoE layer (as ``moelab bench hybrid``), and the
machine's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("label", help="the name printed on the line (e.g. base, new)")
    ap.add_argument("--runs", type=int, default=5, help="hybrid runs, and plain loops (default 5)")
    args = ap.parse_args()

    from moelab.hybrid.bench import _decode, warm_cache
    from moelab.hybrid.runtime import HybridRun
    from moelab.models.tiny import build_tiny

    model = build_tiny("deepseek_v2", seed=0, dtype=torch.bfloat16)
    ids = torch.randint(3, 250, (1, 8), generator=torch.Generator().manual_seed(0))
    memo: dict = {}
    cfg = {"cache": warm_cache(0.25, model, ids, 14, memo), "placement": "host-misses", "executor": "real",
           "device_backend": "moelab", "host_backend": "moelab", "device": "cpu",
           "routing": {"deferred": 1, "min_immediate": 1}}
    steps, control = [], []
    for _ in range(args.runs):
        with HybridRun(model, cfg) as run, torch.no_grad():
            _decode(model, ids, 2)
            first = int(run.events_table()["step"].max()) + 1
            t0 = time.perf_counter()
            _decode(model, ids, 24)
            steps.append((time.perf_counter() - t0) / 24 * 1e3)
            ev = run.events_table()
        ev = ev[(ev["step"] > first) & (ev["lane"].astype(str) == "control") & (ev["layer"] >= 0)]
        ev = ev.assign(us=ev["t_end_us"] - ev["t_start_us"], kind=ev["kind"].astype(str))
        control.append(float(ev[ev["kind"].isin(["plan", "dispatch"])].groupby(["step", "layer"])["us"].sum().median()))
    plain = []
    with torch.no_grad():
        _decode(model, ids, 4)
        for _ in range(args.runs):
            t0 = time.perf_counter()
            _decode(model, ids, 24)
            plain.append((time.perf_counter() - t0) / 24 * 1e3)
    print(f"{args.label}: step ms median {statistics.median(steps):.2f} (min {min(steps):.2f}, max {max(steps):.2f}); "
          f"control µs per MoE layer median {statistics.median(control):.0f}; plain model after the runs ms median "
          f"{statistics.median(plain):.2f} (min {min(plain):.2f}, max {max(plain):.2f}); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
