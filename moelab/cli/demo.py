"""``moelab demo``: the main job — trace a bundled model and write a self-contained HTML report."""

from __future__ import annotations

import sys

from moelab.cli._util import check_output_path, positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="trace a bundled model and write the HTML report",
        description="Record a routing trace of a model on a few prompts and write a self-contained "
        "HTML report (plotly embedded; opens offline), one section per capability. A section that "
        "fails is shown as an error box and the command exits with status 1.",
    )
    p.add_argument("--model", help="model to use (default: the bundled DeepSeek/Qwen2-style model)")
    p.add_argument("--out", default="report.html", help="HTML file to write (default report.html)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing report")
    p.add_argument("--max-new-tokens", type=positive_int, default=24)
    p.add_argument("--quick", action="store_true", help="smaller workloads in every section (seconds)")
    p.add_argument("--sections", help="comma-separated section names to include (default: all; see --list-sections)")
    p.add_argument("--skip", help="comma-separated section names to leave out")
    p.add_argument("--list-sections", action="store_true", help="print the report's sections and exit")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads for the model work (default: 1 for tiny models, else torch's default)")
    p.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="let the accuracy section run model-generated code (pycode) in the sandbox",
    )
    p.set_defaults(func=run)


def _names(text: str | None) -> list[str] | None:
    return [s.strip() for s in text.split(",") if s.strip()] if text is not None else None


def run(args) -> int:
    from moelab.report import check_sections, ordered_sections

    if args.list_sections:
        for s in ordered_sections():
            print(f"{s.name:<12} {s.heading}")
        return 0
    sections, skip = _names(args.sections), _names(args.skip)
    check_sections(sections, skip)  # before loading anything
    from moelab.demo import run_demo

    out = check_output_path(args.out, args.overwrite)
    report = run_demo(
        out,
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        quick=args.quick,
        sections=sections,
        skip=skip,
        allow_code_execution=args.allow_code_execution,
        threads=args.threads,
    )
    for s in report.sections:
        print(f"  {s.name:<12} {s.status:<12} {s.seconds:6.1f} s  {s.figures} figure(s)"
              + (f"  {s.error}" if s.error else ""))
    from moelab.report import load_text

    print(f"wrote {report.path}: sections took {sum(s.seconds for s in report.sections):.0f} s ({load_text()})")
    if report.failed:
        names = ", ".join(s.name for s in report.failed)
        print(f"moelab: error: {len(report.failed)} report section(s) failed: {names} "
              f"(each is an error box in {report.path})", file=sys.stderr)
        return 1
    return 0
