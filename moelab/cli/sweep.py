"""``moelab sweep run|status|report SPEC``: accuracy sweeps that resume and scale out on Ray."""

from __future__ import annotations

from moelab.cli._util import positive_int


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "sweep",
        help="run, inspect and report accuracy sweeps (resumable; local or Ray)",
        description="Accuracy sweeps over models × routing policies × tasks × seeds, from a YAML spec "
        "(see evals/sweeps/); with 'kind: cache' or 'kind: predictor', cache-simulation or predictor sweeps "
        "over routing traces. Finished cells are kept in a results store; running a spec again skips them, "
        "so an interrupted sweep resumes where it stopped.",
    )
    sub = p.add_subparsers(dest="sweep_command", metavar="ACTION")
    sub.required = True

    def common(q) -> None:
        q.add_argument("spec", metavar="SPEC", help="the sweep spec (YAML)")
        q.add_argument("--store", metavar="DIR", help="results store directory (default: the spec's "
                       "'store', else runs/sweeps/<name>)")

    r = sub.add_parser("run", help="run the unfinished cells of a spec",
                       description="Run every cell of SPEC that the store does not hold yet.")
    common(r)
    r.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local: in this process, one cell at a time (default); ray: Ray actors")
    r.add_argument("--workers", type=positive_int, default=None,
                   help="Ray workers (actors), each with its model loaded (default 2 for ray)")
    r.add_argument("--address", metavar="A", help="an existing Ray cluster (default: start a local one)")
    r.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads per worker (default: torch's for local, 1 per Ray worker)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run)

    s = sub.add_parser("status", help="how many cells are done, to do, failed")
    common(s)
    s.add_argument("--json", action="store_true", help="one JSON object per cell on stdout")
    s.set_defaults(func=_status)

    h = sub.add_parser("report", help="tables and deferral-vs-skipping curves as HTML")
    common(h)
    h.add_argument("--html", required=True, metavar="OUT", help="the HTML file to write")
    h.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    h.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    h.add_argument("--self-contained", action="store_true",
                   help="embed plotly.js in OUT (one ~5 MB file) instead of writing plotly.min.js beside it")
    h.set_defaults(func=_report)


def _run(args) -> int:
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.spec import load_spec

    workers = args.workers if args.workers is not None else (2 if args.backend == "ray" else 1)
    if args.backend == "ray":  # the install hint before reading the spec (which loads torch)
        from moelab.sweeps.backends import import_ray

        import_ray()
    spec = load_spec(args.spec)
    summary = run_sweep(spec, backend=args.backend, workers=workers, address=args.address,
                        threads=args.threads, store=args.store, progress=not args.no_progress)
    print(summary.line())
    for h, err in summary.failed.items():
        print(f"failed: {h}: {err}")
    return 1 if summary.failed else 0


def _status(args) -> int:
    from moelab.sweeps.driver import store_path
    from moelab.sweeps.report import collect, status_text
    from moelab.sweeps.spec import load_spec

    spec = load_spec(args.spec)
    statuses = collect(spec, args.store)
    if args.json:
        from moelab.cli._util import emit_json

        emit_json([{"hash": x.cell.hash, "label": x.cell.label(), "state": x.state, "error": x.error,
                    "score": (x.record or {}).get("score"), "stderr": (x.record or {}).get("score_stderr")}
                   for x in statuses])
    else:
        print(status_text(spec, statuses, str(store_path(spec, args.store))))
    return 0


def _report(args) -> int:
    from moelab.sweeps.report import collect, markdown_latency, markdown_tables, write_html
    from moelab.sweeps.spec import load_spec

    spec = load_spec(args.spec)
    statuses = collect(spec, args.store)
    out = write_html(spec, statuses, args.html, overwrite=args.overwrite, self_contained=args.self_contained,
                     store=args.store)
    if args.markdown:
        from moelab.sweeps.driver import store_path
        from moelab.sweeps.report import markdown_paired, paired_rows

        print(markdown_tables(spec, statuses))
        print(markdown_latency(statuses))
        if spec.kind == "eval":
            print(markdown_paired(paired_rows(statuses, store_path(spec, args.store))))
    print(f"wrote {out}")
    return 0
