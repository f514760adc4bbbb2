"""Benchmark: what the forward seam costs when it is used, and that it costs nothing when not.

    python -m moelab.forward.bench [--model NAME] [--steps 256] [--repeats 7] [--json]

Runs one greedy KV-cache decode loop (batch 1) in four settings, interleaved A/B/C/D
in every repeat so drift hits all alike, and prints the median per-step time of each
and its ratio to the unmodified model:

* ``plain`` — the model as loaded;
* ``after`` — after handlers were registered and removed again (the manager leaves no
  hooks behind, so this must equal ``plain`` within noise);
* ``context`` — one no-op ``forward`` handler (the per-forward context alone);
* ``experts`` — one no-op ``plan`` handler (every MoE layer's experts call goes through
  the manager's dispatcher and builds a plan nobody changes).

Targets: ``after`` within noise of ``plain``; ``context`` and ``experts`` a few percent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moelab.forward.points import hooks
from moelab.measure import from_samples


@torch.no_grad()
def decode_loop(model, ids, steps: int) -> float:
    """Seconds per greedy decode step of a KV-cache loop after a prefill of ``ids`` (batch 1)."""
    from transformers import DynamicCache

    from moelab.compat import cache_kwargs, output_cache

    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, **cache_kwargs(cache, model), use_cache=True)
    nxt = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = model(input_ids=nxt, **cache_kwargs(output_cache(out), model), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps


def run(model_name: str | None = None, steps: int = 256, repeats: int = 7) -> dict:
    from moelab.loading import load
    from moelab.models.bundled import default_model_name

    name = model_name or default_model_name()
    model, tok = load(name)
    ids = tok("Tom has 3 apples and buys 5 more. How many", return_tensors="pt").input_ids

    def plan_noop(ctx, layer, call):
        _ = call.plan

    settings = {
        "plain": lambda: decode_loop(model, ids, steps),
        "after": lambda: decode_loop(model, ids, steps),
        "context": lambda: _scoped(model, ids, steps, forward=lambda ctx: None),
        "experts": lambda: _scoped(model, ids, steps, plan=plan_noop),
    }
    with hooks(model, forward=lambda ctx: None, plan=plan_noop):
        decode_loop(model, ids, 4)  # register, run and remove once: "after" measures what is left
    decode_loop(model, ids, 8)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in settings}
    for _ in range(repeats):
        for k, fn in settings.items():
            times[k].append(fn())

    med = {k: statistics.median(v) for k, v in times.items()}
    m = from_samples(times["plain"], warmup=1)
    return {
        "spread_pct": round(max(from_samples(v).spread for v in times.values()) * 100, 1),
        "load": m.load_after, "busy": m.busy, "busy_reason": m.reason,
        "model": name,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "repeats": repeats,
        **{f"{k}_ms": round(v * 1e3, 4) for k, v in med.items()},
        **{f"{k}_vs_plain_pct": round((v / med["plain"] - 1) * 100, 2) for k, v in med.items() if k != "plain"},
    }


def _scoped(model, ids, steps: int, **handlers) -> float:
    with hooks(model, **handlers):
        return decode_loop(model, ids, steps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelab.forward.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the default bundled model)")
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    r = run(args.model, args.steps, args.repeats)
    if args.json:
        print(json.dumps(r, indent=2))  # noqa: T201 - a benchmark's output
    else:
        print(  # noqa: T201
            f"{r['model']}: decode step {r['plain_ms']:.3f} ms plain; after handlers were removed "
            f"{r['after_vs_plain_pct']:+.1f} %; per-forward context {r['context_vs_plain_pct']:+.1f} %; "
            f"experts dispatch with a plan {r['experts_vs_plain_pct']:+.1f} % "
            f"(median of {r['repeats']} x {r['steps']} steps, A/B interleaved, {r['threads']} threads; spread "
            f"±{r['spread_pct']:.1f} %, load {r['load']['load1']:.1f} on {r['load']['cpus']} CPUs)"
            + (f" — BUSY machine: {r['busy_reason']}" if r["busy"] else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
