"""``moelab predict fit|eval``: train and score expert predictors on routing traces.

    moelab predict fit  --trace DIR --kind learned --distance 2 --out predictors/m/learned-d2
    moelab predict eval --trace DIR --predictor predictors/m/learned-d2 --json --dump preds.parquet
    moelab predict eval --trace TEST --predictor token --fit-trace TRAIN --distance 1
    moelab predict compare --trace TRAIN [--test-trace TEST] --kinds frequency,token,learned --distances 1,2
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from moelab.cli._util import DeprecatedAlias, check_output_path, emit_json, positive_int
from moelab.errors import MoelabError
from moelab.timing import DEFAULT_PROFILE, reference_expert_bytes

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser("predict", help="train and evaluate expert predictors",
                              description="Train (fit) and score (eval) expert predictors on routing traces.")
    sub = p.add_subparsers(dest="predict_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    f = sub.add_parser("fit", help="fit a predictor on a trace (scores it on the held-out sequences)")
    f.add_argument("--trace", required=True, help="routing trace directory (hidden states for skip/learned)")
    f.add_argument("--kind", required=True, help="predictor kind: frequency, oracle, token, skip, learned, ...")
    f.add_argument("--distance", type=positive_int, default=1, help="predict MoE layer l+d from layer l (default 1)")
    f.add_argument("--out", help="directory to save the predictor to (predictor.json + state.safetensors)")
    f.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="hyperparameter, e.g. --set width=1024 --set loss=l1 (repeatable)")
    _common(f)
    f.set_defaults(func=_fit)

    e = sub.add_parser("eval", help="score a saved predictor (or a kind, fitted on the fly)")
    e.add_argument("--trace", required=True, help="routing trace directory to score on")
    e.add_argument("--predictor", required=True, help="saved predictor directory, or a kind to fit on the fly")
    e.add_argument("--distance", type=positive_int, default=None,
                   help="distance for a kind fitted on the fly (default 1); must match a saved predictor's")
    e.add_argument("--fit-trace", help="trace to fit a kind on (default: --trace, scored on its held-out sequences)")
    e.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="hyperparameter of a kind")
    e.add_argument("--dump", help="write predicted and actual ids per (token, layer) to this Parquet file")
    _common(e)
    e.set_defaults(func=_eval)

    c = sub.add_parser("compare", help="fit and score several kinds at several distances (a sweep spec)",
                       description="moelab.predictors.compare as a sweep spec run by the sweep engine: every "
                       "kind × distance is a cell, fitted on --trace and scored on --test-trace (default: the "
                       "held-out sequences of --trace); --store keeps the cells and resumes.")
    c.add_argument("--trace", required=True, help="routing trace to fit on (hidden states for skip/learned)")
    c.add_argument("--test-trace", help="trace to score on (default: the held-out sequences of --trace)")
    c.add_argument("--kinds", default="frequency,token,skip,learned,oracle", help="comma-separated predictor kinds")
    c.add_argument("--distances", default="1,2", help="comma-separated distances d (predict layer l+d)")
    c.add_argument("--set", action="append", default=[], metavar="KIND.KEY=VALUE",
                   help="hyperparameter of one kind, e.g. --set learned.width=256 (repeatable)")
    c.add_argument("--seed", type=int, default=0, help="seed of every fit (default 0)")
    c.add_argument("--m", default="1,2,4,8", help="list lengths m for recall@m (default 1,2,4,8)")
    c.add_argument("--hardware", default=DEFAULT_PROFILE, help="hardware profile for GoodPred")
    c.add_argument("--expert-bytes", default=None, help="bytes per expert transfer, or a reference model")
    c.add_argument("--layer-time-us", type=float, default=None, help="override the profile's decode layer time")
    c.add_argument("--link-gbps", dest="link_gbs", type=float, default=None, metavar="GBPS",
                   help="override the profile's link bandwidth (GB/s)")
    _fetch_basis_arg(c)
    c.add_argument("--store", metavar="DIR", help="sweep store to keep the cells in (default: a temporary one)")
    c.add_argument("--json", action="store_true", help="print the reports as JSON")
    c.set_defaults(func=_compare)


def _fetch_basis_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fetch-basis", choices=("predicted", "correct"), default="predicted",
                   help="GoodPred's fetch-rate denominator: 'predicted' (ProMoE's: the share of predicted experts "
                        "fetched in time; default) or 'correct' (the share of correct predictions fetched in time)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model name or path (only if it cannot be loaded by the trace's model name)")
    p.add_argument("--m", default="1,2,4,8", help="list lengths m for recall@m/precision@m (default 1,2,4,8)")
    p.add_argument("--hardware", default=DEFAULT_PROFILE,
                   help="hardware profile for GoodPred: a name (moelab.timing.available_profiles()) or a YAML file")
    p.add_argument("--expert-bytes", default=None,
                   help="bytes per expert transfer, or a reference model (e.g. qwen2-57b-a14b); default: the model's own")
    p.add_argument("--layer-time-us", type=float, default=None, help="override the profile's decode layer time")
    p.add_argument("--link-gbps", "--link-gbs", dest="link_gbs", type=float, default=None, metavar="GBPS",
                   action=DeprecatedAlias, deprecated=("--link-gbs",),
                   help="override the profile's link bandwidth (GB/s; --link-gbs is a deprecated alias)")
    _fetch_basis_arg(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--overwrite", action="store_true", help="replace existing outputs")


def _parse_set(items: list[str]) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise MoelabError(f"--set expects KEY=VALUE, got {item!r}.")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v
    return out


def _m_values(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise MoelabError(f"--m expects comma-separated integers, got {text!r}.") from None


def _model(args):
    if not args.model:
        return None
    from moelab.loading import load

    return load(args.model)[0]


def _evaluate(predictor, data, args, model):
    from moelab.predictors import evaluate

    eb = reference_expert_bytes(args.expert_bytes) if args.expert_bytes else None
    return evaluate(predictor, data, m_values=_m_values(args.m), hardware=args.hardware, expert_bytes=eb,
                    layer_time_us=args.layer_time_us, link_bandwidth_gbs=args.link_gbs, model=model,
                    fetch_basis=args.fetch_basis)


def _fit(args) -> int:
    from moelab._output import reserve_output
    from moelab.predictors import TraceData, make_predictor
    from moelab.trace import open_trace

    out = check_output_path(args.out, args.overwrite) if args.out else None
    data = TraceData(open_trace(args.trace))
    # claim --out before fitting: a second writer of it is refused now, not after the work
    claim = reserve_output(out, args.overwrite, what="predictor output",
                           hint="pass --overwrite to replace it or choose another --out") if out else None
    try:
        model = _model(args)
        predictor = make_predictor(args.kind, distance=args.distance, **_parse_set(args.set))
        predictor.fit(data, model=model)
        report = _evaluate(predictor, data, args, model)
        if claim is not None:
            predictor.save(out, metrics={"heldout": report.to_dict()}, overwrite=args.overwrite,
                           reservation=claim)
    finally:
        if claim is not None:
            claim.abort()  # a no-op after the commit
    _print(report, args, saved=out)
    return 0


def _eval(args) -> int:
    from moelab.predictors import TraceData, available_predictors, load_predictor, make_predictor
    from moelab.trace import open_trace

    dump = check_output_path(args.dump, args.overwrite) if args.dump else None
    data = TraceData(open_trace(args.trace))
    model = _model(args)
    if Path(args.predictor).is_dir():
        predictor = load_predictor(args.predictor, model=model)
        if args.distance is not None and args.distance != predictor.distance:
            raise MoelabError(
                f"predictor {args.predictor!r} was fitted for distance {predictor.distance}, --distance is "
                f"{args.distance}; fit one for that distance."
            )
    elif args.predictor in available_predictors() or not any(c in args.predictor for c in "/\\."):
        predictor = make_predictor(args.predictor, distance=args.distance or 1, **_parse_set(args.set))
        fit_data = TraceData(open_trace(args.fit_trace)) if args.fit_trace else data
        predictor.fit(fit_data, model=model)
    else:
        raise MoelabError(f"--predictor {args.predictor!r} is neither a saved predictor directory nor a kind "
                          f"({', '.join(available_predictors())}).")
    report = _evaluate(predictor, data, args, model)
    if dump is not None:
        report.write_dump(dump)
    _print(report, args, saved=None, dump=dump)
    return 0


def _compare(args) -> int:
    from moelab.sweeps.shortcuts import predictor_spec, run_predictor_comparison

    params: dict[str, dict[str, Any]] = {}
    for kind_key, value in _parse_set(args.set).items():
        kind, dot, key = kind_key.partition(".")
        if not dot or not key:
            raise MoelabError(f"--set {kind_key}=...: expected KIND.KEY=VALUE, e.g. learned.width=256.")
        params.setdefault(kind, {})[key] = value
    try:
        distances = [int(x) for x in args.distances.split(",") if x.strip()]
    except ValueError:
        raise MoelabError(f"--distances expects comma-separated integers, got {args.distances!r}.") from None
    spec = predictor_spec(args.trace, args.test_trace, kinds=[k.strip() for k in args.kinds.split(",") if k.strip()],
                          distances=distances, params=params, seed=args.seed, m=_m_values(args.m),
                          hardware=args.hardware, expert_bytes=args.expert_bytes, layer_time_us=args.layer_time_us,
                          link_gbs=args.link_gbs, fetch_basis=args.fetch_basis)
    reports = run_predictor_comparison(spec, store=args.store, progress=not args.json)
    if args.json:
        emit_json(reports)
        return 0
    print(f"{'kind':12} {'d':>2} {'acc':>6} {'±se':>6} {'decode':>6} {'fetch':>6} {'goodpr':>6} {'µs':>7}  recall@m")
    for r in reports:
        o, dec = r["overall"]["all"], r["overall"]["decode"]
        rec = " ".join(f"R@{m}={_fmt(o.get(f'recall@{m}')).strip()}" for m in r["m_values"])
        print(f"{r['kind']:12} {r['distance']:>2} {_fmt(o['accuracy'])} {_fmt(o['accuracy_stderr'])} "
              f"{_fmt(dec['accuracy'])} {_fmt(o['fetch_rate'])} {_fmt(o['goodpred'])} {r['latency_us']:7.1f}  {rec}")
    print("# acc = mean |predicted ∩ actual| / top-k over all (token, layer) pairs of the scored sequences; "
          "±se clustered by sequence; decode = decode steps only; µs = predictor latency per layer and token; "
          f"fetch = share of the {args.fetch_basis} experts fetched in time (--fetch-basis)")
    return 0


def _fmt(x) -> str:
    return "   -  " if x is None or x != x else f"{x:6.3f}"


def _print(report, args, saved=None, dump=None) -> None:
    if args.json:
        d = report.to_dict()
        if saved:
            d["saved"] = str(saved)
        if dump:
            d["dump"] = str(dump)
        emit_json(d)
        return
    r = report
    print(f"{r.kind} predictor, distance {r.distance}, model {r.model_name}; scored on {r.split}")
    lat = r.latency
    how = (f" (median of {lat['calls']} calls, spread ±{lat['spread']:.0%}, load {lat['load']:.1f}"
           + (f"; BUSY: {lat['busy']}" if lat["busy"] else "") + ")") if lat and lat.get("load") is not None else ""
    print(f"latency {r.latency_us:.1f} µs per layer per token{how} (batch 1, CPU); GoodPred on {r.transfer['profile']}: "
          f"{r.transfer['expert_bytes']} B/expert, transfer {r.transfer['transfer_us']:.1f} µs, "
          f"layer {r.transfer['decode_layer_time_us']:.0f} µs; fetch rate over the {r.fetch_basis} experts "
          f"(--fetch-basis)")
    print(f"{'phase':8} {'layer':>7} {'pairs':>7} {'seqs':>5} {'acc':>6} {'±se':>6} {'fetch':>6} {'goodpr':>6}")
    for row in r.per_layer:
        if row["phase"] == "all":
            continue
        print(f"{row['phase']:8} {row['source_layer']:>3}→{row['target_layer']:<3} {row['pairs']:>7} "
              f"{row['sequences']:>5} {_fmt(row['accuracy'])} {_fmt(row['accuracy_stderr'])} "
              f"{_fmt(row['fetch_rate'])} {_fmt(row['goodpred'])}")
    for ph in ("prefill", "decode", "all"):
        o = r.overall[ph]
        rec = " ".join(f"R@{m}={_fmt(o[f'recall@{m}']).strip()}" for m in r.m_values)
        print(f"{ph:8} overall {o['pairs']:>7} {o['sequences']:>5} {_fmt(o['accuracy'])} "
              f"{_fmt(o['accuracy_stderr'])} {_fmt(o['fetch_rate'])} {_fmt(o['goodpred'])}  {rec}")
    print("# acc = mean |predicted ∩ actual| / top-k over n = pairs (token, layer); ±se = its standard "
          "error clustered by sequence (tokens of one sequence are correlated; "
          "accuracy_stderr_iid in --json is the naive lower bound)")
    if saved:
        print(f"saved to {saved}")
    if dump:
        print(f"dump written to {dump}")
