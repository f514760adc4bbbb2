"""Benchmark: fit time of all per-layer learned predictors on a ~100k-token trace, and the
batch-1 CPU latency of every predictor kind. Prints its numbers; not a timed test.

    .venv/bin/python predictors/bench.py                         # stand-in of the bundled shape
    .venv/bin/python predictors/bench.py --model moelab-tiny-mixtral --tokens 100000

Without ``--model`` it uses a random Mixtral of the bundled preset's shape (H=128, L=4,
E=8, K=2, I=256): fit time depends on the shape and the token count, not on the weights.
Tokens are recorded as prompt forwards (random ids, 256 per sequence).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

import moelab
from moelab.predictors import TraceData, make_predictor
from moelab.predictors.timing import measure_latency_us


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokens", type=int, default=100_000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--distances", default="1,2,3")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model:
        model, _ = moelab.load(args.model)
        name = args.model
    else:
        from moelab.models.tiny import build_tiny

        model = build_tiny("mixtral", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           max_position_embeddings=512)
        name = "stand-in mixtral H=128 L=4 E=8 K=2"
    vocab = model.config.vocab_size
    out = tempfile.mkdtemp(prefix="moelab-bench-") + "/trace"
    t0 = time.perf_counter()
    seq_len, batch = 256, 16
    with moelab.record(model, out, hidden_states=True, model_name=args.model or "stand-in") as rec, torch.inference_mode():
        g = torch.Generator().manual_seed(0)
        for _ in range(0, args.tokens, seq_len * batch):
            model(torch.randint(3, vocab, (batch, seq_len), generator=g))
    trace = rec.trace
    print(f"{name}: recorded {trace.num_rows // trace.num_moe_layers} tokens in {time.perf_counter() - t0:.0f} s")
    data = TraceData(trace)
    data.hidden, data.index  # noqa: B018 - read once, outside the timings
    total = 0.0
    for d in [int(x) for x in args.distances.split(",") if int(x) < trace.num_moe_layers]:
        t0 = time.perf_counter()
        p = make_predictor("learned", distance=d, progress=False).fit(data)
        dt = time.perf_counter() - t0
        total += dt
        epochs = {k: v["epochs"] for k, v in p.history_.items()}
        print(f"learned d={d}: fit {len(p.weights_)} per-layer MLPs in {dt:.1f} s (trained with num_threads={p.num_threads}; "
              f"epochs per layer {epochs}); latency {measure_latency_us(p, data):.1f} µs per layer per token")
    print(f"learned, all distances: {total:.1f} s")
    for kind in ("frequency", "token", "skip"):
        p = make_predictor(kind).fit(data, model=model)
        print(f"{kind}: latency {measure_latency_us(p, data):.1f} µs per layer per token (batch 1, CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
