"""Conformance suite every registered predictor kind passes: the scikit-learn contract,
shapes, online = offline, save/load round trip, determinism under a seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.predictors import (
    PREDICTORS,
    LearnedPredictor,
    Predictor,
    attach,
    available_predictors,
    clone,
    load_predictor,
    make_predictor,
    register_predictor,
)

torch.set_num_threads(1)

KINDS = ["frequency", "oracle", "token", "skip", "learned"]
FAST = {"learned": {"progress": False, "max_epochs": 4, "width": 32}}


def record_trace(path, family="mixtral", n_seq=10, new_tokens=6, hidden=True, seed=0):
    model, _ = moelab.load(f"tiny-random-{family}")
    with moelab.record(model, path, hidden_states=hidden, model_name=f"tiny-random-{family}") as rec:
        for i in range(n_seq):
            g = torch.Generator().manual_seed(seed * 1000 + i)
            ids = torch.randint(3, 250, (1, 6 + i % 4), generator=g)
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return rec.trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return record_trace(tmp_path_factory.mktemp("pred") / "trace")


def make(kind, **kw):
    return make_predictor(kind, **{**FAST.get(kind, {}), **kw})


def test_builtin_kinds_are_registered():
    assert set(KINDS) <= set(available_predictors())


def test_unknown_kind_suggests_close_name():
    with pytest.raises(MoelabError, match="Did you mean 'learned'"):
        make_predictor("lerned")


@pytest.mark.parametrize("kind", KINDS)
def test_fit_returns_self_and_sets_trailing_underscore_state(kind, trace):
    p = make(kind)
    assert not p.is_fitted
    assert p.fit(trace) is p
    assert p.model_fingerprint_ == trace.model_fingerprint
    assert p.trace_id_ == trace.trace_id
    assert len(p.val_sequences_) >= 1 and not set(p.val_sequences_) & set(p.train_sequences_)


@pytest.mark.parametrize("kind", KINDS)
def test_init_only_stores_params_and_clone_copies_them(kind):
    p = make(kind, distance=2)
    params = p.get_params()
    assert params["distance"] == 2
    c = clone(p)
    assert type(c) is type(p) and c.get_params() == params and c is not p
    assert not c.is_fitted
    assert p.set_params(distance=1) is p and p.distance == 1
    with pytest.raises(MoelabError, match="Did you mean 'distance'"):
        p.set_params(distanse=3)


@pytest.mark.parametrize("kind", KINDS)
def test_is_a_scikit_learn_estimator(kind, trace):
    from sklearn.base import BaseEstimator
    from sklearn.base import clone as sk_clone
    from sklearn.exceptions import NotFittedError
    from sklearn.utils import get_tags
    from sklearn.utils.validation import check_is_fitted

    p = make(kind, distance=2)
    assert isinstance(p, BaseEstimator)
    with pytest.raises(NotFittedError, match="not fitted yet"):
        check_is_fitted(p)
    tags = get_tags(p)
    assert tags.requires_fit and not tags.input_tags.two_d_array and not tags.target_tags.required
    p.fit(trace)
    check_is_fitted(p)
    c = sk_clone(p)
    assert type(c) is type(p) and c.get_params() == p.get_params() and not c.is_fitted
    with pytest.raises(NotFittedError):
        check_is_fitted(c)
    assert "distance=2" in repr(p)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("distance", [1, 2])
def test_predictions_have_top_k_or_m_distinct_valid_ids(kind, distance, trace):
    p = make(kind, distance=distance).fit(trace)
    K, E = trace.top_k, trace.num_experts
    for layer in p.source_layers():
        tok, pred = p.predict_trace(trace, layer)
        assert pred.shape == (len(tok), K) and pred.dtype == np.int64
        tok, ranked = p.predict_trace(trace, layer, m=E)
        assert ranked.shape == (len(tok), E)
        assert np.all(np.sort(ranked, axis=1) == np.arange(E))  # a permutation: distinct, in range
        assert np.array_equal(ranked[:, :K], pred)  # ranked lists extend the top-k
    assert p.source_layers() == list(range(trace.num_moe_layers - distance))


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "oracle"])
def test_online_prediction_equals_offline_prediction(kind, trace):
    p = make(kind, distance=1).fit(trace)
    data = moelab.predictors.TraceData(trace)
    tok, offline = p.predict_trace(data, 1)
    rows = data.index.rows[tok, 1]
    hidden = data.hidden[rows]
    for i in range(0, len(tok), 7):  # batch 1, as during a forward pass
        online = p.predict(1, hidden=hidden[i], token_ids=int(data.index.token_id[tok[i]]))
        assert online.shape == (1, trace.top_k)
        assert np.array_equal(online[0], offline[i])


def test_oracle_refuses_online_use(trace):
    p = make("oracle").fit(trace)
    with pytest.raises(MoelabError, match="offline"):
        p.predict(0, token_ids=[5])


@pytest.mark.parametrize("kind", KINDS)
def test_save_load_round_trip_predicts_identically(kind, trace, tmp_path):
    p = make(kind, distance=2).fit(trace)
    p.save(tmp_path / "p")
    q = load_predictor(tmp_path / "p")
    assert type(q) is type(p) and q.get_params() == p.get_params()
    assert q.model_fingerprint_ == p.model_fingerprint_ and q.trace_id_ == p.trace_id_
    assert np.array_equal(q.val_sequences_, p.val_sequences_)
    for layer in p.source_layers():
        assert np.array_equal(q.predict_trace(trace, layer, m=5)[1], p.predict_trace(trace, layer, m=5)[1])
    assert not list(tmp_path.glob(".*partial*"))
    assert sorted(f.name for f in (tmp_path / "p").iterdir()) == ["predictor.json", "state.safetensors"]


def test_save_refuses_existing_output_without_overwrite(trace, tmp_path):
    p = make("frequency").fit(trace)
    p.save(tmp_path / "p")
    with pytest.raises(MoelabError, match="already exists"):
        p.save(tmp_path / "p")
    p.save(tmp_path / "p", overwrite=True)


@pytest.mark.parametrize("kind", KINDS)
def test_fitting_is_deterministic_under_a_seed(kind, trace):
    a = make(kind, distance=1).fit(trace)
    b = make(kind, distance=1).fit(trace)
    for layer in a.source_layers():
        assert np.array_equal(a.predict_trace(trace, layer, m=8)[1], b.predict_trace(trace, layer, m=8)[1])
    if kind == "learned":
        for layer, ws in a.weights_.items():
            for (w1, b1), (w2, b2) in zip(ws, b.weights_[layer]):
                assert np.array_equal(w1, w2) and np.array_equal(b1, b2)


def test_learned_seed_changes_the_split_and_weights(trace):
    a = make("learned", seed=0).fit(trace)
    b = make("learned", seed=1).fit(trace)
    assert not np.array_equal(a.weights_[0][0][0], b.weights_[0][0][0])


def test_user_registered_predictor_is_selectable_by_name(trace, tmp_path):
    @register_predictor("constant-test")
    class Constant(Predictor):
        timing = "static"

        def __init__(self, distance: int = 1, expert: int = 3) -> None:
            self.distance = distance
            self.expert = expert

        def _fit(self, data, model):
            self.width_ = data.trace.num_experts

        def _scores(self, layer, hidden, token_ids, n):
            s = np.zeros((n, self.width_), np.float32)
            s[:, self.expert] = 1
            return s

        def _state(self):
            return {}, {"width": self.width_}

        def _load_state(self, tensors, extra, model):
            self.width_ = extra["width"]

    try:
        p = make_predictor("constant-test", expert=5).fit(trace)
        assert p.predict(0, token_ids=[1, 2])[:, 0].tolist() == [5, 5]
        p.save(tmp_path / "c")
        assert load_predictor(tmp_path / "c").predict(0, token_ids=[1])[0, 0] == 5
    finally:
        PREDICTORS.unregister("constant-test")  # a second registration of another class would raise


@pytest.mark.parametrize("kind", ["learned", "token", "skip"])
def test_attach_calls_back_during_generate_with_the_offline_predictions(kind, trace, tmp_path):
    p = make(kind, distance=1).fit(trace)
    model, _ = moelab.load("tiny-random-mixtral")
    seen: list[tuple[int, int, np.ndarray]] = []
    ids = torch.tensor([[5, 17, 33, 9]])
    with (
        moelab.record(model, tmp_path / "t", hidden_states=True, hidden_dtype="float32",
                      model_name="tiny-random-mixtral") as rec,
        attach(model, p, lambda s, t, e: seen.append((s, t, e.copy()))),
    ):
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    online = {}
    for s, t, e in seen:
        assert t == s + 1
        online.setdefault(s, []).append(e)
    for s in p.source_layers():
        got = np.concatenate(online[s])
        _, offline = p.predict_trace(rec.trace, s)
        assert np.array_equal(got, offline)


def test_attach_refuses_another_model(trace):
    p = make("token").fit(trace)
    other, _ = moelab.load("tiny-random-qwen2_moe")
    with pytest.raises(MoelabError, match="fingerprint"), attach(other, p, lambda *a: None):
        pass


def test_learned_accepts_promoe_settings(trace):
    p = LearnedPredictor(width=64, depth=2, loss="l1", max_epochs=2, progress=False).fit(trace)
    assert len(p.weights_[0]) == 2 and p.weights_[0][0][0].shape == (64, trace.meta["model"]["hidden_size"])
    p = LearnedPredictor(depth=1, loss="ce", max_epochs=2, progress=False).fit(trace)
    assert len(p.weights_[0]) == 1


def test_predictor_drives_cache_prefetch_through_the_adapter(trace):
    from moelab.caches import PrefetchConfig, simulate
    from moelab.caches.prefetch import Prefetcher
    from moelab.predictors import as_prefetcher

    oracle = as_prefetcher(make("oracle", distance=1).fit(trace), trace)
    assert isinstance(oracle, Prefetcher)
    ours = simulate(trace.path, "lru", 0.25, prefetch=PrefetchConfig(predictor=oracle, distance=1))
    theirs = simulate(trace.path, "lru", 0.25, prefetch=PrefetchConfig(predictor="oracle", distance=1))
    assert ours.hit_rate == pytest.approx(theirs.hit_rate)
    with pytest.raises(MoelabError, match="distance 1"):
        simulate(trace.path, "lru", 0.25, prefetch=PrefetchConfig(predictor=oracle, distance=2))
