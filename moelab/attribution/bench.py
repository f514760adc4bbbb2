"""How long an attribution takes: ``python -m moelab.attribution.bench``.

20 arith prompts × 64 generated tokens on the bundled model, deferral of half the top-k:
the baseline's generation, both teacher-forced forwards with the per-layer table, and the
free-running generation under the policy. Prints the median of ``--repeat`` runs, their
spread and the machine's load (target: ≤ 30 s on a 2-core machine).
"""

from __future__ import annotations

import argparse
import time

import moelab
from moelab.measure import from_samples
from moelab.tasks import generate, prompt_and_target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a bundled model (default: the default bundled model)")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--allow-busy", action="store_true", help="report a figure measured on a busy machine (flagged)")
    args = p.parse_args(argv)

    from moelab.attribution import compare
    from moelab.models.bundled import default_model_name

    name = args.model or default_model_name()
    model, tok = moelab.load(name)
    d = max(1, moelab.moe_layers(model)[0].top_k // 2)
    prompts = [prompt_and_target("arith", doc)[0] for doc in generate("arith", "test")[: args.prompts]]
    times, att = [], None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        att = compare(model, {"policy": "deferral", "deferred": d, "min_immediate": 0}, prompts, tokenizer=tok,
                      max_new_tokens=args.tokens)
        times.append(time.perf_counter() - t0)
    m = from_samples(times)
    print(f"{name}: {args.prompts} prompts x up to {args.tokens} tokens ({len(att.tokens)} compared), deferral "
          f"{d}: {m.describe(1, 's')}; min {min(times):.2f} s [target <= 30 s]")
    m.check(args.allow_busy)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
