"""Family adapters: the uniform MoE view of any supported Hugging Face model.

>>> layers = moe_layers(model)          # one MoELayer per MoE block, dense layers skipped
>>> layers[0].num_experts, layers[0].top_k, layers[0].spec
>>> layers[0].route(hidden)             # the layer's exact routing for a hidden state
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from moelab.adapters.base import (
    FamilyAdapter,
    MoELayer,
    RouterSpec,
    Routing,
    find_moe_layers,
    make_routing,
)
from moelab.adapters.families import BUILTIN_ADAPTERS
from moelab.errors import MoelabError, did_you_mean
from moelab.registry import Registry

#: Family adapters by transformers ``config.model_type`` (instances of :class:`FamilyAdapter`).
ADAPTERS: Registry[FamilyAdapter] = Registry("family adapter", base=FamilyAdapter, instances=True)


def register_adapter(adapter: FamilyAdapter, *, overwrite: bool = False) -> FamilyAdapter:
    """Add an adapter for ``adapter.model_type`` (a transformers ``config.model_type``).

    A second adapter for a registered model type raises (naming both places) unless
    ``overwrite=True``.
    """
    if not isinstance(adapter, FamilyAdapter):
        raise MoelabError(f"register_adapter expects a FamilyAdapter instance, got {adapter!r}.")
    ADAPTERS.register(adapter.model_type, adapter, overwrite=overwrite, stacklevel=2)
    return adapter


for _adapter in BUILTIN_ADAPTERS:
    register_adapter(_adapter)


def supported_families() -> list[str]:
    """The model types that have an adapter."""
    return ADAPTERS.names()


def _unwrap(model: Any) -> nn.Module:
    # lm-eval's HFLM and similar wrappers keep the transformers model as `.model`.
    if not isinstance(model, nn.Module) and isinstance(getattr(model, "model", None), nn.Module):
        return model.model
    if not isinstance(model, nn.Module):
        raise MoelabError(f"expected a torch/transformers model, got {type(model).__name__}.")
    return model


def get_adapter(model: Any) -> FamilyAdapter:
    """The adapter of ``model``'s family; a clear error for unsupported or non-MoE models."""
    model = _unwrap(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise MoelabError(
            f"{type(model).__name__} has no transformers config (config.model_type); moelab works on "
            f"Hugging Face MoE models of the families: {', '.join(supported_families())}."
        )
    adapter = ADAPTERS.get(model_type, None)
    if adapter is None:
        raise MoelabError(
            f"model type {model_type!r} ({type(model).__name__}) is not a supported Mixture-of-Experts family."
            f"{did_you_mean(model_type, supported_families())} "
            f"Supported: {', '.join(supported_families())}. To add one, register a FamilyAdapter with "
            "moelab.register_adapter()."
        )
    return adapter


def moe_layers(model: Any) -> list[MoELayer]:
    """The MoE layers of ``model`` in forward order (dense layers are not included)."""
    model = _unwrap(model)
    adapter = get_adapter(model)
    layers = find_moe_layers(model, adapter)
    if not layers:
        raise MoelabError(
            f"found no MoE blocks in {type(model).__name__} (model type {adapter.model_type!r}); "
            "is this a dense configuration (e.g. num_experts=0 or every layer in mlp_only_layers)?"
        )
    return layers


@dataclass(frozen=True)
class ModelInfo:
    """A summary of a model's MoE structure (what ``moelab trace-info`` and meta.json report)."""

    model_type: str
    num_hidden_layers: int
    moe_layers: list[int]
    num_experts: list[int]
    top_k: list[int]
    hidden_size: int
    shared_experts: bool
    router: list[dict]
    expert_bytes: list[int]
    """Bytes of one routed expert's weights (biases included) per MoE layer, in the model's dtype."""

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


def model_info(model: Any) -> ModelInfo:
    """The MoE structure of ``model``."""
    from dataclasses import asdict

    model = _unwrap(model)
    layers = moe_layers(model)
    config = model.config
    return ModelInfo(
        model_type=config.model_type,
        num_hidden_layers=int(getattr(config, "num_hidden_layers", len(layers))),
        moe_layers=[layer.layer_idx for layer in layers],
        num_experts=[layer.num_experts for layer in layers],
        top_k=[layer.top_k for layer in layers],
        hidden_size=int(config.hidden_size),
        shared_experts=any(layer.shared_experts is not None for layer in layers),
        router=[asdict(layer.spec) for layer in layers[:1]],
        expert_bytes=[expert_bytes(layer) for layer in layers],
    )


def expert_bytes(layer: MoELayer) -> int:
    """Bytes of one routed expert of ``layer`` (all expert parameters / E)."""
    total = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    return int(total // max(layer.num_experts, 1))


def model_fingerprint(model: Any) -> str:
    """A short identity of a model: its MoE structure, config and router weights.

    Two loads of the same checkpoint share it; a different model (or different router
    weights) does not. Predictors, caches and traces record it to refuse mixing models.
    """
    import hashlib
    import json

    model = _unwrap(model)
    layers = moe_layers(model)
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype",
                     "_experts_implementation", "_attn_implementation", "architectures"):
        config.pop(volatile, None)
    h = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for layer in layers:
        w = layer.router.weight.detach().float().cpu().contiguous()
        h.update(w.numpy().tobytes())
    return h.hexdigest()[:16]


__all__ = [
    "ADAPTERS",
    "FamilyAdapter",
    "MoELayer",
    "ModelInfo",
    "RouterSpec",
    "Routing",
    "expert_bytes",
    "get_adapter",
    "make_routing",
    "model_fingerprint",
    "model_info",
    "moe_layers",
    "register_adapter",
    "supported_families",
]
