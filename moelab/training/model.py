"""Build a tiny MoE model (transformers config class) from a :class:`ModelShape`."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, PretrainedConfig

from moelab.training.config import ModelShape


def build_config(
    shape: ModelShape, vocab_size: int, bos: int, eos: int, pad: int
) -> PretrainedConfig:
    """The transformers config for ``shape`` with the tokenizer's vocabulary and special ids."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        router_aux_loss_coef=shape.router_aux_loss_coef,
        output_router_logits=False,
    )
    if shape.arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(
            intermediate_size=shape.expert_intermediate_size,
            num_local_experts=shape.num_experts,
            num_experts_per_tok=shape.top_k,
            **common,
        )
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        intermediate_size=shape.shared_expert_intermediate_size or shape.expert_intermediate_size,
        moe_intermediate_size=shape.expert_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        **common,
    )


def build_model(config: PretrainedConfig, experts_implementation: str | None = None):
    """A freshly initialised causal LM for ``config`` (seed torch before calling)."""
    if experts_implementation:
        config._experts_implementation = experts_implementation
    return AutoModelForCausalLM.from_config(config)
