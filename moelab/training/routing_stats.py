"""Per-layer expert load of a trained model on task text (top-k choices of each router)."""

from __future__ import annotations

import math

import torch

from moelab.training.data import Encoded, collate


@torch.no_grad()
def expert_load(model, data: list[Encoded], top_k: int, batch_size: int = 32) -> list[list[int]]:
    """Counts ``[layer][expert]`` of top-k assignments over the non-padding tokens of ``data``."""
    was_training = model.training
    model.eval()
    counts: list[torch.Tensor] | None = None
    for b in range(0, len(data), batch_size):
        batch = collate(data[b : b + batch_size])
        out = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_router_logits=True,
        )
        keep = batch["attention_mask"].reshape(-1).bool()
        layers = out.router_logits
        if counts is None:
            counts = [torch.zeros(lg.shape[-1], dtype=torch.long) for lg in layers]
        for li, lg in enumerate(layers):
            top = lg.reshape(-1, lg.shape[-1])[keep].topk(top_k, dim=-1).indices
            counts[li] += torch.bincount(top.reshape(-1), minlength=lg.shape[-1])
    model.train(was_training)
    return [c.tolist() for c in counts or []]


def load_summary(counts: list[list[int]]) -> list[dict[str, float]]:
    """Per layer: share of the busiest and idlest expert, unused experts, normalised entropy."""
    rows = []
    for layer, c in enumerate(counts):
        total = sum(c) or 1
        shares = [x / total for x in c]
        entropy = -sum(p * math.log(p) for p in shares if p > 0) / math.log(len(c))
        rows.append(
            {
                "layer": layer,
                "min_share": min(shares),
                "max_share": max(shares),
                "unused": sum(1 for x in c if x == 0),
                "entropy": entropy,
            }
        )
    return rows
