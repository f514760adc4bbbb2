"""``moelab cache``: expert-cache simulation over routing traces (``simulate``, ``bench``)."""

from __future__ import annotations

from moelab.cli._util import emit_json, positive_int
from moelab.errors import MoelabError, unknown_name


def register(subparsers) -> None:
    p = subparsers.add_parser("cache", help="simulate expert caches (LRU, LFU, MRS, Belady, ...) over a trace")
    policies = "lru,lfu,fifo,static,mrs,belady,belady-bypass"
    sub = p.add_subparsers(dest="cache_command", metavar="SUBCOMMAND")
    s = sub.add_parser("simulate", help="hit rates of cache policies at given capacities")
    s.add_argument("--trace", required=True, metavar="DIR", help="routing trace directory")
    s.add_argument("--policy", default=policies, help="comma-separated policies")
    s.add_argument("--capacity", default="0.125,0.25,0.5,0.75",
                   help="comma-separated capacities: fractions (0.25, 25%%) or expert counts (2)")
    s.add_argument("--scope", default="layer", help="layer, global, or both (layer,global)")
    s.add_argument(
        "--prefetch",
        metavar="PREDICTOR",
        help="prefetch with a predictor: oracle, repeat, or a saved predictor directory "
        "(moelab predict fit --out; e.g. predictors/<model>/learned-d1)",
    )
    s.add_argument("--distance", type=int, default=None,
                   help="prefetch for MoE layer l + d (default: the saved predictor's distance, else 1)")
    s.add_argument("--budget", type=int, default=None, help="prefetch transfers per MoE layer (the per-layer link budget), in experts")
    s.add_argument("--budget-bytes", type=float, default=None,
                   help="prefetch budget per MoE layer in bytes (whole experts that fit), instead of --budget")
    s.add_argument("--budget-scope", choices=["layer", "forward"], default=None,
                   help="what --budget/--budget-bytes apply to: each MoE layer (default) or each forward pass")
    s.add_argument("--link-gbps", type=float, default=None,
                   help="prefetch budget from a link: GB/s, with --step-ms (budget = GB/s × step time)")
    s.add_argument("--step-ms", type=float, default=None, help="step time in ms for --link-gbps")
    s.add_argument("--link-latency-us", type=float, default=None,
                   help="per-transfer latency in µs for --link-gbps (the FIFO link model of moelab.timing; "
                   "default 0: budget = GB/s × step time)")
    s.add_argument("--expert-bytes", type=positive_int, default=None,
                   help="bytes per expert (default: the size recorded in the trace; traffic is also "
                   "reported in experts)")
    s.add_argument("--include-prefill", action="store_true", help="also replay the prompt tokens")
    s.add_argument("--insertion", default="always", choices=["always", "protect-step"],
                   help="always (default; the published runtimes' rule): a step's hits are served first, then every "
                   "miss is inserted and may evict any cached expert; protect-step (moelab's earlier rule): a "
                   "step's experts never evict each other, a miss without another victim is not inserted")
    s.add_argument("--replay", default="forward", choices=["forward", "sequence"],
                   help="forward (default): one access group per forward pass and MoE layer (the batch's union, "
                   "what a running model's cache sees); sequence: per sequence, step and layer")
    s.add_argument("--warm", action="store_true", help="start with the most popular experts cached")
    s.add_argument("--access-order", choices=["weight", "id"], default="weight",
                   help="serve each step's experts by descending router weight (default) or ascending expert id "
                        "(mixtral-offloading's order)")
    s.add_argument("--oracle-scope", choices=["stream", "sequence"], default="stream",
                   help="the Belady oracles see the whole replay's future (default) or only the current "
                        "sequence's (ProMoE's MIN)")
    s.add_argument("--mrs-pairing", choices=["paper", "published"], default="paper",
                   help="MRS as HybriMoE's paper defines it (eq. 3; default) or as its published code pairs sorted "
                        "scores with ascending expert ids")
    s.add_argument("--mrs-rows", choices=["all", "first"], default="all",
                   help="MRS updated with every token's scores (default) or only row 0 (HybriMoE's code)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.add_argument("--store", metavar="DIR", help="keep the simulated cells in this sweep store: a repeated or "
                   "interrupted sweep resumes from it (default: a temporary store)")
    s.set_defaults(func=run_simulate)
    b = sub.add_parser("bench", help="accesses/s of the compiled simulators on a synthetic stream")
    b.add_argument("--accesses", type=int, default=10_000_000)
    b.add_argument("--layers", type=int, default=16, help="MoE layers of the synthetic stream")
    b.add_argument("--experts", type=int, default=64, help="experts per MoE layer")
    b.add_argument("--top-k", type=int, default=8)
    b.add_argument("--capacity", default="0.25", help="comma-separated fractions")
    b.add_argument("--scope", default="both", help="layer, global, or both (layer,global)")
    b.add_argument("--policy", default=policies)
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=run_bench)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def parse_capacity(text: str) -> float | int:
    """``0.25`` / ``25%`` -> fraction 0.25; ``2`` -> a count of 2 experts."""
    t = text.strip()
    try:
        if t.endswith("%"):
            return float(t[:-1]) / 100.0
        return float(t) if any(c in t for c in ".eE") else int(t)
    except ValueError:
        raise MoelabError(f"capacity {text!r} is neither a fraction (0.25, 25%) nor a count of experts (2).") from None


def parse_scopes(text: str) -> list[str]:
    """``layer``, ``global``, ``layer,global`` or ``both`` (= layer,global) -> a list of scopes."""
    from moelab.caches.base import SCOPES

    scopes: list[str] = []
    for x in (x.strip() for x in text.split(",")):
        for sc in (SCOPES if x == "both" else (x,) if x else ()):
            if sc not in SCOPES:
                raise unknown_name("cache scope", sc, [*SCOPES, "both"])
            if sc not in scopes:
                scopes.append(sc)
    if not scopes:
        raise MoelabError(f"--scope {text!r} names no scope; use layer, global or both.")
    return scopes


def run_simulate(args) -> int:
    from moelab.caches.base import get_policy
    from moelab.caches.simulation import load_stream

    policies = [x.strip() for x in args.policy.split(",") if x.strip()]
    for name in policies:
        get_policy(name)  # unknown names fail here, with suggestions
    capacities = [parse_capacity(c) for c in args.capacity.split(",") if c.strip()]
    scopes = parse_scopes(args.scope)
    prefetch = None
    if args.link_latency_us is not None and args.link_gbps is None:
        raise MoelabError("--link-latency-us is the latency of the --link-gbps link: add --link-gbps and --step-ms.")
    if (args.link_gbps is None) != (args.step_ms is None):
        raise MoelabError("--link-gbps and --step-ms go together: the budget is bandwidth × step time.")
    given = [n for n, v in (("--budget", args.budget), ("--budget-bytes", args.budget_bytes),
                            ("--link-gbps", args.link_gbps)) if v is not None]
    if len(given) > 1:
        raise MoelabError(f"give one prefetch budget, not {' and '.join(given)}.")
    if args.budget_scope is not None and args.link_gbps is not None:
        raise MoelabError("--budget-scope is for --budget/--budget-bytes; a --link-gbps budget is per step (--step-ms).")
    if given and not args.prefetch:
        raise MoelabError(f"{given[0]} is a prefetch budget: add --prefetch PREDICTOR (oracle, repeat or a directory).")
    pf_setting = None
    if args.prefetch:
        from moelab.sweeps.trace_kinds import prefetch_config

        pf_setting = {"predictor": args.prefetch, "distance": args.distance, "budget": args.budget,
                      "budget_bytes": args.budget_bytes, "link_gbps": args.link_gbps, "step_ms": args.step_ms,
                      "link_latency_us": args.link_latency_us, "budget_scope": args.budget_scope}
        prefetch = prefetch_config(pf_setting, args.trace)  # a bad predictor or distance fails here
    stream = load_stream(args.trace, args.include_prefill, scores=any(get_policy(p).needs_scores for p in policies),
                         replay=args.replay)
    # the sweep is a spec run by the sweep engine (cells resumable with --store); the stream is handed over
    from moelab.sweeps.shortcuts import cache_spec, run_cache_sweep

    params: dict[str, dict] = {}
    for p in policies:
        kw = {}
        if p.startswith("belady") and args.oracle_scope != "stream":
            kw["oracle_scope"] = args.oracle_scope
        if p == "mrs":
            kw.update({k: v for k, v in (("pairing", args.mrs_pairing), ("rows", args.mrs_rows))
                       if v != {"pairing": "paper", "rows": "all"}[k]})
        params[p] = kw
    settings = {"access_order": args.access_order} if args.access_order != "weight" else {}
    spec = cache_spec(args.trace, policies, capacities, scopes, prefetch=pf_setting,
                      include_prefill=args.include_prefill, insertion=args.insertion, replay=args.replay,
                      warm=args.warm, expert_bytes=args.expert_bytes, params=params, **settings)
    results = run_cache_sweep(spec, stream, store=args.store)
    ignoring = [p for p in policies if not get_policy(p).accepts_prefetch]
    if args.json:
        emit_json({"trace": args.trace, "accesses": stream.num_accesses, "insertion": args.insertion,
                   "replay": args.replay, "access_order": args.access_order, "oracle_scope": args.oracle_scope,
                   "results": [r.to_dict() for r in results]})
        return 0
    print(f"trace {args.trace}: {stream.num_accesses} expert accesses, {stream.num_layers} MoE layers, "
          f"E={stream.num_experts.tolist()}, {'with' if args.include_prefill else 'decode only, no'} prefill; "
          f"insertion {args.insertion}, replay per {args.replay}"
          + (f"; prefetch {prefetch.describe(int(args.expert_bytes or stream.expert_bytes or 1))}" if prefetch else "")
          + (f" (not for {', '.join(ignoring)}: they ignore prefetches)" if prefetch and ignoring else ""))
    size = args.expert_bytes or stream.expert_bytes
    print(f"expert size: {size} bytes ({'--expert-bytes' if args.expert_bytes else 'recorded in the trace'})"
          if size else "expert size: unknown (the trace does not record it; pass --expert-bytes): "
          "traffic in experts only")
    print(f"{'policy':<13} {'scope':<7} {'capacity':>8} {'hit rate':>9} {'misses':>8} {'moved (experts)':>15} "
          f"{'moved (bytes)':>14}  per-layer hit rate")
    for r in results:
        cap = f"{r.capacity:.1%}" if isinstance(r.capacity, float) else str(r.capacity)
        layers = " ".join(f"{x:.2f}" for x in r.layer_hit_rate)
        extra = f"  [prefetched {r.prefetched}, hits {r.prefetch_hits}, wasted {r.wasted_prefetches}]" if r.prefetch else ""
        moved_bytes = str(r.bytes_moved) if size else "n/a"
        print(f"{r.policy:<13} {r.scope:<7} {cap:>8} {r.hit_rate:>9.2%} {r.misses:>8} {r.transfers:>15} "
              f"{moved_bytes:>14}  {layers}{extra}")
    return 0


def _prefetcher(spec: str, distance: int | None, trace_dir: str) -> tuple[object, int]:
    """(predictor, distance) for ``--prefetch``: a registered name, or a saved predictor directory."""
    from moelab.sweeps.trace_kinds import prefetcher

    return prefetcher(spec, distance, trace_dir)


def run_bench(args) -> int:
    from moelab.caches import bench

    argv = ["--accesses", str(args.accesses), "--layers", str(args.layers), "--experts", str(args.experts),
            "--top-k", str(args.top_k), "--capacity", args.capacity, "--scope", ",".join(parse_scopes(args.scope)), "--policy", args.policy]
    argv += ["--json"] if args.json else []
    return bench.main(argv)


__all__ = ["parse_capacity", "register"]
