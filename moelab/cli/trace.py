"""``moelab trace``: record a routing trace of a model generating on prompts."""

from __future__ import annotations

from moelab.cli._util import add_prompt_arguments, check_output_path, emit_json, prompts_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "trace",
        help="record a routing trace",
        description="Greedy-generate on prompts and record, per token and MoE layer, the routing decisions.",
    )
    p.add_argument("--model", required=True, help="bundled name, tiny-random-<family>, local directory or hub id")
    add_prompt_arguments(p)
    p.add_argument("--hidden-states", action="store_true", help="also record router-input hidden states")
    p.add_argument("--hidden-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--no-scores", action="store_true", help="do not record the full router score vectors")
    p.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16, ...)")
    p.add_argument("--out", required=True, help="trace directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing trace directory")
    p.add_argument("--json", action="store_true", help="print the trace summary as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab._output import reserve_output
    from moelab.loading import load
    from moelab.trace.run import trace_prompts

    out = check_output_path(args.out, args.overwrite)
    prompts = prompts_from_args(args)
    # claim --out before loading the model: a second writer of it is refused now, not after a load
    with reserve_output(out, args.overwrite, what="trace directory",
                        hint="pass --overwrite to replace it or choose another --out") as claim:
        model, tokenizer = load(args.model, dtype=args.dtype)
        trace = trace_prompts(
            model,
            tokenizer,
            prompts,
            out,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            overwrite=args.overwrite,
            scores=not args.no_scores,
            hidden_states=args.hidden_states,
            hidden_dtype=args.hidden_dtype,
            model_name=args.model,
            metadata={"source": args.prompts or f"task:{args.task}"},
            reservation=claim,
        )
    summary = trace.summary()
    if args.json:
        emit_json(summary)
    else:
        print(
            f"wrote {trace.path}: {summary['tokens']} tokens ({summary['prefill_tokens']} prefill, "
            f"{summary['decode_tokens']} decode) x {len(summary['moe_layers'])} MoE layers"
        )
    return 0
