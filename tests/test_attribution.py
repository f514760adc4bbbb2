"""Attribution: teacher-forced KL is exactly zero where outputs cannot change, equals an independent
incremental-decoding computation for deferral and skipping on every family, capture/patch leave
the model exactly as it was, and the results save and load."""

from __future__ import annotations

import pytest
import torch

from moelab.attribution import Attribution, capture, compare, compare_many, patch
from moelab.compat import cache_kwargs, output_cache
from moelab.errors import MoelabError
from moelab.models.tiny import FAMILIES, build_tiny

PROMPTS = [[5, 9, 14, 3], [7, 7, 2], [11, 4, 20, 8, 6]]
CONT = 5


def _seq_inputs(model):
    """Prompts with greedy continuations of the unmodified model (token ids)."""
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CONT, min_new_tokens=CONT,
                               do_sample=False, pad_token_id=0)
        out.append((p, g[0, len(p):].tolist()))
    return out


class _IdTok:
    """A tokenizer stand-in whose 'text' is already token ids."""

    pad_token_id = 0
    eos_token_id = None

    def __call__(self, text, **kw):
        return type("E", (), {"input_ids": list(text)})()


@torch.no_grad()
def _incremental_logits(model, prompt, cont):
    """Logits predicting each continuation token, decoded one token at a time with a KV cache —
    the way generation computes them (independent of compare's single teacher-forced forward)."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    out = model(input_ids=ids, **cache_kwargs(DynamicCache(config=model.config), model), use_cache=True)
    logits = [out.logits[0, -1]]
    for t in cont[:-1]:
        out = model(input_ids=torch.tensor([[t]]), **cache_kwargs(output_cache(out), model), use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits).double()


def _kl(p_logits, q_logits):
    lp, lq = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    torch.manual_seed(0)
    model = build_tiny(request.param).eval()
    return request.param, model, _seq_inputs(model)


def test_identity_gives_exactly_zero_kl(family):
    name, model, seqs = family
    att = compare(model, None, [p for p, _ in seqs], tokenizer=_IdTok(), continuations=[c for _, c in seqs],
                  free_running=False)
    assert (att.tokens["kl"] == 0.0).all() and att.tokens["top1_agree"].all() and (att.tokens["rank"] == 0).all()
    assert (att.layers[["changed_weight", "moved_norm", "moe_delta", "resid_delta"]] == 0).all().all()


@pytest.mark.parametrize("policy", ["deferral:deferred=1,min_immediate=0", "skipping:skipped=1,min_kept=0",
                                    "skipping:skipped=1,min_kept=0,renormalize=true"])
def test_kl_equals_an_independent_incremental_decode(family, policy):
    from moelab.attribution.compare import as_policy

    name, model, seqs = family
    att = compare(model, policy, [p for p, _ in seqs], tokenizer=_IdTok(), continuations=[c for _, c in seqs],
                  free_running=False)
    spec = as_policy(policy)
    for s, (prompt, cont) in enumerate(seqs):
        base = _incremental_logits(model, prompt, cont)
        with spec.make(model, None):  # the policy as generation applies it: decode steps only
            pol = _incremental_logits(model, prompt, cont)
        want = _kl(base, pol)
        got = att.tokens[att.tokens.seq == s].sort_values("index")
        assert got["index"].tolist() == list(range(len(cont)))
        torch.testing.assert_close(torch.tensor(got["kl"].to_numpy()), want.clamp(min=0), atol=2e-5, rtol=2e-3,
                                   msg=f"{name} {policy} seq {s}")
        assert got["kl"].iloc[0] < 1e-10  # predicted by the prompt's forward: a decode policy does not act there
        assert (got["top1_agree"].to_numpy() == (base.argmax(-1) == pol.argmax(-1)).numpy()).all()
    assert att.tokens["kl"].max() > 0, f"{name}: {policy} changed nothing"


def test_caching_and_prefetch_leave_kl_exactly_zero():
    """The hybrid model's caches, placements and a learned predictor's prefetch decide where
    experts run, never what they compute: teacher-forced KL is exactly zero (reference backend)."""
    import moelab
    from moelab.loading import load

    model, tok = load("moelab-tiny-qwen2moe")
    predictor = moelab.resource_dir("predictors") / "moelab-tiny-qwen2moe" / "learned-d1"
    prompts = ["12+7=", "3*4+5=", "25-9="]
    for cfg in ({"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses"},
                {"cache": {"capacity": 0.5, "policy": "mrs"}, "placement": "greedy-hss", "hardware": "pcie4-x16",
                 "prefetch": {"predictor": str(predictor), "distance": 1}}):
        att = compare(model, cfg, prompts, tokenizer=tok, max_new_tokens=6, free_running=False)
        assert len(att.tokens) >= 6 and (att.tokens["kl"] == 0.0).all(), cfg
        assert (att.layers["moved_norm"] == 0).all()


def _state(model):
    """Everything a hook or patch could leave behind: parameters, buffers, hooks, instance attributes."""
    out = {}
    for name, mod in model.named_modules():
        out[name] = (
            sorted(mod.__dict__.keys()), len(mod._forward_hooks), len(mod._forward_pre_hooks),
            len(getattr(mod, "_forward_hooks_with_kwargs", {})),
        )
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    return out, sd


def _same(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_capture_and_patch_restore_the_model_exactly_even_after_an_exception():
    torch.manual_seed(0)
    model = build_tiny("mixtral").eval()
    ids = torch.tensor([[3, 9, 4, 7]])
    before = _state(model)
    ref = model(ids).logits
    with capture(model, ("resid_pre", "moe_in", "router_logits", "experts_out", "moe_out", "resid_post")) as cap:
        got = model(ids).logits
    torch.testing.assert_close(got, ref, atol=0, rtol=0)  # observing changes nothing
    _same(before, _state(model))
    assert cap.get("moe_out", 0).shape == (1, 4, model.config.hidden_size)
    assert cap.get("router_logits", 1).shape == (1, 4, model.config.num_local_experts)
    # the residual stream after the block = before it + the block's output (no other sublayer after the MoE)
    torch.testing.assert_close(cap.get("resid_post", 0), cap.get("resid_pre", 0) + cap.get("moe_out", 0))
    with pytest.raises(RuntimeError, match="boom"), patch(model, "moe_out", lambda t, c, layer: t * 0):
        model(ids)
        raise RuntimeError("boom")
    _same(before, _state(model))
    torch.testing.assert_close(model(ids).logits, ref, atol=0, rtol=0)


def test_patching_a_layer_back_to_the_baseline_recovers_its_effect():
    """The notebook's question in miniature: a policy's MoE output at one layer replaced by the
    baseline's makes that layer's direct change vanish."""
    torch.manual_seed(0)
    model = build_tiny("qwen2_moe").eval()
    ids = torch.tensor([[3, 9, 4, 7, 11, 2]])
    with capture(model, ("moe_out",)) as base:
        model(ids)
    from moelab.policies import ExpertSkipping

    with ExpertSkipping(model, 2, min_kept=0, phase="all"), capture(model, ("moe_out",)) as pol:
        skipped = model(ids).logits
        with patch(model, "moe_out", lambda t, c, layer: base.get("moe_out", layer.index).to(t.dtype)):
            restored = model(ids).logits
    assert not torch.allclose(skipped, model(ids).logits)
    torch.testing.assert_close(restored, model(ids).logits, atol=1e-5, rtol=1e-4)
    assert pol.forwards == 2


def test_bad_input_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    model = build_tiny("mixtral").eval()
    with pytest.raises(MoelabError, match="exactly one of prompts=, trace= or task="):
        compare(model, None)
    with pytest.raises(MoelabError, match="unknown capture point 'resid'.*resid_post"), capture(model, ("resid",)):
        pass
    with (pytest.raises(MoelabError, match="can be captured but not patched"),
          patch(model, "router_logits", lambda t, c, layer: t)):
        pass
    with pytest.raises(MoelabError, match="expected key=value"):
        compare(model, "deferral:2", [[1, 2]], tokenizer=_IdTok())
    with pytest.raises(MoelabError, match="unknown routing policy 'defferal'.*deferral"):
        compare(model, "defferal", [[1, 2]], tokenizer=_IdTok())


def test_save_load_and_compare_many_share_the_sequences(tmp_path):
    torch.manual_seed(0)
    model = build_tiny("mixtral").eval()
    out = compare_many(model, [None, "deferral:deferred=1,min_immediate=0"], [[3, 9, 4], [5, 6]],
                       tokenizer=_IdTok(), max_new_tokens=6)
    (none, dfr) = out.values()
    assert none.tokens[["seq", "index", "token_id"]].equals(dfr.tokens[["seq", "index", "token_id"]])
    assert (dfr.layers.changed_slots > 0).any()
    path = dfr.save(tmp_path / "att")
    back = Attribution.load(path)
    assert back.tokens.equals(dfr.tokens) and back.meta["policy"] == dfr.meta["policy"]
    with pytest.raises(MoelabError, match="exists; pass overwrite=True"):
        dfr.save(tmp_path / "att")
    assert not list(tmp_path.glob(".att.partial-*"))


SWEEP = """\
name: att
models: [tiny-random-mixtral]
policies:
  - none
  - {policy: deferral, min_immediate: 0, grid: {deferred: [1]}}
tasks:
  - {task: arith, limit: 1}
eval: {max_gen_toks: 4}
attribution: {limit: 3, max_new_tokens: 6}
"""


def test_an_attribution_block_enters_the_hash_and_is_checked(tmp_path):
    from moelab.sweeps.spec import expand, load_spec

    fp = {"tiny-random-mixtral": "f" * 16}
    (tmp_path / "a.yaml").write_text(SWEEP)
    (tmp_path / "b.yaml").write_text(SWEEP.replace("attribution: {limit: 3, max_new_tokens: 6}\n", ""))
    with_att = expand(load_spec(tmp_path / "a.yaml"), fp)
    without = expand(load_spec(tmp_path / "b.yaml"), fp)
    assert not {c.hash for c in with_att} & {c.hash for c in without}
    assert with_att[0].attribution == {"limit": 3, "max_new_tokens": 6, "batch_size": 8}
    (tmp_path / "c.yaml").write_text(SWEEP.replace("max_new_tokens: 6", "max_new_token: 6"))
    with pytest.raises(MoelabError, match=r":9: unknown key 'max_new_token' in attribution.*'max_new_tokens'"):
        load_spec(tmp_path / "c.yaml")


@pytest.mark.slow
def test_a_sweep_records_mean_kl_beside_accuracy(tmp_path):
    from moelab.sweeps.driver import run_sweep
    from moelab.sweeps.report import collect
    from moelab.sweeps.spec import load_spec

    (tmp_path / "spec.yaml").write_text(SWEEP)
    spec = load_spec(tmp_path / "spec.yaml")
    summary = run_sweep(spec, store=tmp_path / "store", threads=1, progress=False)
    assert (summary.done, summary.failed) == (2, {})
    att = {x.cell.policy: x.record["attribution"] for x in collect(spec, tmp_path / "store")}
    assert att["none"]["mean_kl"] == 0.0 and att["none"]["top1_agreement"] == 1.0
    assert att["deferral"]["mean_kl"] > 0 and att["deferral"]["tokens"] == 18


@pytest.mark.parametrize("backend", ["batched_mm", "moelab"])
def test_caching_with_another_experts_backend_stays_within_1e_5(backend):
    """The host side computing with another experts implementation (transformers' batched_mm,
    moelab's native kernel) changes logits only by rounding: KL ≤ 1e-5 per token."""
    if backend == "moelab":
        pytest.importorskip("moelab.kernels.op")
    torch.manual_seed(0)
    model = build_tiny("mixtral").eval()
    seqs = _seq_inputs(model)
    cfg = {"cache": {"capacity": 0.25, "policy": "lru"}, "placement": "host-misses", "host_backend": backend}
    att = compare(model, cfg, [p for p, _ in seqs], tokenizer=_IdTok(), continuations=[c for _, c in seqs],
                  free_running=False)
    assert att.tokens["kl"].max() <= 1e-5 and att.tokens["top1_agree"].all()
