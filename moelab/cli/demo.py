"""``moelab demo``: the main job — trace a bundled model and write a self-contained HTML report."""

from __future__ import annotations

from moelab.cli._util import check_output_path, positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="trace a bundled model and write the HTML report",
        description="Record a routing trace of a model on a few prompts and write a self-contained "
        "HTML report (plotly embedded; opens offline).",
    )
    p.add_argument("--model", help="model to use (default: the bundled DeepSeek/Qwen2-style model)")
    p.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")
    p.add_argument("--max-new-tokens", type=positive_int, default=24)
    p.add_argument("--quick", action="store_true", help="smaller workloads in every section (seconds)")
    p.add_argument("--sections", help="comma-separated section names to include (default: all)")
    p.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="let the accuracy section run model-generated code (pycode) in the sandbox",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.demo import run_demo

    out = check_output_path(args.out, args.overwrite)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections is not None else None
    path = run_demo(
        out,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        quick=args.quick,
        sections=sections,
        allow_code_execution=args.allow_code_execution,
    )
    print(f"wrote {path}")
    return 0
