"""Recipe: re-create the shipped predictors of a model and its results table.

    .venv/bin/python predictors/recipe.py --model moelab-tiny-mixtral            # writes predictors/moelab-tiny-mixtral/
    .venv/bin/python predictors/recipe.py --model tiny-random-mixtral --out /tmp/p --quick

Steps (all seeded):

1. Record a *train* trace: prompts of the synthetic tasks' ``train`` split (arith and
   pycode, as the bundled models were trained on), greedy generation of ``--new-tokens``
   tokens each, router-input hidden states recorded (prefill + decode tokens).
2. Record a *test* trace the same way from the ``test`` split (disjoint prompts): every
   number in the results is measured on it, i.e. on held-out sequences.
3. Fit ``learned`` for d = 1, 2, 3 (default hyperparameters; the 9:1 split by sequence is
   used for early stopping) and the baselines frequency, token, skip (and oracle).
4. Evaluate every predictor at every distance on the test trace: accuracy per layer and
   phase, recall/precision@m, GoodPred on the pcie4-x16 profile (with the model's own
   expert size, and projected to Qwen2-57B-A14B expert sizes), batch-1 CPU latency.
5. Save ``learned-d{1,2,3}/`` (predictor.json with the test metrics + state.safetensors),
   ``results.json`` and ``RESULTS.md`` under ``<out>/<model>/``.

Traces are written to a temporary directory (``--work`` to keep them) and not shipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import torch

import moelab
from moelab.loading import model_context_length
from moelab.predictors import TraceData, evaluate, make_predictor
from moelab.tasks import generate
from moelab.timing import reference_expert_bytes

KINDS = ("frequency", "token", "skip", "learned", "oracle")
DISTANCES = (1, 2, 3)
PROJECTION = "deepseek-v2-lite"


def prompts(split: str, n_arith: int, n_code: int, seed: int) -> list[str]:
    arith = [f"Question: {ex['question']}\nAnswer:" for ex in generate("arith", split, n=n_arith, seed=seed)]
    code = [ex["prompt"] for ex in generate("pycode", split, n=n_code, seed=seed)]
    out = []
    for i in range(max(len(arith), len(code))):  # interleave so batches mix tasks
        out += [lst[i] for lst in (arith, code) if i < len(lst)]
    return out


def record(model, tok, texts: list[str], out: Path, name: str, new_tokens: int, batch: int) -> moelab.RoutingTrace:
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    # prompt + generated tokens must fit the model's context; keep the end of a long prompt
    # (what the model continues) and say how many were cut
    room = min(256, (model_context_length(model) or 10**6) - new_tokens)
    tok.truncation_side = "left"
    lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    if any(n > room for n in lengths):
        logging.getLogger("recipe").warning(
            "%d of %d prompts are longer than %d tokens (the context minus %d generated tokens; longest %d): "
            "their beginnings are cut", sum(n > room for n in lengths), len(texts), room, new_tokens, max(lengths))
    with moelab.record(model, out, hidden_states=True, model_name=name, overwrite=True) as rec:
        for i in range(0, len(texts), batch):
            enc = tok(texts[i : i + batch], return_tensors="pt", padding=True, truncation=True, max_length=room)
            with torch.inference_mode():
                model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                               min_new_tokens=new_tokens)
    return rec.trace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model name (default: every bundled model)")
    ap.add_argument("--out", default=None, help="output root (default: the predictors/ resource folder)")
    ap.add_argument("--work", default=None, help="where to record the traces (default: a temporary directory)")
    ap.add_argument("--train-prompts", type=int, default=1400, help="train prompts (half arith, half pycode)")
    ap.add_argument("--test-prompts", type=int, default=364, help="test prompts (≤ 200 arith + 164 pycode)")
    ap.add_argument("--new-tokens", type=int, default=24, help="greedy tokens generated per prompt")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    if args.quick:
        args.train_prompts, args.test_prompts, args.new_tokens = 40, 20, 8
    from moelab._resources import resource_dir
    from moelab.models.bundled import bundled_models

    names = [args.model] if args.model else list(bundled_models())
    if not names:
        raise SystemExit("no bundled models found; pass --model NAME")
    out_root = Path(args.out) if args.out else resource_dir("predictors")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="moelab-recipe-"))
    for name in names:
        run_model(name, out_root / name, work / name, args)
    return 0


def run_model(name: str, out: Path, work: Path, args) -> None:
    log = logging.getLogger("recipe")
    model, tok = moelab.load(name)
    n_tr = args.train_prompts
    t0 = time.perf_counter()
    train = record(model, tok, prompts("train", n_tr // 2, n_tr - n_tr // 2, 0), work / "train", name,
                   args.new_tokens, args.batch)
    n_te = args.test_prompts
    test = record(model, tok, prompts("test", min(200, n_te // 2 + n_te % 2), min(164, n_te // 2), 0),
                  work / "test", name, args.new_tokens, args.batch)
    log.info("recorded %s and %s in %.0f s", train, test, time.perf_counter() - t0)
    train_data, test_data = TraceData(train), TraceData(test)
    L = train.num_moe_layers
    command = (f"python predictors/recipe.py --model {name} --train-prompts {args.train_prompts} "
               f"--test-prompts {args.test_prompts} --new-tokens {args.new_tokens} --batch {args.batch} "
               f"--threads {args.threads}")
    results = {"command": command, "model": name, "fingerprint": train.model_fingerprint, "train": train.summary(),
               "test": test.summary(), "threads": args.threads, "predictors": []}
    for key in ("train", "test"):
        results[key].pop("expert_load", None)
    for d in [d for d in DISTANCES if d < L]:
        for kind in KINDS:
            p = make_predictor(kind, distance=d)
            t1 = time.perf_counter()
            p.fit(train_data, model=model)
            fit_s = time.perf_counter() - t1
            K = max(train.top_k_per_layer)
            rep = evaluate(p, test_data, model=model, m_values=[1, 2, 4, 8, K, 2 * K])
            proj = evaluate(p, test_data, model=model, expert_bytes=reference_expert_bytes(PROJECTION),
                            latency_us=rep.latency_us)
            entry = {"kind": kind, "distance": d, "fit_seconds": fit_s, "latency_us": rep.latency_us,
                     "overall": rep.overall, "per_layer": rep.to_dict()["per_layer"],
                     "goodpred_projected": {"expert_bytes": PROJECTION, **{ph: proj.overall[ph] for ph in ("decode",)}},
                     "transfer": rep.to_dict()["transfer"]}
            results["predictors"].append(json.loads(json.dumps(entry, default=float)))
            log.info("%s d=%d: decode acc %.3f, goodpred %.3f (projected %.3f), %.1f µs, fit %.1f s", kind, d,
                     rep.overall["decode"]["accuracy"], rep.overall["decode"]["goodpred"],
                     proj.overall["decode"]["goodpred"], rep.latency_us, fit_s)
            if kind == "learned":
                p.save(out / f"learned-d{d}", overwrite=True,
                       metrics={"test": rep.to_dict(), "test_trace": results["test"],
                                "recipe": command})
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(_clean(results), indent=1) + "\n")
    (out / "RESULTS.md").write_text(markdown(results))
    print(markdown(results))


def _clean(o):
    import math

    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def markdown(results: dict) -> str:
    def f(x):
        return "–" if x is None or x != x else f"{x:.3f}"

    def acc(o):  # accuracy ± its sequence-clustered stderr (results.json from before it existed: bare)
        se = o.get("accuracy_stderr")
        return f(o["accuracy"]) + ("" if se is None or se != se else f" ± {se:.3f}")

    te = results["test"]
    lines = [
        f"# Predictors of `{results['model']}` (fingerprint `{results['fingerprint']}`)",
        "",
        f"Re-create: `{results['command']}`. All numbers on the **test** trace "
        f"({te['sequences']} held-out prompts, {te['decode_tokens']} decode / {te['prefill_tokens']} prefill tokens); "
        f"fitted on the train trace ({results['train']['sequences']} prompts, {results['train']['tokens']} tokens). "
        f"Accuracy = |pred ∩ actual| / |actual| at m = top-k, ± its standard error clustered by prompt "
        f"(moelab.predictors.metrics; n = the decode/prefill (token, layer) pairs of those prompts). GoodPred on `pcie4-x16` with the model's own expert "
        f"size, and projected with {PROJECTION} expert size ({reference_expert_bytes(PROJECTION) / 1e6:.0f} MB). "
        f"Latency: µs per layer per token, batch 1, CPU ({results['threads']} threads, shared machine).",
        "",
        "| predictor | d | decode acc | prefill acc | decode R@2K | GoodPred | GoodPred (proj.) | latency µs | fit s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in results["predictors"]:
        o = p["overall"]
        r2 = o["decode"].get(f"recall@{2 * max(te['top_k'])}")
        lines.append(
            f"| {p['kind']} | {p['distance']} | {acc(o['decode'])} | {acc(o['prefill'])} | "
            f"{f(r2)} | {f(o['decode']['goodpred'])} | {f(p['goodpred_projected']['decode']['goodpred'])} | "
            f"{f(p['latency_us']) if p['latency_us'] == p['latency_us'] else '–'} | {p['fit_seconds']:.1f} |"
        )
    lines += ["", "Decode accuracy per target layer:", "",
              "| predictor | d | " + " | ".join(f"L{i}" for i in range(len(te["moe_layers"]))) + " |",
              "|---|---|" + "---|" * len(te["moe_layers"])]
    for p in results["predictors"]:
        acc = {r["target_layer"]: r["accuracy"] for r in p["per_layer"] if r["phase"] == "decode"}
        lines.append(f"| {p['kind']} | {p['distance']} | "
                     + " | ".join(f(acc.get(i)) for i in range(len(te["moe_layers"]))) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
