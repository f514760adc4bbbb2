"""Adapters for the ten supported families (transformers 5 fused-experts MoE blocks).

Router semantics, per family (see ``docs/ecosystem.md``):

=============  =======  ===========================  =============================
family         router   weights                      shared experts
=============  =======  ===========================  =============================
mixtral        .gate    softmax → top-k → renorm     —
qwen2_moe      .gate    softmax → top-k (renorm if   .shared_expert, gated by
                        norm_topk_prob)              sigmoid(.shared_expert_gate)
qwen3_moe      .gate    as qwen2_moe                 —
olmoe          .gate    as qwen2_moe                 —
deepseek_v2    .gate    softmax → (grouped) top-k    .shared_experts, ungated
                        × routed_scaling_factor
deepseek_v3    .gate    sigmoid + bias, grouped      .shared_experts, ungated
                        top-k, renorm, × scaling
gpt_oss        .router  top-k logits → softmax       —
granitemoe     .router  top-k logits → softmax       —
phimoe         .router  sparsemixer, always top-2    —
qwen3_next     .gate    as qwen2_moe                 as qwen2_moe
=============  =======  ===========================  =============================
"""

from __future__ import annotations

from dataclasses import dataclass

from moelab.adapters.base import FamilyAdapter, RouterSpec


@dataclass
class SoftmaxTopKAdapter(FamilyAdapter):
    """softmax over all experts, top-k, renormalised always or if ``norm_topk_prob``."""

    always_renormalize: bool = False

    def router_spec(self, config, router) -> RouterSpec:
        renorm = self.always_renormalize or bool(getattr(router, "norm_topk_prob", False))
        return RouterSpec(scoring="softmax", renormalize=renorm)


@dataclass
class TopKSoftmaxAdapter(FamilyAdapter):
    """top-k over the logits, then softmax over the k selected (gpt_oss, granitemoe)."""

    def router_spec(self, config, router) -> RouterSpec:
        return RouterSpec(scoring="softmax", weights="softmax_topk", renormalize=True)


@dataclass
class DeepseekV2Adapter(FamilyAdapter):
    def router_spec(self, config, router) -> RouterSpec:
        method = getattr(router, "topk_method", "greedy")
        return RouterSpec(
            scoring="softmax",
            selection="group_limited_greedy" if method == "group_limited_greedy" else "topk",
            scaling=float(getattr(router, "routed_scaling_factor", 1.0)),
            n_group=getattr(router, "num_group", None),
            topk_group=getattr(router, "topk_group", None),
        )


@dataclass
class DeepseekV3Adapter(FamilyAdapter):
    def router_spec(self, config, router) -> RouterSpec:
        return RouterSpec(
            scoring="sigmoid",
            selection="noaux_tc",
            renormalize=bool(getattr(router, "norm_topk_prob", True)),
            scaling=float(getattr(router, "routed_scaling_factor", 1.0)),
            n_group=getattr(router, "num_group", None),
            topk_group=getattr(router, "topk_group", None),
        )


@dataclass
class PhimoeAdapter(FamilyAdapter):
    def router_spec(self, config, router) -> RouterSpec:
        return RouterSpec(scoring="softmax", selection="sparsemixer")


BUILTIN_ADAPTERS: list[FamilyAdapter] = [
    SoftmaxTopKAdapter("mixtral", always_renormalize=True),
    SoftmaxTopKAdapter("qwen2_moe", shared_attr="shared_expert", shared_gate_attr="shared_expert_gate"),
    SoftmaxTopKAdapter("qwen3_moe"),
    SoftmaxTopKAdapter("olmoe"),
    DeepseekV2Adapter("deepseek_v2", shared_attr="shared_experts"),
    DeepseekV3Adapter("deepseek_v3", shared_attr="shared_experts"),
    TopKSoftmaxAdapter("gpt_oss", router_attr="router", block_returns_tuple=True),
    TopKSoftmaxAdapter("granitemoe", router_attr="router"),
    PhimoeAdapter("phimoe", router_attr="router", fixed_top_k=2),
    SoftmaxTopKAdapter("qwen3_next", shared_attr="shared_expert", shared_gate_attr="shared_expert_gate"),
]
