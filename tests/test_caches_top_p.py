"""MRS's compiled top-p selection against a plain sort, over shapes, tie-heavy scores and NaN."""

import dataclasses

import numpy as np
import pytest

from moelab.caches import simulate, stream_from_groups
from moelab.caches._fast import HAVE_NUMBA, top_p_rows
from moelab.caches.stream import build_stream
from moelab.errors import MoelabError

pytestmark = pytest.mark.skipif(not HAVE_NUMBA, reason="numba not installed: no compiled top-p to compare")


def _plain_top_p(s: np.ndarray, p: int) -> dict[int, float]:
    """The definition: the p largest scores, ties to the lower expert id."""
    order = sorted(range(len(s)), key=lambda e: (-float(s[e]), e))[:p]
    return {e: float(s[e]) for e in order}


def _run(num_experts, p_layer, scores, rows_per_group, group_layer, score_rows):
    key_offset = np.concatenate([[0], np.cumsum(num_experts)]).astype(np.int64)
    row_ptr = np.concatenate([[0], np.cumsum(rows_per_group)]).astype(np.int64)
    P = max(p_layer)
    top_v = np.full((len(score_rows), P), -7.0, dtype=np.float32)
    top_e = np.full((len(score_rows), P), -1, dtype=np.int32)
    bad = top_p_rows(
        np.asarray(group_layer, dtype=np.int32), row_ptr, np.asarray(score_rows, dtype=np.int64),
        scores, np.asarray(p_layer, dtype=np.int64), key_offset, top_v, top_e,
    )
    return bad, top_v, top_e


@pytest.mark.parametrize("kind", ["uniform", "ties", "softmax", "extremes"])
@pytest.mark.parametrize("E", [1, 2, 3, 5, 8, 16, 33, 64, 160])
def test_top_p_matches_the_definition(E, kind):
    rng = np.random.default_rng(E)
    n = 40
    if kind == "uniform":
        scores = rng.random((n, E + 3))
    elif kind == "ties":  # few distinct values: ties at the p-th place are the rule
        scores = rng.integers(0, 3, size=(n, E + 3)).astype(np.float64) / 2
    elif kind == "softmax":
        z = np.exp(rng.normal(size=(n, E + 3)) * 3)
        scores = z / z.sum(1, keepdims=True)
    else:  # signed, zeros of both signs, subnormals and the largest float32s
        pool = np.array([-3.4e38, -1.0, -1e-42, -0.0, 0.0, 1e-42, 1e-30, 0.5, 1.0, 3.4e38])
        scores = rng.choice(pool, size=(n, E + 3))
    scores = scores.astype(np.float32)
    if E % 2:
        scores[:, E:] = 99.0  # padding beyond the layer's experts is never read
    else:
        scores = np.ascontiguousarray(scores[:, :E])  # rows exactly E wide
    for p in sorted({min(q, E) for q in (1, 2, 3, E // 2 or 1, E - 1 or 1, E)}):  # p <= E (mrs_p caps it)
        # groups of 1 to 3 rows, rows visited out of memory order, two rows left out
        sizes = [1, 3, 2] * 6
        perm = rng.permutation(n)[: sum(sizes)]
        bad, top_v, top_e = _run([E], [p], scores, sizes, [0] * len(sizes), perm)
        assert bad == -1
        for r, row in enumerate(perm):
            got = {int(e): float(v) for e, v in zip(top_e[r, :p], top_v[r, :p])}
            assert got == _plain_top_p(scores[row, :E], p), (E, p, kind, row)


def test_top_p_uses_each_layers_width_and_p():
    rng = np.random.default_rng(0)
    num_experts, p_layer = [8, 5, 12], [4, 5, 3]
    scores = rng.integers(0, 4, size=(30, 12)).astype(np.float32)
    group_layer = [0, 1, 2] * 10
    bad, top_v, top_e = _run(num_experts, p_layer, scores, [1] * 30, group_layer, np.arange(30))
    assert bad == -1
    for r in range(30):
        layer = group_layer[r]
        E, p = num_experts[layer], p_layer[layer]
        got = {int(e): float(v) for e, v in zip(top_e[r, :p], top_v[r, :p])}
        assert got == _plain_top_p(scores[r, :E], p)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_top_p_reports_the_first_row_that_is_not_finite(value):
    scores = np.random.default_rng(1).random((6, 8)).astype(np.float32)
    scores[4, 3] = value
    scores[2, 7] = value
    bad, _, _ = _run([8], [4], scores, [1] * 6, [0] * 6, np.arange(6))
    assert bad == 2


def test_a_scores_row_may_serve_several_token_rows():
    scores = np.random.default_rng(2).random((4, 6)).astype(np.float32)
    rows = np.array([3, 1, 3, 0, 1, 3])
    bad, top_v, top_e = _run([6], [3], scores, [1] * 6, [0] * 6, rows)
    assert bad == -1
    for r, row in enumerate(rows):
        assert {int(e): float(v) for e, v in zip(top_e[r], top_v[r])} == _plain_top_p(scores[row], 3)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_mrs_on_non_finite_scores_is_a_clear_error_on_both_backends(value):
    scores = [np.array([0.5, value, 0.2, 0.3], dtype=np.float32), np.array([0.1, 0.2, 0.3, 0.4], dtype=np.float32)]
    s = stream_from_groups([(0, [0, 2]), (0, [3, 2])], num_experts=[4], top_k=[2], scores=scores)
    for backend in ["fast", "reference"]:
        with pytest.raises(MoelabError, match="NaN or an infinity"):
            simulate(s, "mrs", 2, backend=backend)


def test_mrs_fast_matches_reference_on_hand_built_streams():
    """Shared score rows and float64 scores: what a hand-built AccessStream may hold."""
    rng = np.random.default_rng(1)
    base = rng.random((4, 6))
    rows = rng.integers(0, 4, size=60)
    groups = [(0, [int(e) for e in np.argsort(-base[r])[:2]]) for r in rows]
    s = stream_from_groups(groups, num_experts=[6], top_k=[2])
    s = dataclasses.replace(s, score_rows=rows.astype(np.int64), row_ptr=np.arange(61, dtype=np.int64), scores=base)
    for cap, kw in [(3, {"p": 3}), (2, {"p": 2, "alpha": 0.3})]:
        a = simulate(s, "mrs", cap, backend="fast", keep_hits=True, **kw)
        b = simulate(s, "mrs", cap, backend="reference", keep_hits=True, **kw)
        assert np.array_equal(a.hit, b.hit) and a.evictions == b.evictions, (cap, kw)


def test_mrs_fast_matches_reference_on_tie_heavy_scores():
    """Quantised scores (ties everywhere), a 3-token prefill and 2 sequences: multi-row groups."""
    rng = np.random.default_rng(3)
    cols = {k: [] for k in ("seq", "step", "moe_layer", "scores")}
    for seq in range(2):
        for step in range(40):
            for layer in range(2):
                for _ in range(3 if step == 0 else 1):
                    cols["seq"].append(seq)
                    cols["step"].append(step)
                    cols["moe_layer"].append(layer)
                    cols["scores"].append(rng.integers(0, 3, size=16) / 4)
    sc = np.asarray(cols["scores"], dtype=np.float32)
    experts = np.argsort(-sc, axis=1, kind="stable")[:, :2].astype(np.int32)
    weights = np.take_along_axis(sc, experts, axis=1)
    s = build_stream(np.asarray(cols["seq"]), np.asarray(cols["step"]), np.asarray(cols["moe_layer"]), experts,
                     weights, [16, 16], [2, 2], scores=sc, include_prefill=True)
    for scope, cap, kw in [("layer", 0.25, {}), ("global", 0.3, {"p": 5}), ("global", 0.5, {"alpha": 0.7, "p": 16})]:
        a = simulate(s, "mrs", cap, scope, backend="fast", keep_hits=True, **kw)
        b = simulate(s, "mrs", cap, scope, backend="reference", keep_hits=True, **kw)
        assert np.array_equal(a.hit, b.hit), (scope, cap, kw)
        assert (a.evictions, a.transfers) == (b.evictions, b.transfers)
