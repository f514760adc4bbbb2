"""Expert sizes: the bytes one expert transfer moves, computed in one place.

* :func:`expert_bytes_of` — a loaded model's routed expert size (the largest over its MoE
  layers, as :func:`moelab.caches.simulation.load_stream` takes from a trace's
  ``meta.json`` ``model.expert_bytes`` list). Per layer: :func:`moelab.adapters.expert_bytes`.
* :data:`REFERENCE_EXPERT_BYTES` / :func:`reference_expert_bytes` — routed expert sizes of
  real models (bf16), to project results on a tiny model to a real model's transfer sizes.
"""

from __future__ import annotations

from typing import Any

from moelab.errors import MoelabError, unknown_name


def expert_bytes_of(model: Any) -> int:
    """Bytes of one routed expert of ``model`` (its weights and biases, in the model's dtype;
    the largest over MoE layers — they are all equal in the supported families)."""
    from moelab.adapters import expert_bytes, moe_layers

    return max(expert_bytes(layer) for layer in moe_layers(model))


#: Bytes of one routed expert (gate, up and down projections, bf16) of reference models:
#: ``3 × hidden × expert_intermediate × 2 bytes``, shapes from the models' public configs.
REFERENCE_EXPERT_BYTES: dict[str, int] = {
    "mixtral-8x7b": 3 * 4096 * 14336 * 2,
    "qwen2-57b-a14b": 3 * 3584 * 2560 * 2,
    "deepseek-v2-lite": 3 * 2048 * 1408 * 2,
    "deepseek-v3": 3 * 7168 * 2048 * 2,
    "qwen1.5-moe-a2.7b": 3 * 2048 * 1408 * 2,
    "olmoe-1b-7b": 3 * 2048 * 1024 * 2,
}


def reference_expert_bytes(name: str | int) -> int:
    """Expert bytes of a reference model by name, or an integer byte count as is."""
    if isinstance(name, bool):
        raise MoelabError(f"expert bytes must be a positive integer or a reference model name, got {name!r}.")
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        value = int(name)
        if value <= 0:
            raise MoelabError(f"expert bytes must be > 0, got {value}.")
        return value
    if name not in REFERENCE_EXPERT_BYTES:
        raise unknown_name("reference model (expert bytes)", name, REFERENCE_EXPERT_BYTES)
    return REFERENCE_EXPERT_BYTES[name]


__all__ = ["REFERENCE_EXPERT_BYTES", "expert_bytes_of", "reference_expert_bytes"]
