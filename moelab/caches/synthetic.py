"""Synthetic routing columns and streams with tunable popularity skew and temporal locality.

For tests and benchmarks: no model needed. Router logits per (sequence, MoE layer) follow
``logits_t = skew · base + h_t`` with ``h_t = locality · h_{t−1} + noise``, scores are their
softmax, the top-k of the scores are selected (so the routing is softmax top-k, like
Mixtral/Qwen2-MoE).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moelab.caches.stream import AccessStream, build_stream


def synthetic_columns(
    num_layers: int = 4,
    num_experts: int | Sequence[int] = 8,
    top_k: int = 2,
    num_seqs: int = 2,
    steps: int = 64,
    prefill_tokens: int = 0,
    skew: float = 1.0,
    locality: float = 0.6,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Trace-like columns: seq, step, moe_layer, experts (N, K), weights (N, K), scores (N, E).

    Size: the knobs of a synthetic access stream, each with a default.
    """
    rng = np.random.default_rng(seed)
    E_l = np.broadcast_to(np.asarray(num_experts), (num_layers,)).astype(int)
    E = int(E_l.max())
    base = rng.gumbel(size=(num_layers, E)) * skew
    pad = np.arange(E)[None, :] >= E_l[:, None]  # (L, E) experts a layer does not have
    cols: dict[str, list] = {k: [] for k in ("seq", "step", "moe_layer", "experts", "weights", "scores")}

    def emit(step: int, seq_ids: np.ndarray, logits: np.ndarray) -> None:
        # logits: (T, L, E) for T tokens; rows layer-major per forward pass
        logits = np.where(pad[None], -np.inf, logits)
        z = np.exp(logits - logits.max(-1, keepdims=True))
        sc = (z / z.sum(-1, keepdims=True)).astype(np.float32)
        top = np.argsort(-sc, axis=-1, kind="stable")[..., :top_k]
        w = np.take_along_axis(sc, top, axis=-1)
        w = w / w.sum(-1, keepdims=True)
        T = logits.shape[0]
        for layer in range(num_layers):
            cols["seq"].append(seq_ids)
            cols["step"].append(np.full(T, step))
            cols["moe_layer"].append(np.full(T, layer))
            cols["experts"].append(top[:, layer])
            cols["weights"].append(w[:, layer])
            cols["scores"].append(sc[:, layer])

    seqs = np.arange(num_seqs)
    h = rng.normal(size=(num_seqs, num_layers, E))
    if prefill_tokens:
        for s in seqs:
            noise = rng.normal(size=(prefill_tokens, num_layers, E))
            emit(0, np.full(prefill_tokens, s), base[None] + noise)
    for t in range(1, steps + 1):
        h = locality * h + np.sqrt(1 - locality**2) * rng.normal(size=h.shape)
        emit(t, seqs, base[None] + h)
    out = {k: np.concatenate(v) for k, v in cols.items()}
    out["experts"] = out["experts"].astype(np.int32)
    out["num_experts"] = E_l
    out["top_k"] = np.full(num_layers, top_k)
    return out


def synthetic_stream(
    *, include_prefill: bool = False, scores: bool = True, replay: str = "forward", **kwargs
) -> AccessStream:
    """An :class:`AccessStream` over :func:`synthetic_columns` (same keyword arguments).

    Decode steps of all ``num_seqs`` sequences form one forward (a batch), so with
    ``replay="forward"`` (default) a group is their union; ``replay="sequence"`` gives one group
    per sequence, step and layer.
    """
    c = synthetic_columns(**kwargs)
    return build_stream(
        c["seq"],
        c["step"],
        c["moe_layer"],
        c["experts"],
        c["weights"],
        c["num_experts"],
        c["top_k"],
        scores=c["scores"] if scores else None,
        include_prefill=include_prefill,
        model_name="synthetic",
        replay=replay,
    )
