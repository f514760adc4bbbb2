"""MoE-Gen's module-batched decode on live models (moelab.hybrid.throughput) and its bench.

Parity: the module-batched greedy decode must produce the plain model's batched greedy decode
(same tokens, logits allclose; fp32 tiny models). Events: counts and sizes derived from the
schedule's definition (⌈B/b_a⌉ attention micro-batches, b_e-row chunks, B·k routed rows per MoE
layer, experts one after the other in ascending id). The simulation of the same run: with ω = 0,
everything resident and no copies, every job is on the device engine, so a step's longest path is
the sum of its jobs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import moelab
from moelab.errors import MoelabError
from moelab.hybrid.throughput import (
    EXPERTS_IMPLEMENTATION,
    ModuleBatchedDecoder,
    check_structure,
    plain_generate,
)
from moelab.models.tiny import build_tiny
from moelab.simulate.moegen.real import InPlaceCosts, real_config, simulated_step


@pytest.fixture(scope="module")
def models():
    out = {name: moelab.load(name)[0] for name in ("moelab-tiny-mixtral", "moelab-tiny-qwen2moe")}
    out["tiny-deepseek_v2"] = build_tiny("deepseek_v2", seed=0)
    return out


def _ids(model, B: int, P: int = 5) -> torch.Tensor:
    return torch.randint(3, int(model.config.vocab_size), (B, P), generator=torch.Generator().manual_seed(B))


@pytest.mark.parametrize("name", ["moelab-tiny-mixtral", "moelab-tiny-qwen2moe", "tiny-deepseek_v2"])
@pytest.mark.parametrize("B,ba,be", [(4, 2, 3), (5, 5, 1), (6, 4, 64)])
def test_module_batched_greedy_equals_plain_batched_greedy(models, name, B, ba, be):
    m = models[name]
    before = m.config._experts_implementation
    ids = _ids(m, B)
    ref = plain_generate(m, ids, 4)
    out = ModuleBatchedDecoder(m, ba, be).generate(ids, 4)
    assert out.tokens.shape == (B, 5)
    assert torch.equal(out.tokens, ref.tokens)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the schedule's pieces are removed after each step
    assert m.config._experts_implementation == before
    assert all(type(getattr(layer.mlp, n, torch.nn.Identity())).__name__ != "_ChunkedRows"
               for layer in m.model.layers for n in ("shared_experts", "shared_expert"))


def test_events_follow_the_schedule(models):
    m = models["tiny-deepseek_v2"]  # layer 0 dense, layers 1-3 MoE (8 experts, top-4, shared experts)
    B, ba, be, steps = 5, 2, 3, 2
    k = int(m.config.num_experts_per_tok)
    dec = ModuleBatchedDecoder(m, ba, be)
    dec.generate(_ids(m, B), steps)
    ev = dec.log.events
    assert {e.lane for e in ev} == {"device"}
    for s in range(steps):
        for layer in range(m.config.num_hidden_layers):
            mine = [e for e in ev if e.step == s and e.layer == layer]
            attn = [e.tokens for e in mine if e.cause.startswith("Attention[")]
            assert attn == [2, 2, 1]  # ⌈5/2⌉ micro-batches in order
            experts = [e for e in mine if e.kind == "expert-device"]
            if layer == 0:
                assert not experts
                assert [e.tokens for e in mine if e.cause.startswith("DenseMLP")] == [3, 2]
                continue
            assert sum(e.tokens for e in experts) == B * k  # every routed (token, slot) once
            ids_in_order = [e.expert for e in sorted(experts, key=lambda e: e.t_start_us)]
            assert ids_in_order == sorted(ids_in_order)  # one expert after the other
            for x in set(ids_in_order):
                sizes = [e.tokens for e in experts if e.expert == x]
                n = sum(sizes)
                assert sizes == [be] * (n // be) + ([n % be] if n % be else [])
                assert len(sizes) == math.ceil(n / be)
            assert [e.tokens for e in mine if e.kind == "shared-experts"] == [3, 2]
            assert [e.cause for e in mine if e.cause == "Router"] == ["Router"]
        assert [e.tokens for e in ev if e.step == s and e.cause.startswith("LMHead")] == [3, 2]
    t = moelab.Timeline(dec.log.table())
    assert len(t.events) == len(ev)


def test_bad_input_is_refused(models):
    m = models["moelab-tiny-mixtral"]
    with pytest.raises(MoelabError, match="micro_batch"):
        ModuleBatchedDecoder(m, 0, 4)
    with pytest.raises(MoelabError, match="expert_batch"):
        ModuleBatchedDecoder(m, 2, True)
    with pytest.raises(MoelabError, match="input_ids"):
        ModuleBatchedDecoder(m, 2, 2).generate(torch.tensor([1, 2, 3]), 2)
    odd = build_tiny("deepseek_v2", seed=0)
    del odd.model.layers[2].post_attention_layernorm
    with pytest.raises(MoelabError, match="post_attention_layernorm"):
        check_structure(odd)
    with pytest.raises(MoelabError, match="causal LM"):
        check_structure(torch.nn.Linear(2, 2))


def test_the_experts_implementation_is_registered_with_transformers(models):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ModuleBatchedDecoder(models["moelab-tiny-mixtral"], 1, 1)
    assert EXPERTS_IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS


def test_the_simulated_run_has_no_copies_and_is_the_sum_of_its_jobs(models):
    from moelab.simulate.moegen import LayerCosts, step_jobs
    from moelab.timing.costs import CostModel
    from moelab.timing.shapes import ModelShape

    shape = ModelShape.from_model(models["tiny-deepseek_v2"], name="tiny-dsv2")
    cfg = real_config(shape, 8, 4, 2, 16, 8)
    assert cfg.cpu_attention == 0 and cfg.pin_dense and cfg.pinned_experts == shape.num_moe_layers * shape.num_experts
    st, mem = simulated_step(shape, "pcie4-x16", 8, 4, 2, 16, 8)
    lc = InPlaceCosts(LayerCosts(CostModel.of(shape, "pcie4-x16")))
    jobs = step_jobs(lc, cfg)
    assert all(j.cost_us == 0 for j in jobs if j.engine != "gpu")
    assert not any(j.name.startswith(("Wcopy", "Dense prefetch", "CPUAttn")) for j in jobs)
    assert st.step_us == pytest.approx(sum(j.cost_us for j in jobs), rel=1e-9)
    assert st.tokens_per_s == pytest.approx(8 / st.step_us * 1e6)


def test_bench_function_runs_on_a_tiny_model():
    from moelab.simulate.moegen.bench import MODULES, format_result, run_bench, to_json

    r = run_bench(["moelab-tiny-mixtral"], batches=[4], micro_batches=[2, 8], expert_batches=[3], repeats=1,
                  steps=2, profile="pcie4-x16", allow_busy=True)
    assert [(x["batch"], x["micro_batch"], x["expert_batch"]) for x in r["rows"]] == [(4, 2, 3), (4, 4, 3)]
    for x in r["rows"]:
        assert x["ratio"] == pytest.approx(x["tokens_per_s"] / x["sim_tokens_per_s"])
        assert x["tokens_per_s"] == pytest.approx(4 * 2 / x["measurement"].median)
        assert x["real_ms"]["experts"] > 0 and x["real_ms"]["shared-experts"] == 0  # mixtral: no shared experts
        assert set(x["sim_ms"]) == set(MODULES) | {"expert_chunks"}
        assert x["real_ms"]["expert_chunks"] > 0
    assert "moelab-tiny-mixtral" in format_result(r)
    json.dumps(to_json(r))
    with pytest.raises(MoelabError, match="v2-lite:N"):
        run_bench(["v2-lite:0"], repeats=1, profile="pcie4-x16")
