"""``moelab timeline fig10``: the signature plot (KTransformers Fig. 10 redrawn), simulated or real."""

from __future__ import annotations

import sys
from pathlib import Path

from moelab.cli._util import check_output_path, emit_json, non_negative_int, positive_int


def register_fig10(sub) -> None:
    """Add ``fig10`` to the ``moelab timeline`` actions (``sub``: its subparsers)."""
    f = sub.add_parser(
        "fig10", help="the signature plot: one MoE layer without and with 2, 3, 4 deferred experts",
        description="KTransformers Fig. 10 redrawn from events: one MoE layer of a decode step without deferral "
        "and with 2, 3 and 4 deferred experts, stacked on one time axis with busy %% per lane. Default: "
        "DeepSeek-V3 (BF16) simulated on the ktransformers-a100 profile as the simulator's validation cases set "
        "it up; --real: the DeepSeek-V2-Lite-shaped model on the real executor on this machine (about a minute "
        "and a half on 2 cores).")
    f.add_argument("--real", action="store_true", help="run the real executor on this machine instead of simulating")
    f.add_argument("--html", metavar="OUT", required=True, help="HTML file to write")
    f.add_argument("--deferred", type=non_negative_int, nargs="+", default=[0, 2, 3, 4], metavar="N",
                   help="deferred experts per panel (default: 0 2 3 4)")
    f.add_argument("--steps", type=positive_int, default=None,
                   help="decode steps simulated (default 8; the last is drawn) or measured after warm-up with "
                        "--real (default 3; the median step is drawn)")
    f.add_argument("--layers", type=positive_int, default=3, help="--real: MoE layers of the model (default 3)")
    f.add_argument("--json", action="store_true", help="also print the panels' figures (layer µs, busy %%) as JSON")
    f.add_argument("--no-open", action="store_true", help="only write the file (CI, remote machines)")
    f.add_argument("--overwrite", action="store_true", help="replace an existing HTML file")
    f.set_defaults(func=run_fig10)


def run_fig10(args) -> int:
    from moelab.timeline.figure import can_open_browser, write_html
    from moelab.timeline.signature import (
        fig10_figure,
        fig10_table,
        real_fig10,
        real_setup,
        simulated_fig10,
        simulated_setup,
    )

    out = Path(args.html)
    check_output_path(out, args.overwrite)
    if args.real:
        panels = real_fig10(args.deferred, layers=args.layers, steps=args.steps or 3, progress=True)
        sub, title = real_setup(args.layers, args.steps or 3), "One MoE layer on this machine's real executor (Fig. 10 redrawn)"
    else:
        panels = simulated_fig10(args.deferred, steps=args.steps or 8)
        sub, title = simulated_setup(), "One DeepSeek-V3 MoE layer, simulated (KTransformers Fig. 10 redrawn)"
    fig = fig10_figure(panels, title=title, subtitle=sub)
    opened = not args.no_open and can_open_browser()
    path = write_html(fig, out, open_browser=opened)
    table = fig10_table(panels)
    if args.json:
        emit_json(fig.layout.meta["panels"])
    else:
        print(table.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    print(f"wrote {path}" + (" (opened in the browser)" if opened else ""), file=sys.stderr if args.json else sys.stdout)
    return 0
