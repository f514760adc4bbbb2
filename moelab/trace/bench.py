"""Benchmarks: how much recording adds to a decode step, and how much memory it holds.

    python -m moelab.trace.bench [--model NAME] [--steps 512] [--repeats 7] [--json]
    python -m moelab.trace.bench --memory [--rows 500000] [--batch 16] [--max-new-tokens 64] [--hidden-states]

Runs the same greedy decode loop (KV cache, batch 1) with and without a recorder,
alternating A/B so drift hits both alike, and reports medians of the per-step time and
their ratio. The recorder's work — hooks, the batched routing conversion, Parquet
writes and finalising the trace — is all inside the timed region. Target: ≤ 10 % with
scores, without hidden states.

``--memory`` runs what ``moelab trace`` runs (``model.generate`` on left-padded batches of
prompts, a fresh KV cache per batch) while recording, and prints the process's resident memory (current and peak) against the rows
recorded so far, after the same loop without recording as the baseline. Target: peak RSS
flat in the rows (bounded by ``flush_rows``), not growing with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moelab.measure import from_samples
from moelab.trace.recorder import TraceRecorder


@torch.no_grad()
def _decode_loop(model, input_ids, steps: int, recorder: TraceRecorder | None = None) -> tuple[float, float]:
    """(seconds per decode step, seconds to finalise the trace) of a greedy KV-cache loop.

    With a ``recorder``, it starts before the prompt; the steps include its hooks and the
    batched conversions that fall inside the loop (one per 128 forwards), and the
    finalisation (remaining conversion, Parquet write, meta.json, fsync, rename, reopen)
    is timed on its own.
    """
    from moelab.forward.bench import decode_loop

    if recorder is not None:
        recorder.start()
    per_step = decode_loop(model, input_ids, steps)
    t1 = time.perf_counter()
    if recorder is not None:
        recorder.close()
    return per_step, time.perf_counter() - t1


def run(model_name: str | None = None, steps: int = 512, repeats: int = 7, hidden_states: bool = False) -> dict:
    from moelab.loading import load
    from moelab.models.bundled import default_model_name

    name = model_name or default_model_name()
    model, tok = load(name)
    ids = tok("Tom has 3 apples and buys 5 more. How many", return_tensors="pt").input_ids
    base, rec, fin = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        _decode_loop(model, ids, 8)  # warm-up
        for r in range(repeats):
            base.append(_decode_loop(model, ids, steps)[0])
            recorder = TraceRecorder(model, Path(tmp) / f"t{r}", hidden_states=hidden_states)
            per_step, finalise = _decode_loop(model, ids, steps, recorder)
            rec.append(per_step)
            fin.append(finalise)

    b, m = statistics.median(base), statistics.median(rec)
    meas = [from_samples(base, warmup=1), from_samples(rec, warmup=1)]
    return {
        "spread_pct": round(max(x.spread for x in meas) * 100, 1), "load": meas[1].load_after,
        "busy": any(x.busy for x in meas), "busy_reason": "; ".join(x.reason for x in meas if x.busy),
        "model": name,
        "threads": torch.get_num_threads(),
        "steps": steps,
        "repeats": repeats,
        "hidden_states": hidden_states,
        "decode_step_ms": round(b * 1e3, 4),
        "decode_step_recording_ms": round(m * 1e3, 4),
        "overhead_pct": round((m / b - 1) * 100, 2),
        "finalise_ms": round(statistics.median(fin) * 1e3, 2),
    }


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size of this process in MiB (Linux /proc)."""
    cur = peak = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                cur = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) / 1024
    return cur, peak


@torch.no_grad()
def memory(model_name: str | None = None, rows: int = 500_000, batch: int = 16, hidden_states: bool = False,
           points: int = 8, max_new_tokens: int = 64) -> dict:
    """Resident memory against recorded rows (see the module docstring).

    Runs what ``moelab trace`` runs: ``model.generate`` (KV cache, left-padded batches of
    ``batch`` prompts, ``max_new_tokens`` greedy tokens) until ``rows`` rows are recorded,
    once without and once with a recorder, and samples the resident memory between batches.
    """
    from moelab.adapters import moe_layers
    from moelab.loading import load
    from moelab.models.bundled import default_model_name

    name = model_name or default_model_name()
    model, tok = load(name)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = [f"Question {i}: Tom has {i % 50} apples and buys {i % 7} more. How many apples now?"
               for i in range(batch)]
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    n_layers = len(moe_layers(model))

    def loop(recorder: TraceRecorder | None) -> list[dict]:
        samples: list[dict] = []
        done, nxt = 0, rows / points
        while done < rows:
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id,
                                 min_new_tokens=max_new_tokens)
            if recorder is not None:
                done = recorder._rows + recorder._buf_rows + recorder._pending_rows
            else:  # the rows a recorder would have written: real prompt tokens + new tokens, per layer
                done += (int(enc.attention_mask.sum()) + batch * (out.shape[1] - enc.input_ids.shape[1] - 1)) * n_layers
            if done >= nxt or done >= rows:
                cur, peak = _rss_mb()
                samples.append({"rows": int(done), "rss_mb": round(cur, 1), "peak_rss_mb": round(peak, 1)})
                nxt += rows / points
        return samples

    # the writers' libraries (~50 MiB resident once imported) are loaded before the baseline,
    # so the difference is what recording holds, not a one-off import
    import pyarrow.parquet  # noqa: F401
    import safetensors.torch  # noqa: F401

    base = loop(None)
    with tempfile.TemporaryDirectory() as tmp:
        rec = TraceRecorder(model, Path(tmp) / "t", hidden_states=hidden_states)
        rec.start()
        recorded = loop(rec)
        rec.close()
        cur, peak = _rss_mb()
        recorded.append({"rows": rec.trace.num_rows, "rss_mb": round(cur, 1), "peak_rss_mb": round(peak, 1),
                         "after": "close"})
    return {
        "model": name,
        "batch": batch,
        "max_new_tokens": max_new_tokens,
        "hidden_states": hidden_states,
        "flush_rows": rec.config.flush_rows,
        "threads": torch.get_num_threads(),
        "baseline": base,
        "recording": recorded,
        "peak_growth_mb": round(recorded[-1]["peak_rss_mb"] - base[-1]["peak_rss_mb"], 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moelab.trace.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model (default: the default bundled model)")
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--hidden-states", action="store_true", help="also record hidden states")
    p.add_argument("--json", action="store_true")
    p.add_argument("--memory", action="store_true", help="print resident memory against rows recorded")
    p.add_argument("--rows", type=int, default=500_000, help="rows to record with --memory")
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call with --memory")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per generate call with --memory")
    args = p.parse_args(argv)
    if args.memory:
        res = memory(args.model, args.rows, args.batch, args.hidden_states, max_new_tokens=args.max_new_tokens)
        if args.json:
            print(json.dumps(res, indent=2))
            return 0
        print(f"{res['model']}: generate, batch {res['batch']}, {res['max_new_tokens']} new tokens, "
              f"hidden states {res['hidden_states']}, flush_rows {res['flush_rows']}, {res['threads']} threads")
        print(f"{'rows':>9} {'RSS MiB':>9} {'peak MiB':>9}   (without recording)")
        for r in res["baseline"]:
            print(f"{r['rows']:>9} {r['rss_mb']:>9.0f} {r['peak_rss_mb']:>9.0f}")
        print(f"{'rows':>9} {'RSS MiB':>9} {'peak MiB':>9}   (recording)")
        for r in res["recording"]:
            print(f"{r['rows']:>9} {r['rss_mb']:>9.0f} {r['peak_rss_mb']:>9.0f}   {r.get('after', '')}")
        print(f"peak RSS added by recording: {res['peak_growth_mb']:+.0f} MiB")
        return 0
    res = run(args.model, args.steps, args.repeats, args.hidden_states)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(
            f"{res['model']}: decode step {res['decode_step_ms']:.3f} ms, with recording "
            f"{res['decode_step_recording_ms']:.3f} ms -> overhead {res['overhead_pct']:+.1f} % "
            f"(median of {res['repeats']} x {res['steps']} steps, {res['threads']} threads, spread "
            f"±{res['spread_pct']:.1f} %, load {res['load']['load1']:.1f} on {res['load']['cpus']} CPUs); "
            f"finalising the trace: {res['finalise_ms']:.1f} ms once"
            + (f" — BUSY machine: {res['busy_reason']}" if res["busy"] else "")
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
