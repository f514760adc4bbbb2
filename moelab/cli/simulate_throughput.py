"""``moelab simulate throughput``: MoE-Gen's module-based batching on any shape and profile (simulated).

Registered under ``moelab simulate`` by :mod:`moelab.cli.simulate`; the work is
:func:`moelab.simulate.moegen.plan_throughput`.
"""

from __future__ import annotations

import argparse

from moelab.cli._util import emit_json, non_negative_int, positive_int
from moelab.errors import MoelabError
from moelab.timing.profile import apply_settings, get_profile
from moelab.timing.shapes import get_shape


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share in [0, 1] (e.g. 0.5)")
    return v


def register(sub) -> None:
    """Add ``throughput`` to ``moelab simulate``'s subcommands ``sub``."""
    t = sub.add_parser(
        "throughput",
        help="MoE-Gen's throughput schedule: the best batch sizes and tokens/s under GPU and host memory",
        description="Search MoE-Gen's configuration (techniques.md §7.1, Eqs. 1-3): accumulated batch B, attention "
        "micro-batch b_a, expert micro-batch b_e, CPU-attention share ω, expert slots and pinned weights, under the "
        "profile's GPU and host memory; each candidate's step time is the longest path of its DAG of GPU, CPU and "
        "copy jobs, costed by the one cost model. Decode fixes B at the host-memory maximum. Prints the best "
        "configuration, its tokens/s and memory, and on-demand offloading (KV on the GPU, experts copied when "
        "needed) for comparison. A value given pins that axis; the others are searched.",
        epilog="example: moelab simulate throughput --model-shape mixtral-8x7b --hardware moegen-a5000",
    )
    t.add_argument("--model-shape", metavar="SHAPE", required=True, dest="tp_shape",
                   help="a catalog shape (mixtral-8x7b, deepseek-v2-lite, ...) or a config.json")
    t.add_argument("--hardware", metavar="PROFILE", required=True, dest="tp_hardware",
                   help="a hardware profile name or YAML file (moegen-a5000, moegen-a6000, ...)")
    t.add_argument("--dtype", default=None, dest="tp_dtype", help="re-cost the shape's weights in this dtype")
    t.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="tp_settings",
                   help="override one field of the profile (repeatable), e.g. --set host_memory_gb=256")
    t.add_argument("--phase", choices=("decode", "prefill"), default="decode", dest="tp_phase",
                   help="decode (default) or prefill, searched separately as MoE-Gen does")
    t.add_argument("--context", type=positive_int, default=512, dest="tp_prompt", metavar="N",
                   help="prompt tokens per sequence (default 512, MoE-Gen's setting)")
    t.add_argument("--generate", type=non_negative_int, default=256, dest="tp_generate", metavar="N",
                   help="tokens generated per sequence (default 256, MoE-Gen's setting); decode reserves KV for "
                   "prompt + generate and attends over prompt + generate/2 on average")
    t.add_argument("--batch", type=positive_int, default=None, dest="tp_batch", metavar="B",
                   help="pin B (default: decode the host-memory maximum, prefill searched)")
    t.add_argument("--micro-batch", type=positive_int, default=None, dest="tp_micro_batch", metavar="b_a",
                   help="pin the attention micro-batch (sequences)")
    t.add_argument("--expert-batch", type=positive_int, default=None, dest="tp_expert_batch", metavar="b_e",
                   help="pin the expert micro-batch (tokens)")
    t.add_argument("--cpu-attention", type=_share, default=None, dest="tp_omega", metavar="ω",
                   help="pin the CPU-attention share ω in [0, 1] (decode; default searched over 0, 0.1, ..., 1)")
    t.add_argument("--expert-slots", type=positive_int, default=None, dest="tp_slots", metavar="N",
                   help="pin the GPU expert slots S_Expert")
    t.add_argument("--no-baseline", action="store_true", dest="tp_no_baseline",
                   help="skip the on-demand offloading baseline")
    t.add_argument("--events", metavar="OUT.parquet", default=None, dest="tp_events",
                   help="also write one step of the best configuration as events (the project's event schema; "
                   "open with moelab timeline or moelab.Timeline)")
    t.add_argument("--json", action="store_true", dest="tp_json", help="print the plan as JSON")
    t.set_defaults(func=run_throughput)


def run_throughput(args) -> int:
    from moelab.simulate.moegen import plan_throughput
    from moelab.timing.memory import gb

    shape = get_shape(args.tp_shape, dtype=args.tp_dtype)
    hw = apply_settings(get_profile(args.tp_hardware), args.tp_settings)
    if args.tp_phase == "prefill" and args.tp_omega:
        raise MoelabError(f"--cpu-attention {args.tp_omega:g} with --phase prefill: MoE-Gen's prefill is GPU-only; "
                          "drop --cpu-attention or use --phase decode.")
    plan = plan_throughput(shape, hw, phase=args.tp_phase, prompt=args.tp_prompt, generate=args.tp_generate,
                           batch=args.tp_batch, micro_batch=args.tp_micro_batch, expert_batch=args.tp_expert_batch,
                           cpu_attention=args.tp_omega, expert_slots=args.tp_slots,
                           baseline=not args.tp_no_baseline)
    if args.tp_events:
        from moelab.simulate.moegen.events import schedule_events

        schedule_events(shape, hw, plan.best.config).to_parquet(args.tp_events, index=False)
    if args.tp_json:
        emit_json(plan.to_dict())
        return 0
    b = plan.best
    c = b.config
    print(f"{plan.shape} on {plan.profile}, MoE-Gen {plan.phase}: prompt {c.prompt}"
          + (f" + generate {c.generate}" if plan.phase == "decode" else "") + " tokens per sequence")
    print(f"best: {plan.tokens_per_s:.1f} tokens/s — B {c.batch}, b_a {c.micro_batch}, b_e {c.expert_batch}, "
          f"ω {c.cpu_attention:g}, S_Expert {c.expert_slots} slots, S_Params {c.pinned_experts} experts"
          + (" + every layer's dense modules" if c.pin_dense else "") + f"; step {b.step.step_us / 1e3:.1f} ms "
          f"(MoE layer {b.step.moe_layer_us / 1e3:.2f} ms × {b.step.moe_layers}"
          + (f", dense layer {b.step.dense_layer_us / 1e3:.2f} ms × {b.step.dense_layers}" if b.step.dense_layers
             else "") + f", LM head {b.step.lm_head_us / 1e3:.2f} ms)")
    for pool in (b.memory.gpu, b.memory.host):
        terms = " + ".join(f"{t.name} {gb(t.bytes)}" for t in pool.terms if t.bytes)
        size = "not stated" if pool.capacity_bytes is None else f"{pool.capacity_bytes / 1e9:g} GB"
        print(f"  {pool.name} memory: {gb(pool.need_bytes)} of {size} ({terms})")
    if plan.baseline is not None:
        bc = plan.baseline.config
        print(f"on-demand offloading: {plan.baseline.tokens_per_s:.1f} tokens/s at B {bc.batch} (KV on the GPU, each "
              f"expert copied when needed, no prefetch); MoE-Gen {plan.speedup:.1f}×")
    elif not args.tp_no_baseline:
        print("on-demand offloading: not even batch 1 fits on the GPU with its KV cache")
    if args.tp_events:
        print(f"wrote one step's events to {args.tp_events} (moelab.Timeline({args.tp_events!r}).figure())")
    print(f"searched {plan.candidates} configurations that fit ({plan.refused} refused by memory)")
    for a in plan.assumptions:
        print(f"assumed: {a}")
    return 0


__all__ = ["register", "run_throughput"]
