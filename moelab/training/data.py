"""Training data: task examples -> token ids with a loss mask, and a seeded batch stream.

Context and target are tokenised separately and concatenated, exactly as a generator
sees them at evaluation time (the context is encoded alone, the model continues it).
Only target tokens (and the closing EOS) carry loss.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from moelab.tasks import generate, prompt_and_target

logger = logging.getLogger(__name__)

IGNORE = -100


@dataclass
class Encoded:
    """One tokenised example."""

    ids: list[int]
    """Context ids followed by target ids and EOS."""
    n_context: int
    """Number of leading context ids (no loss on them)."""
    task: str
    """Task name."""


def task_texts(tasks: dict[str, int], split: str, seed: int) -> list[tuple[str, str, str]]:
    """(task, context, target) for ``tasks`` = {name: n} from ``split``."""
    out = []
    for name, n in tasks.items():
        for ex in generate(name, split, n=n, seed=seed):  # type: ignore[arg-type]
            ctx, tgt = prompt_and_target(name, ex)
            out.append((name, ctx, tgt))
    return out


def encode(tokenizer, rows: list[tuple[str, str, str]], max_len: int) -> list[Encoded]:
    """Tokenise (task, context, target) rows; drops rows longer than ``max_len``."""
    ctx = tokenizer([r[1] for r in rows], add_special_tokens=False).input_ids
    tgt = tokenizer([r[2] for r in rows], add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    out = [
        Encoded(c + t + [eos], len(c), r[0])
        for r, c, t in zip(rows, ctx, tgt)
        if len(c) + len(t) + 1 <= max_len
    ]
    if len(out) < len(rows):
        logger.info("dropped %d examples longer than %d tokens", len(rows) - len(out), max_len)
    return out


def batch_stream(data: list[Encoded], batch_tokens: int, seed: int, start_step: int = 0):
    """Endless, deterministic batches (``input_ids``, ``attention_mask``, ``labels``).

    Each epoch shuffles with ``seed + epoch``, groups examples of similar length (in
    windows of 64 batches) to limit padding, and shuffles the batches. Batch ``i`` of
    the stream depends only on ``(data, batch_tokens, seed, i)``, so resuming at
    ``start_step`` reproduces the uninterrupted run.
    """
    step = 0
    epoch = 0
    lengths = np.array([len(e.ids) for e in data])
    while True:
        rng = np.random.default_rng(seed * 1000 + epoch)
        order = rng.permutation(len(data))
        batches: list[np.ndarray] = []
        mean_len = float(lengths.mean())
        per_batch = max(1, int(batch_tokens // mean_len))
        window = per_batch * 64
        for w in range(0, len(order), window):
            chunk = order[w : w + window]
            chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
            i = 0
            while i < len(chunk):
                longest = lengths[chunk[min(i + per_batch, len(chunk)) - 1]]
                size = max(1, int(batch_tokens // longest))
                batches.append(chunk[i : i + size])
                i += size
        for b in rng.permutation(len(batches)):
            if step >= start_step:
                yield collate([data[j] for j in batches[b]])
            step += 1
        epoch += 1


def collate(examples: list[Encoded], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded tensors; labels are IGNORE on context and padding."""
    t = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), t), dtype=torch.long)
    labels = torch.full((len(examples), t), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.ids)
        ids[i, :n] = torch.tensor(e.ids)
        mask[i, :n] = 1
        labels[i, e.n_context : n] = torch.tensor(e.ids[e.n_context :])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
