"""What the installed transformers passes: the KV cache under any name or position, a refusal
where a continuation's cache cannot be read, and the installed release as its matrix row says.

Run under each release of the README's supported-versions matrix (``scripts/version_matrix.sh``),
``test_the_installed_release_is_the_row_the_matrix_says`` is the test of that version.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from moelab.compat import (
    CACHE_NAMES,
    TESTED,
    UnreadableForwardError,
    cache_kwarg,
    cache_kwargs,
    conventions,
    find_cache,
    output_cache,
    router_outputs,
    transformers_version,
)
from moelab.forward import hooks
from moelab.models.tiny import FAMILIES, build_tiny


def _filled_cache(n: int) -> DynamicCache:
    """A one-layer DynamicCache holding ``n`` tokens (built without any model)."""
    c = DynamicCache()
    c.update(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4), 0)
    return c


class _OldStyle(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kw):
        return input_ids


class _NewStyle(nn.Module):
    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, **kw):
        return input_ids


# --------------------------------------------------------------------------- every convention
@pytest.mark.parametrize("name", CACHE_NAMES)
def test_a_cache_is_read_under_every_name_transformers_has_used(name):
    got = find_cache(None, (), {name: _filled_cache(5)}, seq_len=1)
    assert (got.name, got.past_len) == (name, 5)


@pytest.mark.parametrize("module", [_OldStyle, _NewStyle])
def test_a_cache_passed_by_position_is_bound_by_the_forward_signature(module):
    ids = torch.zeros(1, 1, dtype=torch.long)
    got = find_cache(module, (ids, None, None, _filled_cache(7)), {}, seq_len=1)
    assert got.past_len == 7 and got.name in ("past_key_values", "cache")


def test_a_legacy_tuple_cache_is_read():
    k = torch.zeros(1, 2, 3, 4)
    assert find_cache(None, (), {"past_key_values": ((k, k),)}, seq_len=1).past_len == 3


def test_an_ordinary_first_forward_is_a_prompt():
    ids = torch.ones(2, 6, dtype=torch.long)
    assert find_cache(None, (), {"input_ids": ids}, seq_len=6).past_len == 0
    assert find_cache(None, (), {"cache": DynamicCache(), "attention_mask": torch.ones(2, 6)}, seq_len=6).past_len == 0
    pos = torch.tensor([[0, 0, 0, 1, 2, 3]])  # left padding: pads at 0, real tokens from 0
    assert find_cache(None, (), {"position_ids": pos}, seq_len=6).past_len == 0


@pytest.mark.parametrize("kwargs, why", [
    ({"kv_state": _filled_cache(4)}, "under kv_state="),
    ({"attention_mask": torch.ones(1, 5)}, "attention mask covers 5 tokens for 1"),
    ({"position_ids": torch.tensor([[4]])}, "position ids reach 4 for 1"),
    ({"cache_position": torch.tensor([4])}, "cache_position starts at 4"),
    ({"cache": torch.ones(3)}, "its cache= argument is a Tensor"),
])
def test_a_continuation_without_a_readable_cache_is_refused(kwargs, why):
    with pytest.raises(UnreadableForwardError, match=why) as e:
        find_cache(None, (), {"input_ids": torch.ones(1, 1, dtype=torch.long), **kwargs}, seq_len=1)
    msg = str(e.value)
    assert transformers_version() in msg and "make install" in msg and "silently" in msg


def test_router_outputs_in_either_order():
    logits, w, ids = torch.randn(3, 4), torch.rand(3, 2), torch.randint(0, 4, (3, 2))
    assert router_outputs((logits, w, ids))[2] is ids
    assert router_outputs((ids, w, logits))[0] is logits


# --------------------------------------------------------------------------- the installed release
def test_the_installed_release_is_the_row_the_matrix_says():
    version = transformers_version()
    if version not in TESTED:
        pytest.skip(f"transformers {version} is not a row of the supported-versions matrix "
                    f"(rows: {', '.join(TESTED)}); conventions read from it: {conventions()}")
    assert conventions() == TESTED[version]
    from transformers import MixtralForCausalLM, MixtralModel

    assert cache_kwarg(MixtralModel) == cache_kwarg(MixtralForCausalLM) == TESTED[version].cache_kwarg


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request):
    torch.manual_seed(0)
    return build_tiny(request.param).eval()


def test_every_family_generates_one_prompt_then_decode_steps(family_model):
    """The phase and step of every forward of a ``generate``, on every family, on this release."""
    seen = []
    ids = torch.tensor([[3, 9, 4, 7]])
    with torch.no_grad(), hooks(family_model, forward=lambda ctx: seen.append((ctx.phase, ctx.step, ctx.inputs.past_len))):
        family_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                              min_new_tokens=3, pad_token_id=0)
    assert seen == [("prefill", 0, 0), ("decode", 1, 4), ("decode", 2, 5)]


def test_moelab_calls_use_the_installed_keyword_without_deprecation(family_model, caplog):
    """A decode loop written with cache_kwargs/output_cache: same logits as generate's loop, no
    deprecation message from transformers, and the forward context sees decode steps."""
    import transformers.utils.logging as tlog

    tlog.warning_once.cache_clear() if hasattr(tlog.warning_once, "cache_clear") else None
    tlog.enable_propagation()
    ids = torch.tensor([[3, 9, 4, 7]])
    phases = []
    with (warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING), torch.no_grad(),
          hooks(family_model, forward=lambda c: phases.append(c.phase))):
        warnings.simplefilter("always")
        out = family_model(input_ids=ids, **cache_kwargs(DynamicCache(config=family_model.config), family_model),
                           use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        out2 = family_model(input_ids=nxt, **cache_kwargs(output_cache(out), family_model), use_cache=True)
        ref = family_model(input_ids=torch.cat([ids, nxt], 1)).logits[:, -1]
    assert phases == ["prefill", "decode", "prefill"]
    torch.testing.assert_close(out2.logits[:, -1], ref, atol=1e-4, rtol=1e-4)
    assert not [r for r in caplog.records if "deprecated" in r.getMessage().lower()]
    assert not [str(w.message) for w in caught if "deprecated" in str(w.message).lower()]


def test_an_unreadable_continuation_is_refused_inside_the_model_and_the_model_recovers():
    torch.manual_seed(0)
    model = build_tiny("mixtral").eval()
    ids = torch.tensor([[3, 9, 4]])
    with torch.no_grad(), hooks(model, forward=lambda ctx: None):
        with pytest.raises(UnreadableForwardError, match="attention mask covers 4 tokens for 3"):
            model(input_ids=ids, attention_mask=torch.ones(1, 4, dtype=torch.long))
        seen = []
        with hooks(model, forward=lambda ctx: seen.append(ctx.phase)):
            model(input_ids=ids)
        assert seen == ["prefill"]


def test_a_router_output_moelab_cannot_read_is_refused():
    with pytest.raises(UnreadableForwardError, match=r"a router returned a 2-tuple.*transformers 5"):
        router_outputs((torch.randn(3, 4), torch.rand(3, 2)))


def test_an_experts_call_is_read_by_position_or_keyword_and_refused_otherwise():
    from moelab.compat import experts_call_arguments, with_routing

    h, i, w = torch.randn(3, 8), torch.randint(0, 4, (3, 2)), torch.rand(3, 2)
    for args, kwargs in [((h, i, w), {}), ((h,), {"top_k_index": i, "top_k_weights": w}),
                         ((), {"hidden_states": h, "router_indices": i, "routing_weights": w})]:
        got = experts_call_arguments(args, kwargs)
        assert got[0] is h and got[1] is i and got[2] is w
        i2, w2 = i.flip(1), w.flip(1)
        a2, k2 = with_routing(args, kwargs, i2, w2)
        assert experts_call_arguments(a2, k2)[1] is i2 and experts_call_arguments(a2, k2)[2] is w2
    with pytest.raises(UnreadableForwardError, match=r"unexpected experts call: 1 positional.*\['indices'\]"):
        experts_call_arguments((h,), {"indices": i})
