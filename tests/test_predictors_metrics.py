"""Metrics: recomputed independently from the CLI's --dump; the GoodPred timing model by hand."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from moelab.cli import main
from moelab.errors import MoelabError
from moelab.predictors import evaluate, make_predictor
from moelab.predictors.timing import TransferModel, in_time_schedule
from moelab.timing import (
    HardwareProfile,
    available_profiles,
    get_profile,
    reference_expert_bytes,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    from tests.test_predictors_conformance import record_trace

    return record_trace(tmp_path_factory.mktemp("metrics") / "trace", n_seq=10)


def _recompute(dump: pd.DataFrame, K: int, m_values: list[int], basis: str = "predicted") -> dict:
    """Metrics from the dump alone, with plain Python sets. ``basis``: ProMoE's fetch rate (in-time
    predicted experts / predicted experts; GoodPred = accuracy × that, per pair) or the share of
    correct predictions in time (GoodPred = correct and in time / |actual|)."""
    out = {}
    for phase in ("prefill", "decode", "all"):
        d = dump if phase == "all" else dump[dump.phase == phase]
        acc, rec, prec, good = [], {m: [] for m in m_values}, {m: [] for m in m_values}, []
        hits_total = in_time_total = 0
        for pred, actual, in_time, ph in zip(d.predicted, d.actual, d.in_time, d.phase):
            a = set(actual.tolist())
            hits = [e in a for e in pred[:K]]
            acc.append(sum(hits) / len(a))
            for m in m_values:
                h = len(set(pred[:m].tolist()) & a)
                rec[m].append(h / len(a))
                prec[m].append(h / m)
            if ph == "decode":
                if basis == "correct":
                    g = sum(h and t for h, t in zip(hits, in_time[:K]))
                    good.append(g / len(a))
                    hits_total += sum(hits)
                    in_time_total += g
                else:
                    made = [t for p, t in zip(pred[:K], in_time[:K]) if p >= 0]
                    good.append(sum(hits) / len(a) * (sum(made) / len(made) if made else 0.0))
                    hits_total += len(made)  # the denominator: predicted experts
                    in_time_total += sum(made)
        # standard error clustered by sequence, written out: sqrt(sum over sequences of the
        # squared sum of residuals) / n; and the naive iid one
        mean = sum(acc) / len(acc)
        by_seq: dict[int, float] = {}
        for s, a in zip(d.seq, acc):
            by_seq[s] = by_seq.get(s, 0.0) + (a - mean)
        out[phase] = {
            "pairs": len(d),
            "sequences": len(by_seq),
            "accuracy": float(np.mean(acc)),
            # undefined (NaN, None in JSON) from a single sequence
            "accuracy_stderr": (sum(v * v for v in by_seq.values()) ** 0.5) / len(acc) if len(by_seq) > 1 else None,
            "accuracy_stderr_iid": float(np.std(acc, ddof=1) / len(acc) ** 0.5),
            **{f"recall@{m}": float(np.mean(rec[m])) for m in m_values},
            **{f"precision@{m}": float(np.mean(prec[m])) for m in m_values},
            "goodpred": float(np.mean(good)) if good else None,
            "fetch_rate": in_time_total / hits_total if hits_total else None,
        }
    return out


@pytest.mark.parametrize(("kind", "basis"), [("token", "predicted"), ("learned", "predicted"),
                                             ("token", "correct")])
def test_cli_metrics_match_an_independent_recomputation_from_the_dump(kind, basis, trace, tmp_path, capsys):
    dump = tmp_path / "dump.parquet"
    code = main(["predict", "eval", "--trace", str(trace.path), "--predictor", kind, "--distance", "2",
                 "--set", "progress=false", "--set", "max_epochs=3", "--json", "--dump", str(dump), "--m", "1,3",
                 "--expert-bytes", "qwen2-57b-a14b", "--layer-time-us", "3000"] if kind == "learned" else
                ["predict", "eval", "--trace", str(trace.path), "--predictor", kind, "--distance", "2",
                 "--json", "--dump", str(dump), "--m", "1,3", "--fetch-basis", basis])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fetch_basis"] == basis
    df = pd.read_parquet(dump)
    assert len(df) == report["overall"]["all"]["pairs"] and set(df.distance) == {2}
    mine = _recompute(df, report["top_k"], report["m_values"], basis)
    for phase, vals in mine.items():
        for key, v in vals.items():
            assert report["overall"][phase][key] == pytest.approx(v), (phase, key)
    # per layer too
    for row in report["per_layer"]:
        d = df if row["phase"] == "all" else df[df.phase == row["phase"]]
        d = d[d.target_layer == row["target_layer"]]
        acc = np.mean([len(set(p[: report["top_k"]]) & set(a)) / len(a) for p, a in zip(d.predicted, d.actual)])
        assert row["accuracy"] == pytest.approx(acc)


def test_eval_scores_only_the_held_out_sequences_of_the_fitting_trace(trace):
    p = make_predictor("token", distance=1).fit(trace)
    r = evaluate(p, trace)
    assert "held-out" in r.split
    assert set(np.unique(r.rows["seq"])) == set(p.val_sequences_.tolist())


def test_oracle_scores_one_and_frequency_matches_its_table(trace):
    r = evaluate(make_predictor("oracle", distance=1).fit(trace), trace)
    assert r.overall["all"]["accuracy"] == 1.0
    assert r.overall["all"][f"recall@{r.top_k}"] == 1.0


def _profile(bw_gbs=1.0, layer_us=100.0, lat_us=0.0, a=0.5):
    return HardwareProfile(name="t", link_bandwidth_gbs=bw_gbs, link_latency_us=lat_us,
                           decode_layer_time_us=layer_us, attention_fraction=a)


def test_in_time_schedule_layer_wise_by_hand():
    # transfer = 40_000 B / (1 GB/s) = 40 µs; layer time 100 µs; latency 10 µs, d = 1, K = 2
    tm = TransferModel(_profile(), expert_bytes=40_000, latency_us=10.0)
    s = in_time_schedule("layer", 1, [2, 2, 2], tm)
    # target 1: ready at 10, transfers end 50 and 90 ≤ 100 → both in time
    # target 2: ready at 110, link free at 90 → ends 150, 190 ≤ 200 → in time
    assert s.tolist() == [[False, False], [True, True], [True, True]]
    tm = TransferModel(_profile(), expert_bytes=50_000, latency_us=10.0)  # 50 µs transfers
    s = in_time_schedule("layer", 1, [2, 2, 2], tm)
    assert s.tolist() == [[False, False], [True, False], [True, False]]  # 60 ok, 110 > 100


def test_in_time_schedule_iteration_and_static_by_hand():
    # forward starts at -50 µs; 30 µs transfers; iteration latency 10 µs per layer
    tm = TransferModel(_profile(), expert_bytes=30_000, latency_us=10.0)
    s = in_time_schedule("iteration", 1, [1, 1, 1], tm)
    # layer 0: ready -40, done -10 ≤ 0; layer 1: done 20 ≤ 100; layer 2: done 50 ≤ 200
    assert s.tolist() == [[True], [True], [True]]
    tm = TransferModel(_profile(), expert_bytes=60_000, latency_us=0.0)
    s = in_time_schedule("static", 1, [2, 2], tm)
    # -50 + 60 = 10 > 0 (late), 70 > 0 (late), 130 ≤ 100? no, 190 > 100
    assert s.tolist() == [[False, False], [False, False]]


def test_goodpred_falls_as_the_link_gets_slower(trace):
    p = make_predictor("token", distance=1).fit(trace)
    goods = [evaluate(p, trace, expert_bytes=reference_expert_bytes("qwen2-57b-a14b"), link_bandwidth_gbs=bw,
                      latency_us=20.0).overall["decode"]["goodpred"] for bw in (1000.0, 50.0, 5.0, 0.5)]
    assert goods == sorted(goods, reverse=True) and goods[0] > goods[-1]
    acc = evaluate(p, trace, expert_bytes=1, latency_us=0.0).overall["decode"]
    assert acc["goodpred"] == pytest.approx(acc["accuracy"]) and acc["fetch_rate"] == 1.0


def test_hardware_profiles_are_a_registry_with_did_you_mean():
    assert {"pcie3-x16", "pcie4-x16", "pcie5-x16"} <= set(available_profiles())
    hw = get_profile("pcie4-x16")
    assert hw.transfer_time_us(25e6) == pytest.approx(hw.link_latency_us + 1000.0)
    with pytest.raises(MoelabError, match="Did you mean 'pcie4-x16'"):
        get_profile("pcie4-x61")
    with pytest.raises(MoelabError, match="link_bandwidth_gbs"):
        dataclasses.replace(hw, link_bandwidth_gbs=0)
    with pytest.raises(MoelabError, match="Did you mean"):
        reference_expert_bytes("mixtral-8x7")


def test_goodpred_rescoring_matches_a_full_evaluation(trace):
    from moelab.predictors.metrics import goodpred

    p = make_predictor("token", distance=1).fit(trace)
    eb = reference_expert_bytes("deepseek-v2-lite")
    base = evaluate(p, trace, expert_bytes=eb, latency_us=15.0)
    for bw in (5.0, 50.0):
        full = evaluate(p, trace, expert_bytes=eb, latency_us=15.0, link_bandwidth_gbs=bw).overall["decode"]
        quick = goodpred(base, p, expert_bytes=eb, link_bandwidth_gbs=bw)
        assert quick["goodpred"] == pytest.approx(full["goodpred"]) and quick["accuracy"] == pytest.approx(full["accuracy"])


def test_cli_fit_saves_with_held_out_metrics_and_eval_loads_it(trace, tmp_path, capsys):
    out = tmp_path / "learned-d1"
    assert main(["predict", "fit", "--trace", str(trace.path), "--kind", "learned", "--out", str(out),
                 "--set", "max_epochs=2", "--set", "progress=false", "--json"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    meta = json.loads((out / "predictor.json").read_text())
    assert meta["params"]["max_epochs"] == 2 and meta["model"]["fingerprint"] == trace.model_fingerprint
    assert meta["metrics"]["heldout"]["overall"]["all"]["accuracy"] == fitted["overall"]["all"]["accuracy"]
    assert main(["predict", "eval", "--trace", str(trace.path), "--predictor", str(out), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["overall"]["all"]["accuracy"] == fitted["overall"]["all"]["accuracy"]
    assert main(["predict", "eval", "--trace", str(trace.path), "--predictor", str(out), "--distance", "2"]) == 2
    assert "fitted for distance 1" in capsys.readouterr().err


def test_cli_table_prints_n_and_the_clustered_stderr_of_accuracy(trace, capsys):
    assert main(["predict", "eval", "--trace", str(trace.path), "--predictor", "frequency", "--distance", "1",
                 "--set", "val_fraction=0.3"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("phase"))
    assert "pairs" in header and "seqs" in header and "±se" in header
    decode = next(line for line in out.splitlines() if line.startswith("decode   overall"))
    r = evaluate(make_predictor("frequency", distance=1, val_fraction=0.3).fit(trace), trace, expert_bytes=1,
                 latency_us=0.0)
    o = r.overall["decode"]
    assert o["sequences"] == 3 and o["accuracy_stderr"] > 0
    assert decode.split()[2:6] == [str(o["pairs"]), str(o["sequences"]), f"{o['accuracy']:.3f}",
                                   f"{o['accuracy_stderr']:.3f}"]
    assert "clustered by sequence" in out
    assert r.accuracy_text() == (f"{o['accuracy']:.3f}±{o['accuracy_stderr']:.3f} "
                                 f"(n={o['pairs']:,} pairs, {o['sequences']} seqs)")


def test_goodpred_rescoring_reports_n_and_stderr(trace):
    from moelab.predictors.metrics import goodpred

    p = make_predictor("token", distance=1).fit(trace)
    r = evaluate(p, trace, sequences=np.arange(10), expert_bytes=1, latency_us=0.0)
    g = goodpred(r, p, expert_bytes=reference_expert_bytes("deepseek-v2-lite"), link_bandwidth_gbs=5.0)
    o = r.overall["decode"]
    assert g["pairs"] == o["pairs"] and g["sequences"] == o["sequences"]
    assert o["sequences"] == 10 and o["accuracy_stderr"] > 0
    assert g["accuracy_stderr"] == pytest.approx(o["accuracy_stderr"]) and g["goodpred_stderr"] >= 0


def test_predictor_plots_draw_clustered_stderr_bars_and_say_n(trace):
    from moelab.predictors import frame, plots

    reports = {}
    for kind in ("token", "frequency"):
        p = make_predictor(kind, distance=1).fit(trace)
        reports[(kind, 1)] = (p, evaluate(p, trace, sequences=np.arange(10), expert_bytes=1, latency_us=0.0))
    per_layer, overall = frame(reports), frame(reports, per_layer=False)
    assert {"pairs", "sequences", "accuracy_stderr"} <= set(overall.columns)
    for fig, df in ((plots.accuracy_per_layer(per_layer), per_layer[per_layer.phase == "decode"]),
                    (plots.accuracy_vs_distance(overall), overall[overall.phase == "decode"])):
        bars = np.concatenate([np.asarray(tr.error_y.array, float) for tr in fig.data])
        assert len(bars) == len(df) and np.allclose(np.sort(bars), np.sort(df.accuracy_stderr.to_numpy()))
        assert (bars > 0).all() and "n = " in fig.layout.title.text and "pairs" in fig.layout.title.text
    fig, g = plots.goodpred_vs_bandwidth(reports, [5, 50], expert_bytes=reference_expert_bytes("deepseek-v2-lite"))
    assert all(tr.error_y.array is not None for tr in fig.data) and "goodpred_stderr" in g.columns


def test_fetch_basis_follows_promoe_by_default_and_the_two_differ_when_only_early_ranks_arrive(trace):
    """ProMoE: FetchRate = predicted experts fetchable in time / predicted experts. With a link that
    delivers only the first rank in time, and a predictor whose top-k is all correct, ProMoE's
    fetch rate is 1/k; the 'correct' basis says 1/k too — but with half the predictions wrong and
    the right ones first, 'correct' counts the wrong late ones out and reads higher."""
    from moelab.predictors.metrics import FETCH_BASES, PredictionReport, _aggregate

    assert FETCH_BASES[0] == "predicted"
    K = 2
    # two decode pairs, top-2: rank 0 correct and in time, rank 1 wrong and late
    match = np.array([[True, False], [True, False]])
    in_time = np.array([[True, False], [True, False]])
    valid = np.ones((2, K), bool)
    n_actual = np.array([2, 2])
    args = (match, n_actual, in_time, np.array([True, True]), K, [1, 2], np.array([0, 1]), valid)
    promoe = _aggregate(*args)  # default basis
    corr = _aggregate(*args, fetch_basis="correct")
    # ProMoE: half the predicted experts arrive; accuracy 1/2, GoodPred 1/2 × 1/2
    assert promoe["fetch_rate"] == pytest.approx(0.5) and promoe["goodpred"] == pytest.approx(0.25)
    # correct basis: every correct prediction arrived; GoodPred = 1 in time / 2 actual
    assert corr["fetch_rate"] == pytest.approx(1.0) and corr["goodpred"] == pytest.approx(0.5)
    assert "fetch_basis" in {f.name for f in dataclasses.fields(PredictionReport)}
    with pytest.raises(MoelabError, match="fetch_basis='promoe'.*predicted.*correct"):
        evaluate(make_predictor("frequency", distance=1).fit(trace), trace, fetch_basis="promoe")
