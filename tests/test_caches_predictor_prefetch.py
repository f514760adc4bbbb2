"""`moelab cache simulate --prefetch <saved predictor>` drives prefetch with a shipped learned predictor."""

import json

import pytest

from moelab._resources import resource_dir
from moelab.cli import main
from moelab.models.bundled import bundled_path

MODEL = "moelab-tiny-mixtral"
PREDICTOR = resource_dir("predictors") / MODEL / "learned-d1"


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory):
    assert bundled_path(MODEL) is not None and PREDICTOR.is_dir(), "bundled model and predictor ship with moelab"
    out = tmp_path_factory.mktemp("pf") / "trace"
    assert main(["trace", "--model", MODEL, "--task", "arith", "--limit", "3", "--max-new-tokens", "12",
                 "--hidden-states", "--out", str(out)]) == 0
    return out


def test_saved_predictor_prefetches_and_hits(trace_dir, capsys):
    capsys.readouterr()
    assert main(["cache", "simulate", "--trace", str(trace_dir), "--policy", "lru", "--capacity", "0.5",
                 "--prefetch", str(PREDICTOR), "--budget", "4", "--json"]) == 0
    (res,) = json.loads(capsys.readouterr().out)["results"]
    assert res["prefetched"] > 0 and res["prefetch_hits"] > 0
    assert res["prefetch_hits"] + res["wasted_prefetches"] <= res["prefetched"]
    assert res["expert_bytes"] > 1  # the trace records real expert sizes


def test_distance_must_match_the_saved_predictor(trace_dir, capsys):
    assert main(["cache", "simulate", "--trace", str(trace_dir), "--prefetch", str(PREDICTOR),
                 "--distance", "2"]) == 2
    assert "predicts at distance 1" in capsys.readouterr().err
