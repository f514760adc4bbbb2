"""``moelab eval``: score a model's accuracy with lm-eval (local tasks, offline GSM8K/HumanEval).

The model is loaded, then scored inside :func:`model_context`, the one place where
routing policies (``--deferred``, ``--skipped``, ``--policy-phase``) wrap it; their
arguments are added in :func:`add_model_arguments`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from moelab.cli._util import emit_json, non_negative_int, positive_int
from moelab.errors import MoelabError
from moelab.evals.data import GSM8K_ENV, HUMANEVAL_ENV


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="score accuracy with lm-eval",
        description="Score a model with lm-eval on moelab's tasks: arith and pycode (synthetic), "
        "gsm8k and humaneval (local copies, no hub). pycode and humaneval execute model-generated "
        "code and need --allow-code-execution.",
    )
    add_model_arguments(p)
    p.add_argument(
        "--tasks",
        required=True,
        metavar="T[,T2]",
        help="comma-separated: arith, pycode, gsm8k, humaneval",
    )
    p.add_argument(
        "--limit", type=positive_int, help="score only the first N documents of each task"
    )
    p.add_argument(
        "--num-fewshot",
        type=non_negative_int,
        metavar="K",
        help="few-shot examples (default: the task's; gsm8k 8)",
    )
    p.add_argument(
        "--allow-code-execution",
        "--confirm-run-unsafe-code",
        dest="allow_code_execution",
        action="store_true",
        help="run model-generated code (pycode, humaneval) in moelab's sandbox",
    )
    p.add_argument(
        "--sandbox-isolation",
        choices=("rlimits", "namespaces"),
        default=None,
        metavar="LEVEL",
        help="least sandbox isolation to accept for generated code: namespaces (default; "
        "kernel-confined) or rlimits (accept the weaker level explicitly)",
    )
    p.add_argument(
        "--gsm8k-dir",
        metavar="DIR",
        help=f"local GSM8K copy with test.jsonl, train.jsonl (default ${GSM8K_ENV})",
    )
    p.add_argument(
        "--humaneval-dir",
        metavar="PATH",
        help=f"local HumanEval directory or .jsonl[.gz] file (default ${HUMANEVAL_ENV})",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=1, help="prompts per forward pass (default 1)"
    )
    p.add_argument("--max-gen-toks", type=positive_int, help="cap on generated tokens per answer")
    p.add_argument(
        "--seed",
        type=int,
        default=1234,
        help="seed for lm-eval and few-shot sampling (default 1234)",
    )
    p.add_argument(
        "--code-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds per generated program",
    )
    p.add_argument(
        "--out", metavar="DIR", help="write results.json and per-sample logs to this new directory"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    p.add_argument("--hybrid", metavar="CONFIG", help="score the model under a hybrid configuration (YAML; the "
                   "same file `moelab run` times); not together with --deferred/--skipped")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def add_model_arguments(p) -> None:
    """The model to score and (next) the routing policy to apply to it."""
    p.add_argument(
        "--model",
        required=True,
        help="bundled name, tiny-random-<family>, local directory or hub id",
    )
    p.add_argument("--dtype", default=None, help="model dtype (float32, bfloat16, ...)")
    from moelab.cli.policy_args import add_policy_arguments

    add_policy_arguments(p)


@contextlib.contextmanager
def model_context(args, model: Any) -> Iterator[Any]:
    """The model as it should be scored: with the routing policy the flags ask for, if any."""
    from moelab.cli.policy_args import policy_context

    if getattr(args, "hybrid", None):
        from moelab.hybrid.runtime import HybridRun

        if getattr(args, "deferred", None) or getattr(args, "skipped", None):
            raise MoelabError("--hybrid already names its routing (routing: in the YAML); drop --deferred/--skipped.")
        with HybridRun(model, args.hybrid):
            yield model
        return
    with policy_context(args, model) as scored:
        yield scored


def run(args) -> int:
    from moelab.evals import EvalConfig, evaluate
    from moelab.evals.api import preflight
    from moelab.loading import load

    config = EvalConfig(
        tasks=args.tasks,
        limit=args.limit,
        num_fewshot=args.num_fewshot,
        allow_code_execution=args.allow_code_execution,
        batch_size=args.batch_size,
        seed=args.seed,
        max_gen_toks=args.max_gen_toks,
        gsm8k_dir=args.gsm8k_dir,
        humaneval_path=args.humaneval_dir,
        code_timeout_s=args.code_timeout,
        sandbox_isolation=args.sandbox_isolation,
    )
    _, _, out = preflight(config, args.out, args.overwrite)  # bad tasks, data, output: fail before loading
    if args.hybrid:
        from moelab.hybrid.config import HybridConfig

        HybridConfig.from_yaml(args.hybrid)  # a bad configuration fails before the model loads
    # claim --out before loading the model: a second `moelab eval` to it is refused now
    claim = None
    if out is not None:
        from moelab._output import reserve_output

        claim = reserve_output(out, args.overwrite, what="output",
                               hint="pass --overwrite to replace it or choose another --out")
    try:
        model, tokenizer = load(args.model, dtype=args.dtype)
        with model_context(args, model) as scored:
            result = evaluate(
                scored,
                tokenizer,
                config=config,
                log_samples_dir=out,
                overwrite=args.overwrite,
                model_name=args.model,
                reservation=claim,
            )
    finally:
        if claim is not None:
            claim.abort()  # a no-op after the commit
    if args.json:
        emit_json(result.to_dict())
    else:
        print(f"model {result.model}")
        for line in result.setup_lines() or ["scored unmodified (no routing policy, no hybrid configuration)"]:
            print(line)
        print(result.table())
        for task in result.tasks.values():
            for note in task.notes:
                print(f"note: {task.task}: {note}")
        if result.code_isolation:
            print(f"generated code ran in the sandbox at isolation level {result.code_isolation}")
        if result.samples_dir:
            print(f"wrote {result.samples_dir}")
    return 0

