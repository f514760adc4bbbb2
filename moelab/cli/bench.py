"""``moelab bench``: benchmarks. ``moelab bench kernels`` times the native experts kernels."""

from __future__ import annotations

import sys

from moelab.cli._util import emit_json, positive_int
from moelab.errors import MoelabError

# Copies of moelab.kernels.bench's defaults (importing it loads transformers, and building the
# parser must stay fast); tests/test_cli_startup.py checks that they agree.
DEFAULT_SHAPES: tuple[str, ...] = ("2048x1408x64x6", "4096x14336x8x2")
DEFAULT_TOKENS: tuple[int, ...] = (1, 4, 16, 64, 256)
DEFAULT_DTYPES: tuple[str, ...] = ("bf16", "int8", "int4", "fp8")
DTYPES: tuple[str, ...] = ("fp32", "bf16", "int8", "int4", "fp8")
BASELINES: tuple[str, ...] = ("eager", "batched_mm", "grouped_mm")
#: ``moelab bench kernels --emulate ISA``: the environment under which this CPU looks, to moelab's kernels
#: and to transformers' built-ins alike, like one whose best instruction set is ISA (a CPU without AMX,
#: or without AVX-512): moelab's path forced (``MOELAB_KERNELS_ISA``), oneDNN's kernels capped
#: (``ONEDNN_MAX_CPU_ISA``, oneDNN's documented switch) and ATen's vectorised kernels held to that
#: level (``ATEN_CPU_CAPABILITY``). Forcing moelab's path alone compares its AVX2 kernels with built-ins
#: that still run AMX tiles through oneDNN, a pairing no machine has.
EMULATE_ENV: dict[str, dict[str, str]] = {
    "avx2": {"MOELAB_KERNELS_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"MOELAB_KERNELS_ISA": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
               "ATEN_CPU_CAPABILITY": "avx512"},
    "avx512vnni": {"MOELAB_KERNELS_ISA": "avx512vnni", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                   "ATEN_CPU_CAPABILITY": "avx512"},
}
# a copy of moelab.simulate.moegen.bench.DEFAULT_MODELS (importing it loads torch)
THROUGHPUT_MODELS: tuple[str, ...] = ("moelab-tiny-mixtral", "v2-lite:2")


def register(subparsers) -> None:
    """The ``bench`` subcommands and their options.

    Size: one argparse declaration per benchmark (kernels, hybrid, timeline, simulate, throughput), each
    option with its help text; splitting it would scatter one command's interface over helpers.
    """
    p = subparsers.add_parser("bench", help="benchmarks (kernels, hybrid, timeline, simulate, throughput)", description="Benchmarks on this machine.")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    k = sub.add_parser(
        "kernels",
        help="native CPU experts kernels vs transformers' experts",
        description="Measure this machine's read bandwidth and FMA peak, then time moelab's fused experts kernels "
        "(per dtype) against the fastest of transformers' eager, batched_mm and grouped_mm experts for realistic "
        "shapes; --prefill times one DeepSeek-V2-Lite-shaped layer at 512 and 2048 tokens instead.",
    )
    k.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), metavar="HxIxExK",
                   help=f"expert shapes (default: {' '.join(DEFAULT_SHAPES)})")
    k.add_argument("--tokens", nargs="+", type=positive_int, default=list(DEFAULT_TOKENS), metavar="T",
                   help="tokens per call (default: 1 4 16 64 256)")
    k.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=list(DTYPES),
                   help=f"moelab weight formats (default: {' '.join(DEFAULT_DTYPES)})")
    k.add_argument("--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES),
                   help="transformers implementations to compare with; speedup is against the fastest "
                   "(default: all three; none to skip)")
    k.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128], help="int8/int4 group size")
    k.add_argument("--repeat", type=positive_int, default=5, help="timed repetitions per point (median)")
    k.add_argument("--quick", action="store_true", help="T=1 and 256 only, first shape, 3 repetitions")
    k.add_argument("--prefill", action="store_true",
                   help="one DeepSeek-V2-Lite-shaped layer (2048x1408x64x6) at 512 and 2048 tokens, uniform and "
                   "skewed routing, instead of --shapes/--tokens")
    k.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    k.add_argument("--allow-busy", action="store_true",
                   help="print figures measured on a busy machine (flagged) instead of refusing them")
    k.add_argument("--emulate", choices=sorted(EMULATE_ENV), default=None,
                   help="time as a CPU whose best instruction set is this one would: moelab's kernels forced to it "
                   "and transformers' built-ins held to it too (oneDNN's ONEDNN_MAX_CPU_ISA, ATen's "
                   "ATEN_CPU_CAPABILITY); reruns the command in a child process with that environment")
    k.set_defaults(func=run_kernels)
    h = sub.add_parser(
        "hybrid",
        help="hybrid runtime: planner cost, functional overhead, real executor on realistic shapes",
        description="Planner cost per MoE layer and step on the bundled models, the functional executor "
        "against the plain model, and the real executor's decode step on DeepSeek-V2-Lite-shaped layers for "
        "deferral 0..4 and device capacity 0/25/50 % (moelab.hybrid.bench).",
    )
    h.add_argument("--layers", type=positive_int, default=3, help="MoE layers of the realistic model (default 3)")
    h.add_argument("--steps", type=positive_int, default=8, help="decode steps per realistic point (default 8)")
    h.add_argument("--skip-realistic", action="store_true", help="only the planner and functional checks")
    h.add_argument("--side-by-side", action="store_true",
                   help="only the side-by-side table: plain transformers (eager, batched_mm, grouped_mm experts) vs "
                   "the real executor with nothing enabled and fully configured vs the simulator's prediction")
    h.add_argument("--skip-side-by-side", action="store_true", help="leave the side-by-side table out")
    h.add_argument("--repeats", type=positive_int, default=7,
                   help="decode loops per side-by-side figure (median, spread; default 7)")
    h.add_argument("--profile", metavar="PROFILE", default=None,
                   help="calibrated profile of this machine for the simulator's prediction (moelab calibrate --out); "
                   "default: calibrate now with --quick settings")
    h.add_argument("--device-backend", metavar="BACKEND", default="auto",
                   help="experts backend of the side-by-side's device lane (default: auto, the plain transformers "
                   "experts implementation that runs fastest here in a short probe, so nothing enabled computes "
                   "the resident experts as the best plain row does; or a backend's name, e.g. reference for "
                   "eager maths in torch); a profile calibrated now measures the same backend, a given one "
                   "should have (moelab calibrate --device-backend)")
    h.add_argument("--allow-busy", action="store_true",
                   help="print figures measured on a busy machine (flagged) instead of refusing them")
    h.set_defaults(func=run_hybrid)
    t = sub.add_parser(
        "timeline",
        help="timeline figure and exports on 1 M synthetic events",
        description="Synthesise a DeepSeek-V3-like hybrid decode (58 MoE layers × 8 experts × steps, with copies, "
        "prefetches, evictions, host and deferred work) and time the timeline's figure, its HTML, the Chrome "
        "JSON export and the Perfetto export (moelab.timeline.bench). Targets: figure ≤ 3 s and ≤ 20 MB of HTML, "
        "Chrome JSON ≤ 5 s for 1 M events.",
    )
    t.add_argument("--events", type=positive_int, default=1_000_000, help="events to synthesise (default 1000000)")
    t.add_argument("--skip-perfetto", action="store_true", help="skip the (slow) Perfetto protobuf export")
    t.add_argument("--repeat", type=positive_int, default=3, help="timed runs of each stage (median; default 3)")
    t.add_argument("--json", action="store_true", help="print the results as JSON")
    t.add_argument("--allow-busy", action="store_true",
                   help="print figures measured on a busy machine (flagged) instead of refusing them")
    t.set_defaults(func=run_timeline)
    sm = sub.add_parser(
        "simulate",
        help="simulator: events/s of the fast path and the reference, and their parity",
        description="Simulate a DeepSeek-V3-sized decode (58 MoE layers, 256 experts top-8) of random routing "
        "planned with an LRU device cache, host misses, deferral and prefetch; print simulated events per "
        "second for the fast path (plans to events, all included) and the plain reference, and whether their "
        "events are equal (moelab.simulate.bench).",
    )
    sm.add_argument("--tokens", type=positive_int, default=512, help="decode steps of the fast path (default 512)")
    sm.add_argument("--reference-tokens", type=positive_int, default=16,
                    help="decode steps run by the reference too, for the parity check (default 16)")
    sm.add_argument("--hardware", default="ktransformers-a100", help="hardware profile (default ktransformers-a100)")
    sm.add_argument("--repeat", type=positive_int, default=3, help="timed runs of the fast path (median; default 3)")
    sm.add_argument("--planner", default="auto", choices=("auto", "compiled", "reference"),
                    help="planner of the plans: compiled (packed records, read directly), reference (Python "
                    "lists); auto: compiled where numba is installed (its first use compiles for a minute or more)")
    sm.add_argument("--json", action="store_true", help="print the results as JSON")
    sm.add_argument("--allow-busy", action="store_true",
                   help="print figures measured on a busy machine (flagged) instead of refusing them")
    sm.set_defaults(func=run_simulate)
    tp = sub.add_parser(
        "throughput",
        help="MoE-Gen's module-batched decode measured vs its simulation on this machine",
        description="Run MoE-Gen's throughput schedule for real (moelab.hybrid.throughput: attention in micro-batches "
        "of b_a sequences, the experts one after the other over all B tokens in b_e-row chunks; a CPU worker is the "
        "device, so no KV or weight copies are made) for a small grid of B, b_a, b_e, and print measured tokens/s "
        "(median of --repeats, spread, load) beside the simulated tokens/s of the same configuration on a calibrated "
        "profile of this machine (ω = 0, every expert and dense module resident, copies costing 0), their ratio "
        "(target within 1.25x) and the plain model's batched decode (moelab.simulate.moegen.bench).",
    )
    tp.add_argument("--models", nargs="+", default=list(THROUGHPUT_MODELS), metavar="MODEL",
                    help="bundled model names or v2-lite:N (DeepSeek-V2-Lite MoE shapes, N MoE layers, bf16) "
                    f"(default: {' '.join(THROUGHPUT_MODELS)})")
    tp.add_argument("--batches", nargs="+", type=positive_int, default=[8, 32], metavar="B",
                    help="accumulated batches B (sequences; default 8 32)")
    tp.add_argument("--micro-batches", nargs="+", type=positive_int, default=[4, 32], metavar="b_a",
                    help="attention micro-batches (sequences), each clipped to B (default 4 32)")
    tp.add_argument("--expert-batches", nargs="+", type=positive_int, default=[2, 64], metavar="b_e",
                    help="rows per expert chunk (default 2 64)")
    tp.add_argument("--prompt", type=positive_int, default=16, help="prompt tokens per sequence (default 16)")
    tp.add_argument("--steps", type=positive_int, default=8, help="decode steps per run (default 8)")
    tp.add_argument("--repeats", type=positive_int, default=5, help="timed runs per point (median; default 5)")
    tp.add_argument("--threads", type=positive_int, default=None,
                    help="torch intra-op threads for the calibration and every run (default: torch's setting)")
    tp.add_argument("--profile", metavar="PROFILE", default=None,
                    help="calibrated profile of this machine (moelab calibrate --out); default: calibrate now with "
                    "--quick settings")
    tp.add_argument("--device", default="cpu", metavar="DEVICE",
                    help="cpu (default: the in-place decoder, the CPU worker as the device) or cuda[:N]: the offloaded "
                    "decoder (moelab.hybrid.throughput_offload: weights and KV in host memory, copied over the link), "
                    "simulated on --profile (default h100-pcie5-ddr5), the plain model on the GPU")
    tp.add_argument("--expert-slots", type=positive_int, default=2, metavar="N",
                    help="S_Expert slots the offloaded decoder streams experts through (--device cuda; default 2)")
    tp.add_argument("--pinned-experts", type=int, default=0, metavar="N",
                    help="routed experts resident on the GPU over all MoE layers (--device cuda; default 0)")
    tp.add_argument("--pin-dense", action="store_true",
                    help="every layer's dense modules resident on the GPU, never copied (--device cuda)")
    tp.add_argument("--events", metavar="PATH", default=None,
                    help="write every point's last run's events (the one schema) to this Parquet file")
    tp.add_argument("--json", action="store_true", help="print the results as JSON")
    tp.add_argument("--allow-busy", action="store_true",
                    help="print figures measured on a busy machine (flagged) instead of refusing them")
    tp.set_defaults(func=run_throughput)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_throughput(args) -> int:
    from moelab.simulate.moegen.bench import format_result, run_bench, to_json
    if args.device == "cpu" and (args.expert_slots != 2 or args.pinned_experts or args.pin_dense):
        raise MoelabError("--expert-slots, --pinned-experts and --pin-dense set the offloaded decoder on a GPU "
                          "(--device cuda); on the CPU every weight stays in place. Fix: drop them, or pass --device cuda.")

    result = run_bench(args.models, batches=args.batches, micro_batches=args.micro_batches,
                       expert_batches=args.expert_batches, prompt=args.prompt, steps=args.steps, repeats=args.repeats,
                       profile=args.profile, allow_busy=args.allow_busy, keep_events=bool(args.events),
                       threads=args.threads, device=args.device, expert_slots=args.expert_slots,
                       pinned_experts=args.pinned_experts, pin_dense=args.pin_dense, progress=None if args.json else
                       (lambda s: print(s, file=sys.stderr, flush=True)))
    if args.events:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.concat_tables([r["events"].table() for r in result["rows"]]), args.events)
    if args.json:
        emit_json(to_json(result))
    else:
        print(format_result(result))
        if args.events:
            print(f"events: {args.events} (moelab.Timeline(PATH) reads them)")
    _refuse_busy([m.reason for m in [r["measurement"] for r in result["rows"] + result["plain"]] if m.busy],
                 args.allow_busy)
    return 0


def run_timeline(args) -> int:
    from moelab.timeline.bench import format_result, run

    result = run(args.events, perfetto=not args.skip_perfetto, repeat=args.repeat,
                 progress=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    if args.json:
        emit_json(result)
    else:
        print(format_result(result))
    _refuse_busy([result[f"{k}_busy"] for k in result["busy"]], args.allow_busy)
    return 0


def _refuse_busy(reasons: list[str], allow_busy: bool) -> None:
    """After a bench printed its figures: refuse them (exit 2) when any was measured on a busy machine."""
    if reasons and not allow_busy:
        from moelab.measure import BusyMachineError

        raise BusyMachineError(f"the figures above were measured on a busy machine ({reasons[0]}); rerun on a "
                               "quiet machine, or pass --allow-busy.")


def run_simulate(args) -> int:
    from moelab.simulate.bench import format_result, run

    result = run(tokens=args.tokens, hardware=args.hardware, reference_tokens=min(args.reference_tokens, args.tokens),
                 repeat=args.repeat, planner=args.planner)
    if args.json:
        emit_json(result)
    else:
        print(format_result(result))
    if not result["parity"]:
        return 1
    _refuse_busy([result["fast"]["busy"]] if result["fast"]["busy"] else [], args.allow_busy)
    return 0


def run_hybrid(args) -> int:
    from moelab.hybrid.bench import raise_if_busy, run
    from moelab.simulate.side_by_side import side_table

    only_side = args.side_by_side
    flagged = run(["moelab-tiny-mixtral", "moelab-tiny-qwen2moe"], args.layers, args.steps,
                  not (args.skip_realistic or only_side), allow_busy=args.allow_busy, planner=not only_side,
                  check_busy=False)
    if not args.skip_side_by_side:
        side_table(print, args.layers, args.steps, args.repeats, args.profile, args.allow_busy, flagged,
                   device_backend=args.device_backend)
    raise_if_busy(flagged, args.allow_busy)
    return 0


def _emulated(args) -> int | None:
    """``--emulate``: the exit status of this command rerun in a child with :data:`EMULATE_ENV`'s
    settings (oneDNN and ATen read theirs once, when torch first uses them, so they cannot be set in
    a process that has run torch), or None when this process already has them."""
    import os
    import subprocess

    env = EMULATE_ENV[args.emulate]
    if all(os.environ.get(k) == v for k, v in env.items()):
        return None
    argv = getattr(args, "argv", None)
    if argv is None:
        raise MoelabError("--emulate reruns `moelab bench kernels` in a child process and needs the command line "
                          "(moelab.cli.main keeps it); call moelab.cli.main([...]) rather than run_kernels directly.")
    print(f"--emulate {args.emulate}: rerunning with " + " ".join(f"{k}={v}" for k, v in env.items()),
          file=sys.stderr, flush=True)
    return subprocess.run([sys.executable, "-m", "moelab.cli", *argv], env={**os.environ, **env}, check=False).returncode


def run_kernels(args) -> int:
    if getattr(args, "emulate", None) and (code := _emulated(args)) is not None:
        return code
    from moelab.kernels.bench import BenchConfig, format_table, run_bench

    cfg = BenchConfig(
        shapes=args.shapes[:1] if args.quick else args.shapes,
        tokens=[1, 256] if args.quick else args.tokens,
        dtypes=args.dtypes, baselines=args.baselines, group_size=args.group_size,
        repeat=3 if args.quick else args.repeat, prefill=args.prefill,
    )
    progress = None if args.json else (lambda s: print(s, file=sys.stderr, flush=True))
    result = run_bench(cfg, progress)
    if args.json:
        emit_json(result)
    else:
        print(format_table(result))
    if result["machine"].get("busy") and not args.allow_busy:
        from moelab.measure import BusyMachineError

        raise BusyMachineError(f"the kernel figures above were measured on a busy machine "
                               f"({result['machine']['busy_reason']}); rerun on a quiet machine, or pass --allow-busy.")
    return 0
