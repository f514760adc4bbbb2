"""``moelab trace-info``: what a trace holds."""

from __future__ import annotations

from moelab.cli._util import emit_json


def register(subparsers) -> None:
    p = subparsers.add_parser("trace-info", help="summarise a routing trace")
    p.add_argument("trace", metavar="DIR", help="trace directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args) -> int:
    from moelab.trace import open_trace

    s = open_trace(args.trace).summary()
    if args.json:
        emit_json(s)
        return 0
    print(f"trace      {s['path']}")
    print(f"model      {s['model']} ({s['model_type']})")
    print(f"tokens     {s['tokens']} ({s['prefill_tokens']} prefill, {s['decode_tokens']} decode) in {s['sequences']} sequences")
    print(f"MoE layers {len(s['moe_layers'])}: {s['moe_layers']}")
    print(f"experts    E={s['num_experts'][0] if len(set(s['num_experts'])) == 1 else s['num_experts']}, "
          f"top-k={s['top_k'][0] if len(set(s['top_k'])) == 1 else s['top_k']}")
    print(f"recorded   scores={s['scores']} hidden_states={s['hidden_states']}")
    print("expert load per layer (experts used, max/min share of selections, coefficient of variation):")
    for row in s["expert_load"]:
        print(f"  layer {row['layer']:3d}: used {row['experts_used']:3d}  max {row['max_share']:.3f}  "
              f"min {row['min_share']:.3f}  cv {row['cv']:.2f}")
    return 0
