"""Bad input gets a clear MoelabError and writes nothing; shipped bundled predictors load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import moelab
from moelab.cli import main
from moelab.errors import MoelabError
from moelab.predictors import evaluate, load_predictor, make_predictor

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    from tests.test_predictors_conformance import record_trace

    root = tmp_path_factory.mktemp("errs")
    return {
        "hidden": record_trace(root / "hidden", n_seq=4, new_tokens=3),
        "plain": record_trace(root / "plain", n_seq=4, new_tokens=3, hidden=False),
        "single": record_trace(root / "single", n_seq=1, new_tokens=3),
        "qwen": record_trace(root / "qwen", family="qwen2_moe", n_seq=3, new_tokens=2),
    }


@pytest.mark.parametrize("kind", ["skip", "learned"])
def test_trace_without_hidden_states_says_how_to_record_them(kind, traces):
    with pytest.raises(MoelabError, match="hidden_states=True"):
        make_predictor(kind).fit(traces["plain"])


def test_cli_fit_failure_writes_nothing(traces, tmp_path, capsys):
    out = tmp_path / "p"
    code = main(["predict", "fit", "--trace", str(traces["plain"].path), "--kind", "learned", "--out", str(out)])
    assert code == 2 and "--hidden-states" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_predictor_of_another_model_is_refused_with_both_identities(traces):
    p = make_predictor("token").fit(traces["hidden"])
    q = traces["qwen"]
    with pytest.raises(MoelabError) as err:
        evaluate(p, q)
    msg = str(err.value)
    assert p.model_fingerprint_ in msg and q.model_fingerprint in msg and "tiny-random-qwen2_moe" in msg


def test_skip_refuses_a_model_other_than_the_traces(traces):
    other, _ = moelab.load("tiny-random-mixtral", seed=1)
    with pytest.raises(MoelabError, match="model mismatch"):
        make_predictor("skip").fit(traces["hidden"], model=other)


def test_distance_beyond_the_last_layer_is_refused(traces):
    L = traces["hidden"].num_moe_layers
    with pytest.raises(MoelabError, match=f"d must be ≤ {L - 1}"):
        make_predictor("learned", distance=L).fit(traces["hidden"])
    p = make_predictor("frequency", distance=2).fit(traces["hidden"])
    with pytest.raises(MoelabError, match="beyond the last MoE layer"):
        p.predict(L - 2, token_ids=[3])


def test_bad_hyperparameters_name_the_value(traces):
    with pytest.raises(MoelabError, match="distance must be an integer ≥ 1, got 0"):
        make_predictor("token", distance=0).fit(traces["hidden"])
    with pytest.raises(MoelabError, match="Did you mean 'bce'"):
        make_predictor("learned", loss="bc").fit(traces["hidden"])
    with pytest.raises(MoelabError, match="width must be an integer"):
        make_predictor("learned", width=0).fit(traces["hidden"])


def test_single_sequence_and_empty_traces_cannot_be_fitted(traces, tmp_path):
    with pytest.raises(MoelabError, match="at least 2 sequences|≥ 2"):
        make_predictor("token").fit(traces["single"])
    model, _ = moelab.load("tiny-random-mixtral")
    with moelab.record(model, tmp_path / "empty") as rec:
        pass
    with pytest.raises(MoelabError, match="empty trace"):
        make_predictor("frequency").fit(rec.trace)


def test_unfitted_predictor_and_wrong_input_sizes(traces):
    with pytest.raises(MoelabError, match="not fitted"):
        make_predictor("learned").predict(0, hidden=np.zeros(32))
    p = make_predictor("learned", max_epochs=1, progress=False).fit(traces["hidden"])
    with pytest.raises(MoelabError, match="hidden size is 32"):
        p.predict(0, hidden=np.zeros(7))
    with pytest.raises(MoelabError, match="needs hidden="):
        p.predict(0, token_ids=[4])
    with pytest.raises(MoelabError, match="m must be an integer in 1..8"):
        p.predict(0, hidden=np.zeros(32), m=9)


def test_loading_something_that_is_not_a_predictor(tmp_path):
    with pytest.raises(MoelabError, match="not a saved predictor"):
        load_predictor(tmp_path)
    (tmp_path / "predictor.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(MoelabError, match="not a moelab predictor"):
        load_predictor(tmp_path)


def test_cli_unknown_kind_suggests_and_exits_2(traces, capsys):
    assert main(["predict", "fit", "--trace", str(traces["hidden"].path), "--kind", "tokn"]) == 2
    assert "Did you mean 'token'" in capsys.readouterr().err


def _shipped():
    from moelab._resources import resource_dir

    root = resource_dir("predictors")
    return sorted(p.parent for p in root.glob("*/*/predictor.json"))


def test_learned_predictors_ship_for_both_bundled_models():
    shipped = {(p.parent.name, p.name) for p in _shipped()}
    for model in ("moelab-tiny-mixtral", "moelab-tiny-qwen2moe"):
        assert {(model, f"learned-d{d}") for d in (1, 2, 3)} <= shipped


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_predictors_load_and_match_their_bundled_model(path):
    from moelab.adapters import model_fingerprint
    from moelab.models.bundled import TINY_RANDOM_PREFIX, bundled_models

    p = load_predictor(path)
    name = p.model_name_
    assert name in bundled_models() or name.startswith(TINY_RANDOM_PREFIX), f"{name!r} is not a shipped model"
    model, _ = moelab.load(name)
    assert model_fingerprint(model) == p.model_fingerprint_
    assert p.metrics_["test"]["overall"]["decode"]["accuracy"] > 0, "shipped predictors carry their test metrics"
    assert p.metrics_["recipe"].startswith("python predictors/recipe.py")
    hidden = torch.zeros(1, p.hidden_size_)
    assert p.predict(0, hidden=hidden).shape == (1, p.top_k_[p.distance])
