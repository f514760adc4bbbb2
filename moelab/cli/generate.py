"""``moelab generate``: greedy text from a model, optionally under a routing policy."""

from __future__ import annotations

from moelab.cli._util import emit_json, positive_int


def register(subparsers) -> None:
    from moelab.cli.policy_args import add_policy_arguments

    p = subparsers.add_parser(
        "generate",
        help="generate text (greedy), optionally with expert deferral or skipping",
        description="Greedy-decode a continuation of --prompt. With --deferred D or --skipped S the "
        "routing policy is applied while generating (decode steps only unless --policy-phase all).",
    )
    p.add_argument("--model", required=True, help="bundled name, tiny-random-<family>, local directory or hub id")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, metavar="K", help="tokens to generate (default 32)")
    p.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16, ...)")
    add_policy_arguments(p)
    p.add_argument("--json", action="store_true", help="print text, token ids and settings as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.cli.policy_args import describe_policy, policy_context
    from moelab.loading import load
    from moelab.policies.textgen import generate_text

    model, tokenizer = load(args.model, dtype=args.dtype)
    with policy_context(args, model):
        gen = generate_text(model, tokenizer, args.prompt, args.max_new_tokens)
    if args.json:
        emit_json({
            "model": args.model,
            "prompt": gen.prompt,
            "policy": describe_policy(args),
            "max_new_tokens": args.max_new_tokens,
            "text": gen.text,
            "token_ids": gen.token_ids,
        })
    else:
        print(gen.text)
    return 0
