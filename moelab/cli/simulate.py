"""``moelab simulate``: what-if grids on any model shape and hardware, and ``moelab simulate validate``."""

from __future__ import annotations

import tempfile
from pathlib import Path

from moelab.cli._util import emit_json, non_negative_int, positive_int
from moelab.errors import MoelabError
from moelab.timing.profile import apply_settings, get_profile, pool_numa, save_profile
from moelab.timing.shapes import get_shape

GRID_HELP = (
    "axes: capacity (experts per layer with a unit: 8e is a count, 25%% or 0.25 a fraction, 0 none), deferral, "
    "placement, policy (cache policy, default lru; static pins the most used experts of the warm-up steps), "
    "prefetch (none, oracle, repeat, activation: MoE-Infinity's; default none), skipping, min_immediate (experts per token deferral keeps, "
    "default 2), select (prefetch choice: impact, HybriMoE's, default; order, ProMoE's), chunks (low-priority "
    "copies in chunks, ProMoE's: a demand copy waits for one chunk; default 1)")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="what-if grids of hybrid configurations on any model shape and hardware (simulated)",
        description="Plan every cell of a configuration grid with the offline planner and simulate it on a "
        "hardware profile: tokens/s and stall time by cause per cell, each beside its oracle bound (Belady's MIN "
        "cache + oracle prefetch, same capacity, deferral and placement). Routing from a recorded trace "
        "(--trace) or synthetic (--synthetic; statistics fitted from --fit-from, by default from a trace of the "
        "bundled moelab-tiny-mixtral, printed). `moelab simulate validate` prints the simulator's error against "
        "this machine and the papers.",
        epilog="example: moelab simulate --model-shape deepseek-v3 --hardware h100-pcie5-ddr5 --synthetic "
        "--steps 16 --grid capacity=0,4e,8e deferral=0,2,3,4 placement=host-misses,greedy-hss "
        "(a cell that does not fit in the profile's GPU or host memory is refused with the numbers)",
    )
    p.add_argument("--model-shape", metavar="SHAPE", help="a catalog shape (deepseek-v3, mixtral-8x7b, ...) or a "
                   "config.json")
    p.add_argument("--dtype", default=None, help="re-cost the shape's weights in this dtype (bf16, fp8, int4, ...)")
    p.add_argument("--hardware", metavar="PROFILE", help="a hardware profile name or YAML file "
                   "(moelab calibrate --out writes one for this machine; a file may say `base: NAME` and override "
                   "some fields)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="settings",
                   help="override one field of the profile, e.g. --set link_efficiency=0.75 --set gpu_memory_gb=94 "
                   "(repeatable; fields: moelab.timing.FIELDS)")
    p.add_argument("--numa", choices=("split", "pooled"), default="split",
                   help="split (default): experts spread over the NUMA nodes, each read at its node's bandwidth; "
                   "pooled: one host lane reading all nodes at once (each expert split over the sockets, as "
                   "KTransformers' NUMA-aware kernels do; what `moelab simulate validate` assumes for the papers)")
    p.add_argument("--kv-on-host", action="store_true",
                   help="the schedule keeps the KV cache in host memory (counted there, not on the GPU)")
    p.add_argument("--ignore-memory", action="store_true",
                   help="simulate cells that do not fit in the profile's GPU or host memory instead of refusing them")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", metavar="DIR", help="routing trace recorded on a model of this shape")
    src.add_argument("--synthetic", action="store_true", help="synthetic routing with fitted statistics")
    p.add_argument("--fit-from", metavar="DIR", help="trace to fit the synthetic statistics from "
                   "(default: one recorded now from the bundled moelab-tiny-mixtral, cached)")
    p.add_argument("--calibrate-synthetic", action="store_true",
                   help="calibrate the synthetic generator to the statistics (slow on large shapes)")
    p.add_argument("--steps", type=positive_int, default=16, help="decode steps measured (default 16)")
    p.add_argument("--warmup", type=non_negative_int, default=16,
                   help="decode steps simulated first and not measured (the caches start empty; default 16)")
    p.add_argument("--batch", type=positive_int, default=1, help="sequences decoded together (synthetic; default 1)")
    p.add_argument("--context", type=non_negative_int, default=1024, help="tokens in the KV cache before the first "
                   "simulated step (default 1024)")
    p.add_argument("--grid", nargs="+", default=[], metavar="AXIS=V1,V2", help=GRID_HELP)
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="decode (default): the what-if grid; prefill: one prompt of --prompt-tokens on the "
                   "stream-loading (OSDI '26) or hybrid path (moelab.simulate.prefill; no routing source needed)")
    p.add_argument("--prompt-tokens", type=positive_int, default=8192, help="prefill: prompt length (default 8192)")
    p.add_argument("--prefill-path", choices=("slp", "hybrid", "auto"), default="auto",
                   help="prefill: slp (experts streamed to a GPU ring), hybrid (GPU attention, CPU experts, "
                   "chunked) or auto (default: slp from the simulated crossover length on)")
    p.add_argument("--ring-slots", type=positive_int, default=None, metavar="R",
                   help="prefill: expert slots of the ring (default: E while transfer dominates, else 2)")
    p.add_argument("--chunk-tokens", type=positive_int, default=512, help="prefill: hybrid path chunk (default 512)")
    p.add_argument("--dense-budget-gb", type=float, default=1.0, metavar="GB",
                   help="prefill: GPU memory for streamed dense modules, outside the ring (default 1, OSDI's)")
    p.add_argument("--events", metavar="OUT.parquet", help="prefill: write the SLP schedule's events (loader, "
                   "compute, unloader, ring slots) for moelab timeline / moelab.Timeline")
    p.add_argument("--decode-batch", type=non_negative_int, default=0, metavar="Y",
                   help="prefill: Y sequences (at --context) decode while the prompt prefills by SLP on the same "
                   "GPU (moelab.simulate.prefill_mixed; default 0: the prefill alone)")
    p.add_argument("--no-oracle", action="store_true", help="skip the oracle bound (half the time)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", metavar="OUT", help="also write the grid as CSV")
    p.add_argument("--json", action="store_true", help="print the grid as JSON")
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="simulate_command", metavar="{validate,throughput}")
    v = sub.add_parser(
        "validate",
        help="the simulator's error against this machine and the papers",
        description="Calibrate this machine (quick) or reuse --profile, predict real-executor runs calibration "
        "did not see (the DeepSeek-V2-Lite-shaped grid of moelab.hybrid.bench and the bundled models) from the "
        "same plans, and the papers' published numbers (KTransformers Fig. 10, OSDI '26) on their stated "
        "machines; print case, published or measured, simulated, error (moelab.simulate.validate).",
    )
    v.add_argument("--profile", metavar="PROFILE", help="reuse this calibrated profile instead of calibrating")
    v.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="settings",
                   help="override one field of --profile for this machine's rows (repeatable); the papers' rows "
                   "keep their machines")
    v.add_argument("--quick", action="store_true", help="fewer cases and steps (for tests)")
    v.add_argument("--papers-only", action="store_true", help="only the papers' cases (no runs on this machine)")
    v.add_argument("--repeat", type=positive_int, default=2, metavar="N",
                   help="run the machine validation N times (each calibrating anew unless --profile) and say "
                   "whether their medians agree within 10 %% (default 2)")
    v.add_argument("--allow-busy", action="store_true",
                   help="run although other work loads the machine (refused by default); every figure flagged")
    v.add_argument("--allow-out-of-bounds", action="store_true",
                   help="use a calibration with values outside their physical bounds (flagged in its provenance)")
    v.add_argument("--numa", choices=("pooled", "split"), default="pooled",
                   help="the papers' CPUs: pooled (default: every expert split over the sockets, one host lane, as "
                   "KTransformers' NUMA-aware kernels do) or split (expert e on node e %% nodes)")
    v.add_argument("--json", action="store_true", help="print the rows as JSON")
    v.set_defaults(func=run_validate)
    from moelab.cli.simulate_throughput import register as register_throughput
    register_throughput(sub)


def run(args) -> int:
    import sys

    from moelab.simulate.whatif import brief_stats, format_table, whatif

    if not args.model_shape or not args.hardware:
        raise MoelabError("moelab simulate needs --model-shape SHAPE and --hardware PROFILE (and --trace DIR or "
                          "--synthetic); see moelab simulate --help.")
    if args.phase == "prefill":
        return run_prefill(args)
    if not args.trace and not args.synthetic:
        raise MoelabError("give a routing source: --trace DIR (recorded on this shape) or --synthetic.")
    if args.fit_from and not args.synthetic:
        raise MoelabError("--fit-from fits synthetic routing; add --synthetic.")
    shape = get_shape(args.model_shape, dtype=args.dtype)
    hw = apply_settings(get_profile(args.hardware), args.settings)
    if args.numa == "pooled":
        hw = pool_numa(hw)
    df = whatif(shape, hw, trace=args.trace, synthetic=args.synthetic, fit_from=args.fit_from,
                steps=args.steps, warmup=args.warmup, batch=args.batch, context=args.context, grid=args.grid,
                oracle=not args.no_oracle, seed=args.seed, calibrate_synthetic=args.calibrate_synthetic,
                progress=sys.stderr.isatty(), check_memory=not args.ignore_memory, kv_on_host=args.kv_on_host)
    a = df.attrs
    if args.csv:
        from moelab._output import write_file_atomic

        write_file_atomic(args.csv, df.to_csv(index=False))
    if args.json:
        emit_json({"rows": df.to_dict(orient="records"),
                   **{k: (v.to_dict() if hasattr(v, "to_dict") else v) for k, v in a.items() if k != "profile"},
                   "profile": {**hw.to_dict(), "provenance": dict(hw.provenance)}})
        return 0
    print(f"{a['shape']} on {a['hardware']}: {a['steps']} decode steps measured after {a['warmup']} warm-up steps, "
          f"batch {a['batch']}, context {a['context']}")
    for f in sorted({*(s.split('=', 1)[0].strip() for s in args.settings)}):
        print(f"--set {f}={getattr(hw, f)}")
    if args.numa == "pooled":
        print(f"NUMA pooled: one host lane reading {hw.numa_node_bandwidth_gbs:g} GB/s (all nodes)")
    print(f"routing: {a['routing_source']}")
    print(f"simulated numbers predict: {_predicts(args.hardware)}")
    if a["routing_stats"] is not None:
        print("routing statistics assumed:")
        print(str(a["routing_stats"]))
        st, gen = a["routing_stats"], a["generated_stats"]
        target = st.for_shape(shape.num_experts, shape.top_k, shape.num_moe_layers, seed=args.seed)
        print(f"carried to {shape.name} (target): {brief_stats(target)}")
        if gen is not None:
            print(f"measured on the generated routing:  {brief_stats(gen)}")
    for note in a["notes"]:
        print(f"note: {note}")
    print(format_table(df))
    print(f"{a['cells']} cells{' + oracle bounds' if not args.no_oracle else ''} in {a['wall_s']:.1f} s wall "
          f"(routing {a['routing_s']:.1f} s)" + (f"; wrote {args.csv}" if args.csv else ""))
    return 0


def run_prefill(args) -> int:
    """``--phase prefill``: one prompt's prefill on the chosen path (moelab.simulate.prefill)."""
    from moelab.simulate.prefill import PrefillConfig, format_prefill, prefill
    from moelab.simulate.prefill_mixed import format_mixed, mixed_prefill_decode

    hw = apply_settings(get_profile(args.hardware), args.settings)
    if args.numa == "pooled":
        hw = pool_numa(hw)
    shape = get_shape(args.model_shape, dtype=args.dtype)
    cfg = PrefillConfig(prompt_tokens=args.prompt_tokens, path=args.prefill_path, ring_slots=args.ring_slots,
                        chunk_tokens=args.chunk_tokens, dense_budget_gb=args.dense_budget_gb)
    if args.decode_batch:
        if args.prefill_path == "hybrid":
            raise MoelabError("--decode-batch models decode beside stream-loading prefill; use --prefill-path slp "
                              "(or auto).")
        res = mixed_prefill_decode(shape, hw, cfg, decode_batch=args.decode_batch, decode_context=args.context)
        fmt = format_mixed
    else:
        res, fmt = prefill(shape, hw, cfg), format_prefill
    if args.events:
        from moelab.simulate.prefill_events import write_events

        write_events(res.schedule, args.events)
    if args.json:
        emit_json(res.to_dict())
    else:
        print(fmt(res))
    return 0


def run_validate(args) -> int:
    from moelab.simulate.validate import format_rows, run_validation

    profile = args.profile
    with tempfile.TemporaryDirectory(prefix="moelab-validate-set-") as tmp:
        if args.settings:
            if not profile:
                raise MoelabError("--set changes the profile given with --profile; without --profile validate "
                                  "calibrates this machine now (write one with moelab calibrate --out P, then "
                                  "--profile P --set FIELD=VALUE).")
            hw = apply_settings(get_profile(profile), args.settings)
            profile = str(save_profile(hw, Path(tmp) / f"{hw.name}.yaml"))  # a file: validate prints its path
        rows, info = run_validation(profile=profile, quick=args.quick, machine=not args.papers_only,
                                    progress=not args.json, repeat=args.repeat, allow_busy=args.allow_busy,
                                    allow_out_of_bounds=args.allow_out_of_bounds, numa=args.numa)
    if args.json:
        emit_json({"rows": rows, **info})
        return 0
    print(format_rows(rows, info))
    return 0


def _predicts(hardware) -> str:
    """What the simulated numbers predict on ``hardware``: the hardware alone, or moelab's executor on it
    (a calibrated profile's runtime overhead, moelab.simulate.runtime)."""
    from moelab.simulate.runtime import EXECUTOR, prediction_label

    hw = get_profile(hardware)
    if prediction_label(hw) == EXECUTOR:
        return (f"moelab's executor on {hw.name} (its runtime overhead: {hw.runtime_layer_us:g} µs per MoE layer, "
                f"{hw.runtime_call_us:g} µs per lane call)")
    return f"the hardware {hw.name} alone (no runtime overhead of moelab's executor in the profile)"
