"""Tiny, randomly initialised MoE models built offline from transformers config classes.

They route (every expert gets traffic) but know nothing; use them for tests and for
structure, and the bundled trained models (``moelab.load("<bundled name>")``) for accuracy.

Shape legend: H hidden, I expert intermediate, E routed experts, K top-k, L layers.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from moelab.errors import unknown_name

#: The families moelab supports, in the order we list them.
FAMILIES: tuple[str, ...] = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "granitemoe",
    "phimoe",
    "qwen3_next",
)

_COMMON: dict[str, Any] = dict(
    vocab_size=259,  # = len(byte_tokenizer()), so every generated id decodes
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Per family: the config keyword arguments on top of _COMMON. Layer 0 is dense where
# the family supports dense layers, so adapters are exercised on mixed stacks.
_FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        mlp_only_layers=[0],
        norm_topk_prob=True,
        head_dim=8,
    ),
    "olmoe": dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=False),
    "deepseek_v2": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.0,
    ),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=4,
        n_shared_experts=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_group=2,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    "gpt_oss": dict(
        num_local_experts=8,
        num_experts_per_tok=4,
        head_dim=8,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    "granitemoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2),
    "qwen3_next": dict(
        num_experts=8,
        num_experts_per_tok=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        head_dim=8,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"] * 2,
        mlp_only_layers=[0],
        norm_topk_prob=True,
    ),
}


def tiny_config(family: str, **overrides: Any):
    """The transformers config of a tiny ``family`` model (offline, milliseconds).

    ``overrides`` replace any config field, e.g. ``num_hidden_layers=6``.
    """
    from transformers import AutoConfig

    if family not in _FAMILY_KWARGS:
        raise unknown_name("model family", family, FAMILIES)
    # Deep copy: config classes may edit nested values in place (qwen3_next adds
    # partial_rotary_factor to rope_parameters), which must not leak into later models.
    kwargs = copy.deepcopy({**_COMMON, **_FAMILY_KWARGS[family], **overrides})
    return AutoConfig.for_model(family, **kwargs)


def build_tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any):
    """A randomly initialised tiny ``family`` causal LM, deterministic for a seed, in eval mode.

    Router weights are re-drawn (std 2/sqrt(H)) so that routing depends on the input: the
    default init of some families is all zeros, which routes every token alike.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        gen = torch.Generator().manual_seed(seed + 1)
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
            if leaf in ("gate", "router") and param.dim() == 2:
                with torch.no_grad():
                    std = 2.0 / param.shape[1] ** 0.5
                    param.copy_((std * torch.randn(param.shape, generator=gen)).to(param.dtype))
    return model.eval()
