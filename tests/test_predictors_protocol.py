"""The one predictor protocol: union order, padding, inputs on any device, the cache's prefetch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.predictors import make_predictor
from moelab.predictors.protocol import to_cpu_tensor, to_numpy, union_predictions, valid_mask

torch.set_num_threads(1)


def record_trace(path, n_seq=6, new_tokens=4):
    model, _ = moelab.load("tiny-random-mixtral")
    with moelab.record(model, path, hidden_states=True, model_name="tiny-random-mixtral") as rec:
        for i in range(n_seq):
            g = torch.Generator().manual_seed(i)
            ids = torch.randint(3, 250, (1, 6 + i % 4), generator=g)
            model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return rec.trace


def make(kind, **kw):
    fast = {"learned": {"progress": False, "max_epochs": 4, "width": 32}}
    return make_predictor(kind, **{**fast.get(kind, {}), **kw})


# ---------------------------------------------------------------------- union order
def test_union_orders_by_tokens_then_best_rank_then_id():
    pred = np.array([[3, 1], [1, 2], [5, 3], [2, 6]])
    # votes: 1:2 (best rank 0), 3:2 (best 0), 2:2 (best 0 via row 3), 5:1 (best 0), 6:1 (best 1)
    assert union_predictions(pred).tolist() == [1, 2, 3, 5, 6]
    # one token: the predictor's own ranking, not sorted by id
    assert union_predictions([[7, 2, 5]]).tolist() == [7, 2, 5]
    assert union_predictions(np.array([7, 2, 5])).tolist() == [7, 2, 5]
    # best rank breaks a tie in votes before the id does
    assert union_predictions([[4, 0], [4, 9], [9, 0]]).tolist() == [4, 9, 0]
    # (votes 4:2 best0; 0:2 best1; 9:2 best0 -> 4 (id) then 9, then 0)


def test_union_skips_padding_rows_and_minus_one_and_repeats():
    pred = torch.tensor([[3, 1], [1, 2], [5, 3]])
    assert union_predictions(pred, valid=torch.tensor([True, False, True])).tolist() == [3, 5, 1]
    assert union_predictions(pred, valid=[False, False, False]).tolist() == []
    assert union_predictions([[2, -1], [-1, -1]]).tolist() == [2]
    # an id repeated within one row is one vote, at its best rank
    assert union_predictions([[4, 4, 1], [1, 0, 0]]).tolist() == [1, 4, 0]
    assert union_predictions(np.zeros((0, 2), dtype=np.int64)).tolist() == []


def test_one_tokens_union_takes_the_short_path_to_the_same_answer():
    """A decode step's single row skips the vectorised rule (a live run asks once per MoE layer);
    with a ``valid`` mask the same row goes the long way: both agree on random rows with repeats
    and ``-1`` entries, and with a limit."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        row = rng.integers(-1, 6, size=int(rng.integers(0, 7)))
        limit = None if rng.random() < 0.5 else int(rng.integers(0, 4))
        short = union_predictions(row[None, :], limit=limit)
        long = union_predictions(row[None, :], valid=np.ones(1, dtype=bool), limit=limit)
        assert short.dtype == np.int64 and short.tolist() == long.tolist(), (row, limit)
    with pytest.raises(MoelabError, match="limit must be an integer"):
        union_predictions([[1, 2]], limit=-1)


def test_union_with_scores_weights_votes_and_limit():
    pred = [[0, 1], [2, 1]]
    # counts would put 1 first (2 votes); weights: 0 -> 0.9, 1 -> 0.05 + 0.05, 2 -> 0.5
    assert union_predictions(pred, scores=[[0.9, 0.05], [0.5, 0.05]]).tolist() == [0, 2, 1]
    assert union_predictions(pred, limit=2).tolist() == [1, 0]
    with pytest.raises(MoelabError, match="scores must have the shape"):
        union_predictions(pred, scores=[1.0, 2.0, 3.0])
    with pytest.raises(MoelabError, match="finite and ≥ 0"):
        union_predictions(pred, scores=[[1, -1], [0, 0]])


def test_union_bad_input_is_one_line():
    with pytest.raises(MoelabError, match="valid has 2 entries but there are 3 tokens"):
        union_predictions([[1], [2], [3]], valid=[True, False])
    with pytest.raises(MoelabError, match="bool mask"):
        valid_mask(np.array([0.5, 1.0]), 2)
    with pytest.raises(MoelabError, match="integer expert ids"):
        union_predictions([[0.5, 1.0]])
    with pytest.raises(MoelabError, match=r"\(tokens, m\)"):
        union_predictions(np.zeros((1, 2, 3), dtype=np.int64))


def test_to_numpy_detaches_moves_and_widens():
    t = torch.randn(3, 4, requires_grad=True)
    assert np.array_equal(to_numpy(t), t.detach().numpy())  # .numpy() on a grad tensor would raise
    b = torch.ones(2, 2, dtype=torch.bfloat16)
    assert to_numpy(b).dtype == np.float32 and to_numpy(b, np.float32).sum() == 4
    assert to_numpy(torch.tensor([1, 2]), np.int64).dtype == np.int64
    assert to_numpy([1, 2]).tolist() == [1, 2]
    assert valid_mask(torch.tensor([1, 0]), 2).tolist() == [True, False]


# ---------------------------------------------------------------------- predictors
@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return record_trace(tmp_path_factory.mktemp("proto") / "trace", n_seq=6, new_tokens=4)


@pytest.fixture(scope="module")
def fitted(trace):
    return {k: make(k, distance=1).fit(trace) for k in ("token", "skip", "learned", "frequency")}


def _inputs(trace, n=5):
    from moelab.predictors.base import as_trace_data

    data = as_trace_data(trace)
    tok = data.index.pairs(0, 1)[:n]
    hidden = data.hidden[data.index.rows[tok, 0]]
    return to_cpu_tensor(hidden), torch.as_tensor(data.index.token_id[tok])  # hidden as recorded (bf16)


@pytest.mark.parametrize("kind", ["token", "skip", "learned", "frequency"])
def test_padding_rows_are_minus_one_and_the_rest_unchanged(kind, fitted, trace):
    p = fitted[kind]
    hidden, ids = _inputs(trace)
    valid = torch.tensor([True, False, True, True, False])
    full = p.predict(0, hidden=hidden, token_ids=ids)
    masked = p.predict(0, hidden=hidden, token_ids=ids, valid=valid)
    assert masked.shape == full.shape
    assert (masked[~valid.numpy()] == -1).all()
    assert np.array_equal(masked[valid.numpy()], full[valid.numpy()])
    sub = p.predict(0, hidden=hidden[valid], token_ids=ids[valid])
    assert np.array_equal(masked[valid.numpy()], sub)
    scores = p.predict_scores(0, hidden=hidden, token_ids=ids, valid=valid)
    assert np.isneginf(scores[~valid.numpy()]).all()
    assert p.predict_union(0, hidden=hidden, token_ids=ids, valid=valid).tolist() == \
        union_predictions(full, valid=valid).tolist()
    none = p.predict(0, hidden=hidden, token_ids=ids, valid=torch.zeros(5, dtype=torch.bool))
    assert (none == -1).all()


@pytest.mark.parametrize("kind", ["token", "skip", "learned"])
def test_torch_and_numpy_inputs_agree(kind, fitted, trace):
    p = fitted[kind]
    hidden, ids = _inputs(trace)
    a = p.predict(0, hidden=hidden, token_ids=ids)
    b = p.predict(0, hidden=to_numpy(hidden, np.float32), token_ids=ids.numpy())
    c = p.predict(0, hidden=hidden.float().requires_grad_(True), token_ids=ids.tolist())
    assert np.array_equal(a, b) and np.array_equal(a, c)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (inputs on the GPU)")
@pytest.mark.parametrize("kind", ["token", "skip", "learned"])
def test_cuda_inputs_give_the_cpu_answer(kind, fitted, trace):
    p = fitted[kind]
    hidden, ids = _inputs(trace)
    valid = torch.tensor([True, False, True, True, True])
    cpu = p.predict(0, hidden=hidden, token_ids=ids, valid=valid)
    gpu = p.predict(0, hidden=hidden.cuda(), token_ids=ids.cuda(), valid=valid.cuda())
    assert np.array_equal(cpu, gpu)
    assert p.predict_union(0, hidden=hidden.cuda(), token_ids=ids.cuda(), valid=valid.cuda()).tolist() == \
        union_predictions(cpu).tolist()


# ---------------------------------------------------------------------- the cache's prefetch path
def test_as_prefetcher_unions_each_step_with_the_one_union(fitted, trace):
    from moelab.predictors import as_prefetcher
    from moelab.predictors.base import as_trace_data

    p = fitted["token"]
    pf = as_prefetcher(p, trace)
    data = as_trace_data(trace)
    tok, pred = p.predict_trace(data, 0)
    seq, step = data.index.seq[tok], data.index.step[tok]
    checked = 0
    for s, st in {(int(a), int(b)) for a, b in zip(seq, step)}:
        rows = (seq == s) & (step == st)
        assert pf.lookup(s, st, 0) == union_predictions(pred[rows]).tolist()
        checked += int(rows.sum() > 1)
    assert checked > 0  # prompts (several tokens) were unioned


def test_cache_prefetch_takes_propose_per_token_rows_and_refuses_a_bare_predictor(fitted):
    from moelab.caches import PrefetchConfig, simulate, stream_from_groups
    from moelab.caches.prefetch import proposals
    from moelab.predictors import OraclePredictor, RepeatPredictor

    stream = stream_from_groups([(0, [0]), (1, [2]), (0, [1]), (1, [3])], [4, 4])

    class PerToken:
        def propose(self, context):  # two tokens, one a padding row of -1
            return np.array([[3, 1], [-1, -1]])

    ptr, keys = proposals(PerToken(), stream, 1)
    assert ptr.tolist() == [0, 2, 2, 4, 4] and (keys - 4).tolist()[:2] == [3, 1]

    class Old:  # the removed protocol, predict(context): refused, not silently adapted
        def predict(self, context):
            return [1]

    with pytest.raises(MoelabError, match="propose"):
        simulate(stream, "lru", 1, prefetch=PrefetchConfig(Old(), 1))
    with pytest.raises(MoelabError, match="as_prefetcher"):
        simulate(stream, "lru", 1, prefetch=PrefetchConfig(fitted["token"], 1))
    # the routing-reading kinds are predictor kinds: by name or as unfitted instances, the same proposals
    for name, kind in (("oracle", OraclePredictor), ("repeat", RepeatPredictor)):
        by_name, by_obj = proposals(name, stream, 1), proposals(kind(), stream, 1)
        assert [a.tolist() for a in by_name] == [a.tolist() for a in by_obj]
    with pytest.raises(MoelabError, match="Did you mean 'repeat'"):
        simulate(stream, "lru", 1, prefetch=PrefetchConfig("repaet", 1))
    with pytest.raises(MoelabError, match="as_prefetcher"):  # a kind that must be fitted is not a source by name
        simulate(stream, "lru", 1, prefetch=PrefetchConfig("learned", 1))
