"""Routing policies: exact restoration, guards and error messages, phases, state isolation, generate."""

from __future__ import annotations

import pytest
import torch

import moelab
from moelab.adapters import moe_layers
from moelab.compat import cache_kwargs, output_cache
from moelab.errors import MoelabError
from moelab.models.tiny import build_tiny
from moelab.policies import ExpertDeferral, ExpertSkipping, active_policies

_HOOK_DICTS = (
    "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def snapshot(model) -> dict:
    """Everything a policy could leave behind: weights (values and storage), buffers, hooks,
    instance attributes (e.g. a patched ``forward``), modes and the config."""
    state = {"config": model.config.to_dict(), "modules": {}}
    for name, m in model.named_modules():
        state["modules"][name] = {
            "type": type(m),
            "dict_keys": sorted(m.__dict__),
            "forward_in_dict": "forward" in m.__dict__,
            "training": m.training,
            "hooks": {h: dict(getattr(m, h, {})) for h in _HOOK_DICTS},
        }
    state["params"] = {n: (p.data_ptr(), p.dtype, p.shape, p.detach().clone()) for n, p in model.named_parameters()}
    state["buffers"] = {n: (b.data_ptr(), b.detach().clone()) for n, b in model.named_buffers()}
    return state


def assert_same_state(a: dict, b: dict) -> None:
    assert a["config"] == b["config"]
    assert a["modules"].keys() == b["modules"].keys()
    for name in a["modules"]:
        assert a["modules"][name] == b["modules"][name], f"module {name!r} changed"
    assert a["params"].keys() == b["params"].keys()
    for n, (ptr, dtype, shape, value) in a["params"].items():
        ptr2, dtype2, shape2, value2 = b["params"][n]
        assert (ptr, dtype, shape) == (ptr2, dtype2, shape2), f"parameter {n} was replaced"
        assert torch.equal(value, value2), f"parameter {n} changed"
    for n, (ptr, value) in a["buffers"].items():
        assert ptr == b["buffers"][n][0] and torch.equal(value, b["buffers"][n][1]), f"buffer {n} changed"


@pytest.fixture(scope="module")
def qwen():
    return build_tiny("qwen2_moe", seed=0)


def ids(B=2, S=6, seed=0):
    return torch.randint(3, 250, (B, S), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def decode_logits(model, x):
    out = model(x, use_cache=True)
    return model(x[:, -1:], **cache_kwargs(output_cache(out))).logits


def test_exit_restores_full_model_state_after_use_nesting_and_exception(qwen):
    before = snapshot(qwen)
    with ExpertSkipping(qwen, 1, renormalize=True, phase="all"), ExpertDeferral(qwen, 2, phase="all"):
        assert len(active_policies(qwen)) == 2
        during = {n: p.data_ptr() for n, p in qwen.named_parameters()}
        decode_logits(qwen, ids())
        qwen.generate(ids(), max_new_tokens=3, do_sample=False)
    assert_same_state(before, snapshot(qwen))
    with pytest.raises(RuntimeError, match="boom"), ExpertDeferral(qwen, 2):
        decode_logits(qwen, ids())
        raise RuntimeError("boom")
    assert_same_state(before, snapshot(qwen))
    assert active_policies(qwen) == []
    # no weight was copied or replaced while the policies were active
    assert during == {n: p.data_ptr() for n, p in qwen.named_parameters()}


def test_switching_settings_hundreds_of_times_leaves_model_exact(qwen):
    x = ids()
    base = decode_logits(qwen, x)
    before = snapshot(qwen)
    for i in range(200):
        policy = ExpertDeferral(qwen, i % 3) if i % 2 else ExpertSkipping(qwen, i % 3)
        with policy:
            pass
    with ExpertDeferral(qwen, 2):
        d2 = decode_logits(qwen, x)
    with ExpertDeferral(qwen, 2):
        assert torch.equal(decode_logits(qwen, x), d2)
    assert torch.equal(decode_logits(qwen, x), base)
    assert_same_state(before, snapshot(qwen))


def test_exception_inside_forward_leaves_no_deferred_state(qwen):
    x = ids()
    with ExpertDeferral(qwen, 2, phase="all"):
        good = qwen(x).logits
        layer = moe_layers(qwen)[-1]
        handle = layer.block.register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("mid-forward")))
        try:
            with pytest.raises(RuntimeError, match="mid-forward"):
                qwen(x)
        finally:
            handle.remove()
        assert torch.equal(qwen(x).logits, good)


def test_deferred_state_is_per_forward_and_per_row(qwen):
    x = ids(B=3)
    with ExpertDeferral(qwen, 2):
        first = decode_logits(qwen, x)
        again = decode_logits(qwen, x)
        rows = [decode_logits(qwen, x[i : i + 1]) for i in range(3)]
    assert torch.equal(first, again)
    for i in range(3):
        torch.testing.assert_close(first[i : i + 1], rows[i], atol=1e-5, rtol=1e-5)


def test_decode_only_default_leaves_prefill_bit_exact(qwen):
    x = ids()
    with torch.no_grad():
        base = qwen(x).logits
        with ExpertDeferral(qwen, 2), ExpertSkipping(qwen, 2):
            assert torch.equal(qwen(x).logits, base)
        with ExpertDeferral(qwen, 2, phase="all"):
            assert not torch.equal(qwen(x).logits, base)


def test_batched_generate_with_padding(qwen):
    x = ids(B=3, S=7)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    x[0, :3] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    base = qwen.generate(x, **kw)
    with ExpertDeferral(qwen, 0):
        assert torch.equal(qwen.generate(x, **kw), base)
    with ExpertDeferral(qwen, 2):
        deferred = qwen.generate(x, **kw)
        alone = qwen.generate(x[1:2], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert deferred.shape == base.shape
    assert torch.equal(deferred[1:2], alone)  # rows do not see each other's deferred experts


def test_guard_below_min_immediate_is_an_error_naming_layer_and_limits(qwen):
    with pytest.raises(MoelabError, match=r"deferred=3 for MoE layer 0 \(decoder layer 1, top-k 4\).*min_immediate=2"):
        ExpertDeferral(qwen, 3).apply()
    assert active_policies(qwen) == []
    with ExpertDeferral(qwen, 3, min_immediate=1):
        pass


def test_phimoe_top2_setting_that_does_not_fit_names_layer():
    phimoe = build_tiny("phimoe")
    assert {layer.top_k for layer in moe_layers(phimoe)} == {2}
    with pytest.raises(MoelabError, match=r"MoE layer 0 \(decoder layer 0, top-k 2\)"):
        ExpertDeferral(phimoe, 1).apply()
    with pytest.raises(MoelabError, match="only 2 routed experts"):
        ExpertDeferral(phimoe, 3, min_immediate=0).apply()
    with ExpertDeferral(phimoe, immediate=2):  # I ≥ top-k: nothing deferred
        pass


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(deferred=[1, 1]), "got 2 per-layer values, but the model has 3 MoE layers"),
        (dict(deferred={0: 1, 2: 1}), "last MoE layer never defers"),
        (dict(deferred={7: 1}), "do not exist"),
        (dict(immediate=[2, 2, 2]), "last MoE layer never defers"),
        (dict(deferred=1, immediate=3), "exactly one of deferred= or immediate="),
        (dict(deferred=1, phase="prefill"), "phase='prefill'"),
        (dict(deferred=1, batch_rule="batch"), "batch_rule='batch'"),
    ],
)
def test_bad_settings_are_refused_with_a_message(qwen, kwargs, message):
    with pytest.raises(MoelabError, match=message):
        ExpertDeferral(qwen, **kwargs).apply()
    assert active_policies(qwen) == []


def test_per_layer_settings_apply_to_named_layers_only(qwen):
    x = ids()
    with ExpertDeferral(qwen, {1: 2}) as p:
        assert p.deferred_ == [0, 2, 0]
        only_second = decode_logits(qwen, x)
    with ExpertDeferral(qwen, [0, 2, 0]):
        assert torch.equal(decode_logits(qwen, x), only_second)
    with ExpertSkipping(qwen, 1, last_layer=False) as s:
        assert s.skipped_ == [1, 1, 0]


def test_skipping_all_routed_experts_needs_min_kept_zero(qwen):
    with pytest.raises(MoelabError, match="min_kept=1"):
        ExpertSkipping(qwen, 4).apply()
    with ExpertSkipping(qwen, 4, min_kept=0, phase="all"):
        out = qwen(ids()).logits
    assert torch.isfinite(out).all()


def test_same_policy_object_cannot_be_applied_twice_but_can_be_reentered(qwen):
    policy = ExpertDeferral(qwen, 1)
    with policy, pytest.raises(MoelabError, match="already applied"):
        policy.apply()
    with policy:
        assert active_policies(qwen) == [policy]
    assert active_policies(qwen) == []


def test_exported_lazily_from_moelab():
    assert moelab.ExpertDeferral is ExpertDeferral
    assert moelab.ExpertSkipping is ExpertSkipping
    assert issubclass(ExpertDeferral, moelab.RoutingPolicy)
