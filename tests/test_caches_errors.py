"""Bad input gets a MoelabError that names the value, the expectation and the fix; and the CLI."""

import json

import numpy as np
import pytest

from moelab.caches import PrefetchConfig, make_cache, simulate, stream_from_groups
from moelab.caches.synthetic import synthetic_stream
from moelab.errors import MoelabError

STREAM = stream_from_groups([(0, [0, 1]), (1, [2]), (0, [3])], num_experts=[4, 4], top_k=[2, 2])


@pytest.mark.parametrize("capacity, match", [(0, "≥ 1"), (-2, "≥ 1"), (0.0, r"\(0, 1\]"), (1.5, "fraction"),
                                             (5, "above the number of experts")])
def test_bad_capacity_is_refused(capacity, match):
    with pytest.raises(MoelabError, match=match):
        simulate(STREAM, "lru", capacity)


def test_unknown_policy_suggests_close_names():
    with pytest.raises(MoelabError, match="Did you mean 'lru'"):
        simulate(STREAM, "lruu", 0.5)


def test_mrs_without_scores_says_how_to_record_them():
    with pytest.raises(MoelabError, match="scores=True"):
        simulate(STREAM, "mrs", 0.5)
    with pytest.raises(MoelabError, match="router scores"):
        make_cache("mrs", [4], 2, top_k=[1]).access(0, [1])


def test_prefetch_with_a_predictor_for_another_model_is_refused():
    s = synthetic_stream(num_layers=2, num_experts=4, top_k=1, num_seqs=1, steps=4)

    class Other:
        model_name = "some-other-model"

        def propose(self, context):
            return [0]

    with pytest.raises(MoelabError, match="built for model 'some-other-model'"):
        simulate(s, "lru", 0.5, prefetch=PrefetchConfig(Other(), 1))

    class WrongShape:
        num_experts = [8, 8]

        def propose(self, context):
            return [0]

    with pytest.raises(MoelabError, match="different model"):
        simulate(s, "lru", 0.5, prefetch=PrefetchConfig(WrongShape(), 1))
    with pytest.raises(MoelabError, match="unknown prefetch predictor 'orcale'. Did you mean 'oracle'"):
        simulate(s, "lru", 0.5, prefetch=PrefetchConfig("orcale", 1))


def test_unknown_policy_parameter_is_refused():
    with pytest.raises(MoelabError, match="takes: alpha, p"):
        simulate(synthetic_stream(num_layers=1, steps=3), "mrs", 0.5, alhpa=0.3)


def test_belady_must_replay_its_own_stream():
    cache = make_cache("belady", [4, 4], 2, stream=STREAM)
    with pytest.raises(MoelabError, match="replay its own stream"):
        cache.access(0, [3])


def test_cli_simulate_prints_hit_rates_and_json(tmp_path, capsys):
    from moelab.cli import main
    from moelab.cli.cache import parse_capacity

    assert parse_capacity("25%") == 0.25 and parse_capacity("2") == 2 and parse_capacity("0.5") == 0.5
    trace = _tiny_trace(tmp_path)
    assert main(["cache", "simulate", "--trace", str(trace), "--policy", "lru,belady", "--capacity", "0.25,4",
                 "--scope", "layer,global", "--prefetch", "oracle", "--budget", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["results"]) == 8
    bel = {(r["scope"], r["capacity"]): r["hit_rate"] for r in out["results"] if r["policy"] == "belady"}
    assert all(r["prefetch"] is None for r in out["results"] if r["policy"] == "belady") and len(bel) == 4
    eb = max(json.loads((trace / "meta.json").read_text())["model"]["expert_bytes"])
    budgets = {}
    for flags in (["--budget", "2"], ["--budget-bytes", str(2.5 * eb)], ["--link-gbps", str(2.5 * eb / 1e6), "--step-ms", "1"]):
        assert main(["cache", "simulate", "--trace", str(trace), "--policy", "lru", "--capacity", "0.25",
                     "--prefetch", "oracle", *flags, "--json"]) == 0
        budgets[flags[0]] = json.loads(capsys.readouterr().out)["results"][0]["prefetch"]
    # the same 2 experts; a count or bytes per MoE layer (the default), a link's window per step
    assert budgets == {"--budget": "oracle d=1 budget=2/layer", "--budget-bytes": "oracle d=1 budget=2/layer",
                       "--link-gbps": "oracle d=1 budget=2/forward"}, budgets
    assert main(["cache", "simulate", "--trace", str(trace), "--policy", "mrs", "--capacity", "2"]) == 0
    assert "per-layer hit rate" in capsys.readouterr().out
    assert main(["cache", "simulate", "--trace", str(trace), "--policy", "lruu"]) == 2
    assert "Did you mean 'lru'" in capsys.readouterr().err


def _tiny_trace(tmp_path):
    """A trace directory written through the trace recorder's public schema (no model needed)."""
    import torch

    import moelab
    from moelab.models.tiny import build_tiny
    from moelab.models.tokenizer import byte_tokenizer

    model, tok = build_tiny("mixtral"), byte_tokenizer()
    enc = tok(["cache", "me"], return_tensors="pt", padding=True)
    with torch.no_grad(), moelab.record(model, tmp_path / "t"):
        model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    return tmp_path / "t"


def test_capacity_as_count_and_fraction_resolve_per_partition():
    from moelab.caches import resolve_capacity

    assert resolve_capacity(0.25, [8, 8], "layer").tolist() == [2, 2]
    assert resolve_capacity(0.125, [8, 8], "global").tolist() == [2]
    assert resolve_capacity(3, [8, 8], "global").tolist() == [3]
    assert np.all(resolve_capacity(0.01, [8], "layer") == 1)  # at least one slot


def test_prefetch_budget_in_bytes_and_from_a_link():
    s = synthetic_stream(num_layers=3, num_experts=8, top_k=2, num_seqs=2, steps=30, seed=1)
    eb = 1000
    # a link's window is per step (forward): compare with count and byte budgets per forward too
    fwd = {"budget_scope": "forward"}
    by_count = simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1, budget=2, **fwd), expert_bytes=eb)
    by_bytes = simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1, budget_bytes=2.9 * eb, **fwd),
                        expert_bytes=eb)
    link = PrefetchConfig.from_link("oracle", 1, gb_per_s=2.5e-3, step_ms=1.0)  # 2.5 MB/s × 1 ms = 2500 bytes
    by_link = simulate(s, "lru", 0.25, prefetch=link, expert_bytes=eb)
    unlimited = simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1), expert_bytes=eb)
    per_layer = simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1, budget=2), expert_bytes=eb)
    assert by_count.prefetched == by_bytes.prefetched == by_link.prefetched < per_layer.prefetched
    assert per_layer.prefetched <= unlimited.prefetched
    assert by_count.hits == by_bytes.hits == by_link.hits
    with pytest.raises(MoelabError, match="size of an expert"):  # a synthetic stream has no expert size
        simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1, budget_bytes=4096))
    with pytest.raises(MoelabError, match="budget_bytes must be ≥ 0"):
        simulate(s, "lru", 0.25, prefetch=PrefetchConfig("oracle", 1, budget_bytes=-1), expert_bytes=eb)
    with pytest.raises(MoelabError, match="step_ms must be > 0"):
        PrefetchConfig.from_link(gb_per_s=10, step_ms=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prefetch", "oracle", "--link-gbps", "10"], "go together"),
        (["--prefetch", "oracle", "--budget", "2", "--budget-bytes", "1e6"], "give one prefetch budget"),
        (["--budget", "2"], "add --prefetch"),
    ],
)
def test_cli_prefetch_budget_errors(tmp_path, capsys, extra, message):
    from moelab.cli import main

    assert main(["cache", "simulate", "--trace", str(tmp_path), "--policy", "lru", *extra]) == 2
    assert message in capsys.readouterr().err
