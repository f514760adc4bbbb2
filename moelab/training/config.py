"""Configuration of a tiny-model training run and the two bundled model presets.

Shape legend: H hidden, I intermediate, E routed experts, K top-k, L layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from moelab.registry import Registry

Arch = Literal["mixtral", "qwen2moe"]


@dataclass
class ModelShape:
    """Architecture of a tiny MoE model (vocabulary size comes from the tokenizer)."""

    arch: Arch = "mixtral"
    """Config family: ``mixtral`` (no shared expert) or ``qwen2moe`` (shared expert)."""
    hidden_size: int = 128
    """H, the residual width."""
    num_layers: int = 4
    """L, number of decoder layers (all MoE)."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    num_experts: int = 8
    """E, routed experts per layer."""
    top_k: int = 2
    """K, experts per token."""
    expert_intermediate_size: int = 256
    """I of each routed expert."""
    shared_expert_intermediate_size: int = 0
    """I of the shared expert (qwen2moe only; 0 for none)."""
    max_position_embeddings: int = 512
    """Longest sequence the rotary embedding is configured for."""
    router_aux_loss_coef: float = 0.02
    """Weight of the load-balancing loss added to the LM loss."""


@dataclass
class TrainConfig:
    """A reproducible training run: model shape, data, optimiser and schedule."""

    name: str = "moelab-tiny-mixtral"
    """Name of the resulting model (directory name under ``moelab/bundled``)."""
    shape: ModelShape = field(default_factory=ModelShape)
    """The model architecture."""
    seed: int = 0
    """Seeds model init, data generation and data order."""
    vocab_size: int = 1024
    """Target BPE vocabulary size (the real size is ``len(tokenizer)``)."""
    n_train: dict[str, int] = field(default_factory=lambda: {"arith": 60000, "pycode": 20000})
    """Training examples per task (train split only)."""
    batch_tokens: int = 4096
    """Approximate tokens per batch, padding included."""
    max_len: int = 256
    """Examples longer than this (in tokens) are dropped."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.05
    """Final learning rate as a fraction of ``lr`` (cosine decay)."""
    warmup_steps: int = 100
    """Linear warm-up steps."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    max_steps: int = 20000
    """Optimizer steps (reduced to fit ``minutes`` when a time budget is given)."""
    threads: int = 2
    """``torch.set_num_threads`` for the run."""
    checkpoint_every_s: float = 120.0
    """Seconds between checkpoints."""
    eval_every_s: float = 600.0
    """Seconds between quick greedy evaluations on a validation subset."""
    eval_n: dict[str, int] = field(default_factory=lambda: {"arith": 40, "pycode": 30})
    """Validation examples per task for the evaluations during training."""
    experts_implementation: str = "grouped_mm"
    """transformers experts implementation used while training."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        d["shape"] = ModelShape(**d["shape"])
        return cls(**d)


#: Training presets by name (:class:`TrainConfig` instances; ``preset(name)`` gives a copy).
PRESETS: Registry[TrainConfig] = Registry("training preset", base=TrainConfig, instances=True)

for _name, _cfg in {
    "mixtral": TrainConfig(
        name="moelab-tiny-mixtral",
        shape=ModelShape(
            arch="mixtral",
            hidden_size=128,
            num_layers=4,
            num_experts=8,
            top_k=2,
            expert_intermediate_size=256,
        ),
    ),
    "qwen2moe": TrainConfig(
        name="moelab-tiny-qwen2moe",
        shape=ModelShape(
            arch="qwen2moe",
            hidden_size=128,
            num_layers=6,
            num_experts=32,
            top_k=8,
            expert_intermediate_size=32,
            shared_expert_intermediate_size=128,
        ),
    ),
}.items():
    PRESETS.register(_name, _cfg)


def preset(name: str) -> TrainConfig:
    """A fresh copy of preset ``name`` (``mixtral`` or ``qwen2moe``)."""
    return TrainConfig.from_dict(PRESETS.get(name).to_dict())
