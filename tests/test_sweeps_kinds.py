"""Sweep cell kinds beyond accuracy: cache and predictor specs (equal to the ad-hoc loops they
replace, resumable), per-cell artifacts (routing trace, hybrid timeline), the accuracy-vs-speed
Pareto front, and the GSM8K/HumanEval pipeline-check specs."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
from pathlib import Path

import pytest

from moelab.errors import MoelabError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    """A small routing trace of the tiny mixtral (3 prompts, 8 new tokens each)."""
    import torch

    import moelab
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    out = tmp_path_factory.mktemp("kinds") / "trace"
    model, tok = build_tiny("mixtral"), byte_tokenizer()
    enc = tok(["cache me", "if you can", "please"], return_tensors="pt", padding=True)
    with torch.no_grad(), moelab.record(model, out):
        model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    return out


def _write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


CACHE_SPEC = """\
name: caches
kind: cache
traces: [{trace}]
policies: [lru, belady, {{policy: mrs, alpha: 0.5}}]
capacities: [0.25, 3]
scopes: [layer, global]
prefetch: [none, {{predictor: oracle, distance: 1, budget: 2}}]
"""


def test_cache_spec_equals_the_cache_sweep_and_resumes(trace, tmp_path, capsys):
    from moelab.caches import PrefetchConfig, simulate
    from moelab.cli import main
    from moelab.sweeps.store import open_store

    spec = _write(tmp_path, CACHE_SPEC.format(trace=trace))
    store = tmp_path / "store"
    assert main(["sweep", "run", str(spec), "--store", str(store), "--no-progress"]) == 0
    assert "0 already done" in capsys.readouterr().out
    expected = [simulate(trace, p, c, s, prefetch=pf, **({"alpha": 0.5} if p == "mrs" else {}))
                for pf in (None, PrefetchConfig("oracle", 1, budget=2)) for s in ("layer", "global")
                for p in ("lru", "belady", "mrs") for c in (0.25, 3) if pf is None or p != "belady"]
    with open_store(store, writable=False) as st:
        good, bad = st.records()
    assert not bad
    from moelab.sweeps.driver import plan
    from moelab.sweeps.spec import load_spec

    with open_store(store, writable=False) as st:
        cells = plan(load_spec(spec), st)
    got = [good[c.hash]["metrics"] for c in cells]
    want = [r.to_dict() for r in expected]
    assert len(got) == len(want) == 20  # belady takes no prefetch: 3·2·2 demand + 2·2·2 prefetch
    assert json.loads(json.dumps(got, default=str)) == json.loads(json.dumps(want, default=str))
    assert main(["sweep", "run", str(spec), "--store", str(store), "--no-progress"]) == 0
    assert "0 cell(s) run, 20 already done" in capsys.readouterr().out
    assert main(["sweep", "report", str(spec), "--store", str(store), "--html", str(tmp_path / "r.html")]) == 0
    page = (tmp_path / "r.html").read_text()
    assert "hit rate" in page and "belady" in page


def test_cache_simulate_store_resumes_with_the_same_output(trace, tmp_path, capsys):
    from moelab.cli import main

    argv = ["cache", "simulate", "--trace", str(trace), "--policy", "lru,lfu", "--capacity", "0.25,0.5", "--json"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*argv, "--store", str(tmp_path / "s")]) == 0
    assert json.loads(capsys.readouterr().out) == plain
    with sqlite3.connect(tmp_path / "s" / "results.sqlite") as c:
        assert c.execute("SELECT count(*) FROM cells").fetchone()[0] == 4
        before = dict(c.execute("SELECT hash, checksum FROM cells"))
    assert main([*argv, "--store", str(tmp_path / "s")]) == 0  # read back, nothing recomputed
    assert json.loads(capsys.readouterr().out) == plain
    with sqlite3.connect(tmp_path / "s" / "results.sqlite") as c:
        assert dict(c.execute("SELECT hash, checksum FROM cells")) == before


PREDICTOR_SPEC = """\
name: preds
kind: predictor
traces: [{trace}]
predictors: [frequency, token]
distances: [1, 2]
"""


def test_predictor_spec_equals_the_predictor_comparison(trace, tmp_path, capsys):
    from moelab.cli import main
    from moelab.predictors import compare
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    spec = _write(tmp_path, PREDICTOR_SPEC.format(trace=trace))
    store = tmp_path / "store"
    assert main(["sweep", "run", str(spec), "--store", str(store), "--no-progress"]) == 0
    statuses = collect(load_spec(spec), store)
    assert [x.state for x in statuses] == ["done"] * 4
    expected = compare(trace, kinds=["frequency", "token"], distances=[1, 2])
    for x in statuses:
        c = x.cell
        rep = expected[(c.method, c.point["distance"])][1]
        assert x.record["score"] == rep.overall["all"]["accuracy"]
        assert x.record["metrics"]["per_layer"] == json.loads(json.dumps(rep.to_dict()["per_layer"], default=str))
    capsys.readouterr()
    assert main(["predict", "compare", "--trace", str(trace), "--kinds", "frequency,token", "--distances", "1,2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["distance"]) for r in out] == [("frequency", 1), ("token", 1), ("frequency", 2),
                                                          ("token", 2)]
    assert main(["predict", "compare", "--trace", str(trace), "--kinds", "frequncy"]) == 2
    assert "Did you mean 'frequency'" in capsys.readouterr().err


@pytest.mark.parametrize("old, new, message", [
    ("kind: cache", "kind: cach", r":2: unknown sweep kind 'cach'.*'cache'"),
    ("policies: [lru,", "policies: [lruu,", r":4: unknown cache policy 'lruu'.*'lru'"),
    ("scopes: [layer, global]", "scopes: [layr]", r":6: unknown cache scope 'layr'.*'layer'"),
    ("capacities: [0.25, 3]", "capacities: [0.25, 1.5]", r":5: capacity 1.5"),
    ("budget: 2}", "budget: 2, budget_bytes: 9}", r":7: give one prefetch budget"),
    ("prefetch:", "prefech:", r":7: unknown key 'prefech' in the sweep spec.*'prefetch'"),
])
def test_trace_spec_errors_name_the_line(trace, tmp_path, old, new, message):
    from moelab.sweeps.spec import load_spec

    text = CACHE_SPEC.format(trace=trace)
    assert old in text
    with pytest.raises(MoelabError, match=message):
        load_spec(_write(tmp_path, text.replace(old, new)))
    with pytest.raises(MoelabError, match="not a routing trace"):
        load_spec(_write(tmp_path, text.replace(str(trace), str(tmp_path)), "b.yaml"))


# --------------------------------------------------------------------------- artifacts
ARTIFACTS_SPEC = """\
name: art
models: [tiny-random-mixtral]
policies:
  - none
  - {policy: hybrid, config: {cache: {capacity: 0.5, policy: lru}, placement: host-misses, executor: real}}
tasks:
  - {task: arith, limit: 1}
eval: {max_gen_toks: 2}
artifacts: {trace: true, timeline: true}
"""


@pytest.mark.slow
def test_cells_record_their_trace_and_timeline_atomically(tmp_path):
    import pyarrow.parquet as pq

    from moelab.hybrid.events import COLUMNS
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec
    from moelab.trace import open_trace

    spec = load_spec(_write(tmp_path, ARTIFACTS_SPEC))
    store = tmp_path / "store"
    summary = run_sweep(spec, store=store, threads=1, progress=False)
    assert (summary.done, summary.failed) == (2, {})
    recs = {x.cell.policy: x.record for x in collect(spec, store)}
    for rec in recs.values():
        tr = open_trace(store / rec["trace_path"])
        assert tr.num_moe_layers > 0 and len(tr.column("seq")) > 0
        assert rec["trace_path"].startswith(rec["samples_path"])
    assert recs["none"]["timeline_path"] is None  # only hybrid cells have a timeline
    events = pq.read_table(store / recs["hybrid"]["timeline_path"])
    assert list(COLUMNS) == events.column_names[:len(COLUMNS)] and events.num_rows > 0
    # a cell whose artifact went missing is not counted: it is recomputed on the next run
    shutil.rmtree(store / recs["hybrid"]["trace_path"])
    states = {x.cell.policy: (x.state, x.error) for x in collect(spec, store)}
    assert states["hybrid"][0] == "bad" and "trace" in states["hybrid"][1]
    again = run_sweep(spec, store=store, threads=1, progress=False)
    assert again.done == 1 and again.skipped == 1
    assert (store / collect(spec, store)[1].record["trace_path"]).is_dir()


# --------------------------------------------------------------------------- Pareto front
def test_pareto_front_of_accuracy_against_tokens_per_s(tmp_path):
    """Records that carry a (here made-up) simulated speed get the accuracy-vs-tokens/s plot and
    its Pareto front; the made-up numbers live in this test only."""
    from moelab.sweeps.report import CellStatus, pareto_front, speed_points, write_html
    from moelab.sweeps.spec import expand, load_spec

    spec = load_spec(_write(tmp_path, ARTIFACTS_SPEC.replace("artifacts: {trace: true, timeline: true}\n", "")
                            .replace("  - none\n", "  - none\n  - {policy: deferral, grid: {deferred: [1]}}\n")))
    cells = expand(spec, {"tiny-random-mixtral": "0" * 16})
    made_up = [(0.60, {"tokens_per_s": 10.0}), (0.55, {"tokens_per_s": 20.0}), (0.50, {"latency_s": 0.04})]
    statuses = [CellStatus(c, "done", {"score": s, "score_stderr": 0.05, "n_docs": 100, "latency": {"p": lat},
                                       "wall_s": 1.0})
                for c, (s, lat) in zip(cells, made_up)]
    points = speed_points(statuses)["p"]
    assert sorted(p.tokens_per_s for p in points) == [10.0, 20.0, 25.0]
    front = pareto_front(points)
    assert [(p.score, p.tokens_per_s) for p in front] == [(0.60, 10.0), (0.55, 20.0), (0.50, 25.0)]
    statuses[2].record["latency"]["p"] = {"tokens_per_s": 15.0}  # slower and worse than cell 2: dominated
    assert [p.score for p in pareto_front(speed_points(statuses)["p"])] == [0.60, 0.55]
    page = write_html(spec, statuses, tmp_path / "r.html").read_text()
    assert "Accuracy vs simulated tokens/s · p" in page and "Pareto front" in page
    assert "No simulated latency" not in page


# --------------------------------------------------------------------------- real-benchmark specs
DATA = ROOT.parent / "shared" / "data"  # the local copies (never committed); as tests/test_evals_api.py
ENV = {"gsm8k": ("MOELAB_GSM8K_DIR", DATA / "gsm8k"), "humaneval": ("MOELAB_HUMANEVAL_DIR", DATA / "humaneval")}


@pytest.mark.slow
@pytest.mark.parametrize("task", ["gsm8k", "humaneval"])
def test_gsm8k_and_humaneval_specs_run_on_a_bundled_model(tmp_path, monkeypatch, task):
    """The shipped GSM8K/HumanEval specs, limited to 2 documents and 2 policies, on the bundled
    model they list: a pipeline check (a tiny model scores ~0; the numbers are not checked)."""
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import TaskSpec, load_spec

    env, default = ENV[task]
    if not os.environ.get(env):
        if not default.is_dir():
            pytest.skip(f"no local {task} copy: {default} is absent and ${env} is not set")
        monkeypatch.setenv(env, str(default))
    spec = load_spec(ROOT / "evals" / "sweeps" / f"{task}_deferral_vs_skipping.yaml")
    assert [t.name for t in spec.tasks] == [task] and spec.tasks[0].limit is None  # the full split
    spec.tasks = [TaskSpec(task, limit=2, num_fewshot=spec.tasks[0].num_fewshot)]
    spec.policies = spec.policies[:2]  # unmodified, deferral
    spec.eval = dataclasses.replace(spec.eval, max_gen_toks=16)
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert summary.failed == {} and summary.done == 3  # none + deferral D=1, 2
    for x in collect(spec, tmp_path / "store"):
        assert x.state == "done" and x.record["n_docs"] == 2 and 0.0 <= x.record["score"] <= 1.0
