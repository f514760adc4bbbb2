"""``moelab run``: a hybrid configuration on prompts; writes trace, plans and timeline."""

from __future__ import annotations

from moelab.cli._util import add_prompt_arguments, emit_json, prompts_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "run",
        help="run a hybrid CPU/GPU configuration on prompts; write trace, plan log and timeline",
        description="Greedy-generate on prompts with the model under a hybrid configuration (YAML: cache, "
        "placement, prefetch, routing, backends, executor) and write OUT/trace (routing trace), "
        "OUT/plans.jsonl, OUT/events.parquet (the timeline), OUT/summary.json and OUT/config.json.",
    )
    p.add_argument("--model", required=True, help="bundled name, tiny-random-<family>, local directory or hub id")
    p.add_argument("--hybrid", required=True, metavar="CONFIG", help="hybrid configuration YAML file")
    add_prompt_arguments(p)
    p.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16, ...)")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.hybrid.config import HybridConfig
    from moelab.hybrid.run import run_prompts
    from moelab.loading import load

    config = HybridConfig.from_yaml(args.hybrid)  # bad configs fail before the model loads
    prompts = prompts_from_args(args)
    model, tokenizer = load(args.model, dtype=args.dtype)
    summary = run_prompts(model, tokenizer, prompts, config, args.out, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, overwrite=args.overwrite, model_name=args.model)
    if args.json:
        emit_json(summary)
    else:
        tps = summary.get("tokens_per_s")
        rate = f"{tps:.2f} tokens/s ({summary['tokens_per_s_basis']})" if tps else "no decode steps to time"
        if summary.get("lanes"):
            busy = ", ".join(f"{k} {v:.0f} %" for k, v in sorted(summary["busy_pct"].items()))
            lanes = f"lanes busy: {busy}; host/device overlap {summary['overlap_pct']:.0f} %"
        else:
            lanes = (f"the {config.executor} executor runs no lanes (no timeline events); use executor: real "
                     "or simulated for one")
        print(f"wrote {args.out}: {summary['plans']} layer plans, {summary['trace_rows']} trace rows; {rate}; {lanes}")
    return 0
