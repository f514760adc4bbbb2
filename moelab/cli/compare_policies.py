"""``moelab compare-policies``: accuracy under Expert Deferral versus Expert Skipping.

Scores the model unmodified and with each number of deferred and skipped experts (a sweep
spec run by :mod:`moelab.sweeps`: ``--store DIR`` keeps the cells and resumes), and
prints the table of relative accuracy change versus experts affected (the structure of
KTransformers' Figure 13); ``--html`` writes the plotly heatmap.
"""

from __future__ import annotations

import argparse

from moelab.cli._util import check_output_path, emit_json, positive_int


def _counts(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 0,1,2; got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers ≥ 0 like 0,1,2; got {text!r}")
    return values


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "compare-policies",
        help="accuracy of expert deferral vs expert skipping (table + heatmap)",
        description="Score a model with lm-eval unmodified and under each deferral and skipping count; "
        "print the relative accuracy change versus the number of affected experts.",
    )
    p.add_argument("--model", required=True, help="bundled name, tiny-random-<family>, local directory or hub id")
    p.add_argument("--tasks", required=True, metavar="T[,T2]", help="comma-separated: arith, pycode, gsm8k, humaneval")
    p.add_argument("--deferred", type=_counts, default=[0, 1, 2], metavar="D,D2,...",
                   help="deferred-expert counts to score (default 0,1,2)")
    p.add_argument("--skipped", type=_counts, default=[0, 1, 2], metavar="S,S2,...",
                   help="skipped-expert counts to score (default 0,1,2)")
    p.add_argument("--limit", type=positive_int, help="score only the first N documents of each task")
    p.add_argument("--policy-phase", choices=("decode", "all"), default="decode",
                   help="apply the policies in decode steps only (default) or in prefill too")
    p.add_argument("--renormalize", action="store_true", help="skipping: rescale the kept experts' weights")
    p.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16, ...)")
    p.add_argument("--batch-size", type=positive_int, default=1, help="prompts per forward pass (default 1)")
    p.add_argument("--max-gen-toks", type=positive_int, help="cap on generated tokens per answer")
    p.add_argument("--allow-code-execution", action="store_true",
                   help="run model-generated code (pycode, humaneval) in moelab's sandbox")
    p.add_argument("--gsm8k-dir", metavar="DIR", help="local GSM8K copy (default $MOELAB_GSM8K_DIR)")
    p.add_argument("--humaneval-dir", metavar="PATH", help="local HumanEval copy (default $MOELAB_HUMANEVAL_DIR)")
    p.add_argument("--html", metavar="FILE", help="write the plotly heatmap to this self-contained HTML file")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --html file")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--store", metavar="DIR", help="keep the scored cells in this sweep store: an interrupted or "
                   "repeated comparison resumes from it (default: a temporary store)")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.evals import EvalConfig
    from moelab.evals.api import preflight
    from moelab.loading import load
    from moelab.sweeps.shortcuts import policy_comparison_spec, run_policy_comparison

    html = check_output_path(args.html, args.overwrite) if args.html else None
    settings = dict(
        batch_size=args.batch_size,
        max_gen_toks=args.max_gen_toks,
        allow_code_execution=args.allow_code_execution,
        gsm8k_dir=args.gsm8k_dir,
        humaneval_path=args.humaneval_dir,
    )
    preflight(EvalConfig(tasks=args.tasks, limit=args.limit, **settings))  # fail before loading
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    # the comparison is a sweep spec run by the sweep engine (resumable with --store)
    spec = policy_comparison_spec(args.model, args.dtype, tasks, deferred=args.deferred, skipped=args.skipped,
                                  limit=args.limit, phase=args.policy_phase, renormalize=args.renormalize, **settings)
    model, tokenizer = load(args.model, dtype=args.dtype)
    cmp = run_policy_comparison(spec, model, tokenizer, deferred=args.deferred, skipped=args.skipped,
                                phase=args.policy_phase, renormalize=args.renormalize, limit=args.limit,
                                store=args.store)
    if html is not None:
        cmp.write_html(html)
    if args.json:
        emit_json({**cmp.to_dict(), "html": str(html) if html else None})
    else:
        print(cmp.table())
        if html is not None:
            print(f"wrote {html}")
    return 0
