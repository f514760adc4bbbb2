"""Adapters: every family's MoE view matches what its blocks actually compute."""

import pytest
import torch

import moelab
from moelab.adapters import model_fingerprint, moe_layers
from moelab.models.tiny import FAMILIES, build_tiny

EXPECTED = {
    # family: (MoE decoder layers, top-k, shared experts, gated shared)
    "mixtral": ([0, 1, 2, 3], 2, False, False),
    "qwen2_moe": ([1, 2, 3], 4, True, True),
    "qwen3_moe": ([1, 2, 3], 4, False, False),
    "olmoe": ([0, 1, 2, 3], 4, False, False),
    "deepseek_v2": ([1, 2, 3], 4, True, False),
    "deepseek_v3": ([1, 2, 3], 4, True, False),
    "gpt_oss": ([0, 1, 2, 3], 4, False, False),
    "granitemoe": ([0, 1, 2, 3], 2, False, False),
    "phimoe": ([0, 1, 2, 3], 2, False, False),
    "qwen3_next": ([1, 2, 3], 4, True, True),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_layers_found_by_structure_and_dense_layers_skipped(family):
    layers = moe_layers(build_tiny(family))
    idx, k, shared, gated = EXPECTED[family]
    assert [layer.layer_idx for layer in layers] == idx
    assert [layer.index for layer in layers] == list(range(len(idx)))
    assert all(layer.top_k == k and layer.num_experts == 8 for layer in layers)
    assert all((layer.shared_experts is not None) == shared for layer in layers)
    assert all((layer.shared_gate is not None) == gated for layer in layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_view_reconstructs_block_output(family):
    """experts(x, route(x)) + shared part == block(x): the view holds everything the block uses."""
    model = build_tiny(family)
    torch.manual_seed(0)
    for layer in moe_layers(model):
        x = torch.randn(2, 5, model.config.hidden_size)
        out = layer.block(x)
        out = out[0] if isinstance(out, tuple) else out
        h = x.reshape(-1, x.shape[-1])
        r = layer.route(h)
        assert r.experts.shape == (10, layer.top_k) and r.scores.shape == (10, layer.num_experts)
        assert torch.all(r.weights[:, :-1] >= r.weights[:, 1:]), "sorted by descending weight"
        expected = layer.experts(h, r.experts, r.weights)
        if layer.shared_experts is not None:
            s = layer.shared_experts(h)
            if layer.shared_gate is not None:
                s = torch.sigmoid(layer.shared_gate(h)) * s
            expected = expected + s
        torch.testing.assert_close(out.reshape(-1, out.shape[-1]), expected, rtol=1e-5, atol=1e-5)


def test_phimoe_is_top2_whatever_the_config_says():
    model = build_tiny("phimoe", num_experts_per_tok=4)
    assert {layer.top_k for layer in moe_layers(model)} == {2}


def test_router_specs_follow_family_semantics():
    spec = {f: moe_layers(build_tiny(f))[0].spec for f in ("mixtral", "deepseek_v3", "gpt_oss", "qwen2_moe")}
    assert spec["mixtral"].renormalize and spec["mixtral"].scoring == "softmax"
    assert spec["deepseek_v3"].scoring == "sigmoid" and spec["deepseek_v3"].selection == "noaux_tc"
    assert spec["deepseek_v3"].scaling == 2.5
    assert spec["gpt_oss"].weights == "softmax_topk"
    assert not spec["qwen2_moe"].renormalize  # norm_topk_prob=False in the tiny config


def test_dense_model_is_refused_with_model_type_and_families():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(moelab.MoelabError, match=r"'llama'.*Supported: mixtral"):
        moe_layers(LlamaForCausalLM(cfg))


def test_load_refuses_non_moe_directory(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    with pytest.raises(moelab.MoelabError, match="'llama'.*not a supported Mixture-of-Experts"):
        moelab.load(tmp_path / "llama")


def test_load_unknown_name_suggests_close_names():
    with pytest.raises(moelab.MoelabError, match="Did you mean 'tiny-random-mixtral'"):
        moelab.load("tiny-random-mixtrl")
    with pytest.raises(moelab.MoelabError, match="neither a bundled model nor an existing directory"):
        moelab.load("./no/such/model")


def test_load_passes_dtype_device_map_and_keeps_remote_code_off(tiny_model_dir, monkeypatch):
    import transformers

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(source, **kwargs):
        seen.update(kwargs)
        kwargs.pop("device_map", None)
        return real(source, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, tok = moelab.load(tiny_model_dir("olmoe"), dtype="bf16", device_map="cpu")
    assert seen["trust_remote_code"] is False
    assert seen["dtype"] is torch.bfloat16 and seen["device_map"] == "cpu"
    assert next(model.parameters()).dtype is torch.bfloat16 and tok is not None


def test_model_instance_is_accepted_as_is():
    model = build_tiny("mixtral")
    assert moelab.load(model)[0] is model


def test_fingerprint_identifies_weights_not_object():
    a, b, c = build_tiny("mixtral", seed=0), build_tiny("mixtral", seed=0), build_tiny("mixtral", seed=1)
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(c)


def test_tiny_models_do_not_depend_on_what_was_built_before():
    """A config class that edits nested values in place must not change later tiny models."""
    before = model_fingerprint(build_tiny("mixtral"))
    for family in FAMILIES:
        build_tiny(family)
    assert model_fingerprint(build_tiny("mixtral")) == before


def test_loaded_models_can_select_the_moelab_experts_implementation():
    import subprocess
    import sys

    code = (
        "import moelab\n"
        "m, _ = moelab.load('tiny-random-mixtral')\n"
        "m.set_experts_implementation('moelab_int8')\n"
        "print(m.config._experts_implementation)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("moelab_int8")
