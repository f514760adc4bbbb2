"""Synthetic routing: statistics fitted from routing, generated back, recovered."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from moelab.errors import MoelabError
from moelab.simulate.synthetic import (
    RoutingStats,
    check_trace_shape,
    fit_routing_stats,
    router_scores,
    synthetic_routing,
)
from moelab.timing.shapes import ModelShape, get_shape


@pytest.fixture(scope="module", autouse=True)
def _calibration_cache(tmp_path_factory):
    """Calibrations of these tests are kept in a temporary directory, not ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELAB_SYNTHETIC_CACHE", str(tmp_path_factory.mktemp("synthetic-cache")))
        yield


def _shape(E: int, K: int, L: int) -> ModelShape:
    return ModelShape(name=f"toy-{E}x{K}", num_layers=L, moe_layers=tuple(range(L)), num_experts=E, top_k=K,
                      hidden_size=64, expert_intermediate=32)


@pytest.fixture(scope="module")
def stats() -> RoutingStats:
    return RoutingStats.from_lifts(
        16, 4, skew=[0.9, 0.6, 1.1, 0.7], reuse_lift=[0.3, 0.2, 0.15, 0.2],
        adjacent_lift=[0.0, 0.25, 0.4, 0.1], weight_profile=[0.5, 0.25, 0.15, 0.1], weight_sum=1.0,
        weight_spread=0.1,
    )


@pytest.fixture(scope="module")
def generated(stats):
    return synthetic_routing(_shape(16, 4, 4), stats, steps=64, batch=64, seed=3)


def test_fitted_statistics_recover_the_generating_ones(stats, generated):
    got = fit_routing_stats(generated, num_experts=16)
    assert got.num_layers == 4 and got.tokens == 64 * 64
    np.testing.assert_allclose(got.skew, stats.skew, atol=0.1)
    np.testing.assert_allclose(got.reuse_lift, stats.reuse_lift, atol=0.04)
    np.testing.assert_allclose(got.adjacent_lift[1:], stats.adjacent_lift[1:], atol=0.05)
    np.testing.assert_allclose(got.weight_profile, stats.weight_profile, atol=0.03)
    assert got.weight_sum == pytest.approx(1.0, abs=1e-5)
    assert math.isnan(got.adjacent[0])


def test_uncalibrated_generation_misses_the_targets(stats):
    """The calibration matters: the rough lift → bonus guess is measurably off."""
    raw = synthetic_routing(_shape(16, 4, 4), stats, steps=64, batch=64, seed=3, calibrate=False)
    got = fit_routing_stats(raw, num_experts=16)
    err = np.nanmax(np.abs(np.array(got.adjacent_lift[1:]) - stats.adjacent_lift[1:]))
    err = max(err, np.max(np.abs(np.array(got.reuse_lift) - stats.reuse_lift)))
    assert err > 0.05


def test_forward_routing_attributes(stats):
    fw = synthetic_routing(_shape(16, 4, 4), stats, steps=3, batch=2, prompt_len=5, seed=3)  # calibrated once
    assert [(f.forward, f.step, f.phase, f.tokens) for f in fw] == [
        (0, 0, "prefill", 10), (1, 1, "decode", 2), (2, 2, "decode", 2), (3, 3, "decode", 2)]
    for f in fw:
        assert len(f.ids) == len(f.weights) == 4 and f.scores is None
        for ids, w in zip(f.ids, f.weights):
            assert ids.dtype == np.int64 and ids.shape == (f.tokens, 4)
            assert w.dtype == np.float32 and w.shape == (f.tokens, 4)
            assert ((ids >= 0) & (ids < 16)).all()
            assert all(len(set(row)) == 4 for row in ids.tolist())  # K distinct experts
            assert (np.diff(w, axis=1) <= 0).all()  # descending weights


def test_deterministic_by_seed(monkeypatch):
    from moelab.simulate import synthetic

    monkeypatch.setenv("MOELAB_SYNTHETIC_CACHE", "")  # no disk cache: calibrate every time
    two = RoutingStats.from_lifts(16, 4, skew=[0.8, 0.8], reuse_lift=[0.2, 0.2], adjacent_lift=[0.0, 0.3])
    runs = []
    for seed in (7, 7, 8):
        synthetic._CALIBRATIONS.clear()  # the calibration itself must be deterministic too
        runs.append(synthetic_routing(_shape(16, 4, 2), two, steps=4, batch=3, seed=seed))
    a, b, c = runs
    flat = lambda fw: np.concatenate([x.ravel() for f in fw for x in f.ids])  # noqa: E731
    assert np.array_equal(flat(a), flat(b))
    assert np.array_equal(np.concatenate([x.ravel() for f in a for x in f.weights]),
                          np.concatenate([x.ravel() for f in b for x in f.weights]))
    assert not np.array_equal(flat(a), flat(c))


def test_rescaled_to_another_shape(stats):
    target = stats.for_shape(32, 6, 7)
    assert (target.num_experts, target.top_k, target.num_layers) == (32, 6, 7)
    np.testing.assert_allclose(target.reuse_lift, [stats.reuse_lift[j] for j in (0, 0, 1, 2, 2, 2, 3)], atol=1e-9)
    assert sum(target.weight_profile) == pytest.approx(1.0)
    assert stats.for_shape(16, 4, 4) is stats
    fw = synthetic_routing(_shape(32, 6, 7), stats, steps=2, batch=2, seed=0, calibrate=False)
    assert all(x.shape == (2, 6) and x.max() < 32 for f in fw for x in f.ids)


def test_stats_table_and_round_trip(stats):
    text = str(stats)
    assert "zipf_s" in text and "weight profile" in text and len(text.splitlines()) == 2 + 4 + 1
    assert RoutingStats.from_dict(stats.to_dict()).skew == stats.skew
    assert list(stats.table().columns)[:3] == ["moe_layer", "zipf_s", "reuse"]


def test_bad_inputs(stats):
    with pytest.raises(MoelabError, match="batch is 0, expected an integer ≥ 1"):
        synthetic_routing(_shape(16, 4, 4), stats, batch=0)
    with pytest.raises(MoelabError, match="top_k 9 must be in 1..num_experts"):
        stats.for_shape(8, 9, 2)
    with pytest.raises(MoelabError, match="unknown model shape"):
        synthetic_routing("deepseek-v9", stats)
    with pytest.raises(MoelabError, match="reuse_lift values"):
        RoutingStats.from_lifts(8, 2, [1.0], [1.5], [0.0])
    with pytest.raises(MoelabError, match="weight_profile has 3 ranks, top_k is 4"):
        RoutingStats(16, 4, (1.0,), (0.5,), (0.2,), (math.nan,), (math.nan,), (0.5, 0.3, 0.2))


def test_trace_whose_experts_do_not_match_the_shape():
    trace = SimpleNamespace(num_experts=32, top_k=8, num_moe_layers=6, path="traces/run1",
                            meta={"model": {"name": "moelab-tiny-qwen2moe"}})
    with pytest.raises(MoelabError) as e:
        check_trace_shape(trace, get_shape("deepseek-v3"))
    msg = str(e.value)
    assert "\n" not in msg and "E=32" in msg and "E=256" in msg and "--synthetic" in msg
    check_trace_shape(SimpleNamespace(num_experts=256, top_k=8, num_moe_layers=58, path="t", meta={"model": {}}),
                      get_shape("deepseek-v3"))


def test_fit_on_a_recorded_trace(tmp_path):
    import torch

    import moelab
    from moelab.models.tiny import build_tiny

    model = build_tiny("mixtral")
    ids = torch.randint(3, 200, (4, 6), generator=torch.Generator().manual_seed(0))
    with moelab.record(model, tmp_path / "t"):
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                       min_new_tokens=12, pad_token_id=0)
    st = fit_routing_stats(tmp_path / "t")
    assert (st.num_experts, st.top_k, st.num_layers) == (8, 2, 4)
    assert st.tokens == 4 * 11
    assert all(0 <= r <= 1 for r in st.reuse) and all(s >= 0 for s in st.skew)
    assert sum(st.weight_profile) == pytest.approx(1.0)
    assert "moelab" in str(st) or "trace" in str(st)


def test_a_deep_model_from_a_shallow_trace_keeps_the_statistics():
    """Nine layers from two (DeepSeek-V3's 58 from a 6-layer trace works the same way): layers
    deep in a run of alike layers reuse their predecessor's bonuses, and their statistics must
    still come out as the targets (the exponent used to drift along such runs)."""
    two = RoutingStats.from_lifts(16, 4, skew=[0.8, 0.6], reuse_lift=[0.2, 0.15], adjacent_lift=[0.0, 0.3])
    fw = synthetic_routing(_shape(16, 4, 9), two, steps=64, batch=64, seed=0)
    got, want = fit_routing_stats(fw, num_experts=16), two.for_shape(16, 4, 9)
    np.testing.assert_allclose(got.skew, want.skew, atol=0.1)
    np.testing.assert_allclose(got.reuse_lift, want.reuse_lift, atol=0.04)
    np.testing.assert_allclose(got.adjacent_lift[1:], want.adjacent_lift[1:], atol=0.05)


def test_calibrations_are_kept_on_disk(tmp_path, monkeypatch):
    from moelab.simulate import synthetic

    monkeypatch.setenv("MOELAB_SYNTHETIC_CACHE", str(tmp_path))
    two = RoutingStats.from_lifts(16, 4, skew=[0.5, 0.9], reuse_lift=[0.1, 0.3], adjacent_lift=[0.0, 0.2])
    a = synthetic_routing(_shape(16, 4, 2), two, steps=3, batch=2, seed=11)
    files = list(tmp_path.glob("calibration-*.npz"))
    assert len(files) == 1 and not list(tmp_path.glob(".calibration-*"))
    synthetic._CALIBRATIONS.clear()

    def boom(*args, **kwargs):
        raise AssertionError("calibrated again although a calibration was on disk")

    monkeypatch.setattr(synthetic, "_calibrate", boom)
    b = synthetic_routing(_shape(16, 4, 2), two, steps=3, batch=2, seed=11)
    assert all(np.array_equal(x, y) for f, g in zip(a, b) for x, y in zip(f.ids, g.ids))
    files[0].write_bytes(b"not an npz")  # a damaged file is ignored, not trusted
    synthetic._CALIBRATIONS.clear()
    monkeypatch.setattr(synthetic, "_calibrate", lambda *a, **k: (np.zeros(2), np.zeros(2), np.zeros(2)))
    synthetic_routing(_shape(16, 4, 2), two, steps=1, batch=1, seed=11)


# ---------------------------------------------------------------------- synthesised router scores
@pytest.mark.parametrize("E, K, mass", [(16, 4, 0.5), (8, 2, 0.1), (64, 8, 0.9), (4, 4, 0.5)])
def test_router_scores_keep_the_top_k_in_order_and_in_the_weights_ratio(E, K, mass):
    rng = np.random.default_rng(0)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(200)])
    w = np.sort(rng.dirichlet(np.ones(K), size=200), axis=1)[:, ::-1]
    logp = np.log(rng.dirichlet(np.ones(E)))
    sc = router_scores(ids, w, logp, np.random.default_rng(1), mass)
    assert sc.shape == (200, E) and sc.dtype == np.float32
    np.testing.assert_allclose(sc.sum(1), 1.0, rtol=1e-5)
    top = np.argsort(-sc, axis=1, kind="stable")[:, :K]
    tied = np.isclose(w[:, :-1], w[:, 1:]).any(1)  # equal weights may come out in either order
    assert (np.sort(top, 1) == np.sort(ids, 1)).all() and (top[~tied] == ids[~tied]).all()
    picked = np.take_along_axis(sc, ids, 1)
    np.testing.assert_allclose(picked / picked.sum(1, keepdims=True), w / w.sum(1, keepdims=True), rtol=1e-4)
    if E > K:  # the top-k hold `mass`, unless the k-th would then fall below an even spread of the rest
        frac = w / w.sum(1, keepdims=True)
        floor = 1 / (1 + (E - K) * frac[:, -1])
        assert (picked.sum(1) >= np.minimum(mass, 1) - 1e-5).all() and (picked.sum(1) > floor).all()
        np.testing.assert_allclose(picked.sum(1)[floor < mass * 0.99], mass, rtol=1e-4)


def test_scores_favour_popular_experts_when_not_chosen_and_leave_ids_alone(stats):
    plain = synthetic_routing(_shape(16, 4, 4), stats, steps=8, batch=32, seed=5, calibrate=False)
    scored = synthetic_routing(_shape(16, 4, 4), stats, steps=8, batch=32, seed=5, calibrate=False, scores=True)
    assert plain[0].scores is None and len(scored[0].scores) == 4
    for a, b in zip(plain, scored):  # a separate random stream: the routing itself is unchanged
        assert all((x == y).all() for x, y in zip(a.ids, b.ids))
        assert all((x == y).all() for x, y in zip(a.weights, b.weights))
    layer = 0
    ids = np.concatenate([f.ids[layer] for f in scored])
    sc = np.concatenate([f.scores[layer] for f in scored])
    uses = np.bincount(ids.ravel(), minlength=16)
    chosen = np.zeros_like(sc, dtype=bool)
    np.put_along_axis(chosen, ids, True, 1)
    unchosen_mean = np.where(chosen, np.nan, sc)
    mean_when_not_chosen = np.nanmean(unchosen_mean, 0)
    hot, cold = np.argsort(-uses)[:4], np.argsort(uses)[:4]
    assert mean_when_not_chosen[hot].mean() > mean_when_not_chosen[cold].mean()


def test_the_mrs_cache_runs_on_synthetic_routing():
    from moelab.simulate.whatif import whatif

    st = RoutingStats.from_lifts(8, 2, [1.0] * 32, [0.3] * 32, [0.0] + [0.2] * 31, [0.6, 0.4])
    df = whatif("mixtral-8x7b", "rtx4090-desktop", synthetic=True, stats=st, steps=2, warmup=2, oracle=False,
                grid=["capacity=1e", "policy=mrs"])
    assert df.iloc[0]["tokens_per_s"] > 0 and any("router scores are synthesised" in n for n in df.attrs["notes"])
