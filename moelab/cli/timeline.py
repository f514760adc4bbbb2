"""``moelab timeline``: summaries, interactive figures and trace exports of a run's events."""

from __future__ import annotations

import sys
from pathlib import Path

from moelab.cli._util import check_output_path, emit_json
from moelab.errors import MoelabError

FORMATS = {"chrome": ".json", "perfetto": ".pftrace", "html": ".html"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "timeline", help="timeline of a hybrid run: summary, interactive figure, Chrome/Perfetto export",
        description="Read the events (events.parquet) of run directories written by `moelab run --hybrid` "
        "(or events Parquet files) and summarise, draw or export them.")
    sub = p.add_subparsers(dest="timeline_command", metavar="ACTION")
    s = sub.add_parser("summary", help="busy %%, overlap, stalls by cause, critical path, tokens/s",
                       description="Summaries computed from the events alone; with two runs, compared line by line.")
    s.add_argument("runs", nargs="+", metavar="DIR", help="run directory or events Parquet file (two: compared)")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(func=run_summary)
    v = sub.add_parser("show", help="interactive figure as a self-contained HTML file",
                       description="One row per lane (several runs overlaid on one time axis), bars coloured by "
                       "fate, copy→compute flows and counter tracks; written as offline HTML and opened.")
    v.add_argument("runs", nargs="+", metavar="DIR", help="run directories or events Parquet files")
    v.add_argument("--html", metavar="OUT", help="HTML file to write (default: DIR/timeline.html)")
    v.add_argument("--steps", metavar="A:B", help="steps to draw, inclusive (default: all)")
    v.add_argument("--layers", metavar="A:B", help="MoE layers to draw, inclusive (default: all)")
    v.add_argument("--color-by", choices=["fate", "kind"], default="fate", help="bar colours (default: fate)")
    v.add_argument("--critical-path", type=int, metavar="STEP", help="draw this step's critical path")
    v.add_argument("--no-open", action="store_true", help="only write the file (CI, remote machines)")
    v.add_argument("--overwrite", action="store_true", help="replace an existing HTML file")
    v.set_defaults(func=run_show)
    e = sub.add_parser("export", help="Chrome trace JSON, Perfetto protobuf or HTML",
                       description="chrome: Trace Event Format JSON (ui.perfetto.dev, chrome://tracing); "
                       "perfetto: a Perfetto protobuf trace; html: the interactive figure.")
    e.add_argument("runs", nargs="+", metavar="DIR", help="run directories or events Parquet files (one process each)")
    e.add_argument("--format", choices=list(FORMATS), default="chrome", help="output format (default: chrome)")
    e.add_argument("--out", metavar="F", help="output file (default: DIR/timeline.json|.pftrace|.html)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    e.set_defaults(func=run_export)
    from moelab.cli.timeline_fig10 import register_fig10

    register_fig10(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _open(paths: list[str]):
    from moelab.timeline import Timeline

    return [Timeline.open(p) for p in paths]


def _range(text: str | None, what: str):
    if text is None:
        return None
    try:
        a, _, b = text.partition(":")
        return (int(a), int(b or a))
    except ValueError:
        raise MoelabError(f"--{what} {text!r}: expected A:B (inclusive integers, e.g. 0:3) or A.") from None


def _default_out(run: str, ext: str) -> Path:
    p = Path(run)
    return (p if p.is_dir() else p.parent) / f"timeline{ext}"


def run_summary(args) -> int:
    tls = _open(args.runs)
    if len(tls) > 2:
        raise MoelabError(f"timeline summary takes one run or two to compare, got {len(tls)}.")
    if len(tls) == 2:
        table = tls[0].compare(tls[1])
        if args.json:
            emit_json(table.to_dict(orient="records"))
        else:
            print(table.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
        return 0
    s = tls[0].summary()
    if args.json:
        emit_json(s)
        return 0
    wall = s["wall_us"]
    print(f"timeline   {s['name']}: {s['events']} events, {s['steps']} steps, wall {wall / 1e3:.2f} ms")
    rate = f"{s['tokens_per_s']:.2f} tokens/s ({s['tokens_per_s_basis']}), " if s["tokens_per_s"] else ""
    print(f"rates      {rate}{s['steps_per_s'] or 0:.2f} steps/s, {s['expert_pairs_per_s'] or 0:.0f} (token, expert) pairs/s")
    print("busy       " + ", ".join(f"{k} {v:.1f} %" for k, v in s["busy_pct"].items()))
    print(f"overlap    {s['overlap_pct']:.1f} % of the host lanes' busy time had the device side busy too")
    stall = sum(s["stall_us"].values())
    print(f"stalls     {stall / 1e3:.2f} ms of the control thread: " +
          ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in s["stall_us"].items()))
    if s.get("critical_path_us") is not None:
        print(f"critical   path {s['critical_path_us'] / 1e3:.3f} ms per step on average "
              f"({100 * s['critical_path_share']:.0f} % of the step's wall)")
    print("fates      " + ", ".join(f"{k} {v}" for k, v in s["fates"].items()) + f" ({s['fates_basis']})")
    return 0


def run_show(args) -> int:
    from moelab.timeline.figure import write_html

    out = Path(args.html) if args.html else _default_out(args.runs[0], ".html")
    check_output_path(out, args.overwrite)
    tls = _open(args.runs)
    fig = tls[0].figure(*tls[1:], steps=_range(args.steps, "steps"), layers=_range(args.layers, "layers"),
                        color_by=args.color_by, critical_path=args.critical_path)
    from moelab.timeline.figure import can_open_browser

    opened = not args.no_open and can_open_browser()
    path = write_html(fig, out, open_browser=opened)
    note = " (opened in the browser)" if opened else "" if args.no_open else " (no display here: open it in a browser)"
    print(f"wrote {path}{note}")
    return 0


def run_export(args) -> int:
    out = Path(args.out) if args.out else _default_out(args.runs[0], FORMATS[args.format])
    other = next((f for f, ext in FORMATS.items() if f != args.format and out.suffix == ext), None)
    if other is not None:  # e.g. --format chrome --out t.pftrace: a viewer would misread the file
        raise MoelabError(f"--out {out} has the {other} extension {out.suffix} but --format is {args.format}; "
                          f"use --format {other}, or an output ending in {FORMATS[args.format]}.")
    check_output_path(out, args.overwrite)
    tls = _open(args.runs)
    if args.format == "chrome":
        from moelab.timeline.export import to_chrome

        path = to_chrome(tls, out)
    elif args.format == "perfetto":
        from moelab.timeline.export import to_perfetto

        path = to_perfetto(tls, out)
    else:
        from moelab.timeline.figure import write_html

        path = write_html(tls[0].figure(*tls[1:]), out)
    n = sum(len(t) for t in tls)
    print(f"wrote {path} ({args.format}, {n} events)", file=sys.stdout)
    return 0
