"""The MoE view of a Hugging Face model: one :class:`MoELayer` per MoE block.

A :class:`FamilyAdapter` knows how one model family names its parts and computes its
router weights; :func:`moe_layers` finds the MoE blocks *by structure* (a module with a
router child and a fused ``experts`` child), so dense layers inside MoE models
(DeepSeek ``first_k_dense_replace``, Qwen ``mlp_only_layers``) are skipped correctly.

Shape legend: T tokens, E routed experts, K top-k, H hidden.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from moelab.compat import router_outputs
from moelab.errors import MoelabError

Scoring = Literal["softmax", "sigmoid"]
Selection = Literal["topk", "group_limited_greedy", "noaux_tc", "sparsemixer"]
WeightRule = Literal["scores", "softmax_topk"]


@dataclass(frozen=True)
class RouterSpec:
    """How a layer's router turns logits into the top-k experts and their weights."""

    scoring: Scoring
    """Full score vector over all E experts: ``softmax`` or ``sigmoid`` of the logits."""
    selection: Selection = "topk"
    """``topk`` of the scores; DeepSeek-V2 ``group_limited_greedy``; DeepSeek-V3
    ``noaux_tc`` (bias-corrected grouped top-k); PhiMoE ``sparsemixer``."""
    weights: WeightRule = "scores"
    """``scores``: the selected experts' scores; ``softmax_topk``: softmax over the
    top-k logits (gpt_oss, granitemoe)."""
    renormalize: bool = False
    """Whether the top-k weights are divided by their sum."""
    scaling: float = 1.0
    """Factor applied to the weights after selection (DeepSeek ``routed_scaling_factor``)."""
    n_group: int | None = None
    """Expert groups for grouped top-k."""
    topk_group: int | None = None
    """Groups kept in grouped top-k."""


@dataclass
class Routing:
    """One router call. ``experts``/``weights`` are sorted by descending weight."""

    logits: torch.Tensor  # (T, E)
    scores: torch.Tensor  # (T, E) float32
    experts: torch.Tensor  # (T, K) int64
    weights: torch.Tensor  # (T, K)


@dataclass
class MoELayer:
    """One MoE block of a model, with everything a routing experiment needs."""

    index: int
    """Ordinal among the model's MoE layers (0 .. L_moe-1)."""
    layer_idx: int
    """Index of the decoder layer that holds the block."""
    name: str
    """Qualified module name of the block, e.g. ``model.layers.3.mlp``."""
    block: nn.Module
    router: nn.Module
    experts: nn.Module
    shared_experts: nn.Module | None
    shared_gate: nn.Module | None
    """``sigmoid(shared_gate(x))`` scales the shared experts (Qwen2-MoE/Qwen3-Next); None if ungated."""
    num_experts: int
    top_k: int
    spec: RouterSpec
    adapter: FamilyAdapter = field(repr=False)

    @torch.no_grad()
    def route(self, hidden: torch.Tensor) -> Routing:
        """Route ``hidden`` (T×H or B×S×H) through this layer's own router module.

        Calling the module itself keeps the family's exact semantics (grouped top-k,
        correction bias, sparsemixer, ...); the result is sorted by descending weight.
        """
        h = hidden.reshape(-1, hidden.shape[-1])
        logits, weights, experts = router_outputs(self.router(h))  # in the order this transformers uses
        return make_routing(logits, weights, experts, self.spec.scoring)


def make_routing(logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, scoring: Scoring) -> Routing:
    """A :class:`Routing` from a router's outputs: scores computed, top-k sorted by weight."""
    logits = logits.reshape(-1, logits.shape[-1])
    weights = weights.reshape(logits.shape[0], -1)
    experts = experts.reshape(logits.shape[0], -1)
    order = torch.argsort(weights.float(), dim=-1, descending=True, stable=True)
    scores = logits.float().softmax(-1) if scoring == "softmax" else logits.float().sigmoid()
    return Routing(
        logits=logits,
        scores=scores,
        experts=experts.gather(1, order).long(),
        weights=weights.gather(1, order),
    )


@dataclass
class FamilyAdapter:
    """What differs between MoE families. Register new ones with :func:`register_adapter`."""

    model_type: str
    router_attr: str = "gate"
    shared_attr: str | None = None
    shared_gate_attr: str | None = None
    block_returns_tuple: bool = False
    """gpt_oss's block returns ``(hidden, router_scores)`` instead of a tensor."""
    fixed_top_k: int | None = None
    """PhiMoE's router is hard-coded to top-2 whatever the config says."""

    def router_spec(self, config, router: nn.Module) -> RouterSpec:  # pragma: no cover - abstract
        raise NotImplementedError

    def top_k(self, config, router: nn.Module) -> int:
        if self.fixed_top_k is not None:
            return self.fixed_top_k
        k = getattr(router, "top_k", None) or getattr(config, "num_experts_per_tok", None)
        if not k:
            raise MoelabError(
                f"{self.model_type}: cannot tell top-k (router has no top_k and config.num_experts_per_tok "
                f"is {getattr(config, 'num_experts_per_tok', None)!r}); set num_experts_per_tok in the config."
            )
        return int(k)

    def is_block(self, module: nn.Module) -> bool:
        router = getattr(module, self.router_attr, None)
        experts = getattr(module, "experts", None)
        return (
            isinstance(router, nn.Module)
            and isinstance(experts, nn.Module)
            and (hasattr(experts, "gate_up_proj") or hasattr(experts, "down_proj"))
        )


_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def find_moe_layers(model: nn.Module, adapter: FamilyAdapter) -> list[MoELayer]:
    """The MoE blocks of ``model``, in forward order, found by structure."""
    config = model.config
    layers: list[MoELayer] = []
    for name, module in model.named_modules():
        if not adapter.is_block(module):
            continue
        match = _LAYER_RE.search(name)
        layer_idx = int(match.group(1)) if match else len(layers)
        router = getattr(module, adapter.router_attr)
        experts = module.experts
        num_experts = int(
            getattr(experts, "num_experts", None)
            or getattr(router, "num_experts", None)
            or router.weight.shape[0]
        )
        shared = getattr(module, adapter.shared_attr, None) if adapter.shared_attr else None
        shared_gate = getattr(module, adapter.shared_gate_attr, None) if adapter.shared_gate_attr else None
        layers.append(
            MoELayer(
                index=len(layers),
                layer_idx=layer_idx,
                name=name,
                block=module,
                router=router,
                experts=experts,
                shared_experts=shared,
                shared_gate=shared_gate,
                num_experts=num_experts,
                top_k=adapter.top_k(config, router),
                spec=adapter.router_spec(config, router),
                adapter=adapter,
            )
        )
    layers.sort(key=lambda layer: layer.layer_idx)
    for i, layer in enumerate(layers):
        layer.index = i
    return layers
